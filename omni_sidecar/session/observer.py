"""Session registry and the hooks that turn relay activity into metrics.

``SessionRegistry`` knows every live relay (for shutdown, engine loss,
``/debug/sessions`` and the process-wide pending-output cap) and keeps an
exact running total of pending output bytes: each relay reports the change
of its buffer after every core call, so enforcing
``max_total_pending_output_bytes`` costs O(1) per event.

For the operator console (``omni_sidecar/admin/app.py``) each session also keeps its last
``LIFECYCLE_EVENTS`` lifecycle events (created, engine session, cancels,
overflows, closing, close) with wall-clock timestamps, noticed by comparing a
few core fields after each core call; the registry keeps the final view of the
last ``RECENT_CLOSED_SESSIONS`` sessions so a session that just ended can still
be inspected. Both rings are bounded and drop their oldest entry when full.

Tracing (docs/design.md, Tracing) hangs off the same hooks: a session's
:class:`SessionTracer` (None when ``tracing = "off"``) hears response-level
events only (``session.created``, ``response.created``/``done``, cancels,
overflows and the end), never an audio delta, so with tracing off its cost
is one None check per non-audio event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from omni_sidecar.core.buffer import Entry
from omni_sidecar.core.capabilities import EngineCapabilities, EngineVersion
from omni_sidecar.core.events import ClientEvent, EventKind, UpstreamEvent
from omni_sidecar.core.usage import UNNAMED_KEY
from omni_sidecar.metrics import SidecarMetrics

if TYPE_CHECKING:
    from omni_sidecar.core.session import SessionCore

__all__ = [
    "LIFECYCLE_EVENTS",
    "RECENT_CLOSED_SESSIONS",
    "CapabilityBook",
    "SessionObserver",
    "SessionRegistry",
    "SessionTracer",
    "Tracing",
]

log = logging.getLogger(__name__)


class Relay(Protocol):
    """What the registry needs of a live session (``omni_sidecar.session.relay.Relay`` has this
    shape; a Protocol here keeps ``omni_sidecar.session.relay`` → ``omni_sidecar.session.observer`` one-way)."""

    key: str
    core: SessionCore
    started_at: float
    bytes_client_to_upstream: int
    bytes_upstream_to_client: int

    def shed(self) -> None: ...

    def shutdown(self) -> None: ...

    def engine_unavailable(self) -> None: ...


class SessionTracer(Protocol):
    """One session's trace (``omni_sidecar.session.tracing`` builds it; only built with tracing on).

    Called only for response-level events: never per audio delta.
    """

    def upstream_headers(self, headers: dict[str, str]) -> None:
        """Add this session's W3C trace context to the engine handshake's headers."""

    def refused(self, reason: str) -> None:
        """The session never opened (``reason`` is one of our rejection reasons)."""

    def upstream_event(self, event: UpstreamEvent) -> None:
        """A non-audio engine event, after the core took it."""

    def client_event(self, event: ClientEvent) -> None:
        """A ``response.create`` or a cancelling client event, before its core call's news."""

    def cancelled(self, response_ids: Sequence[str]) -> None:
        """The core tombstoned these responses (newest last)."""

    def overflow(self, policy: str) -> None:
        """The session's output bound overflowed (``policy``: what the core did)."""

    def end(self, outcome: str, close_code: int | None) -> None:
        """The session ended with this outcome (our own enum) and close code."""


class Tracing(Protocol):
    """The process's tracer (``omni_sidecar.session.tracing.OtlpTracing``; None when off)."""

    def session(self, key: str, headers: Mapping[str, str], *, model: str | None) -> SessionTracer:
        """Start a session's span, a child of the client's ``traceparent`` if any."""

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop."""


_C2U = "client_to_upstream"
_U2C = "upstream_to_client"

#: Lifecycle events kept per session (events); the oldest is dropped when full.
LIFECYCLE_EVENTS: Final = 50
#: Ended sessions whose final view stays readable (sessions); oldest dropped.
RECENT_CLOSED_SESSIONS: Final = 100


class CapabilityBook:
    """The process's engine capabilities (docs/design.md, Engine capabilities) and their gauge.

    New sessions start from :attr:`current`; what a session learns on the wire
    comes back through :meth:`learn` (never over config or preflight).

    Args:
        metrics: ``omni_sidecar_engine_info`` is kept equal to :attr:`current`.
        initial: from ``engine.version`` and preflight.
    """

    def __init__(self, metrics: SidecarMetrics, initial: EngineCapabilities) -> None:
        self._metrics = metrics
        self.current = initial
        self._export()

    def learn(self, version: EngineVersion) -> bool:
        """A session saw ``version``'s behaviour. Returns whether that changed anything."""
        learned = self.current.learn(version)
        if learned is self.current:
            return False
        log.info(
            "the engine behaves like vLLM-Omni %s (seen on the wire; was %s from %s)",
            version.value,
            self.current.version.value,
            self.current.source.value,
        )
        self.current = learned
        self._export()
        return True

    def _export(self) -> None:
        self._metrics.set_engine_info(self.current.version.value, self.current.source.value)


class SessionRegistry:
    """Live relays and the process-wide pending-output total.

    Args:
        metrics: where to report.
        max_total_pending_output_bytes: above this, the largest session is shed.
        capabilities: what the engine does, as far as known at start.
    """

    def __init__(
        self,
        metrics: SidecarMetrics,
        *,
        max_total_pending_output_bytes: int,
        capabilities: EngineCapabilities | None = None,
    ) -> None:
        self.metrics = metrics
        self.capabilities = CapabilityBook(
            metrics, capabilities if capabilities is not None else EngineCapabilities()
        )
        #: Called with a session's engine replica (None: the one engine) when
        #: that engine refused the session as full (set by omni_sidecar.edge.app.ProxyState).
        self.on_engine_full: Callable[[int | None], None] = lambda engine: None
        self.max_total = max_total_pending_output_bytes
        self.relays: dict[str, Relay] = {}
        self._observers: dict[str, SessionObserver] = {}
        self._pending_bytes: dict[str, int] = {}
        self._pending_events: dict[str, int] = {}
        self.total_pending_bytes = 0
        self.total_pending_events = 0
        #: Final views of ended sessions, newest last (see RECENT_CLOSED_SESSIONS).
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_CLOSED_SESSIONS)
        #: Responses cancelled, all sessions, since start (the console's total).
        self.total_cancels = 0
        self._empty: asyncio.Event | None = None
        #: Set at shutdown: a session admitted after it is told to close at once.
        self.closing_all = False
        # Read at scrape time: no gauge update on the per-event path.
        metrics.output_pending_bytes.set_function(lambda: self.total_pending_bytes)
        metrics.output_pending_events.set_function(lambda: self.total_pending_events)

    async def wait_empty(self) -> None:
        """Wait until no session is live."""
        if not self.relays:
            return
        if self._empty is None:
            self._empty = asyncio.Event()
        self._empty.clear()
        await self._empty.wait()

    def add(self, relay: Relay) -> None:
        self.relays[relay.key] = relay
        self._pending_bytes[relay.key] = 0
        self._pending_events[relay.key] = 0
        self.metrics.sessions_active.set(len(self.relays))

    def remove(self, relay: Relay) -> None:
        if relay.key in self.relays:
            self.recent.append(self.detail(relay.key) or {"id": relay.key})
        self.relays.pop(relay.key, None)
        self._observers.pop(relay.key, None)
        self.total_pending_bytes -= self._pending_bytes.pop(relay.key, 0)
        self.total_pending_events -= self._pending_events.pop(relay.key, 0)
        self.metrics.sessions_active.set(len(self.relays))
        if not self.relays and self._empty is not None:
            self._empty.set()

    def observer(
        self,
        key: str,
        *,
        client_address: str = "",
        engine: int | None = None,
        key_name: str = UNNAMED_KEY,
        tracer: SessionTracer | None = None,
    ) -> SessionObserver:
        observer = SessionObserver(
            self,
            key,
            client_address=client_address,
            engine=engine,
            key_name=key_name,
            tracer=tracer,
        )
        self._observers[key] = observer
        return observer

    def relays_on(self, engine: int) -> list[Relay]:
        """Live sessions placed on one engine replica (its failure ends only these)."""
        return [
            relay
            for key, relay in self.relays.items()
            if (observer := self._observers.get(key)) is not None and observer.engine == engine
        ]

    def pending_by_engine(self, count: int) -> list[int]:
        """Pending output bytes per engine replica: placement's tie-breaker."""
        totals = [0] * count
        for key, observer in self._observers.items():
            if observer.engine is not None and 0 <= observer.engine < count:
                totals[observer.engine] += self._pending_bytes.get(key, 0)
        return totals

    def flush_metrics(self) -> None:
        """Move per-session event/byte counts into the counters (before a scrape)."""
        for observer in self._observers.values():
            observer.flush()

    def unflushed(self) -> tuple[int, int, int, int]:
        """Events and bytes (client→upstream, then upstream→client) not in the counters yet.

        Counters plus these are the exact totals now, without a flush: the
        console asks every second, and flushing 500 sessions (thousands of
        labelled-counter increments) would hold the relay up for milliseconds.
        """
        c2u_events = c2u_bytes = u2c_events = u2c_bytes = 0
        for observer in self._observers.values():
            a, b, c, d = observer.unflushed()
            c2u_events += a
            c2u_bytes += b
            u2c_events += c
            u2c_bytes += d
        return c2u_events, c2u_bytes, u2c_events, u2c_bytes

    def update_pending(self, key: str, pending_bytes: int, pending_events: int) -> None:
        """Record a session's current buffer size; shed the largest if over the cap."""
        if key not in self._pending_bytes:
            return
        self.total_pending_bytes += pending_bytes - self._pending_bytes[key]
        self.total_pending_events += pending_events - self._pending_events[key]
        self._pending_bytes[key] = pending_bytes
        self._pending_events[key] = pending_events
        if self.max_total and self.total_pending_bytes > self.max_total:
            self._shed_largest()

    def _shed_largest(self) -> None:
        candidates = [key for key, relay in self.relays.items() if not relay.core.buffer.closed]
        if not candidates:
            return
        key = max(candidates, key=self._pending_bytes.__getitem__)
        relay = self.relays[key]
        log.warning(
            "pending output %d bytes over the process cap %d; shedding session %s (%d bytes)",
            self.total_pending_bytes,
            self.max_total,
            key,
            self._pending_bytes[key],
        )
        self.metrics.overflows.labels("process_total").inc()
        relay.shed()

    def statistics(self) -> list[dict[str, Any]]:
        """Per-session JSON for /debug/sessions, oldest session first."""
        now = time.monotonic()
        return [self._view(key, relay, now) for key, relay in self.relays.items()]

    def select(self, offset: int, limit: int, query: str = "") -> tuple[int, list[str]]:
        """(sessions matching ``query``, the ids of ``limit`` of them from ``offset``).

        Oldest first. ``query`` filters by substring of our id, the engine's
        session id or the client address before paging, so only the page is
        then rendered (with :meth:`view`).
        """
        keys = list(self.relays)
        if query:
            keys = [key for key in keys if query in self._search_text(key)]
        return len(keys), keys[offset : offset + limit]

    def view(self, key: str, *, max_ids: int | None = None) -> dict[str, Any] | None:
        """One live session's JSON (None once it ended); id lists cut to the newest ``max_ids``."""
        relay = self.relays.get(key)
        if relay is None:
            return None
        return self._view(key, relay, time.monotonic(), max_ids=max_ids)

    def detail(self, key: str) -> dict[str, Any] | None:
        """One live session's view and its lifecycle events; None when not live."""
        relay = self.relays.get(key)
        if relay is None:
            return None
        view = self._view(key, relay, time.monotonic())
        observer = self._observers.get(key)
        view["events"] = [] if observer is None else observer.lifecycle()
        return view

    def _search_text(self, key: str) -> str:
        relay = self.relays[key]
        observer = self._observers.get(key)
        address = observer.client_address if observer is not None else ""
        return f"{key} {relay.core.session_id or ''} {address}"

    def _view(
        self, key: str, relay: Relay, now: float, *, max_ids: int | None = None
    ) -> dict[str, Any]:
        stats = relay.core.statistics()
        cancelled = relay.core.ledger.tombstoned()
        if max_ids is not None:
            cancelled = cancelled[-max_ids:] if max_ids else []
        buffer = stats.buffer
        observer = self._observers.get(key)
        playback = relay.core.playback.view(now)
        # Audio the client holds unplayed (the largest over its items), when paced.
        leads = [item["lead_ms"] for item in playback["items"] if not item["finished"]]
        lead_ms = max(leads, default=0) if playback["pacing"] else None
        if max_ids is not None:
            playback["items"] = playback["items"][-max_ids:] if max_ids else []
        return {
            "id": key,
            "upstream_session_id": stats.session_id,
            "client_address": observer.client_address if observer is not None else "",
            "key": observer.key_name if observer is not None else UNNAMED_KEY,
            "engine": observer.engine if observer is not None else None,
            "started_at": observer.started_at if observer is not None else None,
            "age_seconds": round(now - relay.started_at, 3),
            "state": stats.state.value,
            "outcome": relay.core.outcome.value if relay.core.outcome is not None else None,
            "close_code": relay.core.close_code,
            "pending_bytes": buffer.pending_bytes,
            "pending_events": buffer.pending_events,
            "reserve_bytes": buffer.reserve_bytes,
            "reserve_events": buffer.reserve_events,
            "peak_pending_bytes": buffer.peak_pending_bytes,
            "active_response": stats.active_response,
            "open_responses": list(stats.open_responses),
            "cancelled_responses": cancelled,
            "tombstones": stats.ledger.tombstones,
            "tombstone_evictions": stats.ledger.evictions,
            "late_audio_after_eviction": stats.ledger.late_after_eviction,
            "overflows": stats.overflows,
            "overflowed": relay.core.outcome is not None and relay.core.outcome.value == "overflow",
            "cancels": stats.cancels,
            "dropped": {
                r.value: {"events": e, "bytes": b} for r, (e, b) in stats.drops.items() if e
            },
            "bytes_client_to_upstream": relay.bytes_client_to_upstream,
            "bytes_upstream_to_client": relay.bytes_upstream_to_client,
            "playback": playback,
            "playback_lead_ms": lead_ms,
        }


class SessionObserver:
    """Hooks a relay calls, kept to plain integer arithmetic per event.

    Event and byte counts are accumulated per session and added to the
    Prometheus counters by ``flush`` (at every scrape and at session end), so
    the hot path takes no metric locks. ``tracer`` (None: tracing off) hears
    only response-level events.
    """

    __slots__ = (
        "_cancels_seen",
        "_core",
        "_delay",
        "_engine_full_seen",
        "_flushed",
        "_key",
        "_last_pending",
        "_late_evicted_seen",
        "_m",
        "_overflows_seen",
        "_playback_seen",
        "_registry",
        "_session_id_seen",
        "_state_seen",
        "c2u_audio",
        "c2u_bytes",
        "c2u_control",
        "c2u_invalid",
        "client_address",
        "engine",
        "events",
        "key_name",
        "started_at",
        "tracer",
        "u2c_audio",
        "u2c_bytes",
        "u2c_control",
        "u2c_error",
        "u2c_invalid",
    )

    def __init__(
        self,
        registry: SessionRegistry,
        key: str,
        *,
        client_address: str = "",
        engine: int | None = None,
        key_name: str = UNNAMED_KEY,
        tracer: SessionTracer | None = None,
    ) -> None:
        self._registry = registry
        self._key = key
        #: This session's trace; None when tracing is off (docs/design.md, Tracing).
        self.tracer = tracer
        self.client_address = client_address
        #: The API key's name from the key file (never the key), or ``unnamed``.
        self.key_name = key_name
        #: The engine replica this session was placed on (docs/design.md, Engine pool).
        self.engine = engine
        #: Wall-clock seconds (Unix time): shown to people next to their logs.
        self.started_at = time.time()
        #: (wall-clock seconds, kind, detail), newest last; see LIFECYCLE_EVENTS.
        self.events: deque[tuple[float, str, str]] = deque(maxlen=LIFECYCLE_EVENTS)
        on = "" if engine is None else f", engine {engine}"
        self.events.append((self.started_at, "created", f"client {client_address or '?'}{on}"))
        self._cancels_seen = 0
        self._state_seen: object = None
        self._session_id_seen: str | None = None
        m = registry.metrics
        self._m = m
        self._delay = m.output_queue_delay
        self._overflows_seen = 0
        self._late_evicted_seen = 0
        self._last_pending = (0, 0)
        self.c2u_control = self.c2u_audio = self.c2u_invalid = self.c2u_bytes = 0
        self.u2c_audio = self.u2c_control = self.u2c_error = self.u2c_invalid = 0
        self.u2c_bytes = 0
        self._core: SessionCore | None = None
        self._playback_seen: tuple[float, int, int, int, int] = (0.0, 0, 0, 0, 0)
        self._engine_full_seen = False
        self._flushed = (0, 0, 0, 0, 0, 0, 0, 0, 0)

    def client_event(self, size: int, *, forwarded: bool, audio: bool = False) -> None:
        if not forwarded:
            self.c2u_invalid += 1
            return
        if audio:
            self.c2u_audio += 1
        else:
            self.c2u_control += 1
        self.c2u_bytes += size

    def upstream_event(self, event: UpstreamEvent) -> None:
        kind = event.kind
        if kind is EventKind.AUDIO_DELTA:
            self.u2c_audio += 1
        elif kind is EventKind.ERROR:
            self.u2c_error += 1
        elif kind is EventKind.MALFORMED:
            self.u2c_invalid += 1
        else:
            self.u2c_control += 1
            if self.tracer is not None:
                self.tracer.upstream_event(event)
        self.u2c_bytes += event.size

    def flush(self) -> None:
        """Add the counts accumulated since the last flush to the counters."""
        if self._core is not None:
            self._export_playback(self._core)
        now = (
            self.c2u_control,
            self.c2u_audio,
            self.c2u_invalid,
            self.c2u_bytes,
            self.u2c_audio,
            self.u2c_control,
            self.u2c_error,
            self.u2c_invalid,
            self.u2c_bytes,
        )
        before = self._flushed
        if now == before:
            return
        d = [a - b for a, b in zip(now, before, strict=True)]
        m = self._m
        for value, counter in (
            (d[0], m.events.labels(_C2U, "control")),
            (d[1], m.events.labels(_C2U, "audio")),
            (d[2], m.events.labels(_C2U, "invalid")),
            (d[3], m.bytes.labels(_C2U)),
            (d[4], m.events.labels(_U2C, "audio")),
            (d[5], m.events.labels(_U2C, "control")),
            (d[6], m.events.labels(_U2C, "error")),
            (d[7], m.events.labels(_U2C, "invalid")),
            (d[8], m.bytes.labels(_U2C)),
        ):
            if value:
                counter.inc(value)
        self._flushed = now

    def unflushed(self) -> tuple[int, int, int, int]:
        """(events, bytes) client→upstream, then upstream→client, counted since the last flush."""
        f = self._flushed
        c2u = self.c2u_control + self.c2u_audio + self.c2u_invalid
        u2c = self.u2c_audio + self.u2c_control + self.u2c_error + self.u2c_invalid
        return (
            c2u - f[0] - f[1] - f[2],
            self.c2u_bytes - f[3],
            u2c - f[4] - f[5] - f[6] - f[7],
            self.u2c_bytes - f[8],
        )

    @property
    def events_client_to_upstream(self) -> int:
        """Client frames read this session (forwarded or not)."""
        return self.c2u_control + self.c2u_audio + self.c2u_invalid

    def delivered(self, entry: Entry, written_at: float) -> None:
        self._delay.observe(max(0.0, written_at - entry.enqueued_at))

    def after_core_call(self, core: SessionCore) -> None:
        """Sync buffer size; export drops, overflows and timings when there is news."""
        self._core = core
        buffer = core.buffer
        pending = (buffer.pending_bytes, len(buffer))
        if pending != self._last_pending:
            self._last_pending = pending
            self._registry.update_pending(self._key, pending[0], pending[1])
        if core.news:
            core.news = False
            self._export_news(core)
        if (
            core.state is not self._state_seen
            or core.session_id is not self._session_id_seen
            or _cancels(core) != self._cancels_seen
        ):
            self._note_lifecycle(core)

    def note(self, kind: str, detail: str = "") -> None:
        """Add a lifecycle event (kind is ours; detail may carry peer strings)."""
        self.events.append((time.time(), kind, detail))

    def lifecycle(self) -> list[dict[str, Any]]:
        """The lifecycle events as JSON, oldest first."""
        return [{"at": at, "kind": kind, "detail": detail} for at, kind, detail in self.events]

    def _note_lifecycle(self, core: SessionCore) -> None:
        """Record what changed since the last core call (rare: off the per-event path)."""
        if core.session_id is not self._session_id_seen:
            self._session_id_seen = core.session_id
            if core.session_id is not None:
                self.note("engine_session", core.session_id)
        cancels = _cancels(core)
        if cancels != self._cancels_seen:
            tombstoned = core.ledger.tombstoned()
            latest = tombstoned[-1] if tombstoned else "?"
            for _ in range(cancels - self._cancels_seen):
                self.note("cancel", f"response {latest}")
            if self.tracer is not None:
                self.tracer.cancelled(tombstoned[-(cancels - self._cancels_seen) :])
            self._registry.total_cancels += cancels - self._cancels_seen
            self._cancels_seen = cancels
        if core.state is not self._state_seen:
            first = self._state_seen is None
            self._state_seen = core.state
            if not first:
                outcome = core.outcome.value if core.outcome is not None else "?"
                self.note(core.state.value, f"outcome {outcome}")

    def _export_news(self, core: SessionCore) -> None:
        m = self._m
        for reason, (events, size) in core.take_drops().items():
            m.dropped_events.labels(reason.value).inc(events)
            m.dropped_bytes.labels(reason.value).inc(size)
        overflows = core.overflow_count
        if overflows != self._overflows_seen:
            m.overflows.labels(core.settings.overflow_policy.value).inc(
                overflows - self._overflows_seen
            )
            self._overflows_seen = overflows
            self.note("overflow", f"policy {core.settings.overflow_policy.value}")
            if self.tracer is not None:
                self.tracer.overflow(core.settings.overflow_policy.value)
        late_evicted = core.ledger.late_after_eviction
        if late_evicted != self._late_evicted_seen:
            m.late_audio_after_eviction.inc(late_evicted - self._late_evicted_seen)
            self._late_evicted_seen = late_evicted
        silence, first = core.take_observations()
        for value in silence:
            m.cancel_to_silence.observe(value)
        for value in first:
            m.first_audio.observe(value)
        if core.engine_full and not self._engine_full_seen:
            # Passed on to the client; new sessions keep off that engine a while.
            self._engine_full_seen = True
            m.engine_full.labels("session").inc()
            self.note("engine_full", "the engine refused the session: no room")
            self._registry.on_engine_full(self.engine)
        self._export_playback(core)

    def _export_playback(self, core: SessionCore) -> None:
        """Playback ledger counters since the last export (plain integer compares)."""
        playback = core.playback
        m = self._m
        for value in playback.take_lead_observations():
            m.audio_lead_at_cancel.observe(value)
        for code in playback.take_own_errors():
            m.engine_ack_errors.labels(code.value).inc()
        learned = playback.take_learned()
        if learned is not None:
            self.note("engine_behaviour", f"behaves like vLLM-Omni {learned.value}")
            self._registry.capabilities.learn(learned)
        seen = self._playback_seen
        now = (
            playback.audio_sent,
            playback.acks_sent,
            playback.truncations_client,
            playback.truncations_sidecar,
            playback.paced_bound_releases,
        )
        if now == seen:
            return
        if now[0] > seen[0]:
            m.audio_delivered.inc(now[0] - seen[0])
        if now[1] > seen[1]:
            m.playback_acks.inc(now[1] - seen[1])
        if now[2] > seen[2]:
            m.truncations.labels("client").inc(now[2] - seen[2])
        if now[3] > seen[3]:
            m.truncations.labels("sidecar").inc(now[3] - seen[3])
        if now[4] > seen[4]:
            m.paced_bound_releases.inc(now[4] - seen[4])
        self._playback_seen = now

    def session_observations(self, core: SessionCore) -> None:
        """The session ended: final sync and its outcome."""
        core.news = False
        self._export_news(core)
        self.after_core_call(core)
        self.flush()
        outcome = core.outcome
        self._m.sessions.labels(outcome.value if outcome else "error").inc()
        self.note(
            "close", f"outcome {outcome.value if outcome else 'error'}, code {core.close_code}"
        )
        if self.tracer is not None:
            self.tracer.end(outcome.value if outcome else "error", core.close_code)


def _cancels(core: SessionCore) -> int:
    """Cancels so far: the core counts them for ``statistics()``; read without building it."""
    return core._cancels
