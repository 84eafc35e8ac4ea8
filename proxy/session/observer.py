"""A session's observer: metrics, lifecycle events and traces from what the relay reports.

The relay counts each event here with plain integer arithmetic and hands
over each drain of the core (docs/design.md, Metrics): its news (drops,
overflows, cancels, timings) and the buffer size for the registry. The
observer reads the session through ``SessionView`` and writes nothing into
it. Each session keeps its last ``LIFECYCLE_EVENTS`` lifecycle events for the
console; tracing hears response-level events only (docs/design.md, Tracing).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from metrics import SidecarMetrics
from proxy.core.buffer import Entry
from proxy.core.capabilities import EngineVersion
from proxy.core.drain import Drain, Report
from proxy.core.events import ClientEvent, ClientKind, EventKind, UpstreamEvent
from proxy.core.session_core import ClientDecision
from proxy.core.usage import UNNAMED_KEY
from proxy.core.view import PlaybackTotals, SessionView

__all__ = [
    "LIFECYCLE_EVENTS",
    "Registry",
    "RelayObserver",
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
        """Export what is queued (at most ``EXPORT_AT_EXIT_SECONDS``) and stop."""


class _Capabilities(Protocol):
    """What an observer tells the process's engine capabilities (``CapabilityBook``)."""

    def learn(self, version: EngineVersion) -> bool: ...


class Registry(Protocol):
    """What an observer reports to (``proxy.session.registry.SessionRegistry`` has this
    shape; a Protocol here keeps ``registry`` → ``observer`` one-way)."""

    metrics: SidecarMetrics
    total_cancels: int
    on_engine_full: Callable[[int | None], None]
    #: The sidecar drains: a client that drops now is not held for a resume.
    draining: bool

    @property
    def capabilities(self) -> _Capabilities: ...

    def update_pending(
        self, key: str, pending_bytes: int, pending_events: int, journal_bytes: int = 0
    ) -> None: ...


class RelayObserver(Protocol):
    """What the relay reports to (:class:`SessionObserver`; a fake in the shell's tests).

    A Protocol, not the class: the compiled relay checks a concrete type on
    every call, and the shell's tests hand it a stand-in.
    """

    @property
    def tracer(self) -> SessionTracer | None: ...

    def watch(self, view: SessionView) -> None: ...

    def client_frame(self, size: int, decision: ClientDecision) -> None: ...

    def upstream_event(self, event: UpstreamEvent) -> None: ...

    def upstream_invalid(self, size: int) -> None: ...

    def delivered(self, entries: Sequence[Entry], written_at: float) -> None: ...

    def after_drain(self, out: Drain) -> None: ...

    def may_hold(self) -> bool: ...

    def session_end(self) -> None: ...


_C2U = "client_to_upstream"
_U2C = "upstream_to_client"

#: Lifecycle events kept per session (events); the oldest is dropped when full.
LIFECYCLE_EVENTS: Final = 50


_NO_PLAYBACK: Final = PlaybackTotals(0.0, 0, 0, 0, 0)


class SessionObserver:
    """Hooks a relay calls, kept to plain integer arithmetic per event.

    Event and byte counts are accumulated per session and added to the
    Prometheus counters by ``flush`` (at every scrape and at session end), so
    the hot path takes no metric locks. ``tracer`` (None: tracing off) hears
    only response-level events.
    """

    __slots__ = (
        "_delay",
        "_flushed",
        "_key",
        "_last_pending",
        "_m",
        "_playback_seen",
        "_registry",
        "_session_id_seen",
        "_state_seen",
        "_view",
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
        self._view: SessionView | None = None
        self._state_seen: object = None
        self._session_id_seen: str | None = None
        m = registry.metrics
        self._m = m
        self._delay = m.output_queue_delay
        #: (pending bytes, pending events, journal bytes) as last told to the registry.
        self._last_pending = (0, 0, 0)
        self.c2u_control = self.c2u_audio = self.c2u_invalid = self.c2u_bytes = 0
        self.u2c_audio = self.u2c_control = self.u2c_error = self.u2c_invalid = 0
        self.u2c_bytes = 0
        self._playback_seen = _NO_PLAYBACK
        self._flushed = (0, 0, 0, 0, 0, 0, 0, 0, 0)

    def watch(self, view: SessionView) -> None:
        """The session this observer reports on (read-only)."""
        self._view = view

    @property
    def view(self) -> SessionView | None:
        return self._view

    def client_frame(self, size: int, decision: ClientDecision) -> None:
        """A client data frame of ``size`` bytes and what the core made of it."""
        event = decision.event
        if event is None:  # over the frame rate (not parsed), or binary
            self.c2u_invalid += 1
            return
        if decision.forward:
            if event.kind is ClientKind.AUDIO_APPEND:
                self.c2u_audio += 1
            else:
                self.c2u_control += 1
            self.c2u_bytes += event.size
        else:
            self.c2u_invalid += 1
        tracer = self.tracer
        if tracer is not None and (event.cancels or event.kind is ClientKind.RESPONSE_CREATE):
            tracer.client_event(event)  # before the drain's report of the cancel

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

    def may_hold(self) -> bool:
        """A client that dropped may be held for a resume (not while the sidecar drains)."""
        return not self._registry.draining

    def upstream_invalid(self, size: int) -> None:
        """An engine frame that is not part of the protocol (binary)."""
        self.u2c_invalid += 1
        self.u2c_bytes += size

    def flush(self) -> None:
        """Add the counts accumulated since the last flush to the counters."""
        if self._view is not None:
            self._export_playback(self._view.playback_totals())
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

    def delivered(self, entries: Sequence[Entry], written_at: float) -> None:
        """These events were written to the client at ``written_at``: their queue delay."""
        observe = self._delay.observe
        for entry in entries:
            observe(max(0.0, written_at - entry.enqueued_at))

    def after_drain(self, out: Drain) -> None:
        """Sync the buffer size; export the drain's news; note lifecycle changes."""
        view = self._view
        if view is None:
            return
        last = self._last_pending
        if (
            out.pending_bytes != last[0]
            or out.pending_events != last[1]
            or out.journal_bytes != last[2]
        ):
            self._last_pending = (out.pending_bytes, out.pending_events, out.journal_bytes)
            self._registry.update_pending(
                self._key, out.pending_bytes, out.pending_events, out.journal_bytes
            )
        if out.report is not None:
            self._export(out.report)
        if view.state is not self._state_seen or view.session_id is not self._session_id_seen:
            self._note_lifecycle(view)

    def pending_changed(self) -> None:
        """The registry changed this session's figures itself (it trimmed its journal):
        the next drain reports them again."""
        self._last_pending = (-1, -1, -1)

    def note(self, kind: str, detail: str = "") -> None:
        """Add a lifecycle event (kind is ours; detail may carry peer strings)."""
        self.events.append((time.time(), kind, detail))

    def lifecycle(self) -> list[dict[str, Any]]:
        """The lifecycle events as JSON, oldest first."""
        return [{"at": at, "kind": kind, "detail": detail} for at, kind, detail in self.events]

    def _note_lifecycle(self, view: SessionView) -> None:
        """Record what changed since the last drain (rare: off the per-event path)."""
        if view.session_id is not self._session_id_seen:
            self._session_id_seen = view.session_id
            if view.session_id is not None:
                self.note("engine_session", view.session_id)
        if view.state is not self._state_seen:
            first = self._state_seen is None
            self._state_seen = view.state
            if not first:
                outcome = view.outcome.value if view.outcome is not None else "?"
                self.note(view.state.value, f"outcome {outcome}")

    def _export(self, report: Report) -> None:
        m = self._m
        for reason, (events, size) in report.drops.items():
            m.dropped_events.labels(reason.value).inc(events)
            m.dropped_bytes.labels(reason.value).inc(size)
        if report.cancelled:
            for response_id in report.cancelled:
                self.note("cancel", f"response {response_id}")
            if self.tracer is not None:
                self.tracer.cancelled(report.cancelled)
            self._registry.total_cancels += len(report.cancelled)
        if report.overflows:
            m.overflows.labels(report.overflow_policy).inc(report.overflows)
            self.note("overflow", f"policy {report.overflow_policy}")
            if self.tracer is not None:
                self.tracer.overflow(report.overflow_policy)
        if report.late_after_eviction:
            m.late_audio_after_eviction.inc(report.late_after_eviction)
        for value in report.silence:
            m.cancel_to_silence.observe(value)
        for value in report.first_audio:
            m.first_audio.observe(value)
        if report.engine_full:
            # Passed on to the client; new sessions keep off that engine a while.
            m.engine_full.labels("session").inc()
            self.note("engine_full", "the engine refused the session: no room")
            self._registry.on_engine_full(self.engine)
        for value in report.lead_at_cancel:
            m.audio_lead_at_cancel.observe(value)
        for code in report.own_ack_errors:
            m.engine_ack_errors.labels(code.value).inc()
        if report.learned is not None:
            self.note("engine_behaviour", f"behaves like vLLM-Omni {report.learned.value}")
            self._registry.capabilities.learn(report.learned)
        if report.replayed:
            m.resume_replayed_events.inc(report.replayed)
        if report.resume_refused:
            m.resumes.labels("refused").inc()
        if report.resume_expired:
            m.resume_grace_expired.inc()
            self.note("resume_expired", "the client did not come back within the grace")

    def _export_playback(self, now: PlaybackTotals) -> None:
        """Playback ledger counters since the last export (plain compares)."""
        seen = self._playback_seen
        if now == seen:
            return
        m = self._m
        if now.audio_sent > seen.audio_sent:
            m.audio_delivered.inc(now.audio_sent - seen.audio_sent)
        if now.acks_sent > seen.acks_sent:
            m.playback_acks.inc(now.acks_sent - seen.acks_sent)
        if now.truncations_client > seen.truncations_client:
            m.truncations.labels("client").inc(now.truncations_client - seen.truncations_client)
        if now.truncations_sidecar > seen.truncations_sidecar:
            m.truncations.labels("sidecar").inc(now.truncations_sidecar - seen.truncations_sidecar)
        if now.paced_bound_releases > seen.paced_bound_releases:
            m.paced_bound_releases.inc(now.paced_bound_releases - seen.paced_bound_releases)
        self._playback_seen = now

    def session_end(self) -> None:
        """The session ended (after its last drain): final flush and its outcome."""
        self.flush()
        view = self._view
        outcome = view.outcome if view is not None else None
        close_code = view.close_code if view is not None else None
        self._m.sessions.labels(outcome.value if outcome else "error").inc()
        self.note("close", f"outcome {outcome.value if outcome else 'error'}, code {close_code}")
        if self.tracer is not None:
            self.tracer.end(outcome.value if outcome else "error", close_code)
