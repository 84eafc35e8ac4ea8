"""The one path from a session to its client socket.

``ClientFrameWriter`` owns every byte written to a client connection: engine
events (text frames), pings, pongs and the close frame. It is a sink: the
relay takes events from the core and hands them over (:meth:`take`), with a
validity check the writer applies at write time; the writer holds no
reference to the core and reports what it wrote or dropped through
:class:`DeliveryHooks`. It is also installed
as the aiohttp ``WebSocketResponse``'s own frame writer (see
:func:`proxy.compat.install_client_writer`), so the close frames aiohttp sends
by itself (an oversized client frame: 1009) take the same path.

Rules it enforces (docs/design.md, Relay shell):

- **Write bound.** :meth:`start_batch` and :meth:`take` tell the relay to take
  events only while what the client transport holds unsent plus the batch of
  taken events is below ``client_write_buffer_bytes`` (also the transport's
  high-water mark, set by the app). So a client that stops reading pins at
  most the bound plus one event here; a single event larger than the bound
  is written alone.
- **Write-time re-check.** A taken event is re-checked (``still_valid``, the
  core's check) when it is written: audio of a response cancelled between
  taking and writing is dropped (``cancelled_audio``), not written.
- **Batching.** While more engine frames are already parsed and waiting
  (``upstream_backlog``), taken events are gathered and written with one
  ``writelines`` at the end of the loop tick; at real-time pace (no backlog)
  each event is written at once.
- **Control frames.** A ping is written at once (the keepalive sends at most
  one per half interval). A pong is written at once while the transport is
  below its mark; above it only the latest ping's pong is kept and written
  when the transport drains (RFC 6455 §5.5.3 allows answering only the most
  recent ping), so a client that pings without reading cannot grow memory.
- **Close.** The close frame is written once, after everything taken before
  it; nothing is written after it (RFC 6455 §5.5.1).

The writer does no waiting itself except :meth:`wait_writable`; everything
else is synchronous, so there is no await between taking an event from the
core and writing it (apart from the batch's end-of-tick write, re-checked).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sized
from typing import Any, Final, Protocol

from proxy import compat
from proxy.core.buffer import Entry
from proxy.core.session_core import DropReason
from proxy.session.frames import (
    MAX_CONTROL_PAYLOAD,
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    close_payload,
    frame_header,
)

__all__ = ["AiohttpWriterAdapter", "ClientFrameWriter", "DeliveryHooks"]

log = logging.getLogger(__name__)

_NO_BACKLOG: Final[Sized] = ()


class DeliveryHooks(Protocol):
    """What the writer reports to its session (the core's bookkeeping, metrics, wake-ups)."""

    def delivered(self, entry: Entry, taken_at: float, now: float) -> None:
        """One taken event was written to the client at ``now``."""

    def dropped(self, entry: Entry, reason: DropReason) -> None:
        """One taken event was not written (cancelled since, or the connection is gone)."""

    def written(self) -> None:
        """A write (or a drop of taken events) happened: sync buffer metrics."""

    def blocked(self) -> None:
        """Something is waiting for the transport to drain: wake the delivery task."""


class ClientFrameWriter:
    """Writes frames to one client transport, within the write bound.

    Args:
        protocol: aiohttp's protocol of the client connection (flow control).
        hooks: delivery callbacks.
        still_valid: the write-time re-check of a taken event (the core's).
        write_buffer_bytes: the write bound (``client_write_buffer_bytes``).
        clock: monotonic seconds.
        call_soon: schedules the end-of-tick batch write (``loop.call_soon``).
        upstream_backlog: engine frames parsed and not yet read (live view).
    """

    def __init__(
        self,
        protocol: Any,
        hooks: DeliveryHooks,
        *,
        still_valid: Callable[[Entry], bool],
        write_buffer_bytes: int,
        clock: Callable[[], float],
        call_soon: Callable[[Callable[[], None]], object],
        upstream_backlog: Sized = _NO_BACKLOG,
    ) -> None:
        self._protocol = protocol
        self._still_valid = still_valid
        self._hooks = hooks
        self._bound = write_buffer_bytes
        self._clock = clock
        self._call_soon = call_soon
        self._backlog = upstream_backlog
        #: Entries taken from the core and not written yet (at most one tick).
        self._batch: list[tuple[Entry, float]] = []
        self._batch_bytes = 0
        #: What the batch being taken may hold: the bound less what the transport holds.
        self._room = write_buffer_bytes
        self._flush_scheduled = False
        #: Payload of the latest unanswered ping, while the transport was paused.
        self._pending_pong: bytes | None = None
        self.close_sent = False
        #: The close code we sent (None until then); what the client actually got.
        self.close_code_sent: int | None = None
        self.frames_written = 0
        self.bytes_written = 0
        self.pongs_coalesced = 0
        #: Pings answered only by the one pending pong (the client is not reading).
        self.unanswered_pings = 0

    # -- state ---------------------------------------------------------------------------------

    @property
    def transport(self) -> Any:
        """The client transport, or None once the connection is lost."""
        return compat.client_transport(self._protocol)

    @property
    def gone(self) -> bool:
        """The connection is lost or closing: nothing more can be written."""
        transport = compat.client_transport(self._protocol)
        return transport is None or bool(transport.is_closing())

    @property
    def paused(self) -> bool:
        """The transport is above its high-water mark: write no more events now."""
        return compat.writing_paused(self._protocol)

    @property
    def has_pending(self) -> bool:
        """Taken events or a pong wait for the transport."""
        return bool(self._batch) or self._pending_pong is not None

    @property
    def batch_bytes(self) -> int:
        """Bytes taken into the batch and not written yet."""
        return self._batch_bytes

    async def wait_writable(self) -> None:
        """Wait until the transport is below its low-water mark.

        Raises:
            ConnectionError: the connection was lost meanwhile.
        """
        if compat.writing_paused(self._protocol):
            await compat.wait_writable(self._protocol)

    # -- events ---------------------------------------------------------------------------------

    def start_batch(self) -> bool | None:
        """Start taking events: write a pending pong, and say whether any may be taken.

        What the transport already holds counts against the bound too, so a
        client that stops reading pins at most the bound (plus one event)
        here, not a full batch on top of a full transport.

        Returns:
            None when nothing may be taken or written now (the transport is
            above its mark, or a close frame went out: no :meth:`end_batch`
            either); False when the batch already holds the bound; True when
            events may be taken.
        """
        protocol = self._protocol
        if compat.writing_paused(protocol) or self.close_sent:
            return None
        if self._pending_pong is not None:
            self._write_control(OP_PONG, self._pending_pong)
            self._pending_pong = None
            self.unanswered_pings = 0
        # What the transport holds (_buffered, written out: once per engine event).
        transport = compat.client_transport(protocol)
        held = 0 if transport is None else int(transport.get_write_buffer_size())
        self._room = self._bound - held
        return self._batch_bytes < self._room

    def take(self, entry: Entry, taken_at: float) -> bool:
        """Add a taken event to the batch; a full batch is written first.

        Args:
            entry: the event, already taken from the core.
            taken_at: when it was taken (its queue delay ends there).

        Returns:
            Whether another event may be taken into this batch.
        """
        size = entry.event.size
        if self._batch and self._batch_bytes + size > self._room:
            # The batch is full: write it; this event starts the next one.
            self.flush()
            self._room = self._bound - self._buffered()
        self._batch.append((entry, taken_at))
        self._batch_bytes += size
        return self._batch_bytes < self._room and not compat.writing_paused(self._protocol)

    def end_batch(self, *, defer: bool = False) -> None:
        """Write the batch now, or at the end of the loop tick.

        Args:
            defer: the caller is the engine reader: while more engine frames
                are already waiting, write the batch at the end of the loop
                tick instead of now (one transport write per burst).
        """
        if not self._batch:
            return
        if defer and self._backlog and self._batch_bytes < self._bound:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._call_soon(self._scheduled_flush)
        else:
            self.flush()

    def _buffered(self) -> int:
        """Bytes the client transport holds unsent (0 once it is gone)."""
        transport = compat.client_transport(self._protocol)
        return 0 if transport is None else int(transport.get_write_buffer_size())

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def flush(self, *, force: bool = False) -> None:
        """Write the taken events as text frames in one transport call.

        Each is re-checked first. While the transport is above its mark the
        batch stays (the delivery task writes it once it drains), unless
        ``force`` (the session is closing: what was taken goes before the
        close frame).
        """
        batch = self._batch
        if not batch:
            return
        transport = compat.client_transport(self._protocol)
        if (
            not force
            and compat.writing_paused(self._protocol)
            and transport is not None
            and not transport.is_closing()
        ):
            self._hooks.blocked()
            return
        self._batch = []
        self._batch_bytes = 0
        still_valid = self._still_valid
        hooks = self._hooks
        if transport is None or transport.is_closing():
            for entry, _ in batch:
                hooks.dropped(entry, DropReason.SESSION_CLOSED)
            hooks.written()
            return
        if len(batch) == 1:
            # One event (real-time pace): no lists to build.
            entry, taken_at = batch[0]
            if still_valid(entry):
                payload = entry.event.text.encode("utf-8", "surrogatepass")
                transport.writelines((frame_header(OP_TEXT, len(payload)), payload))
                self.frames_written += 1
                self.bytes_written += len(payload)
                hooks.delivered(entry, taken_at, self._clock())
            else:
                # Cancelled after it was taken: not one byte of it is written.
                hooks.dropped(entry, DropReason.CANCELLED_AUDIO)
            hooks.written()
            return
        parts: list[bytes] = []
        written: list[tuple[Entry, float]] = []
        for entry, taken_at in batch:
            if not still_valid(entry):
                hooks.dropped(entry, DropReason.CANCELLED_AUDIO)
            else:
                payload = entry.event.text.encode("utf-8", "surrogatepass")
                parts.append(frame_header(OP_TEXT, len(payload)))
                parts.append(payload)
                written.append((entry, taken_at))
                self.bytes_written += len(payload)
        if parts:
            transport.writelines(parts)
            self.frames_written += len(written)
            now = self._clock()
            for entry, taken_at in written:
                hooks.delivered(entry, taken_at, now)
        hooks.written()

    def discard(self) -> None:
        """Drop what was taken and not written (the connection is gone)."""
        for entry, _ in self._batch:
            self._hooks.dropped(entry, DropReason.SESSION_CLOSED)
        self._batch = []
        self._batch_bytes = 0
        self._hooks.written()

    # -- control frames ----------------------------------------------------------------------------

    def ping(self, payload: bytes = b"") -> None:
        """Write a ping at once (keepalive)."""
        self._write_control(OP_PING, payload[:MAX_CONTROL_PAYLOAD])

    def pong(self, payload: bytes) -> None:
        """Answer a client's ping; above the mark, keep only the latest."""
        payload = payload[:MAX_CONTROL_PAYLOAD]
        if self.paused and not self.gone:
            if self._pending_pong is not None:
                self.pongs_coalesced += 1
            self._pending_pong = payload
            self.unanswered_pings += 1
            self._hooks.blocked()
            return
        self._pending_pong = None
        self.unanswered_pings = 0
        self._write_control(OP_PONG, payload)

    def close(self, code: int, reason: bytes = b"") -> bool:
        """Write the close frame once, after everything already taken.

        Returns:
            True when this call wrote it.
        """
        if self.close_sent:
            return False
        self.flush(force=True)
        if self.gone:
            self.close_sent = True
            return False
        self._write_control(OP_CLOSE, close_payload(code, reason))
        self.close_sent = True
        self.close_code_sent = code
        return True

    def _write_control(self, opcode: int, payload: bytes) -> None:
        if self.close_sent:
            return
        transport = compat.client_transport(self._protocol)
        if transport is None or transport.is_closing():
            return
        transport.write(frame_header(opcode, len(payload)) + payload)

    def close_transport(self) -> None:
        """Close the connection once what was written has been sent."""
        transport = compat.client_transport(self._protocol)
        if transport is not None:
            transport.close()

    def abort(self) -> None:
        """Drop the connection now (close deadline passed, keepalive lost)."""
        transport = compat.client_transport(self._protocol)
        if transport is not None:
            transport.abort()

    # -- aiohttp's writer interface (installed as WebSocketResponse._writer) ----------------------

    async def send_frame(self, message: bytes, opcode: int, compress: int | None = None) -> None:
        """aiohttp's ``WebSocketWriter.send_frame``: route its frames through us."""
        if opcode == OP_PING:
            self.ping(message)
        elif opcode == OP_PONG:
            self.pong(message)
        elif opcode == OP_CLOSE:
            code = int.from_bytes(message[:2], "big") if len(message) >= 2 else 1000
            self.close(code, message[2:])
        elif opcode in (OP_TEXT, OP_BINARY) and not self.close_sent:
            transport = compat.client_transport(self._protocol)
            if transport is not None and not transport.is_closing():
                transport.write(frame_header(opcode, len(message)) + message)

    async def close_frame(self, code: int = 1000, message: bytes | str = b"") -> None:
        """aiohttp's ``WebSocketWriter.close`` (see :class:`AiohttpWriterAdapter`)."""
        if isinstance(message, str):
            message = message.encode("utf-8")
        self.close(code, message)


class AiohttpWriterAdapter:
    """The object aiohttp's ``WebSocketResponse`` sees as its frame writer.

    aiohttp calls ``send_frame(message, opcode)`` and ``close(code, message)``
    and reads ``transport``; all three go to the session's
    :class:`ClientFrameWriter`.
    """

    __slots__ = ("_writer",)

    def __init__(self, writer: ClientFrameWriter) -> None:
        self._writer = writer

    @property
    def transport(self) -> Any:
        return self._writer.transport

    async def send_frame(self, message: bytes, opcode: int, compress: int | None = None) -> None:
        await self._writer.send_frame(message, opcode, compress)

    async def close(self, code: int = 1000, message: bytes | str = b"") -> None:
        await self._writer.close_frame(code, message)
