"""The aiohttp applications: the client listener and the admin listener.

Client listener (DESIGN.md §7): WS ``/v1/realtime`` and ``/v1/duplex``,
``GET /healthz``, ``GET /readyz``; every other path is reverse-proxied to the
engine, streamed. Admin listener: ``GET /metrics``, ``GET /debug/sessions``.

Admission happens before the WebSocket upgrade (DESIGN.md §6): draining or
engine not ready → 503, ``max_sessions`` reached → 503 with ``Retry-After``
(after waiting up to ``admission_timeout`` for a slot), upstream connect
failure → 502. The upstream WebSocket is opened before the client's upgrade
completes, so a client never gets a socket that leads nowhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import parse_qsl, urlencode, urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from metrics import SidecarMetrics
from proxy.auth import AuthPolicy, load_api_keys, offered_subprotocols
from proxy.config import Settings
from proxy.core.buffer import BufferLimits
from proxy.core.session import OverflowPolicy, SessionCore, SessionSettings
from proxy.observer import SessionRegistry
from proxy.relay import Relay, new_event_id, tune_client_socket

__all__ = [
    "Admission",
    "ProxyState",
    "UpstreamTarget",
    "build_admin_app",
    "build_client_app",
    "session_settings",
]

log = logging.getLogger(__name__)

STATE: Final[web.AppKey[ProxyState]] = web.AppKey("omni_sidecar_state")

#: aiohttp's writer awaits a drain after this many bytes; ours never does.
_NO_WRITER_DRAIN: Final = 1 << 62
#: Largest frame accepted from the engine (DuplexClient allows 64 MiB too).
MAX_UPSTREAM_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: Headers never copied between hops (RFC 9110 §7.6.1) or recomputed by aiohttp.
_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
    }
)
_WS_PATHS: Final = ("/v1/realtime", "/v1/duplex")
#: Subprotocols a browser Realtime client may offer; we accept, the engine never sees them.
_CLIENT_SUBPROTOCOLS: Final = ("realtime", "openai-beta.realtime-v1")


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """Where the engine is: ``ws_base`` like ``ws://127.0.0.1:8091``."""

    ws_base: str

    @property
    def http_base(self) -> str:
        if self.ws_base.startswith("wss://"):
            return "https://" + self.ws_base[6:]
        if self.ws_base.startswith("ws://"):
            return "http://" + self.ws_base[5:]
        return self.ws_base

    @classmethod
    def from_url(cls, url: str) -> UpstreamTarget:
        """Accept ``ws://h:p`` or a full ``ws://h:p/prefix/v1/realtime``."""
        parts = urlsplit(url)
        path = parts.path.rstrip("/")
        for suffix in _WS_PATHS:
            if path.endswith(suffix):
                path = path[: -len(suffix)]
                break
        return cls(f"{parts.scheme}://{parts.netloc}{path}")


class Admission:
    """Session slots and the reasons not to admit.

    Args:
        max_sessions: concurrent sessions; 0 = unlimited.
        admission_timeout: seconds to wait for a free slot before refusing.
    """

    def __init__(
        self, max_sessions: int, admission_timeout: float, *, max_sessions_per_ip: int = 0
    ) -> None:
        self.max_sessions = max_sessions
        self.admission_timeout = admission_timeout
        self.max_sessions_per_ip = max_sessions_per_ip
        self.per_ip: dict[str, int] = {}
        self.active = 0
        self.draining = False
        self.engine_ready = False
        self.not_ready_reason = "engine is starting"
        self._freed = asyncio.Condition()

    def refusal(self) -> tuple[str, str] | None:
        """(metric reason, message) when no session may start, ignoring capacity."""
        if self.draining:
            return "draining", "the sidecar is shutting down"
        if not self.engine_ready:
            return "not_ready", self.not_ready_reason
        return None

    def _has_slot(self) -> bool:
        return self.max_sessions == 0 or self.active < self.max_sessions

    async def acquire(self) -> bool:
        """Take a slot, waiting up to ``admission_timeout``. False when none came."""
        if not self._has_slot() and self.admission_timeout > 0:
            async with self._freed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.admission_timeout):
                        await self._freed.wait_for(self._has_slot)
        if not self._has_slot():
            return False
        self.active += 1
        return True

    def acquire_ip(self, address: str) -> bool:
        """Count a session of one client address; False when it has too many."""
        if self.max_sessions_per_ip <= 0:
            return True
        count = self.per_ip.get(address, 0)
        if count >= self.max_sessions_per_ip:
            return False
        self.per_ip[address] = count + 1
        return True

    def release_ip(self, address: str) -> None:
        if self.max_sessions_per_ip <= 0:
            return
        count = self.per_ip.get(address, 0) - 1
        if count > 0:
            self.per_ip[address] = count
        else:
            self.per_ip.pop(address, None)

    async def release(self) -> None:
        self.active -= 1
        async with self._freed:
            self._freed.notify_all()

    async def wait_idle(self) -> None:
        """Wait until no session holds a slot (handshakes in flight included)."""
        async with self._freed:
            await self._freed.wait_for(lambda: self.active == 0)

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self.engine_ready = ready
        self.not_ready_reason = reason or ("" if ready else "engine is not ready")


@dataclass
class ProxyState:
    """Everything the handlers share; one per process."""

    settings: Settings
    metrics: SidecarMetrics
    admission: Admission
    registry: SessionRegistry
    target: Callable[[], UpstreamTarget | None]
    http: aiohttp.ClientSession | None = None
    session_settings: SessionSettings = field(init=False)
    auth: AuthPolicy = field(init=False)

    def __post_init__(self) -> None:
        self.session_settings = session_settings(self.settings)
        keys = load_api_keys(self.settings.api_keys, self.settings.api_keys_file)
        self.auth = AuthPolicy(keys, self.settings.allowed_origins)

    def client_session(self) -> aiohttp.ClientSession:
        if self.http is None or self.http.closed:
            # limit=0: aiohttp's default of 100 connections would cap sessions.
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self.http = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
            )
        return self.http


def session_settings(settings: Settings) -> SessionSettings:
    """The core's value object, from the flat settings."""
    return SessionSettings(
        buffer=BufferLimits(
            max_pending_output_bytes=settings.max_pending_output_bytes,
            max_pending_output_events=settings.max_pending_output_events,
            output_reserve_bytes=settings.output_reserve_bytes,
            output_reserve_events=settings.output_reserve_events,
            max_close_notice_bytes=settings.max_close_notice_bytes,
        ),
        overflow_policy=OverflowPolicy(settings.overflow_policy),
        interrupt_on_speech_started=settings.interrupt_on_speech_started,
        max_tombstones=settings.max_tombstones,
        tombstone_ttl=settings.tombstone_ttl,
        max_input_audio_rate=settings.max_input_audio_rate,
    )


def _json_error(status: int, reason: str, message: str, **headers: str) -> web.Response:
    return web.json_response(
        {"error": {"code": reason, "message": message}}, status=status, headers=headers
    )


# -- client listener ---------------------------------------------------------------------


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    refusal = state.admission.refusal()
    body = {
        "sessions": state.admission.active,
        "max_sessions": state.admission.max_sessions,
    }
    if refusal is not None:
        return web.json_response(
            {"status": "not_ready", "reason": refusal[0], "detail": refusal[1], **body}, status=503
        )
    if not state.admission._has_slot():
        return web.json_response(
            {
                "status": "not_ready",
                "reason": "capacity",
                "detail": "all session slots are in use",
                **body,
            },
            status=503,
        )
    return web.json_response({"status": "ready", **body})


def _upstream_url(state: ProxyState, target: UpstreamTarget, request: web.Request) -> str:
    url = target.ws_base + request.path
    query = list(parse_qsl(request.query_string, keep_blank_values=True))
    if not state.settings.forward_query:
        query = []
    if state.settings.upstream_autostart_off and not any(k == "autostart" for k, _ in query):
        query.append(("autostart", "0"))
    if query:
        url += "?" + urlencode(query)
    return url


def _upstream_headers(state: ProxyState, request: web.Request) -> dict[str, str]:
    mode = state.settings.upstream_authorization
    headers: dict[str, str] = {}
    if mode == "pass-through":
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
    elif mode.startswith("key:"):
        headers["Authorization"] = "Bearer " + mode[4:]
    return headers


async def _realtime(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return await _reverse_proxy(request)
    state = request.app[STATE]
    metrics = state.metrics
    denied = _check_auth(request, state)
    if denied is not None:
        return denied
    refusal = state.admission.refusal()
    if refusal is not None:
        metrics.sessions_rejected.labels(refusal[0]).inc()
        return _json_error(503, refusal[0], refusal[1], **{"Retry-After": "5"})
    address = request.remote or ""
    if not state.admission.acquire_ip(address):
        metrics.sessions_rejected.labels("capacity").inc()
        return _json_error(
            429, "capacity", "too many sessions from this address", **{"Retry-After": "1"}
        )
    try:
        if not await state.admission.acquire():
            metrics.sessions_rejected.labels("capacity").inc()
            return _json_error(
                503, "capacity", "all session slots are in use", **{"Retry-After": "1"}
            )
        try:
            return await _run_session(request, state)
        finally:
            await state.admission.release()
    finally:
        state.admission.release_ip(address)


def _check_auth(request: web.Request, state: ProxyState) -> web.Response | None:
    """401/403 before anything else; keys are never logged."""
    result = state.auth.check(
        request.headers, offered_subprotocols(request.headers.get("Sec-WebSocket-Protocol"))
    )
    if result.ok:
        return None
    state.metrics.sessions_rejected.labels(result.reason).inc()
    headers = {"WWW-Authenticate": 'Bearer realm="omni-sidecar"'} if result.status == 401 else {}
    return _json_error(result.status, result.reason, result.message, **headers)


async def _run_session(request: web.Request, state: ProxyState) -> web.StreamResponse:
    settings = state.settings
    metrics = state.metrics
    target = state.target()
    if target is None:
        metrics.sessions_rejected.labels("not_ready").inc()
        return _json_error(503, "not_ready", "engine is not ready", **{"Retry-After": "5"})
    url = _upstream_url(state, target, request)
    metrics.upstream_connects.inc()
    started = time.monotonic()
    try:
        async with asyncio.timeout(
            min(settings.upstream_connect_timeout, settings.handshake_timeout)
        ):
            upstream = await state.client_session().ws_connect(
                url,
                headers=_upstream_headers(state, request),
                # Keepalive is the relay's own (see Relay._heartbeat_tick): aiohttp's
                # re-arms a timer on every received message.
                max_msg_size=MAX_UPSTREAM_MESSAGE_BYTES,
                compress=0,
                autoping=False,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=settings.close_timeout),
            )
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        metrics.upstream_connect_failures.inc()
        metrics.sessions_rejected.labels("upstream_unavailable").inc()
        log.warning("upstream connect to %s failed: %s", url, exc or type(exc).__name__)
        return _json_error(502, "upstream_unavailable", f"cannot reach the engine: {exc}")
    metrics.upstream_connect.observe(time.monotonic() - started)

    client = web.WebSocketResponse(
        protocols=_CLIENT_SUBPROTOCOLS,
        max_msg_size=settings.max_client_message_bytes,
        compress=False,
        autoping=False,
        # Flow control is ours: the relay writes only while the transport is
        # below client_write_buffer_bytes. aiohttp's own drain inside send_str
        # would block the engine reader (the fast path writes from it).
        writer_limit=_NO_WRITER_DRAIN,
    )
    try:
        async with asyncio.timeout(settings.handshake_timeout):
            await client.prepare(request)
    except BaseException:
        await upstream.close()
        raise
    _tune_upstream(upstream, settings.max_pending_input_bytes)
    protocol = tune_client_socket(request, settings.client_write_buffer_bytes)
    key = uuid.uuid4().hex[:12]
    relay = Relay(
        session_key=key,
        client=client,
        client_protocol=protocol,
        upstream=upstream,
        core=SessionCore(state.session_settings, new_event_id=new_event_id),
        observer=state.registry.observer(key),
        close_timeout=settings.close_timeout,
        drain_timeout=settings.drain_timeout,
        upstream_close_timeout=settings.upstream_close_timeout,
        max_pending_input_bytes=settings.max_pending_input_bytes,
        write_buffer_bytes=settings.client_write_buffer_bytes,
        max_session_duration=settings.max_session_duration,
        client_idle_timeout=settings.client_idle_timeout,
        heartbeat_interval=settings.heartbeat_interval,
    )
    metrics.sessions_started.inc()
    state.registry.add(relay)
    if state.registry.closing_all:
        relay.shutdown()  # its handshake raced the shutdown: close it with 1001 now
    relay.log.info("session open: %s -> %s", request.remote, url)
    try:
        await relay.run()
    finally:
        state.registry.remove(relay)
        outcome = relay.core.outcome
        relay.log.info(
            "session closed: %s (client close code %s)",
            outcome.value if outcome else "error",
            relay.core.close_code,
        )
    return client


def _tune_upstream(upstream: aiohttp.ClientWebSocketResponse, max_pending: int) -> None:
    """Let unsent input grow to ``max_pending_input_bytes`` without blocking the
    client reader (a blocked reader could not act on a cancel); the relay fails
    the session instead when the engine stops reading."""
    writer = getattr(upstream, "_writer", None)
    transport = getattr(writer, "transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.set_write_buffer_limits(high=max_pending)
    if writer is not None and hasattr(writer, "_limit"):
        writer._limit = max_pending


async def _reverse_proxy(request: web.Request) -> web.StreamResponse:
    """Stream any other HTTP request to the engine and its answer back."""
    state = request.app[STATE]
    denied = _check_auth(request, state)
    if denied is not None:
        return denied
    target = state.target()
    if target is None:
        return _json_error(503, "not_ready", "engine is not ready")
    url = target.http_base + request.path_qs
    headers = CIMultiDict(
        (k, v)
        for k, v in request.headers.items()
        if k.lower() not in _HOP_BY_HOP and k.lower() != "authorization"
    )
    # Same rule as for WebSockets: upstream_authorization decides what the engine sees.
    headers.update(_upstream_headers(state, request))
    data = request.content if request.body_exists else None
    try:
        async with state.client_session().request(
            request.method,
            url,
            headers=headers,
            data=data,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=state.settings.upstream_connect_timeout
            ),
        ) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    response.headers.add(name, value)
            if upstream.headers.get("Content-Encoding"):
                response.headers["Content-Encoding"] = upstream.headers["Content-Encoding"]
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return _json_error(502, "upstream_unavailable", f"cannot reach the engine: {exc}")


def build_client_app(state: ProxyState) -> web.Application:
    """The client-facing application."""
    app = web.Application(client_max_size=state.settings.max_client_message_bytes)
    app[STATE] = state
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    for path in _WS_PATHS:
        app.router.add_route("*", path, _realtime)
    app.router.add_route("*", "/{tail:.*}", _reverse_proxy)

    async def _close_http(_app: web.Application) -> None:
        if state.http is not None:
            await state.http.close()

    app.on_cleanup.append(_close_http)
    return app


# -- admin listener --------------------------------------------------------------------------


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.registry.flush_metrics()
    accept = request.headers.get("Accept", "")
    if "application/openmetrics-text" in accept:
        body = generate_openmetrics(state.metrics.registry)  # type: ignore[no-untyped-call]
        content_type = OPENMETRICS_CONTENT_TYPE
    else:
        body = generate_latest(state.metrics.registry)
        content_type = CONTENT_TYPE_LATEST
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


async def _debug_sessions(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "sessions": state.registry.statistics(),
            "total_pending_bytes": state.registry.total_pending_bytes,
            "total_pending_events": state.registry.total_pending_events,
        }
    )


def build_admin_app(state: ProxyState) -> web.Application:
    """The operator-facing application; never expose it to clients."""
    app = web.Application()
    app[STATE] = state
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/debug/sessions", _debug_sessions)
    return app
