"""The aiohttp internals the relay and the edge's guard reach, one function each.

Each reach is a hook named in :data:`proxy.compat.check.HOOKS` and checked at
start-up (docs/design.md, Relay shell).
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Awaitable, Callable, Sized
from typing import Any, Final, Protocol

import aiohttp
from aiohttp import client_ws, web, web_ws
from aiohttp import web_protocol as _web_protocol
from aiohttp.http_websocket import WebSocketError, WSCloseCode

try:  # a missing module is a missing hook (see HOOKS), not an import error
    from aiohttp._websocket import helpers as _websocket_helpers
except ImportError:  # pragma: no cover - aiohttp < 3.11
    _websocket_helpers = None  # type: ignore[assignment]


# -- the hooks ------------------------------------------------------------------------------


#: The connection's transport (``BaseProtocol.transport``); None once lost. An
#: ``attrgetter`` (C) rather than a Python function: the frame writer reads it
#: on every event.
client_transport: Final[Callable[[Any], asyncio.Transport | None]] = operator.attrgetter(
    "transport"
)


async def wait_writable(protocol: Any) -> None:
    """Wait until the client transport drained below its low-water mark.

    Raises:
        ConnectionResetError: the connection was lost meanwhile.
    """
    await protocol._drain_helper()


def install_client_writer(client: web.WebSocketResponse, writer: Any) -> None:
    """Route every frame aiohttp would write for ``client`` through ``writer``.

    After ``prepare()``, ``WebSocketResponse`` sends data, ping, pong and close
    frames through its ``_writer`` (``send_frame(message, opcode)``,
    ``close(code, message)``). Replacing it makes our frame writer the only
    path from this session to the client socket, including the close frame
    aiohttp writes itself when its parser rejects a frame (1009, 1002).
    """
    if client._writer is None:  # pragma: no cover - the app calls this after prepare()
        raise RuntimeError("install_client_writer() before prepare()")
    client._writer = writer


#: aiohttp's reader queue with a hand-over for text messages (install_text_push).
_text_push_queue: type[Any] | None = None


def install_text_push() -> bool:
    """Let client text messages skip aiohttp's reader queue (see :func:`push_text`).

    ``WebSocketResponse`` builds its reader queue from the name
    ``aiohttp.web_ws.WebSocketDataQueue`` when it is prepared; that name is
    pointed at a subclass whose ``feed_data`` (what the frame parser calls for
    each parsed message) hands text messages to a callback when one is set,
    and queues everything as before otherwise. Without a callback it is the
    same queue. Idempotent.

    Returns:
        False when this aiohttp has no such name (text frames stay queued);
        ``serve`` never gets there: the hook is in :data:`HOOKS`.
    """
    global _text_push_queue
    if _text_push_queue is not None:
        return True
    base: Any = getattr(web_ws, "WebSocketDataQueue", None)
    if base is None:  # pragma: no cover - every supported aiohttp has it
        return False
    text = aiohttp.WSMsgType.TEXT

    class TextPushQueue(base):  # type: ignore[misc]
        """aiohttp's reader queue; with ``on_text`` set, text messages go there at once."""

        on_text: Callable[[str], None] | None = None

        def feed_data(self, data: Any, size: int) -> None:
            on_text = self.on_text
            if on_text is not None and data[0] == text:
                on_text(data[1])
                return
            super().feed_data(data, size)

    web_ws.WebSocketDataQueue = TextPushQueue  # type: ignore[attr-defined]
    _text_push_queue = TextPushQueue
    return True


#: aiohttp's server-side frame parser with the mask check (install_mask_check).
_mask_checking_reader: type[Any] | None = None

#: Why a client's connection was failed by a check here (the ``reason`` label values).
UNMASKED_FRAME: Final = "unmasked_frame"


class MaskWalk(Protocol):
    """Walks one connection's frame headers (``proxy.session.frames.FrameHeaders``)."""

    def unmasked_at(self, data: bytes) -> int:
        """Offset of the first unmasked frame's header in ``data`` (0: it began in an
        earlier read); -1 when there is none so far."""
        ...


#: A fresh walk per client connection; None: no check (install_mask_check sets it).
_new_mask_walk: Callable[[], MaskWalk] | None = None


def install_mask_check(walk: Callable[[], MaskWalk]) -> bool:
    """Fail client connections that send an unmasked frame (RFC 6455 §5.1).

    A client must mask every frame it sends and a server must close the
    connection when one is not; aiohttp's parser unmasks a frame whose mask bit
    is set and takes it as it is otherwise. ``WebSocketResponse`` builds its
    parser from the name ``aiohttp.web_ws.WebSocketReader`` when it is
    prepared (server side only: the engine link's parser is not this one);
    that name is pointed at a subclass whose ``feed_data`` first hands the
    bytes it gets to the connection's ``walk()`` (which reads the frame
    headers, never the payloads). At a header without the mask bit it gives
    aiohttp's parser only the bytes before it, then fails the reader queue
    with ``WebSocketError(1002)``, aiohttp's own path for a protocol error
    (``receive()`` closes with 1002 through the session's frame writer and
    returns ERROR), and ends the connection's reading. The connection's
    protocol (the queue's ``_protocol``) is told once, through its
    ``on_protocol_violation(reason)`` when it has one. Idempotent; the last
    ``walk`` given serves the connections prepared from then on.

    Returns:
        False when this aiohttp has no such name; ``serve`` never gets there:
        the hook is in :data:`HOOKS`.
    """
    global _new_mask_walk
    if _mask_checking_reader is None and not install_mask_reader():
        return False
    _new_mask_walk = walk
    return True


def install_mask_reader() -> bool:
    """Point ``web_ws.WebSocketReader`` at the checking subclass (once)."""
    global _mask_checking_reader
    if _mask_checking_reader is not None:
        return True
    base: Any = getattr(web_ws, "WebSocketReader", None)
    if base is None:  # pragma: no cover - every supported aiohttp has it
        return False

    class MaskCheckingReader(base):  # type: ignore[misc]
        """aiohttp's frame parser, refusing unmasked frames first."""

        def __init__(self, queue: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(queue, *args, **kwargs)
            # The compiled parser keeps its queue private: kept here as well.
            self.client_queue = queue
            walk = _new_mask_walk
            self.mask_walk: MaskWalk | None = None if walk is None else walk()
            self._refused = False

        def feed_data(self, data: Any) -> tuple[bool, bytes]:
            if self._refused:
                return True, b""
            chunk = data if type(data) is bytes else bytes(data)
            walk = self.mask_walk
            at = -1 if walk is None else walk.unmasked_at(chunk)
            if at < 0:
                result: tuple[bool, bytes] = super().feed_data(chunk)
                return result
            if at:
                eof, _tail = super().feed_data(chunk[:at])
                if eof:
                    return True, b""
            self._refused = True
            queue = self.client_queue
            queue.set_exception(WebSocketError(WSCloseCode.PROTOCOL_ERROR, "unmasked client frame"))
            report = getattr(queue._protocol, "on_protocol_violation", None)
            if report is not None:
                report(UNMASKED_FRAME)
            return True, b""

    web_ws.WebSocketReader = MaskCheckingReader  # type: ignore[attr-defined]
    _mask_checking_reader = MaskCheckingReader
    return True


def push_text(client: web.WebSocketResponse, handler: Callable[[str], None] | None) -> bool:
    """Hand ``client``'s text messages to ``handler`` as they are parsed (None: queue them).

    Turning it on is refused while messages are still queued (one would
    overtake another); the caller reads the queue and asks again.

    Returns:
        True when the hand-over is now as asked.
    """
    queue = client._reader
    if _text_push_queue is None or not isinstance(queue, _text_push_queue):
        return handler is None
    if handler is not None and len(queue._buffer):
        return False
    queue.on_text = handler
    return True


def upstream_transport(upstream: client_ws.ClientWebSocketResponse) -> asyncio.Transport | None:
    """The engine connection's transport (unsent input, abort on keepalive loss)."""
    transport: asyncio.Transport | None = upstream._writer.transport
    return transport


def upstream_protocol(upstream: client_ws.ClientWebSocketResponse) -> Any:
    """The engine connection's protocol (``WebSocketWriter.protocol``): its flow control."""
    return upstream._writer.protocol


#: The connection's transport is above its high-water mark
#: (``BaseProtocol.writing_paused``, a bool). Read per event, so an ``attrgetter`` too.
writing_paused: Final[Callable[[Any], bool]] = operator.attrgetter("writing_paused")


def on_writing_resumed(protocol: Any, callback: Callable[[], None] | None) -> None:
    """Call ``callback`` each time ``protocol``'s transport drains below its low-water mark.

    aiohttp's protocol only wakes a coroutine parked in ``_drain_helper``; the
    upstream link needs a callback (the relay resumes reading the client from
    it). The protocol instance's ``resume_writing`` is wrapped, so aiohttp's
    own bookkeeping still runs first. None unwraps it again (the link is done:
    no reference cycle through the protocol).
    """
    if callback is None:
        vars(protocol).pop("resume_writing", None)
        return
    resume = protocol.resume_writing

    def resume_writing() -> None:
        resume()
        callback()

    protocol.resume_writing = resume_writing


def upstream_backlog(upstream: client_ws.ClientWebSocketResponse) -> Sized:
    """Engine frames aiohttp has parsed that the relay has not read yet.

    A live view (aiohttp's reader deque): the fast path batches writes while
    it is non-empty.
    """
    buffer: Sized = upstream._reader._buffer
    return buffer


def websocket_mask(mask: bytes, data: bytearray) -> None:
    """XOR ``data`` in place with the 4-byte ``mask`` (aiohttp's C routine when built).

    The picows upstream link masks its own frames with it (they are written in
    one batch per loop tick, not one send per frame).
    """
    _websocket_helpers.websocket_mask(mask, data)


def set_upstream_write_limit(upstream: client_ws.ClientWebSocketResponse, limit: int) -> None:
    """Let unsent input grow to ``limit`` bytes before aiohttp's writer awaits a drain.

    The relay fails the session itself when the engine stops reading
    (``max_pending_input_bytes``); aiohttp's own drain would instead block the
    client reader, which then could not act on a cancel.
    """
    writer = upstream._writer
    writer._limit = limit
    transport = upstream_transport(upstream)
    if transport is not None:
        transport.set_write_buffer_limits(high=limit)


def bound_sockets(site: web.BaseSite) -> list[Any]:
    """The sockets a started site listens on (for port 0)."""
    server = site._server
    return list(getattr(server, "sockets", None) or [])


# -- the client listener's edge (proxy/edge/guard.py) ---------------------------------------------------


def requests_parsed(protocol: Any) -> int:
    """Request heads aiohttp's parser completed on this connection (``_request_count``).

    The edge sees a head complete when this grows during ``data_received``.
    """
    return int(protocol._request_count)


def head_refused(protocol: Any) -> bool:
    """aiohttp's parser refused the last request head (its 400: a line, field or header
    count over the listener's limits, or a malformed head); the edge counts it."""
    messages = protocol._messages
    return bool(messages) and isinstance(messages[-1][0], _web_protocol._ErrInfo)


def upgraded(protocol: Any) -> bool:
    """The upgrade was accepted: a WebSocket reader (``_payload_parser``, set only by
    an accepted ``WebSocketResponse``) now parses the connection, so no more request
    heads can follow. A declined upgrade has none: aiohttp parses heads again."""
    return protocol._payload_parser is not None


def closing(protocol: Any) -> bool:
    """aiohttp will not read another request on this connection."""
    return bool(protocol._close or protocol._force_close)


def detach_transport(protocol: Any) -> asyncio.Transport | None:
    """Take the client connection away from aiohttp's request handler, still open.

    ``force_close()`` marks the handler closed (it parses no more requests, its
    request loop ends without touching the socket, its payload lingering is
    skipped) and closes ``protocol.transport`` when one is set; unsetting
    ``transport`` first leaves the socket to the caller: the edge's lingering
    close after an error answer. None when the connection is already gone.
    """
    transport: asyncio.Transport | None = protocol.transport
    protocol.transport = None
    protocol.force_close()
    return transport


class HookedRequestHandler(web.RequestHandler):
    """aiohttp's per-connection request handler, with its per-request step as a hook.

    ``RequestHandler._handle_request`` runs one request and returns
    ``(response, reset)``; the edge needs to act after each one (count it,
    open the next head's timer, linger after an error answer). Subclasses
    override :meth:`around_request` instead of the private method.
    """

    async def _handle_request(self, *args: Any, **kwargs: Any) -> Any:
        return await self.around_request(super()._handle_request(*args, **kwargs))

    async def around_request(self, handling: Awaitable[Any]) -> Any:
        """Run one request (await ``handling``) and return its ``(response, reset)``."""
        return await handling


class HookedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connection factory a subclass may replace.

    aiohttp builds the listener's ``web.Server`` in the private
    ``BaseRunner._make_server``; subclasses override :meth:`make_server`,
    which gets the one aiohttp built.
    """

    async def _make_server(self) -> web.Server:
        return self.make_server(await super()._make_server())

    def make_server(self, base: web.Server) -> web.Server:
        """The server the site listens with (``base``: the one aiohttp built)."""
        return base


def handler_kwargs(server: web.Server) -> dict[str, Any]:
    """What ``web.Server`` passes each ``RequestHandler`` it makes (loop and handler args).

    The edge builds its own server and handlers with exactly these.
    """
    return {"loop": server._loop, **server._kwargs}
