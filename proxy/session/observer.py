"""The hooks that turn relay activity into metrics, lifecycle events and traces.

A relay calls its :class:`SessionObserver` per event with plain integer
arithmetic, and after every core call (``after_core_call``): the observer
reports the session's buffer size to the registry
(proxy/session/registry.py) and, when the core's telemetry
(``core.telemetry``, proxy/core/telemetry.py) has news, exports drops,
overflows and timings.

For the operator console each session keeps its last ``LIFECYCLE_EVENTS``
lifecycle events (created, engine session, cancels, overflows, closing,
close) with wall-clock timestamps, noticed by comparing a few core fields
after each core call; the ring is bounded and drops its oldest entry when full.

Tracing (docs/design.md, Tracing) hangs off the same hooks: a session's
:class:`SessionTracer` (None when ``tracing = "off"``) hears response-level
events only (``session.created``, ``response.created``/``done``, cancels,
overflows and the end), never an audio delta, so with tracing off its cost
is one None check per non-audio event.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from metrics import SidecarMetrics
from proxy.core.buffer import Entry
from proxy.core.capabilities import EngineVersion
from proxy.core.events import ClientEvent, EventKind, UpstreamEvent
from proxy.core.usage import UNNAMED_KEY

if TYPE_CHECKING:
    from proxy.core.session_core import SessionCore

__all__ = [
    "LIFECYCLE_EVENTS",
    "Registry",
    "SessionObserver",
    "SessionTracer",
    "Tracing",
]


class SessionTracer(Protocol):
    """One session's trace (``proxy.session.tracing`` builds it; only built with tracing on).

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
    """The process's tracer (``proxy.session.tracing.OtlpTracing``; None when off)."""

    def session(self, key: str, headers: Mapping[str, str], *, model: str | None) -> SessionTracer:
        """Start a session's span, a child of the client's ``traceparent`` if any."""

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop."""


class _Capabilities(Protocol):
    """What an observer tells the process's engine capabilities (``CapabilityBook``)."""

    def learn(self, version: EngineVersion) -> bool: ...


class Registry(Protocol):
    """What an observer reports to (``proxy.session.registry.SessionRegistry`` has this
    shape; a Protocol here keeps ``registry`` → ``observer`` one-way)."""

    metrics: SidecarMetrics
    total_cancels: int
    on_engine_full: Callable[[int | None], None]

    @property
    def capabilities(self) -> _Capabilities: ...

    def update_pending(self, key: str, pending_bytes: int, pending_events: int) -> None: ...


_C2U = "client_to_upstream"
_U2C = "upstream_to_client"

#: Lifecycle events kept per session (events); the oldest is dropped when full.
LIFECYCLE_EVENTS: Final = 50


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
        registry: Registry,
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
        telemetry = core.telemetry
        if telemetry.news:
            telemetry.news = False
            self._export_news(core)
        if (
            core.state is not self._state_seen
            or core.session_id is not self._session_id_seen
            or telemetry.cancels != self._cancels_seen
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
        cancels = core.telemetry.cancels
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
        telemetry = core.telemetry
        for reason, (events, size) in telemetry.take_drops().items():
            m.dropped_events.labels(reason.value).inc(events)
            m.dropped_bytes.labels(reason.value).inc(size)
        overflows = telemetry.overflows
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
        silence, first = telemetry.take_observations()
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
        core.telemetry.news = False
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
