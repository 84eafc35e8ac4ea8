"""RFC 6455 frame encoding, free of I/O.

The proxy writes text, ping, pong and close frames to clients itself (see
:mod:`proxy.session.writer`). Frames from a server are never masked
(RFC 6455 §5.1) and never fragmented here: every message is one final frame.
The upstream link writes its text frames itself too, masked (a client's frames
always are): :func:`masked_frame_header`.
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = [
    "MAX_CONTROL_PAYLOAD",
    "OP_BINARY",
    "OP_CLOSE",
    "OP_PING",
    "OP_PONG",
    "OP_TEXT",
    "close_payload",
    "frame_header",
    "masked_frame_header",
]

OP_TEXT: Final = 0x1
OP_BINARY: Final = 0x2
OP_CLOSE: Final = 0x8
OP_PING: Final = 0x9
OP_PONG: Final = 0xA

#: Control frames carry at most 125 bytes (RFC 6455 §5.5).
MAX_CONTROL_PAYLOAD: Final = 125

_FIN: Final = 0x80
_MASKED: Final = 0x80
_PACK_16: Final = struct.Struct("!BBH").pack
_PACK_64: Final = struct.Struct("!BBQ").pack
_PACK_CODE: Final = struct.Struct("!H").pack


def frame_header(opcode: int, length: int) -> bytes:
    """The header of an unmasked final frame (RFC 6455 §5.2).

    Payload length: 7 bits up to 125; 126 then 16 bits up to 65535; 127 then
    64 bits beyond.

    Args:
        opcode: one of the ``OP_*`` constants.
        length: payload length in bytes.

    Returns:
        2, 4 or 10 header bytes.
    """
    first = _FIN | opcode
    if length < 126:
        return bytes((first, length))
    if length < 65536:
        return _PACK_16(first, 126, length)
    return _PACK_64(first, 127, length)


def masked_frame_header(opcode: int, length: int, mask: bytes) -> bytes:
    """The header of a masked final frame (client to server), ``mask`` included.

    Args:
        opcode: one of the ``OP_*`` constants.
        length: payload length in bytes.
        mask: the frame's 4-byte masking key.
    """
    first = _FIN | opcode
    if length < 126:
        return bytes((first, _MASKED | length)) + mask
    if length < 65536:
        return _PACK_16(first, _MASKED | 126, length) + mask
    return _PACK_64(first, _MASKED | 127, length) + mask


def close_payload(code: int, reason: bytes = b"") -> bytes:
    """A close frame's payload: the 2-byte code, then a reason cut to fit 125 bytes.

    The reason is cut on a UTF-8 character boundary so it stays valid text
    (RFC 6455 §5.5.1 requires it to be UTF-8).
    """
    reason = reason[: MAX_CONTROL_PAYLOAD - 2]
    while reason:
        try:
            reason.decode("utf-8")
            break
        except UnicodeDecodeError:
            reason = reason[:-1]
    return _PACK_CODE(code) + reason
