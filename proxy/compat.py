"""Every aiohttp internal the product touches, named once and checked at startup.

The relay and the edge's guard need what aiohttp's public API cannot say or
do (docs/design.md, Relay shell), so the product reaches into aiohttp here and
nowhere else, each reach a :class:`Hook` in ``HOOKS``. :func:`missing_hooks`
checks them against the installed aiohttp without a socket; ``serve`` calls
:func:`require_hooks` before it binds anything and exits 2 naming the version
and the missing hook.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass
from typing import Any, Final, Protocol

import aiohttp
from aiohttp import base_protocol, client_proto, client_ws, http_websocket, web, web_runner, web_ws
from aiohttp import web_protocol as _web_protocol
from aiohttp import web_server as _web_server
from aiohttp.http_websocket import WebSocketError, WSCloseCode

try:  # a missing module is a missing hook (see HOOKS), not an import error
    from aiohttp._websocket import helpers as _websocket_helpers
except ImportError:  # pragma: no cover - aiohttp < 3.11
    _websocket_helpers = None  # type: ignore[assignment]

__all__ = [
    "AIOHTTP_VERSION",
    "HOOKS",
    "UNMASKED_FRAME",
    "AiohttpHookMissing",
    "Hook",
    "HookedAppRunner",
    "HookedRequestHandler",
    "MaskWalk",
    "bound_sockets",
    "client_transport",
    "closing",
    "detach_transport",
    "handler_kwargs",
    "head_refused",
    "install_client_writer",
    "install_mask_check",
    "install_text_push",
    "missing_hooks",
    "on_writing_resumed",
    "push_text",
    "requests_parsed",
    "require_hooks",
    "upstream_backlog",
    "upstream_protocol",
    "upstream_transport",
    "wait_writable",
    "websocket_mask",
    "writing_paused",
]

AIOHTTP_VERSION: Final = aiohttp.__version__


class AiohttpHookMissing(RuntimeError):
    """The installed aiohttp lacks an internal the proxy relies on.

    Attributes:
        hook: the name of the missing hook, as in :data:`HOOKS`.
    """

    def __init__(self, hook: str) -> None:
        super().__init__(
            f"aiohttp {AIOHTTP_VERSION} lacks {hook}, which omni-sidecar needs; "
            "install the aiohttp version range declared in pyproject.toml"
        )
        self.hook = hook


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
    if _mask_checking_reader is None and not _install_mask_reader():
        return False
    _new_mask_walk = walk
    return True


def _install_mask_reader() -> bool:
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


# -- the startup check ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hook:
    """One internal the proxy relies on, and how to see that it is there."""

    name: str
    present: Callable[[], bool]


def _assigns(function: Any, *attributes: str) -> bool:
    """The function's code reads or writes every one of ``attributes``."""
    code = getattr(function, "__code__", None)
    return code is not None and all(name in code.co_names for name in attributes)


def _queue_has_buffer() -> bool:
    """aiohttp's WebSocket reader queue (C or Python build) exposes ``_buffer``."""
    from aiohttp._websocket.reader import WebSocketDataQueue

    loop = asyncio.new_event_loop()
    try:
        queue = WebSocketDataQueue(object(), 1 << 16, loop=loop)  # type: ignore[arg-type]
        return isinstance(getattr(queue, "_buffer", None), Sized)
    finally:
        loop.close()


def _text_push_reaches_the_parser() -> bool:
    """The text push works: ``WebSocketResponse`` builds its queue from the module
    name, and aiohttp's frame parser (C or Python) hands a parsed text message
    to the override of ``feed_data`` (checked by parsing one frame)."""
    if not _assigns(web_ws.WebSocketResponse._post_start, "WebSocketDataQueue", "_reader"):
        return False
    if not install_text_push():
        return False
    from aiohttp._websocket import reader

    reader_class: Any = reader.WebSocketReader

    class _Protocol:
        def pause_reading(self) -> None: ...

        def resume_reading(self) -> None: ...

    loop = asyncio.new_event_loop()
    try:
        queue_class: Any = web_ws.WebSocketDataQueue  # type: ignore[attr-defined]
        queue: Any = queue_class(_Protocol(), 1 << 16, loop=loop)
        got: list[str] = []
        queue.on_text = got.append
        try:
            parser: Any = reader_class(queue, 1 << 16, compress=False, decode_text=True)
        except TypeError:  # aiohttp < 3.13 has no decode_text
            parser = reader_class(queue, 1 << 16, compress=False)
        parser.feed_data(b"\x81\x02hi")  # one unmasked text frame, FIN set
        return got == ["hi"] and not len(queue._buffer)
    finally:
        loop.close()


class _FirstHeader:
    """The startup check's walk: each read starts with a whole frame header."""

    def unmasked_at(self, data: bytes) -> int:
        return 0 if len(data) >= 2 and not data[1] & 0x80 else -1


def _mask_check_reaches_the_parser() -> bool:
    """The mask check works: ``WebSocketResponse`` builds its parser from the module
    name, the subclass's ``feed_data`` is what the parser is fed through, a masked
    frame still parses and an unmasked one fails the queue and reaches the queue's
    ``_protocol`` (checked by feeding both)."""
    if not _assigns(web_ws.WebSocketResponse._post_start, "WebSocketReader", "_reader"):
        return False
    if not _install_mask_reader():
        return False
    from aiohttp._websocket import reader

    violations: list[str] = []

    class _Protocol:
        def pause_reading(self) -> None: ...

        def resume_reading(self) -> None: ...

        def on_protocol_violation(self, reason: str) -> None:
            violations.append(reason)

    loop = asyncio.new_event_loop()
    try:
        queue: Any = reader.WebSocketDataQueue(_Protocol(), 1 << 16, loop=loop)  # type: ignore[arg-type]
        reader_class: Any = web_ws.WebSocketReader  # type: ignore[attr-defined]
        try:
            parser: Any = reader_class(queue, 1 << 16, compress=False, decode_text=True)
        except TypeError:  # aiohttp < 3.13 has no decode_text
            parser = reader_class(queue, 1 << 16, compress=False)
        parser.mask_walk = _FirstHeader()
        masked = parser.feed_data(b"\x81\x82\x00\x00\x00\x00hi")  # zero mask key: "hi"
        refused = parser.feed_data(b"\x81\x02hi")  # unmasked
        return (
            masked == (False, b"")
            and len(queue._buffer) == 1
            and refused[0] is True
            and violations == [UNMASKED_FRAME]
            and queue.exception() is not None
        )
    finally:
        loop.close()


def _has_kwarg(function: Any, name: str) -> bool:
    code = getattr(function, "__code__", None)
    return (
        code is not None and name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    )


HOOKS: Final[tuple[Hook, ...]] = (
    Hook(
        "BaseProtocol.writing_paused",
        lambda: isinstance(getattr(base_protocol.BaseProtocol, "writing_paused", None), property),
    ),
    Hook(
        "BaseProtocol._drain_helper",
        lambda: asyncio.iscoroutinefunction(
            getattr(base_protocol.BaseProtocol, "_drain_helper", None)
        ),
    ),
    Hook(
        "BaseProtocol.transport",
        lambda: _assigns(base_protocol.BaseProtocol.__init__, "transport"),
    ),
    Hook(
        "WebSocketResponse._writer (send_frame/close)",
        lambda: (
            _assigns(web_ws.WebSocketResponse._post_start, "_writer")
            and _assigns(web_ws.WebSocketResponse.close, "_writer")
            and _assigns(web_ws.WebSocketResponse.send_frame, "_writer", "send_frame")
        ),
    ),
    Hook(
        "WebSocketWriter.send_frame/close/_limit/transport/protocol",
        lambda: (
            asyncio.iscoroutinefunction(getattr(http_websocket.WebSocketWriter, "send_frame", None))
            and asyncio.iscoroutinefunction(getattr(http_websocket.WebSocketWriter, "close", None))
            and _assigns(http_websocket.WebSocketWriter.__init__, "_limit", "transport", "protocol")
        ),
    ),
    Hook(
        "ResponseHandler.resume_writing, wrapped per instance",
        lambda: (
            "resume_writing" in vars(base_protocol.BaseProtocol)
            and "__slots__" not in vars(client_proto.ResponseHandler)
        ),
    ),
    Hook(
        "web_ws.WebSocketDataQueue built by _post_start, its feed_data called by the parser",
        lambda: _text_push_reaches_the_parser(),
    ),
    Hook(
        "web_ws.WebSocketReader built by _post_start, its feed_data called by the handler, "
        "WebSocketDataQueue._protocol/set_exception",
        lambda: _mask_check_reaches_the_parser(),
    ),
    Hook(
        "ClientWebSocketResponse._writer/_reader",
        lambda: _assigns(client_ws.ClientWebSocketResponse.__init__, "_writer", "_reader"),
    ),
    Hook("WebSocketDataQueue._buffer", lambda: _queue_has_buffer()),
    Hook("BaseSite._server", lambda: _assigns(web_runner.BaseSite.__init__, "_server")),
    Hook(
        "RequestHandler._payload_parser",
        lambda: _assigns(_web_protocol.RequestHandler.__init__, "_payload_parser"),
    ),
    Hook(
        "RequestHandler._request_count/_close/_force_close/_handle_request/_messages",
        lambda: (
            _assigns(
                _web_protocol.RequestHandler.__init__, "_request_count", "_close", "_force_close"
            )
            and _assigns(_web_protocol.RequestHandler.data_received, "_request_count")
            and _assigns(_web_protocol.RequestHandler.start, "_handle_request")
            and asyncio.iscoroutinefunction(_web_protocol.RequestHandler._handle_request)
            and _assigns(_web_protocol.RequestHandler.data_received, "_messages", "_ErrInfo")
        ),
    ),
    Hook(
        "RequestHandler.force_close closes .transport, start() leaves it when _force_close",
        lambda: (
            _assigns(_web_protocol.RequestHandler.force_close, "_force_close", "transport")
            and _assigns(_web_protocol.RequestHandler.start, "_force_close", "transport")
        ),
    ),
    Hook(
        "Server._loop/_kwargs, BaseRunner._make_server",
        lambda: (
            _assigns(_web_server.Server.__init__, "_loop", "_kwargs")
            and _assigns(_web_server.Server.__call__, "_loop", "_kwargs")
            and asyncio.iscoroutinefunction(getattr(web_runner.AppRunner, "_make_server", None))
        ),
    ),
    Hook("ClientWSTimeout", lambda: hasattr(aiohttp, "ClientWSTimeout")),
    Hook(
        "_websocket.helpers.websocket_mask",
        lambda: callable(getattr(_websocket_helpers, "websocket_mask", None)),
    ),
    Hook(
        "ClientSession.ws_connect(timeout=ClientWSTimeout)",
        lambda: _has_kwarg(aiohttp.ClientSession._ws_connect, "timeout"),
    ),
)
"""Every hook :mod:`proxy.compat` and its callers use, in one list."""


def missing_hooks() -> list[str]:
    """Names of the hooks the installed aiohttp does not have (empty when all are there)."""
    missing = []
    for hook in HOOKS:
        try:
            ok = hook.present()
        except Exception:  # noqa: BLE001 - an attribute chain that broke is a missing hook too
            ok = False
        if not ok:
            missing.append(hook.name)
    return missing


def require_hooks() -> None:
    """Raise :class:`AiohttpHookMissing` for the first missing hook.

    Raises:
        AiohttpHookMissing: the installed aiohttp cannot run the proxy.
    """
    missing = missing_hooks()
    if missing:
        raise AiohttpHookMissing(", ".join(missing))
