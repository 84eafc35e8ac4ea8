"""RFC 6455 frame encoding, free of I/O.

The proxy writes text, ping, pong and close frames to clients itself (see
:mod:`proxy.session.writer`). Frames from a server are never masked
(RFC 6455 §5.1) and never fragmented here: every message is one final frame.
The upstream link writes its text frames itself too, masked (a client's frames
always are): :func:`masked_frame_header`. A client's frames are checked for
their mask bit (:class:`FrameHeaders`, used by ``proxy.compat.install_mask_check``).
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
    "ControlPayload",
    "FrameHeaders",
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

#: A control frame's payload as aiohttp hands it over: a ping's is a ``bytearray``
#: (the stubs say ``bytes``; compiled code checks the real type).
ControlPayload = bytes | bytearray

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


class FrameHeaders:
    """Walks the RFC 6455 frame headers of a byte stream, skipping the payloads.

    Only the headers are read (two bytes, the extended length, the mask key);
    payload bytes are counted, never looked at. :meth:`unmasked_at` says where
    the first frame without the mask bit starts.
    """

    __slots__ = ("_partial", "_skip")

    def __init__(self) -> None:
        #: The start of a header split across reads (at most 13 bytes).
        self._partial = b""
        #: Payload bytes of the current frame still to come.
        self._skip = 0

    def unmasked_at(self, data: bytes) -> int:
        """Offset in ``data`` of the first unmasked frame's header; -1 when every header
        seen so far has the mask bit (a header begun in an earlier read counts as 0)."""
        pos, end = 0, len(data)
        while True:
            skip = self._skip
            if skip:
                if skip >= end - pos:
                    self._skip = skip - (end - pos)
                    return -1
                pos += skip
                self._skip = 0
            if pos >= end:
                return -1
            start = pos - len(self._partial)
            head = self._partial + data[pos : pos + 14 - len(self._partial)]
            if len(head) < 2:
                self._partial = head
                return -1
            second = head[1]
            if not second & 0x80:
                return max(0, start)
            length = second & 0x7F
            size = 2 + (2 if length == 126 else 8 if length == 127 else 0) + 4
            if len(head) < size:
                self._partial = head
                return -1
            if length == 126:
                length = int.from_bytes(head[2:4], "big")
            elif length == 127:
                length = int.from_bytes(head[2:10], "big")
            pos += size - len(self._partial)
            self._partial = b""
            self._skip = length
