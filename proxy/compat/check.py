"""The start-up check: every aiohttp internal :mod:`proxy.compat.internals` reaches,
named as a :class:`Hook` and looked for without a socket (docs/design.md, Relay shell).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
from aiohttp import base_protocol, client_proto, client_ws, http_websocket, web_runner, web_ws
from aiohttp import web_protocol as _web_protocol
from aiohttp import web_server as _web_server

try:  # a missing module is a missing hook (see HOOKS), not an import error
    from aiohttp._websocket import helpers as _websocket_helpers
except ImportError:  # pragma: no cover - aiohttp < 3.11
    _websocket_helpers = None  # type: ignore[assignment]


from proxy.compat.internals import UNMASKED_FRAME, install_mask_reader, install_text_push

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
    if not install_mask_reader():
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
