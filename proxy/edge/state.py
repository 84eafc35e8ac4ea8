"""What the client listener's handlers share: :class:`ProxyState`, one per process.

The settings in the shapes the handlers use (the core's ``SessionSettings``,
the auth policy, the edge limits, the quota gate, the usage book), the
session registry and metrics, where the engine is (:class:`UpstreamTarget`),
and what the engine is sent for a client's request (:func:`upstream_url`,
:func:`upstream_headers`). A reload swaps the live part in
(:meth:`ProxyState.apply_settings`). Engine admission state is not kept here:
``router`` is the one reference to the engines layer's
:class:`~engine_launcher.admission.EngineAdmission`, and every reader asks it
through ``ProxyState`` (:meth:`ProxyState.refusal` for "engine not ready").
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Final
from urllib.parse import parse_qsl, urlencode, urlsplit

import aiohttp
from aiohttp import web

from engine_launcher.admission import EngineAdmission
from metrics import SidecarMetrics
from proxy.core.buffer import BufferLimits
from proxy.core.dialect import OpenAIDialect, engine_dialect, select_flavour
from proxy.core.dialect.turn_hook import TurnSourceFactory
from proxy.core.dialect.turns_adapter import DetectorTurns
from proxy.core.playback import AckMode, PlaybackSettings
from proxy.core.resume_token import ResumeTokens
from proxy.core.session_settings import OverflowPolicy, SessionSettings
from proxy.core.voice_activity import VoiceModelError
from proxy.edge.auth import AuthPolicy, load_key_file
from proxy.edge.guard import EdgeGuard, EdgeLimits
from proxy.edge.quota_store import QuotaGate
from proxy.edge.resume_secret import load_resume_secret
from proxy.edge.resume_spent import SpentTokens
from proxy.edge.session_slots import Admission
from proxy.session.observer import Tracing
from proxy.session.openai_side import OpenAISide
from proxy.session.registry import SessionRegistry
from proxy.session.usage_log import UsageBook, UsageFile
from proxy.session.voice_model import load_voice_model
from proxy.settings import Settings

__all__ = [
    "STATE",
    "WS_PATHS",
    "ProxyState",
    "UpstreamTarget",
    "client_query",
    "max_per_engine",
    "openai_translator",
    "session_settings",
    "upstream_headers",
    "upstream_url",
]

#: The name these lines have always been logged under (before the edge was split).
log = logging.getLogger("omni_sidecar.edge.app")

STATE: Final[web.AppKey[ProxyState]] = web.AppKey("omni_sidecar_state")

#: The WebSocket routes of the client listener.
WS_PATHS: Final = ("/v1/realtime", "/v1/duplex")


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
        for suffix in WS_PATHS:
            if path.endswith(suffix):
                path = path[: -len(suffix)]
                break
        return cls(f"{parts.scheme}://{parts.netloc}{path}")


@dataclass
class ProxyState:
    """Everything the handlers share; one per process."""

    settings: Settings
    metrics: SidecarMetrics
    admission: Admission
    registry: SessionRegistry
    target: Callable[[], UpstreamTarget | None]
    http: aiohttp.ClientSession | None = None
    #: Whether and where each engine replica admits (engine_launcher/admission.py,
    #: built by the pool): the proxy's one reference to it. None = no engine gate.
    router: EngineAdmission | None = None
    #: ``omni-sidecar drain --engine K``: True when the drain began (proxy/server.py).
    drain_engine: Callable[[int], bool] | None = None
    #: OpenTelemetry tracing (proxy/session/tracing.py); None when ``tracing = "off"``.
    tracing: Tracing | None = None
    #: Each listener's URL and whether it was ``bound`` here or passed by ``systemd``
    #: (``/debug/summary``; proxy/server.py fills it in).
    listeners: dict[str, dict[str, str]] = field(default_factory=dict)
    session_settings: SessionSettings = field(init=False)
    #: Binds the resume tokens clients get to their session and key (``resume_secret_file``).
    resume_tokens: ResumeTokens = field(init=False)
    #: The newest token generation issued per session: older ones are spent, fleet-wide
    #: with ``quota_redis_url`` (proxy/edge/resume_spent.py).
    resume_spent: SpentTokens = field(init=False)
    auth: AuthPolicy = field(init=False)
    #: The client listener's connection-level limits (proxy/edge/guard.py).
    edge: EdgeGuard = field(init=False)
    #: Per-key usage counters and the usage file (proxy/session/usage_log.py).
    usage: UsageBook = field(init=False)
    #: Quotas per key name, counted here or in Redis (proxy/edge/quota_store.py).
    quota: QuotaGate = field(init=False)

    def __post_init__(self) -> None:
        # Read once: a reload keeps the secret the running sessions' tokens carry.
        secret = load_resume_secret(self.settings.resume_secret_file)
        self.resume_tokens = ResumeTokens(secret)
        self.resume_spent = SpentTokens(
            self.settings.quota_redis_url,
            self.settings.quota_redis_timeout,
            self.settings.quota_redis_max_connections,
            self.metrics,
        )
        self.session_settings = session_settings(self.settings, secret)
        keys, quotas = load_key_file(self.settings.api_keys, self.settings.api_keys_file)
        self.auth = AuthPolicy(keys, self.settings.allowed_origins)
        self.metrics.set_usage_keys(self.auth.key_names)
        self.quota = QuotaGate(
            self.metrics,
            redis_url=self.settings.quota_redis_url,
            timeout=self.settings.quota_redis_timeout,
            max_connections=self.settings.quota_redis_max_connections,
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
            self.protocol_violation,
        )
        self.metrics.pending_handshakes.set_function(lambda: self.edge.pending)
        self.metrics.lingering_connections.set_function(lambda: self.edge.lingering)
        self.metrics.resume_waiting.set_function(lambda: len(self.admission.waits))
        self.metrics.session_slots_used.set_function(lambda: self.admission.active)
        self.registry.on_engine_full = self.engine_full

    def refusal(self) -> tuple[str, str] | None:
        """(metric reason, message) when no session may start, slots and placement aside.

        ``draining``: the sidecar is shutting down; ``not_ready``: no engine
        replica serves (``router.ready``, with the reason of the change that
        left none). None: sessions may start as far as these go.
        """
        if self.admission.draining:
            return "draining", "the sidecar is shutting down"
        router = self.router
        if router is not None and not router.ready:
            return "not_ready", router.not_ready_reason
        return None

    @property
    def resume_checks(self) -> tuple[ResumeTokens, SpentTokens]:
        """What a resume's token is checked with: its binding, and whether it is spent."""
        return self.resume_tokens, self.resume_spent

    @property
    def engine_ready(self) -> bool:
        """Sessions may start as far as the engines go (and the sidecar is not shutting down)."""
        return self.refusal() is None

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

    def refused_at_accept(self, reason: str, count: int) -> None:
        """Count connections the listener closed at accept (it logs them, rate-limited)."""
        self.metrics.rejected_connections.labels(reason).inc(count)

    def protocol_violation(self, reason: str, address: str) -> None:
        """Count and log one client connection failed (1002) for a WebSocket protocol violation."""
        self.metrics.client_protocol_violations.labels(reason).inc()
        log.warning(
            "client %s violated the WebSocket protocol (%s): closed 1002", address or "?", reason
        )

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
        new_session_settings = session_settings(settings, self.session_settings.resume_secret)
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
        self.admission.max_resume_waits = settings.max_resume_waits
        self.admission.max_resume_waits_per_key = settings.max_resume_waits_per_key
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


def session_settings(settings: Settings, resume_secret: bytes = b"") -> SessionSettings:
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
        max_pending_input_bytes=settings.max_pending_input_bytes,
        client_resume_grace=settings.client_resume_grace,
        resume_journal_bytes=settings.resume_journal_bytes,
        resume_journal_ttl=settings.resume_journal_ttl,
        resume_secret=resume_secret,
        playback=PlaybackSettings(
            pacing=settings.playback_pacing,
            max_audio_lead=settings.max_audio_lead,
            max_paced_audio_bytes=settings.max_paced_audio_bytes,
            ack=AckMode(settings.playback_ack),
            ack_interval=settings.playback_ack_interval,
        ),
    )


def upstream_url(state: ProxyState, target: UpstreamTarget, request: web.Request) -> str:
    """The engine URL for a client's request: its path, and its query when forwarded."""
    url = target.ws_base + request.path
    query = list(parse_qsl(request.query_string, keep_blank_values=True))
    if not state.settings.forward_query:
        query = []
    if state.settings.upstream_autostart_off and not any(k == "autostart" for k, _ in query):
        query.append(("autostart", "0"))
    if query:
        url += "?" + urlencode(query)
    return url


def client_query(request: web.Request) -> dict[str, str]:
    """The client's query as the engine reads it: a repeated name's last value wins
    (aiohttp's ``request.query`` gives the first, which the engine never reads)."""
    return dict(parse_qsl(request.query_string, keep_blank_values=True))


def upstream_headers(state: ProxyState, request: web.Request) -> dict[str, str]:
    """What the engine is told about credentials (``upstream_authorization``)."""
    mode = state.settings.upstream_authorization
    headers: dict[str, str] = {}
    if mode == "pass-through":
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
    elif mode.startswith("key:"):
        headers["Authorization"] = "Bearer " + mode[4:]
    return headers


# -- the front door of a new client connection (docs/design.md, OpenAI dialect) -----------


def openai_translator(request: web.Request, state: ProxyState) -> OpenAISide | None:
    """The client's OpenAI front door (``select_flavour``), for the engine release the
    sidecar fronts, with the sidecar's own turn detection where its model is installed;
    None: the engine's own protocol."""
    flavour = select_flavour(
        state.settings.client_dialect, request.path, request.query, request.headers
    )
    if flavour is None:
        return None
    engine = engine_dialect(state.registry.capabilities.current.version)
    return OpenAISide(OpenAIDialect(flavour, engine, _event_id, turns=_turns()))


def _event_id() -> str:
    return "event_" + uuid.uuid4().hex


@cache
def _turns() -> TurnSourceFactory | None:
    """Sessions' turn detectors on the process's one voice-activity model, loaded at the
    first OpenAI client (None: the model is not installed; the engine's VAD is asked)."""
    try:
        model = load_voice_model()
    except VoiceModelError as exc:
        log.warning("no turn detection of the sidecar's own for OpenAI clients: %s", exc)
        return None
    return lambda: DetectorTurns(model.new_stream())
