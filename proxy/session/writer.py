"""The one path from a session to its client socket (docs/design.md, Relay shell).

``ClientFrameWriter`` writes every byte a client gets: engine events, pings,
pongs and the close frame. It is a sink: the relay gives it what the core
drained (:meth:`write`) and hands what it reports back to the core; it holds
no core. It is also aiohttp's own frame writer for that ``WebSocketResponse``
(:class:`AiohttpWriterAdapter`), so aiohttp's own close frames take this path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from proxy import compat
from proxy.core.buffer import Entry
from proxy.session.frames import (
    MAX_CONTROL_PAYLOAD,
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    ControlPayload,
    close_payload,
    frame_header,
)

__all__ = ["AiohttpWriterAdapter", "ClientFrameWriter", "OutputTranslator"]

log = logging.getLogger(__name__)


class OutputTranslator(Protocol):
    """A front door speaking another protocol to its client (docs/design.md, Phone
    front door): each delivered event becomes the frames its client gets."""

    def to_client(self, text: str) -> list[str]: ...


class ClientFrameWriter:
    """Writes frames to one client transport, within the write bound.

    Args:
        protocol: aiohttp's protocol of the client connection (flow control).
        write_buffer_bytes: the write bound (``client_write_buffer_bytes``,
            also the transport's high-water mark).
        translator: what events become for a client of another protocol (None:
            each event is written as its own text).
    """

    def __init__(
        self,
        protocol: Any,
        *,
        write_buffer_bytes: int,
        translator: OutputTranslator | None = None,
    ) -> None:
        self._protocol = protocol
        self._bound = write_buffer_bytes
        self._translator = translator
        #: Payload of the latest unanswered ping, while the transport was paused.
        self._pending_pong: ControlPayload | None = None
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
        """A pong waits for the transport to drain."""
        return self._pending_pong is not None

    async def wait_writable(self) -> None:
        """Wait until the transport is below its low-water mark.

        Raises:
            ConnectionError: the connection was lost meanwhile.
        """
        if compat.writing_paused(self._protocol):
            await compat.wait_writable(self._protocol)

    # -- events ---------------------------------------------------------------------------------

    def room(self) -> int:
        """Bytes of events the relay may take now; a pending pong goes first.

        What the transport already holds counts against the bound, so a client
        that stops reading pins at most the bound (plus one event) here.

        Returns:
            0 while the transport is above its mark, the connection is gone
            (also when the pending pong just found it lost) or a close frame
            went out; else the bound less what it holds. Above 0, a ``write``
            right after writes: what a drain takes for that room is written.
        """
        protocol = self._protocol
        if compat.writing_paused(protocol) or self.close_sent:
            return 0
        transport = compat.client_transport(protocol)
        if transport is None or transport.is_closing():
            return 0
        if self._pending_pong is not None:
            self._write_control(OP_PONG, self._pending_pong)
            self._pending_pong = None
            self.unanswered_pings = 0
            if transport.is_closing():
                return 0  # the pong's send failed: the connection is lost
        return max(0, self._bound - int(transport.get_write_buffer_size()))

    def write(self, entries: Sequence[Entry]) -> bool:
        """Write events as text frames, in order, in one transport call.

        Returns:
            True when they were written; False when the connection is gone
            (none was).
        """
        transport = compat.client_transport(self._protocol)
        if transport is None or transport.is_closing():
            return False
        if self._translator is not None:
            self._write_translated(transport, entries)
        elif len(entries) == 1:
            # One event (real-time pace): no list to build.
            payload = entries[0].event.text.encode("utf-8", "surrogatepass")
            transport.writelines((frame_header(OP_TEXT, len(payload)), payload))
            self.bytes_written += len(payload)
        else:
            parts: list[bytes] = []
            for entry in entries:
                payload = entry.event.text.encode("utf-8", "surrogatepass")
                parts.append(frame_header(OP_TEXT, len(payload)))
                parts.append(payload)
                self.bytes_written += len(payload)
            transport.writelines(parts)
        self.frames_written += len(entries)
        return True

    def _write_translated(self, transport: Any, entries: Sequence[Entry]) -> None:
        """Each event as the frames its translator makes of it (zero or more)."""
        assert self._translator is not None
        parts: list[bytes] = []
        for entry in entries:
            for text in self._translator.to_client(entry.event.text):
                payload = text.encode("utf-8")
                parts.append(frame_header(OP_TEXT, len(payload)))
                parts.append(payload)
                self.bytes_written += len(payload)
        if parts:
            transport.writelines(parts)

    # -- control frames ----------------------------------------------------------------------------

    def send_text(self, text: str) -> None:
        """One text frame of the shell's own (not an event of the core), written at once."""
        if not self.close_sent:
            transport = compat.client_transport(self._protocol)
            if transport is not None and not transport.is_closing():
                payload = text.encode("utf-8")
                transport.write(frame_header(OP_TEXT, len(payload)) + payload)

    def ping(self, payload: ControlPayload = b"") -> None:
        """Write a ping at once (keepalive)."""
        self._write_control(OP_PING, payload[:MAX_CONTROL_PAYLOAD])

    def pong(self, payload: ControlPayload) -> bool:
        """Answer a client's ping; above the mark, keep only the latest (RFC 6455 §5.5.3).

        Returns:
            False when the pong waits for the transport to drain.
        """
        payload = payload[:MAX_CONTROL_PAYLOAD]
        if self.paused and not self.gone:
            if self._pending_pong is not None:
                self.pongs_coalesced += 1
            self._pending_pong = payload
            self.unanswered_pings += 1
            return False
        self._pending_pong = None
        self.unanswered_pings = 0
        self._write_control(OP_PONG, payload)
        return True

    def close(self, code: int, reason: bytes = b"") -> bool:
        """Write the close frame once, after everything written before it (RFC 6455 §5.5.1).

        Returns:
            True when this call wrote it.
        """
        if self.close_sent:
            return False
        if self.gone:
            self.close_sent = True
            return False
        self._write_control(OP_CLOSE, close_payload(code, reason))
        self.close_sent = True
        self.close_code_sent = code
        return True

    def _write_control(self, opcode: int, payload: ControlPayload) -> None:
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

    async def send_frame(
        self, message: ControlPayload, opcode: int, compress: int | None = None
    ) -> None:
        """aiohttp's ``WebSocketWriter.send_frame``: route its frames through us."""
        if opcode == OP_PING:
            self.ping(message)
        elif opcode == OP_PONG:
            self.pong(message)
        elif opcode == OP_CLOSE:
            code = int.from_bytes(message[:2], "big") if len(message) >= 2 else 1000
            self.close(code, bytes(message[2:]))
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

    async def send_frame(
        self, message: ControlPayload, opcode: int, compress: int | None = None
    ) -> None:
        await self._writer.send_frame(message, opcode, compress)

    async def close(self, code: int = 1000, message: bytes | str = b"") -> None:
        await self._writer.close_frame(code, message)
