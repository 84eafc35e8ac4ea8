"""Frames toward the engine: masked here and written once per loop tick.

Both engine links write their data frames through an :class:`Outbox`. A
client append and the playback acks that ride along with it cost one
``writelines``, not one send each; past ``FLUSH_NOW_BYTES`` queued the batch
is written at once, so the transport's flow control (``write_limit``) also
applies to a sender that never yields. Client-to-server frames are masked
(RFC 6455 §5.3) with keys from the OS entropy source, drawn 4 KiB at a time,
using aiohttp's C mask routine.
"""

from __future__ import annotations

import asyncio
import os
from typing import Final

from proxy import compat
from proxy.session.frames import masked_frame_header

__all__ = ["FLUSH_NOW_BYTES", "Outbox"]

#: Queued engine-bound bytes that are written at once instead of at the end of the tick.
FLUSH_NOW_BYTES: Final = 64 * 1024


class _MaskKeys:
    """Masking keys from the OS entropy source (RFC 6455 §5.3), drawn 4 KiB at a time."""

    __slots__ = ("_at", "_pool")

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def next(self) -> bytes:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(4096)
            at = 0
        self._at = at + 4
        return self._pool[at : at + 4]


_MASK_KEYS: Final = _MaskKeys()


class Outbox:
    """Masked frames for one engine connection, written at the end of the loop tick.

    Args:
        loop: the running loop (kept: ``asyncio.get_running_loop()`` costs a
            ``getpid()`` system call per use).

    ``transport`` is set once the connection is up and cleared when it is
    lost; frames queued without one are dropped.
    """

    __slots__ = ("_frames", "_loop", "_scheduled", "pending_bytes", "transport")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._frames: list[bytes | bytearray] = []
        self._scheduled = False
        #: Payload bytes queued and not written yet (part of the input backlog).
        self.pending_bytes = 0
        self.transport: asyncio.Transport | None = None

    def frame(self, opcode: int, payload: bytearray) -> None:
        """Queue one frame of ``opcode``; ``payload`` is masked in place."""
        if self.transport is None:
            return
        mask = _MASK_KEYS.next()
        compat.websocket_mask(mask, payload)
        frames = self._frames
        frames.append(masked_frame_header(opcode, len(payload), mask))
        frames.append(payload)
        self.pending_bytes += len(payload)
        if self.pending_bytes >= FLUSH_NOW_BYTES:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what is queued now (what was sent goes before a close frame, too)."""
        self._scheduled = False
        frames = self._frames
        if not frames:
            return
        self._frames = []
        self.pending_bytes = 0
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.writelines(frames)
