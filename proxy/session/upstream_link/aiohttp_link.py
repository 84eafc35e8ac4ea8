"""The engine link over aiohttp's client WebSocket (``upstream_client = "aiohttp"``).

aiohttp parses the engine's frames and queues them; ``run`` reads that queue
and hands each message to the relay. Sending does not go through aiohttp's
coroutine ``send_str``: frames are masked and written through an
:class:`~proxy.session.upstream_link.frame_outbox.Outbox` onto the
connection's transport, as the picows link does, so the relay never awaits a
send and handles a client frame the same way with either link. aiohttp still
writes the close handshake (after the outbox is flushed) and the keepalive
ping. The internals this needs are in :mod:`proxy.compat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sized
from typing import Any, Protocol

import aiohttp

from proxy import compat
from proxy.session.frames import OP_PONG, OP_TEXT
from proxy.session.upstream_link.frame_outbox import Outbox
from proxy.session.upstream_link.interface import CLEAN_CLOSES, UpstreamHandler

__all__ = ["AiohttpUpstreamLink", "read_messages"]

log = logging.getLogger(__name__)


class AiohttpUpstreamLink:
    """:class:`~proxy.session.upstream_link.interface.UpstreamLink` over aiohttp.

    Args:
        upstream: the connected engine WebSocket.
        log: the session's logger.
    """

    __slots__ = ("_held", "_log", "_outbox", "_protocol", "_upstream", "backlog", "on_drained")

    def __init__(self, upstream: aiohttp.ClientWebSocketResponse, log: Any = log) -> None:
        self._upstream = upstream
        self._log = log
        self.backlog: Sized = compat.upstream_backlog(upstream)
        self._protocol = compat.upstream_protocol(upstream)
        self._outbox = Outbox(asyncio.get_running_loop())
        self._outbox.transport = compat.upstream_transport(upstream)
        #: Called when the transport drains after a pause (set by the relay).
        self.on_drained: Callable[[], None] | None = None
        compat.on_writing_resumed(self._protocol, self._resumed)
        #: The first message, read by first_text() before run().
        self._held: aiohttp.WSMessage | None = None

    def _resumed(self) -> None:
        if self.on_drained is not None:
            self.on_drained()

    @property
    def closed(self) -> bool:
        return self._upstream.closed

    @property
    def close_code(self) -> int | None:
        return self._upstream.close_code

    @property
    def write_paused(self) -> bool:
        return compat.writing_paused(self._protocol) and not self._upstream.closed

    def input_backlog(self) -> int:
        transport = compat.upstream_transport(self._upstream)
        if transport is None:
            return 0
        try:
            return self._outbox.pending_bytes + int(transport.get_write_buffer_size())
        except (AttributeError, RuntimeError, OSError):  # pragma: no cover - closed transport
            return 0

    def send_nowait(self, text: str) -> None:
        if self._upstream.closed:
            return
        self._outbox.frame(OP_TEXT, bytearray(text, "utf-8", "surrogatepass"))

    def pong_nowait(self, payload: bytes) -> None:
        """Answer the engine's ping (autoping is off: the keepalive is the relay's)."""
        if not self._upstream.closed:
            self._outbox.frame(OP_PONG, bytearray(payload[:125]))

    async def send(self, text: str) -> None:
        self.send_nowait(text)
        await self.wait_drained()

    async def wait_drained(self) -> None:
        while self.write_paused:
            try:
                await compat.wait_writable(self._protocol)
            except (ConnectionError, RuntimeError):
                return

    async def first_text(self, timeout: float) -> str | None:
        if self._held is None:
            try:
                async with asyncio.timeout(timeout):
                    self._held = await self._upstream.receive()
            except TimeoutError:
                return None
        held = self._held
        return held.data if held.type is aiohttp.WSMsgType.TEXT else None

    async def run(self, handler: UpstreamHandler) -> bool:
        held, self._held = self._held, None
        source: _MessageSource = self._upstream if held is None else _Held(self._upstream, held)
        try:
            return await read_messages(source, self, handler)
        finally:
            self._outbox.flush()
            compat.on_writing_resumed(self._protocol, None)

    async def ping(self) -> None:
        if not self._upstream.closed:
            self._outbox.flush()
            with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
                await self._upstream.ping()

    def abort(self) -> None:
        self._outbox.transport = None
        transport = compat.upstream_transport(self._upstream)
        if transport is not None:
            transport.abort()

    async def close(self) -> None:
        if not self._upstream.closed:
            self._outbox.flush()  # what was sent goes before the close frame
            await self._upstream.close()
        self._outbox.transport = None


class _MessageSource(Protocol):
    @property
    def close_code(self) -> int | None: ...

    async def receive(self) -> aiohttp.WSMessage: ...


class _Held:
    """A message source whose first message was read already (first_text)."""

    __slots__ = ("_first", "_source")

    def __init__(self, source: _MessageSource, first: aiohttp.WSMessage) -> None:
        self._source = source
        self._first: aiohttp.WSMessage | None = first

    @property
    def close_code(self) -> int | None:
        return self._source.close_code

    async def receive(self) -> aiohttp.WSMessage:
        first, self._first = self._first, None
        if first is not None:
            return first
        return await self._source.receive()


class _MessageSink(Protocol):
    def send_nowait(self, text: str) -> None: ...

    def pong_nowait(self, payload: bytes) -> None: ...


async def read_messages(
    source: _MessageSource, sink: _MessageSink, handler: UpstreamHandler
) -> bool:
    """Read aiohttp messages from ``source`` into ``handler`` until the connection ends.

    What the handler answers to a text message is sent through ``sink`` at once.

    Returns:
        True when it ended with a clean close code (1000, 1001).
    """
    while True:
        msg = await source.receive()
        kind = msg.type
        if kind is aiohttp.WSMsgType.TEXT:
            for text in handler.upstream_text(msg.data):
                sink.send_nowait(text)
        elif kind is aiohttp.WSMsgType.PING:
            handler.upstream_alive()
            sink.pong_nowait(msg.data)
        elif kind is aiohttp.WSMsgType.PONG:
            handler.upstream_alive()
        elif kind is aiohttp.WSMsgType.BINARY:
            handler.upstream_binary(len(msg.data))
        else:
            return source.close_code in CLEAN_CLOSES and kind is not aiohttp.WSMsgType.ERROR
