"""The aiohttp applications: the client listener and the admin listener.

Client listener (docs/design.md, Routes and listeners): WS ``/v1/realtime``
and ``/v1/duplex``, ``GET /healthz``, ``GET /readyz``; every other path is
reverse-proxied to the engine, streamed (omni_sidecar/edge/reverse_proxy.py). The admin
listener is ``omni_sidecar/admin/app.py``.

Admission happens before the WebSocket upgrade (docs/design.md, Admission and
lifecycle), after the handshake itself was found valid (omni_sidecar/edge/handshake.py):
draining or engine not ready → 503, ``max_sessions`` reached → 503 with ``Retry-After``
(after waiting up to ``admission_timeout`` for a slot), upstream connect
failure → 502. The upstream WebSocket is opened before the client's upgrade
completes, so a client never gets a socket that leads nowhere. With an engine
pool the session is first placed on a replica (omni_sidecar/engines/placement.py;
docs/design.md, Engine pool): none admits → 503 ``not_ready``, all full → 503
``capacity`` with ``Retry-After``.

A full engine accepts the socket and then sends ``error`` {resource_exhausted}
(docs/design.md, Engine capabilities). When the engine opens the session at
connect (``?model=`` without ``autostart=0``) that error is its first frame:
the handshake waits up to ``engine_open_wait`` for it and answers 503
``engine_capacity`` with ``Retry-After`` before the client's upgrade. Said
later (the engine opens on the client's first frame) it is passed on to the
client. Either way the replica admits no new session for
``engine_full_backoff`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit

import aiohttp
from aiohttp import web

from omni_sidecar import compat
from omni_sidecar.core.buffer import BufferLimits
from omni_sidecar.core.capabilities import opens_at_connect, session_is_duplex
from omni_sidecar.core.events import classify_upstream
from omni_sidecar.core.playback import AckMode, PlaybackSettings
from omni_sidecar.core.quota import QuotaRefusal
from omni_sidecar.core.session import OverflowPolicy, SessionCore, SessionSettings, is_engine_full
from omni_sidecar.edge.auth import AuthPolicy, AuthResult, load_key_file, offered_subprotocols
from omni_sidecar.edge.guard import EdgeGuard, EdgeLimits, client_address
from omni_sidecar.edge.handshake import validate_upgrade, wants_websocket
from omni_sidecar.edge.quota import QuotaGate
from omni_sidecar.edge.reverse_proxy import ProxyRequest, reverse_proxy
from omni_sidecar.engines.placement import Router
from omni_sidecar.metrics import SidecarMetrics
from omni_sidecar.session.engine_link import UpstreamConnectError, connect_upstream
from omni_sidecar.session.observer import SessionObserver, SessionTracer, Tracing
from omni_sidecar.session.registry import SessionRegistry
from omni_sidecar.session.relay import Relay, new_event_id
from omni_sidecar.session.usage_log import UsageBook, UsageFile
from omni_sidecar.session.writer import AiohttpWriterAdapter
from omni_sidecar.settings.proxy import Settings

__all__ = [
    "Admission",
    "ProxyState",
    "UpstreamTarget",
    "build_client_app",
    "max_per_engine",
    "session_settings",
]

log = logging.getLogger(__name__)
#: One line per ended session (and, from the edge, per refused handshake).
access_log = logging.getLogger("omni_sidecar.access")

STATE: Final[web.AppKey[ProxyState]] = web.AppKey("omni_sidecar_state")

#: Largest frame accepted from the engine (DuplexClient allows 64 MiB too).
MAX_UPSTREAM_MESSAGE_BYTES: Final = 64 * 1024 * 1024
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
    #: The engines as JSON for the console (omni_sidecar.admin.console.EngineView.snapshot).
    engines: Callable[[], list[dict[str, Any]]] = list
    #: Replica states and per-replica slots (omni_sidecar/engines/placement.py); None = one engine.
    router: Router | None = None
    #: ``omni-sidecar drain --engine K``: True when the drain began (omni_sidecar/server.py).
    drain_engine: Callable[[int], bool] | None = None
    #: OpenTelemetry tracing (omni_sidecar/session/tracing.py); None when ``tracing = "off"``.
    tracing: Tracing | None = None
    session_settings: SessionSettings = field(init=False)
    auth: AuthPolicy = field(init=False)
    #: The client listener's connection-level limits (omni_sidecar/edge/guard.py).
    edge: EdgeGuard = field(init=False)
    #: Per-key usage counters and the usage file (omni_sidecar/session/usage_log.py).
    usage: UsageBook = field(init=False)
    #: Quotas per key name, counted here or in Redis (omni_sidecar/edge/quota.py).
    quota: QuotaGate = field(init=False)

    def __post_init__(self) -> None:
        self.session_settings = session_settings(self.settings)
        keys, quotas = load_key_file(self.settings.api_keys, self.settings.api_keys_file)
        self.auth = AuthPolicy(keys, self.settings.allowed_origins)
        self.metrics.set_usage_keys(self.auth.key_names)
        self.quota = QuotaGate(
            self.metrics,
            redis_url=self.settings.quota_redis_url,
            timeout=self.settings.quota_redis_timeout,
            slot_ttl=self.settings.quota_slot_ttl,
        )
        self.quota.quotas = quotas
        usage_file = None
        if self.settings.usage_file:
            usage_file = UsageFile(
                self.settings.usage_file,
                max_bytes=self.settings.usage_file_max_bytes,
                backups=self.settings.usage_file_backups,
                max_pending=self.settings.usage_file_max_pending,
                on_failure=self.metrics.usage_records_dropped.inc,
            )
        self.usage = UsageBook(self.metrics, usage_file)
        self.edge = EdgeGuard(
            EdgeLimits.from_settings(self.settings),
            self.reject_connection,
            lambda outcome: self.metrics.lingering_closes.labels(outcome).inc(),
        )
        self.metrics.pending_handshakes.set_function(lambda: self.edge.pending)
        self.metrics.lingering_connections.set_function(lambda: self.edge.lingering)
        self.registry.on_engine_full = self.engine_full

    def engine_full(self, engine: int | None) -> None:
        """The engine (replica ``engine``) said it has no room: admit nothing there a while."""
        backoff = self.settings.engine_full_backoff
        if backoff <= 0 or self.router is None:
            return
        index = 0 if engine is None else engine
        self.router.mark_full(index, time.monotonic() + backoff)
        log.warning(
            "engine %d refused a session as full; no new session goes there for %.1f s",
            index,
            backoff,
        )

    def retry_after(self) -> str:
        """``Retry-After`` for an engine_capacity refusal: when the backoff ends."""
        wait = self.settings.engine_full_backoff
        if self.router is not None:
            wait = self.router.retry_after(time.monotonic()) or wait
        return str(max(1, math.ceil(wait)))

    def reject_connection(self, reason: str, status: int, address: str) -> None:
        """Count and log one connection or request refused at the edge (docs/security.md)."""
        self.metrics.rejected_connections.labels(reason).inc()
        log.warning(
            "refused connection from %s: %s%s",
            address or "?",
            f"{status} " if status else "closed, ",
            reason,
        )

    def apply_settings(self, settings: Settings) -> None:
        """Swap in reloaded settings (SIGHUP): new sessions and handshakes use them.

        Running relays keep the ``SessionCore`` they were built with. Builds
        everything first, so a failure (an unreadable keys file) changes nothing.
        """
        new_session_settings = session_settings(settings)
        keys, quotas = load_key_file(settings.api_keys, settings.api_keys_file)
        self.auth = AuthPolicy(keys, settings.allowed_origins)
        # New names get their series; a name dropped from the file keeps its totals.
        self.metrics.set_usage_keys(self.auth.key_names)
        # New quotas apply to new sessions; the counts (per name) carry over.
        self.quota.quotas = quotas
        self.quota.slot_ttl = settings.quota_slot_ttl
        self.session_settings = new_session_settings
        self.settings = settings
        self.admission.max_sessions = settings.max_sessions
        self.admission.admission_timeout = settings.admission_timeout
        self.admission.max_sessions_per_ip = settings.max_sessions_per_ip
        if self.router is not None:
            self.router.max_per_engine = max_per_engine(settings)
        self.edge.update(EdgeLimits.from_settings(settings))

    def client_session(self) -> aiohttp.ClientSession:
        if self.http is None or self.http.closed:
            # limit=0: aiohttp's default of 100 connections would cap sessions.
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self.http = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
            )
        return self.http


def max_per_engine(settings: Settings) -> int:
    """``max_sessions_per_engine``, defaulting to ``max_sessions`` (0 = unlimited)."""
    return settings.max_sessions_per_engine or settings.max_sessions


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
        max_client_frame_rate=settings.max_client_frame_rate,
        client_frame_burst=settings.client_frame_burst,
        playback=PlaybackSettings(
            pacing=settings.playback_pacing,
            max_audio_lead=settings.max_audio_lead,
            max_paced_audio_bytes=settings.max_paced_audio_bytes,
            ack=AckMode(settings.playback_ack),
            ack_interval=settings.playback_ack_interval,
        ),
    )


def _json_error(status: int, reason: str, message: str, **headers: str) -> web.Response:
    return web.json_response(
        {"error": {"code": reason, "message": message}}, status=status, headers=headers
    )


def _quota_refused(refused: QuotaRefusal) -> web.Response:
    """429 ``quota_exceeded`` naming the quota, with ``Retry-After`` (docs/design.md, Quotas)."""
    kind = refused.kind.value
    message = f"this API key's {kind} quota ({refused.limit:g}) is used up"
    return web.json_response(
        {
            # _json_error's shape, plus what a client needs to back off.
            "error": {"code": "quota_exceeded", "message": message},
            "status": "rejected",
            "reason": "quota_exceeded",
            "quota": kind,
            "limit": refused.limit,
            "retry_after": refused.retry_after,
        },
        status=429,
        headers={"Retry-After": str(refused.retry_after)},
    )


# -- client listener ---------------------------------------------------------------------


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    refusal = state.admission.refusal()
    body: dict[str, Any] = {
        "sessions": state.admission.active,
        "max_sessions": state.admission.max_sessions,
        # Redis down is degraded, not down: the limits are then per process.
        "quota": state.quota.readiness(),
    }
    router = state.router
    if router is not None:
        # Every replica's state; 200 while at least one admits (docs/design.md, Engine pool).
        now = time.monotonic()
        body["engines"] = router.views(now)
        placed = router.refusal(now)
        if refusal is None and placed is not None:
            return web.json_response(
                {"status": "not_ready", "reason": placed[0], "detail": placed[1], **body},
                status=503,
                headers={"Retry-After": _retry_after(state, placed[0])},
            )
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
    """The handshake: validity, auth, readiness, per-address and global slots, in that order.

    A request that does not ask for a WebSocket is plain HTTP and is
    reverse-proxied; one that does must be a complete, valid handshake
    (omni_sidecar/edge/handshake.py) before anything else is spent on it.
    """
    if not wants_websocket(request.headers):
        return await _reverse_proxy(request)
    state = request.app[STATE]
    metrics = state.metrics
    address = client_address(request)
    version = (request.version.major, request.version.minor)
    invalid = validate_upgrade(request.method, version, request.headers)
    if invalid is not None:
        metrics.rejected_connections.labels("bad_handshake").inc()
        _log_refused(address, invalid.status, invalid.reason)
        response = _json_error(invalid.status, invalid.reason, invalid.message, **invalid.headers)
        response.force_close()
        return response
    auth = _check_auth(request, state)
    if isinstance(auth, web.Response):
        return auth
    refusal = state.admission.refusal()
    if refusal is not None:
        metrics.sessions_rejected.labels(refusal[0]).inc()
        _log_refused(address, 503, refusal[0])
        return _json_error(503, refusal[0], refusal[1], **{"Retry-After": "5"})
    if not state.admission.acquire_ip(address):
        metrics.sessions_rejected.labels("capacity").inc()
        _log_refused(address, 429, "capacity")
        return _json_error(
            429, "capacity", "too many sessions from this address", **{"Retry-After": "1"}
        )
    try:
        if not await state.admission.acquire():
            metrics.sessions_rejected.labels("capacity").inc()
            _log_refused(address, 503, "capacity")
            return _json_error(
                503, "capacity", "all session slots are in use", **{"Retry-After": "1"}
            )
        try:
            return await _run_session(request, state, auth.key_name)
        finally:
            await state.admission.release()
    finally:
        state.admission.release_ip(address)


def _log_refused(address: str, status: int, reason: str) -> None:
    """One line per refused handshake: who, what status, why (never a key)."""
    log.warning("refused handshake from %s: %d %s", address or "?", status, reason)


def _check_auth(request: web.Request, state: ProxyState) -> web.Response | AuthResult:
    """401/403 before anything else, else the accepted result (with its key's name).

    Keys are never logged.
    """
    result = state.auth.check(
        request.headers, offered_subprotocols(request.headers.get("Sec-WebSocket-Protocol"))
    )
    if result.ok:
        return result
    state.metrics.sessions_rejected.labels(result.reason).inc()
    _log_refused(client_address(request), result.status, result.reason)
    headers = {"WWW-Authenticate": 'Bearer realm="omni-sidecar"'} if result.status == 401 else {}
    return _json_error(result.status, result.reason, result.message, **headers)


def _retry_after(state: ProxyState, reason: str) -> str:
    if reason == "engine_capacity":
        return state.retry_after()
    return "1" if reason == "capacity" else "5"


async def _run_session(
    request: web.Request, state: ProxyState, key_name: str
) -> web.StreamResponse:
    router = state.router
    if router is None:
        return await _run_placed(request, state, None, key_name)
    now = time.monotonic()
    engine = router.choose(state.registry.pending_by_engine(router.count), now)
    if engine is None:
        reason, message = router.refusal(now) or ("capacity", "every engine replica is full")
        state.metrics.sessions_rejected.labels(reason).inc()
        _log_refused(client_address(request), 503, reason)
        return _json_error(503, reason, message, **{"Retry-After": _retry_after(state, reason)})
    # The slot is held from here, across the upstream connect, until the session ends.
    router.take(engine)
    try:
        return await _run_placed(request, state, engine, key_name)
    finally:
        router.release(engine)


async def _run_placed(
    request: web.Request, state: ProxyState, engine: int | None, key_name: str
) -> web.StreamResponse:
    """Trace (when on) and run one placed session; its span ends on every path."""
    key = uuid.uuid4().hex[:12]
    refused = await state.quota.admit(key_name, key)
    if refused is not None:
        state.metrics.sessions_rejected.labels("quota_exceeded").inc()
        _log_refused(client_address(request), 429, f"quota_exceeded ({refused.kind.value})")
        return _quota_refused(refused)
    try:
        tracing = state.tracing
        if tracing is None:
            return await _open_session(request, state, engine, key, key_name, None)
        tracer = tracing.session(key, request.headers, model=request.query.get("model"))
        try:
            return await _open_session(request, state, engine, key, key_name, tracer)
        finally:
            tracer.refused("handshake_failed")  # no-op when the session span already ended
    finally:
        with contextlib.suppress(Exception):
            await state.quota.release(key)


async def _open_session(
    request: web.Request,
    state: ProxyState,
    engine: int | None,
    key: str,
    key_name: str,
    tracer: SessionTracer | None,
) -> web.StreamResponse:
    settings = state.settings
    metrics = state.metrics
    target = state.target() if engine is None or state.router is None else _replica(state, engine)
    if target is None:
        metrics.sessions_rejected.labels("not_ready").inc()
        if tracer is not None:
            tracer.refused("not_ready")
        return _json_error(503, "not_ready", "engine is not ready", **{"Retry-After": "5"})
    url = _upstream_url(state, target, request)
    metrics.upstream_connects.inc()
    started = time.monotonic()
    headers = _upstream_headers(state, request)
    if tracer is not None:
        tracer.upstream_headers(headers)
    try:
        async with asyncio.timeout(
            min(settings.upstream_connect_timeout, settings.handshake_timeout)
        ):
            upstream = await connect_upstream(
                settings.upstream_client,
                url,
                headers=headers,
                max_message_bytes=MAX_UPSTREAM_MESSAGE_BYTES,
                write_limit=settings.max_pending_input_bytes,
                close_timeout=settings.close_timeout,
                session=state.client_session() if settings.upstream_client == "aiohttp" else None,
            )
    except (UpstreamConnectError, TimeoutError) as exc:
        metrics.upstream_connect_failures.inc()
        metrics.sessions_rejected.labels("upstream_unavailable").inc()
        log.warning("upstream connect to %s failed: %s", url, exc or type(exc).__name__)
        if tracer is not None:
            tracer.refused("upstream_unavailable")
        return _json_error(502, "upstream_unavailable", f"cannot reach the engine: {exc}")
    metrics.upstream_connect.observe(time.monotonic() - started)
    upstream_query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    if settings.engine_open_wait > 0 and opens_at_connect(upstream_query):
        # The engine opens the session now: a full one says so as its first frame.
        left = settings.handshake_timeout - (time.monotonic() - started)
        first = await upstream.first_text(max(0.0, min(settings.engine_open_wait, left)))
        if first is not None and is_engine_full(classify_upstream(first)):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(settings.close_timeout):
                    await upstream.close()
            metrics.engine_full.labels("handshake").inc()
            metrics.sessions_rejected.labels("engine_capacity").inc()
            state.engine_full(engine)
            _log_refused(client_address(request), 503, "engine_capacity")
            if tracer is not None:
                tracer.refused("engine_capacity")
            return _json_error(
                503,
                "engine_capacity",
                "the engine has no room for another session",
                **{"Retry-After": _retry_after(state, "engine_capacity")},
            )
    duplex = session_is_duplex(urlsplit(url).path, upstream_query)
    capabilities = state.registry.capabilities.current.for_session(duplex=duplex)

    client = web.WebSocketResponse(
        protocols=_CLIENT_SUBPROTOCOLS,
        max_msg_size=settings.max_client_message_bytes,
        compress=False,
        autoping=False,
    )
    try:
        async with asyncio.timeout(settings.handshake_timeout):
            await client.prepare(request)
    except BaseException:
        await upstream.close()
        raise
    protocol = _tune_client_socket(request, settings.client_write_buffer_bytes)
    address = client_address(request)
    observer = state.registry.observer(
        key, client_address=address, engine=engine, key_name=key_name, tracer=tracer
    )
    relay = Relay(
        session_key=key,
        client=client,
        client_protocol=protocol,
        upstream=upstream,
        core=SessionCore(
            state.session_settings, new_event_id=new_event_id, capabilities=capabilities
        ),
        observer=observer,
        close_timeout=settings.close_timeout,
        drain_timeout=settings.drain_timeout,
        upstream_close_timeout=settings.upstream_close_timeout,
        max_pending_input_bytes=settings.max_pending_input_bytes,
        write_buffer_bytes=settings.client_write_buffer_bytes,
        max_session_duration=settings.max_session_duration,
        client_idle_timeout=settings.client_idle_timeout,
        heartbeat_interval=settings.heartbeat_interval,
        client_address=address,
        client_push=functools.partial(compat.push_text, client),
    )
    # From here on every frame to this client, aiohttp's own close frames
    # included, goes through the relay's frame writer.
    compat.install_client_writer(client, AiohttpWriterAdapter(relay.writer))
    state.quota.attach(key, relay.core.usage, relay.end_for_quota)
    metrics.sessions_started.inc()
    state.registry.add(relay)
    if state.registry.closing_all:
        relay.shutdown()  # its handshake raced the shutdown: close it with 1001 now
    relay.log.info("session open: %s -> %s", address, url)
    try:
        await relay.run()
    finally:
        state.registry.remove(relay)
        _log_session_end(relay, observer, state.usage)
    return client


def _replica(state: ProxyState, engine: int) -> UpstreamTarget | None:
    assert state.router is not None
    url = state.router.targets[engine]
    return None if url is None else UpstreamTarget.from_url(url)


def _log_session_end(relay: Relay, observer: SessionObserver, usage: UsageBook) -> None:
    """One access line per session (logger ``omni_sidecar.access``), with its usage.

    The usage record (docs/design.md, Usage) is counted per key name and, with
    ``usage_file``, written as one JSON line.
    """
    core = relay.core
    now = relay.timers.now()
    duration = now - relay.started_at
    record = usage.add(
        core.usage.record(observer.key_name, duration, core.playback.heard(now)),
        {
            "ts": round(observer.started_at + duration, 3),
            "session": relay.key,
            "engine_session": core.session_id or "-",
            "started_at": round(observer.started_at, 3),
        },
    )
    outcome = core.outcome.value if core.outcome is not None else "error"
    sent = relay.close_code_sent
    drops = {r.value: e for r, (e, _b) in core.drop_totals().items() if e}
    fields = {
        "session": relay.key,
        "engine_session": core.session_id or "-",
        "client": relay.client_address or "-",
        "duration_s": round(duration, 3),
        "events_in": observer.events_client_to_upstream,
        "bytes_in": relay.bytes_client_to_upstream,
        "events_out": relay.writer.frames_written,
        "bytes_out": relay.writer.bytes_written,
        "drops": ",".join(f"{k}:{v}" for k, v in sorted(drops.items())) or "none",
        "outcome": outcome,
        # The code the client actually got; "not_sent" when no close frame reached it.
        "close_code": sent if sent is not None else "not_sent",
    }
    for name in _USAGE_FIELDS:
        fields[name] = record[name]
    # The fields ride as extras: text logs append them as key=value, JSON logs
    # give each a key of its own.
    access_log.info("session end", extra=fields)


#: The usage record's fields the access line carries (the record's identity fields it has already).
_USAGE_FIELDS: Final = (
    "key",
    "audio_in_seconds",
    "audio_out_seconds",
    "audio_delivered_seconds",
    "audio_heard_seconds",
    "responses_started",
    "responses_completed",
    "responses_cancelled",
    "responses_failed",
    "responses_incomplete",
    "responses_unfinished",
    "input_tokens",
    "output_tokens",
    "total_tokens",
)


def _tune_client_socket(request: web.Request, write_buffer_bytes: int) -> Any:
    """Bound what the transport and kernel hold for this client; return its protocol."""
    transport = request.transport
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.set_write_buffer_limits(high=write_buffer_bytes)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, write_buffer_bytes)
    return request.protocol


async def _reverse_proxy(request: web.Request) -> web.StreamResponse:
    """Any other HTTP request: auth, then streamed to the engine (omni_sidecar/edge/reverse_proxy.py)."""
    state = request.app[STATE]
    denied = _check_auth(request, state)
    if isinstance(denied, web.Response):
        return denied
    target = state.target()
    if target is None:
        return _json_error(503, "not_ready", "engine is not ready")
    address = client_address(request)
    return await reverse_proxy(
        request,
        ProxyRequest(
            base_url=target.http_base,
            session=state.client_session(),
            # Same rule as for WebSockets: upstream_authorization decides what the engine sees.
            extra_headers=_upstream_headers(state, request),
            drop_headers=frozenset({"authorization"}),
            max_body_bytes=state.edge.limits.max_http_body_bytes,
            connect_timeout=state.settings.upstream_connect_timeout,
            address=address,
            reject=lambda reason: state.metrics.rejected_connections.labels(reason).inc(),
        ),
    )


def build_client_app(state: ProxyState) -> web.Application:
    """The client-facing application."""
    # Client text frames can then be handed to their relay as they are parsed.
    compat.install_text_push()
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
