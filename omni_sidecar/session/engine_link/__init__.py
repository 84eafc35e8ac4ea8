"""The session's WebSocket to the engine, as the relay sees it.

The engine link pushes frames into the relay instead of being read by it:
``run(handler)`` hands every engine text frame to
:meth:`UpstreamHandler.upstream_text` as it arrives and returns when the
connection ends. Sending never raises for a connection that went away; the
link tells how many bytes of input the engine has not taken yet
(``max_pending_input_bytes`` is enforced by the relay with it), exposes
whether more engine frames are already parsed (the client writer batches on
it), and can drop the connection when the keepalive gives up.

Two implementations, chosen by the ``upstream_client`` setting:

- :class:`PicowsUpstreamLink` (the default): picows parses and masks frames in
  C and calls back per frame with the payload as a buffer, so an engine event
  costs no task wake-up, no message object and no reader queue.
- :class:`AiohttpUpstreamLink`: aiohttp's client WebSocket, read by a loop of
  ``await receive()``; the internals it reads are in :mod:`omni_sidecar.compat`.

Both answer the engine's pings themselves; the relay's own keepalive pings go
through :meth:`UpstreamLink.ping`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sized
from typing import Any, Final, Protocol

import aiohttp
import picows

from omni_sidecar import compat
from omni_sidecar.session.frames import OP_TEXT, masked_frame_header
from omni_sidecar.settings import UpstreamClient

__all__ = [
    "AiohttpUpstreamLink",
    "PicowsUpstreamLink",
    "UpstreamConnectError",
    "UpstreamHandler",
    "UpstreamLink",
    "connect_upstream",
]

log = logging.getLogger(__name__)

#: Engine close codes that are a clean end (anything else: engine_unavailable).
#: 1005: a Close frame without a code (RFC 6455 §7.1.5), as aiohttp also takes it.
CLEAN_CLOSES: Final = frozenset({1000, 1001, 1005})
#: A Close frame without a code, as the receiver reports it (RFC 6455 §7.1.5).
_NO_STATUS: Final = 1005


class UpstreamHandler(Protocol):
    """What the link calls for each engine frame (the relay)."""

    def upstream_text(self, text: str) -> bool:
        """One engine text message. Returns True when commands for the engine wait."""

    def upstream_binary(self, size: int) -> None:
        """One engine binary message (not part of the protocol: dropped)."""

    def upstream_alive(self) -> None:
        """A control frame arrived (the keepalive's proof of life)."""

    def take_upstream_commands(self) -> list[str]:
        """The frames the session wants sent to the engine now, in order."""


class UpstreamLink(Protocol):
    """What the relay needs of its engine connection."""

    @property
    def backlog(self) -> Sized:
        """Engine frames parsed and not yet handed over (a live view)."""

    @property
    def closed(self) -> bool: ...

    @property
    def close_code(self) -> int | None: ...

    @property
    def sends_without_waiting(self) -> bool:
        """:meth:`send_nowait` works (else every send is awaited)."""

    @property
    def write_paused(self) -> bool:
        """Input toward the engine is above its mark (``send_nowait`` still queues)."""

    #: Called when a paused link drained (set by the relay).
    on_drained: Callable[[], None] | None

    async def wait_drained(self) -> None:
        """Return once the link is not write-paused (at once when it is not)."""

    def input_backlog(self) -> int:
        """Bytes written toward the engine that it has not taken yet."""

    def send_nowait(self, text: str) -> None:
        """Queue a text frame without waiting (only when ``sends_without_waiting``)."""

    async def first_text(self, timeout: float) -> str | None:
        """The engine's first text frame, without taking it (``run`` hands it over first).

        Returns:
            It, once it arrived within ``timeout`` seconds (before ``run``);
            None when nothing came in time, the first frame is not text, or
            the connection ended without one.
        """

    async def run(self, handler: UpstreamHandler) -> bool:
        """Hand engine frames to ``handler`` until the connection ends.

        Returns:
            True when the engine closed cleanly (close code 1000 or 1001).
        """

    async def send(self, text: str) -> None:
        """Send a text frame; a connection that went away is logged, not raised."""

    async def ping(self) -> None: ...

    def abort(self) -> None:
        """Drop the connection now."""

    async def close(self) -> None: ...


class UpstreamConnectError(Exception):
    """The engine WebSocket could not be opened (refused, timed out, not 101)."""


async def connect_upstream(
    client: UpstreamClient,
    url: str,
    *,
    headers: Mapping[str, str],
    max_message_bytes: int,
    write_limit: int,
    close_timeout: float,
    session: aiohttp.ClientSession | None = None,
) -> UpstreamLink:
    """Open the engine WebSocket for one session.

    The caller bounds the time (``upstream_connect_timeout``).

    Args:
        client: ``"picows"`` or ``"aiohttp"`` (the ``upstream_client`` setting).
        url: the engine's ``ws://``/``wss://`` URL with path and query.
        headers: extra request headers (Authorization).
        max_message_bytes: larger engine messages end the connection.
        write_limit: unsent input (bytes) at which sending waits for a drain;
            0 waits whenever the transport is above its mark.
        close_timeout: aiohttp's wait for the engine's close reply.
        session: the aiohttp client session (``"aiohttp"`` only).

    Raises:
        UpstreamConnectError: the engine did not accept the WebSocket.
    """
    if client == "picows":
        return await PicowsUpstreamLink.connect(
            url, headers=headers, max_message_bytes=max_message_bytes, write_limit=write_limit
        )
    assert session is not None, "the aiohttp link needs a client session"
    try:
        upstream = await session.ws_connect(
            url,
            headers=dict(headers),
            # Keepalive is the relay's own (SessionTimers): aiohttp's re-arms a
            # timer on every received message.
            max_msg_size=max_message_bytes,
            compress=0,
            autoping=False,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=close_timeout),
        )
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamConnectError(str(exc) or type(exc).__name__) from exc
    compat.set_upstream_write_limit(upstream, write_limit)
    return AiohttpUpstreamLink(upstream)


# -- picows -------------------------------------------------------------------------------------

_TEXT: Final = picows.WSMsgType.TEXT
_BINARY: Final = picows.WSMsgType.BINARY
_CONTINUATION: Final = picows.WSMsgType.CONTINUATION
_CLOSE: Final = picows.WSMsgType.CLOSE
_PING: Final = picows.WSMsgType.PING
_PONG: Final = picows.WSMsgType.PONG


#: Queued engine-bound bytes that are written at once instead of at the end of the tick.
_FLUSH_NOW_BYTES: Final = 64 * 1024


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


class _FramesWaiting:
    """The picows link's ``backlog``: 1 while more frames of the current read wait."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting = 0

    def __len__(self) -> int:
        return self.waiting


class PicowsUpstreamLink(picows.WSListener):
    """:class:`UpstreamLink` over picows (frames by callback, masking in C).

    Messages fragmented by the engine are joined here, bounded by
    ``max_message_bytes``; invalid UTF-8 in a text message closes the link
    with 1007, as aiohttp would.

    Text frames toward the engine are masked here and written together at the
    end of the loop tick (one ``writelines``): a client append and the
    playback acks that ride along with it cost one send, not one each.
    Control frames (the keepalive's ping, pongs, close) go through picows.
    """

    sends_without_waiting = True

    def __init__(self, *, max_message_bytes: int, write_limit: int) -> None:
        super().__init__()
        self.transport: picows.WSTransport | None = None
        self._underlying: asyncio.Transport | None = None
        self.backlog = _FramesWaiting()
        self._handler: UpstreamHandler | None = None
        self._max_message = max_message_bytes
        self._write_limit = write_limit
        #: Messages that arrived before run() (the engine's session.created):
        #: reading pauses at the first one, so at most one socket read is held.
        self._early: list[tuple[picows.WSMsgType, bytes]] = []
        #: first_text() waits on it for the first of those.
        self._first: asyncio.Future[None] | None = None
        self._fragments: list[bytes] | None = None
        self._fragment_kind: picows.WSMsgType = _TEXT
        self._fragment_bytes = 0
        self._close_code: int | None = None
        #: We failed the connection (a protocol error): frames after it are ignored.
        self._failed = False
        self._disconnected = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._log: Any = log
        #: Masked frames to write at the end of this loop tick, and their size.
        self._out: list[bytes | bytearray] = []
        self._out_bytes = 0
        self._flush_scheduled = False
        # Kept: asyncio.get_running_loop() costs a getpid() system call per use.
        self._loop = asyncio.get_running_loop()
        self.on_drained: Callable[[], None] | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        headers: Mapping[str, str],
        max_message_bytes: int,
        write_limit: int,
    ) -> PicowsUpstreamLink:
        link = cls(max_message_bytes=max_message_bytes, write_limit=write_limit)
        try:
            await picows.ws_connect(
                lambda: link,
                url,
                extra_headers=dict(headers),
                # The caller's upstream_connect_timeout bounds the whole connect.
                websocket_handshake_timeout=None,
                max_frame_size=max_message_bytes,
                max_redirects=0,
                enable_auto_pong=True,
                logger_name="omni_sidecar.upstream",
            )
        except (picows.WSError, OSError) as exc:
            raise UpstreamConnectError(str(exc) or type(exc).__name__) from exc
        transport = link.transport
        assert transport is not None
        underlying = transport.underlying_transport
        with contextlib.suppress(Exception):
            underlying.set_write_buffer_limits(high=write_limit)
        return link

    # -- picows callbacks -----------------------------------------------------------------

    def on_ws_connected(self, transport: picows.WSTransport) -> None:
        self.transport = transport
        # Kept: reached on every frame sent and every input_backlog().
        self._underlying = transport.underlying_transport

    def on_ws_frame(self, transport: picows.WSTransport, frame: picows.WSFrame) -> None:
        if self._failed:
            return  # we failed the connection: nothing more is processed (RFC 6455 §7.1.7)
        handler = self._handler
        if (
            frame.msg_type == _TEXT
            and frame.fin
            and handler is not None
            and self._fragments is None
        ):
            # The hot path: one engine event, handed over from the parser's buffer.
            self.backlog.waiting = not frame.last_in_buffer
            try:
                text = frame.get_payload_as_utf8_text()
            except UnicodeDecodeError as exc:
                raise self._fail(_not_utf8()) from exc
            if handler.upstream_text(text):
                self._send_commands(handler)
            return
        try:
            self._other_frame(transport, frame)
        except picows.WSProtocolError as exc:
            raise self._fail(exc) from None

    def _fail(self, exc: picows.WSProtocolError) -> picows.WSProtocolError:
        """We fail the connection with ``exc`` (picows sends its close frame)."""
        self._failed = True
        return exc

    def on_ws_disconnected(self, transport: picows.WSTransport) -> None:
        self._disconnected = True
        self._resume()
        self._first_arrived()

    def _first_arrived(self) -> None:
        first = self._first
        if first is not None and not first.done():
            first.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resume()
        if self.on_drained is not None:
            self.on_drained()

    # -- frames off the hot path ----------------------------------------------------------

    def _other_frame(self, transport: picows.WSTransport, frame: picows.WSFrame) -> None:
        kind = frame.msg_type
        if kind == _CLOSE:
            # A flexible IntEnum (any code); 0 when the frame carries none.
            self._close_code = frame.get_close_code().value or _NO_STATUS
            self._flush()
            if not transport.is_close_frame_sent:
                transport.send_close(frame.get_close_code())
            transport.disconnect()
            return
        if kind == _PING or kind == _PONG:
            if self._handler is not None:
                self._handler.upstream_alive()
            return
        if kind == _CONTINUATION:
            if self._fragments is None:
                raise picows.WSProtocolError(
                    picows.WSCloseCode.PROTOCOL_ERROR, "continuation without a first frame"
                )
            self._add_fragment(frame)
            if not frame.fin:
                return
            payload = b"".join(self._fragments)
            kind = self._fragment_kind
            self._fragments = None
            self._fragment_bytes = 0
        elif kind == _TEXT or kind == _BINARY:
            if self._fragments is not None:
                raise picows.WSProtocolError(
                    picows.WSCloseCode.PROTOCOL_ERROR, "new message inside a fragmented one"
                )
            if not frame.fin:
                self._fragments = []
                self._fragment_kind = kind
                self._add_fragment(frame)
                return
            payload = frame.get_payload_as_bytes()
        else:  # pragma: no cover - picows knows no other opcodes
            return
        self._message(kind, payload)

    def _add_fragment(self, frame: picows.WSFrame) -> None:
        assert self._fragments is not None
        self._fragment_bytes += frame.payload_size
        if self._fragment_bytes > self._max_message:
            raise picows.WSProtocolError(
                picows.WSCloseCode.MESSAGE_TOO_BIG,
                f"engine message over {self._max_message} bytes",
            )
        self._fragments.append(frame.get_payload_as_bytes())

    def _message(self, kind: picows.WSMsgType, payload: bytes) -> None:
        handler = self._handler
        if handler is None:
            self._early.append((kind, payload))
            if self.transport is not None:
                self.transport.underlying_transport.pause_reading()
            self._first_arrived()
            return
        self.backlog.waiting = 0
        if kind == _TEXT:
            if handler.upstream_text(_utf8(payload)):
                self._send_commands(handler)
        else:
            handler.upstream_binary(len(payload))

    def _send_commands(self, handler: UpstreamHandler) -> None:
        for text in handler.take_upstream_commands():
            self.send_nowait(text)

    def send_nowait(self, text: str) -> None:
        if self.transport is None or self.closed:
            return
        payload = bytearray(text, "utf-8", "surrogatepass")
        mask = _MASK_KEYS.next()
        compat.websocket_mask(mask, payload)
        self._out.append(masked_frame_header(OP_TEXT, len(payload), mask))
        self._out.append(payload)
        self._out_bytes += len(payload)
        if self._out_bytes >= _FLUSH_NOW_BYTES:
            # Enough for one write: the transport's flow control (write_limit)
            # then applies to a sender that never yields, too.
            self._flush()
            return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out = self._out
        if not out:
            return
        self._out = []
        self._out_bytes = 0
        if self._underlying is not None and not self._disconnected:
            self._underlying.writelines(out)

    # -- UpstreamLink ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        transport = self.transport
        return (
            self._disconnected
            or self._close_code is not None
            or transport is None
            or transport.is_close_frame_sent
        )

    @property
    def close_code(self) -> int | None:
        return self._close_code

    def input_backlog(self) -> int:
        underlying = self._underlying
        if underlying is None or self._disconnected:
            return 0
        try:
            return self._out_bytes + int(underlying.get_write_buffer_size())
        except (AttributeError, RuntimeError, OSError):  # pragma: no cover - closed transport
            return 0

    async def first_text(self, timeout: float) -> str | None:
        if not self._early and not self._disconnected and self._handler is None:
            self._first = self._loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._first
            except TimeoutError:
                return None
            finally:
                self._first = None
        if not self._early or self._early[0][0] != _TEXT:
            return None
        try:
            return self._early[0][1].decode("utf-8")
        except UnicodeDecodeError:
            return None  # run() fails the link with 1007

    async def run(self, handler: UpstreamHandler) -> bool:
        transport = self.transport
        assert transport is not None
        self._handler = handler
        early, self._early = self._early, []
        try:
            for kind, payload in early:
                self._message(kind, payload)
        except picows.WSProtocolError as exc:
            # As picows ends a connection whose callback raised it (the close
            # code is the error's): e.g. a held first frame that is not UTF-8.
            self._failed = True
            transport.send_close(exc.code, str(exc.args[1]).encode()[:120])
            transport.disconnect()
            self._log.info("engine link closed: %s", exc)
            return False
        except Exception:
            # The same end as another exception raised inside a picows callback.
            transport.send_close(picows.WSCloseCode.INTERNAL_ERROR)
            transport.disconnect()
            raise
        if early and not self._disconnected:
            transport.underlying_transport.resume_reading()
        try:
            await transport.wait_disconnected()
        except picows.WSProtocolError as exc:
            self._log.info("engine link closed: %s", exc)
            return False
        return self._close_code in CLEAN_CLOSES

    async def send(self, text: str) -> None:
        self.send_nowait(text)
        # Like aiohttp's writer: wait for the engine to take input once the
        # transport is above write_limit (the relay fails the session first
        # when max_pending_input_bytes is set).
        await self.wait_drained()

    @property
    def write_paused(self) -> bool:
        return self._write_paused and not self._disconnected

    async def wait_drained(self) -> None:
        while self._write_paused and not self._disconnected:
            if self._drained is None or self._drained.done():
                self._drained = self._loop.create_future()
            await self._drained

    def _resume(self) -> None:
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def ping(self) -> None:
        transport = self.transport
        if transport is not None and not self.closed:
            transport.send_ping()

    def abort(self) -> None:
        transport = self.transport
        if transport is not None and not self._disconnected:
            transport.disconnect(graceful=False)

    async def close(self) -> None:
        """Send a close frame and wait for the engine's (the caller bounds the wait)."""
        transport = self.transport
        if transport is None or self._disconnected:
            return
        try:
            self._flush()  # what was sent goes before the close frame
            if not transport.is_close_frame_sent:
                transport.send_close(picows.WSCloseCode.OK)
            with contextlib.suppress(picows.WSError):
                await transport.wait_disconnected()
        finally:
            if not self._disconnected:
                transport.disconnect()


def _utf8(payload: bytes) -> str:
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8() from exc


def _not_utf8() -> picows.WSProtocolError:
    return picows.WSProtocolError(picows.WSCloseCode.INVALID_TEXT, "engine text frame is not UTF-8")


# -- aiohttp ------------------------------------------------------------------------------------


class AiohttpUpstreamLink:
    """:class:`UpstreamLink` over aiohttp's client WebSocket.

    Args:
        upstream: the connected engine WebSocket.
        log: the session's logger.
    """

    __slots__ = ("_held", "_log", "_upstream", "backlog", "on_drained")

    #: aiohttp's send is a coroutine: the relay's tasks send, awaiting each.
    sends_without_waiting = False
    #: aiohttp's send waits for a drain itself.
    write_paused = False

    def __init__(self, upstream: aiohttp.ClientWebSocketResponse, log: Any = log) -> None:
        self._upstream = upstream
        self._log = log
        self.backlog: Sized = compat.upstream_backlog(upstream)
        self.on_drained: Callable[[], None] | None = None  # aiohttp's send drains itself
        #: The first message, read by first_text() before run().
        self._held: aiohttp.WSMessage | None = None

    @property
    def closed(self) -> bool:
        return self._upstream.closed

    @property
    def close_code(self) -> int | None:
        return self._upstream.close_code

    def input_backlog(self) -> int:
        transport = compat.upstream_transport(self._upstream)
        if transport is None:
            return 0
        try:
            return int(transport.get_write_buffer_size())
        except (AttributeError, RuntimeError, OSError):  # pragma: no cover - closed transport
            return 0

    def send_nowait(self, text: str) -> None:
        raise NotImplementedError("the aiohttp link sends by awaiting send()")

    async def wait_drained(self) -> None:
        return None

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
        return await read_messages(source, self, handler)

    async def send(self, text: str) -> None:
        if self._upstream.closed:
            return
        try:
            await self._upstream.send_str(text)
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            self._log.info("upstream send failed: %s", exc)

    async def ping(self) -> None:
        if not self._upstream.closed:
            with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
                await self._upstream.ping()

    async def pong(self, payload: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
            await self._upstream.pong(payload)

    def abort(self) -> None:
        transport = compat.upstream_transport(self._upstream)
        if transport is not None:
            transport.abort()

    async def close(self) -> None:
        if not self._upstream.closed:
            await self._upstream.close()


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
    async def send(self, text: str) -> None: ...

    async def pong(self, payload: bytes) -> None: ...


async def read_messages(
    source: _MessageSource, sink: _MessageSink, handler: UpstreamHandler
) -> bool:
    """Read aiohttp messages from ``source`` into ``handler`` until the connection ends.

    Returns:
        True when it ended with a clean close code (1000, 1001).
    """
    while True:
        msg = await source.receive()
        kind = msg.type
        if kind is aiohttp.WSMsgType.TEXT:
            if handler.upstream_text(msg.data):
                for text in handler.take_upstream_commands():
                    await sink.send(text)
        elif kind is aiohttp.WSMsgType.PING:
            handler.upstream_alive()
            await sink.pong(msg.data)
        elif kind is aiohttp.WSMsgType.PONG:
            handler.upstream_alive()
        elif kind is aiohttp.WSMsgType.BINARY:
            handler.upstream_binary(len(msg.data))
        else:
            return source.close_code in CLEAN_CLOSES and kind is not aiohttp.WSMsgType.ERROR
