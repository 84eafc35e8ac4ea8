"""The client listener's edge: what a connection may cost before it has a request.

aiohttp bounds each header line and field and the number of headers, but not
the head as a whole, the time a client may take to send it, nor how many
connections may sit half-way through one. This module bounds each
(``max_request_head_bytes``, ``request_head_timeout``,
``max_pending_handshakes``), reads a trusted PROXY header, and closes every
error answer before the upgrade with a lingering close, before aiohttp's
request handler sees a byte. docs/design.md, Admission and lifecycle; each
limit, its default and what it protects: docs/security.md, 3a.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import web

from proxy import compat
from proxy.edge.forwarded import (
    ProxyHeaderError,
    TrustedProxies,
    forwarded_client,
    parse_proxy_header,
    proxy_header_kind,
)
from proxy.edge.linger import Linger
from proxy.edge.reverse_proxy import DEFAULT_MAX_HTTP_BODY_BYTES
from proxy.settings import Settings

__all__ = [
    "DEFAULT_LINGERING_TIME",
    "DEFAULT_LINGERING_TIMEOUT",
    "DEFAULT_MAX_HTTP_BODY_BYTES",
    "DEFAULT_MAX_LINGERING_BYTES",
    "DEFAULT_MAX_PENDING_HANDSHAKES",
    "DEFAULT_MAX_REQUEST_HEAD_BYTES",
    "DEFAULT_REQUEST_HEAD_TIMEOUT",
    "EdgeAppRunner",
    "EdgeGuard",
    "EdgeLimits",
    "EdgeRequestHandler",
    "Lingered",
    "Violated",
    "client_address",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_HEAD_BYTES: Final = 32 * 1024
DEFAULT_REQUEST_HEAD_TIMEOUT: Final = 10.0
DEFAULT_MAX_PENDING_HANDSHAKES: Final = 256
DEFAULT_LINGERING_TIME: Final = 5.0
DEFAULT_LINGERING_TIMEOUT: Final = 2.0
DEFAULT_MAX_LINGERING_BYTES: Final = 1024 * 1024
#: aiohttp's per-item limits on the client listener: no legitimate client of a
#: realtime API sends a request line or a header near 8 KiB, nor 64 headers.
MAX_LINE_BYTES: Final = 8 * 1024
MAX_FIELD_BYTES: Final = 8 * 1024
MAX_HEADERS: Final = 64
#: How many bytes decide whether a connection starts with a PROXY header.
_PROXY_SNIFF_BYTES: Final = 12
#: A PROXY header that is not complete after this many bytes is not one.
_PROXY_MAX_BYTES: Final = 16 + 1024
#: A burst of at least this many pending connections that falls to a quarter
#: of its peak hands the freed heap back to the OS (see :meth:`EdgeGuard.release`).
_TRIM_AFTER_PENDING: Final = 64
#: ... at most this often, in seconds.
_TRIM_INTERVAL: Final = 1.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None elsewhere (musl, macOS): then nothing is trimmed."""
    name = ctypes.util.find_library("c")
    try:
        function = getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None
    if function is None:
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    trim: Callable[[int], int] = function
    return trim


_MALLOC_TRIM: Final = _load_malloc_trim()

Reject = Callable[[str, int, str], None]
"""``reject(reason, status, address)``: count and log one refusal (status 0: closed only)."""

Lingered = Callable[[str], None]
"""``lingered(outcome)``: count one lingering close by how it ended
(``metrics.definitions.LINGER_OUTCOMES``)."""

Violated = Callable[[str, str], None]
"""``violated(reason, address)``: count and log one WebSocket connection failed for a
protocol violation its parser refused (``metrics.definitions.CLIENT_PROTOCOL_VIOLATIONS``)."""


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """The edge's settings, in their units (see the module docstring)."""

    max_request_head_bytes: int = DEFAULT_MAX_REQUEST_HEAD_BYTES
    request_head_timeout: float = DEFAULT_REQUEST_HEAD_TIMEOUT
    max_pending_handshakes: int = DEFAULT_MAX_PENDING_HANDSHAKES
    lingering_time: float = DEFAULT_LINGERING_TIME
    lingering_timeout: float = DEFAULT_LINGERING_TIMEOUT
    max_lingering_bytes: int = DEFAULT_MAX_LINGERING_BYTES
    trusted_proxies: tuple[str, ...] = ()
    #: Reverse-proxied request bodies (proxy/edge/reverse_proxy.py), bytes.
    max_http_body_bytes: int = DEFAULT_MAX_HTTP_BODY_BYTES

    @classmethod
    def from_settings(cls, settings: Settings) -> EdgeLimits:
        """From :class:`proxy.settings.proxy_settings.Settings`."""
        return cls(
            max_request_head_bytes=settings.max_request_head_bytes,
            request_head_timeout=settings.request_head_timeout,
            max_pending_handshakes=settings.max_pending_handshakes,
            lingering_time=settings.lingering_time,
            lingering_timeout=settings.lingering_timeout,
            max_lingering_bytes=settings.max_lingering_bytes,
            trusted_proxies=tuple(settings.trusted_proxies),
            max_http_body_bytes=settings.max_http_body_bytes,
        )


class EdgeGuard:
    """State shared by every connection of the client listener.

    Args:
        limits: the settings.
        reject: called once per refused connection or request (metrics and log).
        lingered: called once per lingering close, with its outcome (metrics).
        violated: called once per upgraded connection failed for a protocol
            violation (an unmasked frame: ``proxy.compat.install_mask_check``).
    """

    def __init__(
        self,
        limits: EdgeLimits,
        reject: Reject,
        lingered: Lingered | None = None,
        violated: Violated | None = None,
    ) -> None:
        self.limits = limits
        self.trusted = TrustedProxies(limits.trusted_proxies)
        self.reject = reject
        self.lingered: Lingered = lingered or (lambda outcome: None)
        self.violated: Violated = violated or (lambda reason, address: None)
        #: Connections whose current request head is not complete.
        self.pending = 0
        #: Connections lingering after an error answer (they count against the cap too).
        self.lingering = 0
        self._peak = 0
        self._trimmed_at = -_TRIM_INTERVAL
        self._trim_later: asyncio.TimerHandle | None = None

    def full(self) -> bool:
        """No room for one more pending or lingering connection (``max_pending_handshakes``)."""
        cap = self.limits.max_pending_handshakes
        return cap > 0 and self.pending + self.lingering >= cap

    def opened(self) -> None:
        """One more connection is sending a request head."""
        self.pending += 1
        self._peak = max(self._peak, self.pending)

    def closed(self) -> None:
        """A head completed, or its connection was refused or went away."""
        self.pending -= 1
        if self._peak >= _TRIM_AFTER_PENDING and self.pending <= self._peak // 4:
            self._peak = self.pending
            asyncio.get_running_loop().call_soon(self.release)

    def release(self) -> None:
        """Hand the heap freed by a burst of pending connections back to the OS.

        The heads of hundreds of connections are many small allocations; once
        those clients leave, glibc keeps the freed heap (RSS stayed +12 MiB after
        250 held 31 KB heads left) until something trims it. Not a leak, but
        memory an operator sees as taken: trimming once when a burst ends
        returns it (+2 MiB). At most once per second (a later burst's end is
        trimmed when the second is up); a no-op without glibc.
        """
        if _MALLOC_TRIM is None or self._trim_later is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self._trimmed_at + _TRIM_INTERVAL - loop.time()
        if wait > 0:
            self._trim_later = loop.call_later(wait, self._trim)
        else:
            self._trim()

    def _trim(self) -> None:
        assert _MALLOC_TRIM is not None
        self._trim_later = None
        self._trimmed_at = asyncio.get_running_loop().time()
        _MALLOC_TRIM(0)

    def update(self, limits: EdgeLimits) -> None:
        """Reloaded settings: they apply to the next read, timer and connection."""
        self.trusted = TrustedProxies(limits.trusted_proxies)
        self.limits = limits


def _http_response(status: int, reason: str, code: str, message: str) -> bytes:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class EdgeRequestHandler(compat.HookedRequestHandler):
    """aiohttp's per-connection protocol, with the edge's bounds in front of its parser."""

    def __init__(self, manager: Any, *, guard: EdgeGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        #: The client address a trusted PROXY header gave; None: the TCP peer's.
        self.proxied_source: str | None = None
        self.peer = ""
        self._sniff: bytes | None = b""  # None once the PROXY question is settled
        self._head_open = False
        self._head_bytes = 0
        self._head_tail = b""
        self._head_timer: asyncio.TimerHandle | None = None
        self._handled = 0
        self._refused = False
        #: Set once an error answer was written and the connection lingers.
        self._linger: Linger | None = None

    # -- the connection ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if peername else ""
        if self.guard.full():
            self._refuse("pending_handshakes", 0, b"")
            return
        self._open_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        # The upgrade's shortcut (data_received bound on the instance) is a
        # reference cycle: drop it so the connection is freed by refcount.
        vars(self).pop("data_received", None)
        self._close_head()
        linger = self._linger
        if linger is not None:
            self._linger = None
            linger.lost(exc)
        super().connection_lost(exc)

    def eof_received(self) -> None:
        linger = self._linger
        if linger is not None:  # the client closed its side: it has read what it wanted
            linger.end("client_closed")
        super().eof_received()

    def force_close(self) -> None:
        super().force_close()
        linger = self._linger
        if linger is not None:  # shutdown: no more lingering
            linger.end("shutdown")

    @property
    def address(self) -> str:
        """The address the edge logs for this connection."""
        return self.proxied_source or self.peer

    def on_protocol_violation(self, reason: str) -> None:
        """The upgraded connection's frame parser refused it for ``reason`` (it closes 1002)."""
        self.guard.violated(reason, self.address)

    def data_received(self, data: bytes) -> None:
        linger = self._linger
        if linger is not None:
            linger.discard(data)
            return
        if self._refused:
            return
        if self._sniff is not None:
            data = self._take_proxy_header(data)
            if not data:
                return
        if self._head_open:
            if not self._head_fits(data):
                self._refuse(
                    "head_too_large",
                    431,
                    _http_response(
                        431,
                        "Request Header Fields Too Large",
                        "head_too_large",
                        f"the request head exceeds {self.guard.limits.max_request_head_bytes}"
                        " bytes",
                    ),
                )
                return
            before = compat.requests_parsed(self)
            super().data_received(data)
            if compat.requests_parsed(self) != before:
                self._close_head()
                if compat.head_refused(self):  # aiohttp answers it 400 and closes
                    # Nothing after it is parsed: it is dropped until the answer
                    # is written, then discarded by the lingering close.
                    self._refused = True
                    self.guard.reject("bad_request_head", 400, self.address)
            return
        if compat.upgraded(self):
            # An accepted WebSocket: no more heads to guard. Every further chunk
            # goes straight to aiohttp's handler, without this method on the path.
            self.data_received = super().data_received  # type: ignore[method-assign]
        super().data_received(data)

    async def around_request(self, handling: Awaitable[Any]) -> Any:
        keep_alive = False
        error_answer = False
        try:
            result = await handling
            response, reset = result
            keep_alive = bool(response.keep_alive) and not reset
            error_answer = not reset and response.status >= 400
            return result
        finally:
            self._handled += 1
            if self.transport is None or compat.upgraded(self):
                pass
            elif keep_alive and not compat.closing(self):
                # Keep-alive: the next request's head starts now, unless it is
                # already parsed (pipelined).
                if compat.requests_parsed(self) == self._handled:
                    self._open_head()
            elif error_answer:
                # The connection ends after an error answer: linger, instead of
                # aiohttp's close right after this method returns.
                self._linger_after_answer()

    # -- the request head ------------------------------------------------------------------------

    def _open_head(self) -> None:
        if self._head_open or self._refused:
            return
        self._head_open = True
        self._head_bytes = 0
        self._head_tail = b""
        self.guard.opened()
        timeout = self.guard.limits.request_head_timeout
        if timeout > 0:
            self._head_timer = asyncio.get_running_loop().call_later(timeout, self._head_expired)

    def _close_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._head_open:
            self._head_open = False
            self.guard.closed()

    def _head_fits(self, data: bytes) -> bool:
        """Count ``data`` against the head; False when the head would exceed its cap.

        Bytes after the end of the head (``CRLF CRLF``) in the same read are
        body and do not count.
        """
        limit = self.guard.limits.max_request_head_bytes
        start = self._head_bytes
        self._head_bytes += len(data)
        if limit <= 0 or self._head_bytes <= limit:
            self._head_tail = (self._head_tail + data)[-3:]
            return True
        tail = self._head_tail
        end = (tail + data).find(b"\r\n\r\n")
        return end >= 0 and start - len(tail) + end + 4 <= limit

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self._head_open or self._refused:
            return
        timeout = self.guard.limits.request_head_timeout
        self._refuse(
            "head_timeout",
            408,
            _http_response(
                408,
                "Request Timeout",
                "head_timeout",
                f"the request head was not complete within {timeout:g} s",
            ),
        )

    # -- the PROXY protocol ---------------------------------------------------------------------

    def _take_proxy_header(self, data: bytes) -> bytes:
        """Strip a PROXY header off the start of the stream; the HTTP bytes after it."""
        assert self._sniff is not None
        buffered = self._sniff + data
        kind = proxy_header_kind(buffered[:_PROXY_SNIFF_BYTES])
        if kind is None:
            self._sniff = None
            return buffered
        if kind == "" and len(buffered) < _PROXY_SNIFF_BYTES:
            self._sniff = buffered
            return b""
        if not self.guard.trusted.trusts(self.peer):
            self._refuse("untrusted_proxy_header", 0, b"")
            return b""
        try:
            header = parse_proxy_header(buffered)
        except ProxyHeaderError as exc:
            log.debug("bad PROXY header from %s: %s", self.peer, exc)
            self._refuse("bad_proxy_header", 0, b"")
            return b""
        if header is None:
            if len(buffered) >= _PROXY_MAX_BYTES:
                self._refuse("bad_proxy_header", 0, b"")
                return b""
            self._sniff = buffered
            return b""
        self._sniff = None
        self.proxied_source = header.source
        return buffered[header.length :]

    # -- refusing ----------------------------------------------------------------------------------

    def _refuse(self, reason: str, status: int, response: bytes) -> None:
        """Count, log, answer (when ``response``: then linger) and close; nothing more is parsed."""
        self._refused = True
        self._close_head()
        self.guard.reject(reason, status, self.address)
        transport = self.transport
        if transport is not None and response:
            transport.write(response)
            self._linger_after_answer()
            return
        self.force_close()

    # -- the lingering close ----------------------------------------------------------------------

    def _linger_after_answer(self) -> None:
        """The answer is written: take the socket from aiohttp and close it lingering.

        With no room under ``max_pending_handshakes`` it is closed at once.
        """
        transport = compat.detach_transport(self)
        if transport is None or self._linger is not None:
            return
        if self.guard.full():
            self.guard.lingered("no_room")
            transport.close()
            return
        self._linger = Linger(transport, self.guard)


class EdgeServer(web.Server):
    """aiohttp's connection factory, making :class:`EdgeRequestHandler` s."""

    def __init__(self, *args: Any, guard: EdgeGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> EdgeRequestHandler:
        return EdgeRequestHandler(self, guard=self.guard, **compat.handler_kwargs(self))


class EdgeAppRunner(compat.HookedAppRunner):
    """``web.AppRunner`` for the client listener: its connections go through the edge.

    Args:
        app: the client application.
        guard: the edge's limits and shared state.
        kwargs: as for ``web.AppRunner``; aiohttp's per-line, per-field and
            header-count limits default to the edge's small ones.
    """

    def __init__(self, app: web.Application, *, guard: EdgeGuard, **kwargs: Any) -> None:
        kwargs.setdefault("max_line_size", MAX_LINE_BYTES)
        kwargs.setdefault("max_field_size", MAX_FIELD_BYTES)
        kwargs.setdefault("max_headers", MAX_HEADERS)
        super().__init__(app, **kwargs)
        self.guard = guard

    def make_server(self, base: web.Server) -> web.Server:
        return EdgeServer(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            guard=self.guard,
            **compat.handler_kwargs(base),
        )


def client_address(request: web.BaseRequest) -> str:
    """The client's address for the per-address limit and the logs.

    The TCP peer, unless it is a trusted proxy: then the address a PROXY
    header carried, or the rightmost untrusted ``X-Forwarded-For`` hop
    (:func:`proxy.edge.forwarded.forwarded_client`).
    """
    protocol = request.protocol
    if not isinstance(protocol, EdgeRequestHandler):
        return request.remote or ""
    trusted = protocol.guard.trusted
    peer = protocol.peer
    if protocol.proxied_source is not None and trusted.trusts(peer):
        peer = protocol.proxied_source
    return forwarded_client(peer, request.headers.getall("X-Forwarded-For", []), trusted)
