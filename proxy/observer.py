"""Session registry and the hooks that turn relay activity into metrics.

``SessionRegistry`` knows every live relay (for shutdown, engine loss,
``/debug/sessions`` and the process-wide pending-output cap) and keeps an
exact running total of pending output bytes: each relay reports the change
of its buffer after every core call, so enforcing
``max_total_pending_output_bytes`` costs O(1) per event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from metrics import SidecarMetrics
from proxy.core.buffer import Entry
from proxy.core.events import EventKind, UpstreamEvent

if TYPE_CHECKING:
    from proxy.core.session import SessionCore
    from proxy.relay import Relay

__all__ = ["SessionObserver", "SessionRegistry"]

log = logging.getLogger(__name__)

_C2U = "client_to_upstream"
_U2C = "upstream_to_client"


class SessionRegistry:
    """Live relays and the process-wide pending-output total.

    Args:
        metrics: where to report.
        max_total_pending_output_bytes: above this, the largest session is shed.
    """

    def __init__(self, metrics: SidecarMetrics, *, max_total_pending_output_bytes: int) -> None:
        self.metrics = metrics
        self.max_total = max_total_pending_output_bytes
        self.relays: dict[str, Relay] = {}
        self._observers: dict[str, SessionObserver] = {}
        self._pending_bytes: dict[str, int] = {}
        self._pending_events: dict[str, int] = {}
        self.total_pending_bytes = 0
        self.total_pending_events = 0
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
        self.relays.pop(relay.key, None)
        self._observers.pop(relay.key, None)
        self.total_pending_bytes -= self._pending_bytes.pop(relay.key, 0)
        self.total_pending_events -= self._pending_events.pop(relay.key, 0)
        self.metrics.sessions_active.set(len(self.relays))
        if not self.relays and self._empty is not None:
            self._empty.set()

    def observer(self, key: str) -> SessionObserver:
        observer = SessionObserver(self, key)
        self._observers[key] = observer
        return observer

    def flush_metrics(self) -> None:
        """Move per-session event/byte counts into the counters (before a scrape)."""
        for observer in self._observers.values():
            observer.flush()

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
        """Per-session JSON for /debug/sessions."""
        now = time.monotonic()
        out = []
        for key, relay in self.relays.items():
            stats = relay.core.statistics()
            buffer = stats.buffer
            out.append(
                {
                    "id": key,
                    "upstream_session_id": stats.session_id,
                    "age_seconds": round(now - relay.started_at, 3),
                    "state": stats.state.value,
                    "pending_bytes": buffer.pending_bytes,
                    "pending_events": buffer.pending_events,
                    "reserve_bytes": buffer.reserve_bytes,
                    "reserve_events": buffer.reserve_events,
                    "peak_pending_bytes": buffer.peak_pending_bytes,
                    "active_response": stats.active_response,
                    "open_responses": list(stats.open_responses),
                    "cancelled_responses": relay.core.ledger.tombstoned(),
                    "tombstones": stats.ledger.tombstones,
                    "tombstone_evictions": stats.ledger.evictions,
                    "late_audio_after_eviction": stats.ledger.late_after_eviction,
                    "overflows": stats.overflows,
                    "overflowed": relay.core.outcome is not None
                    and relay.core.outcome.value == "overflow",
                    "cancels": stats.cancels,
                    "dropped": {
                        r.value: {"events": e, "bytes": b} for r, (e, b) in stats.drops.items() if e
                    },
                    "bytes_client_to_upstream": relay.bytes_client_to_upstream,
                    "bytes_upstream_to_client": relay.bytes_upstream_to_client,
                }
            )
        return out


class SessionObserver:
    """Hooks a relay calls, kept to plain integer arithmetic per event.

    Event and byte counts are accumulated per session and added to the
    Prometheus counters by ``flush`` (at every scrape and at session end), so
    the hot path takes no metric locks.
    """

    __slots__ = (
        "_delay",
        "_flushed",
        "_key",
        "_last_pending",
        "_late_evicted_seen",
        "_m",
        "_overflows_seen",
        "_registry",
        "c2u_audio",
        "c2u_bytes",
        "c2u_control",
        "c2u_invalid",
        "u2c_audio",
        "u2c_bytes",
        "u2c_control",
        "u2c_error",
        "u2c_invalid",
    )

    def __init__(self, registry: SessionRegistry, key: str) -> None:
        self._registry = registry
        self._key = key
        m = registry.metrics
        self._m = m
        self._delay = m.output_queue_delay
        self._overflows_seen = 0
        self._late_evicted_seen = 0
        self._last_pending = (0, 0)
        self.c2u_control = self.c2u_audio = self.c2u_invalid = self.c2u_bytes = 0
        self.u2c_audio = self.u2c_control = self.u2c_error = self.u2c_invalid = 0
        self.u2c_bytes = 0
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
        self.u2c_bytes += event.size

    def flush(self) -> None:
        """Add the counts accumulated since the last flush to the counters."""
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

    def delivered(self, entry: Entry, written_at: float) -> None:
        self._delay.observe(max(0.0, written_at - entry.enqueued_at))

    def after_core_call(self, relay: Relay) -> None:
        """Sync buffer size; export drops, overflows and timings when there is news."""
        core = relay.core
        buffer = core.buffer
        pending = (buffer.pending_bytes, len(buffer))
        if pending != self._last_pending:
            self._last_pending = pending
            self._registry.update_pending(self._key, pending[0], pending[1])
        if core.news:
            core.news = False
            self._export_news(core)

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
        late_evicted = core.ledger.late_after_eviction
        if late_evicted != self._late_evicted_seen:
            m.late_audio_after_eviction.inc(late_evicted - self._late_evicted_seen)
            self._late_evicted_seen = late_evicted
        silence, first = core.take_observations()
        for value in silence:
            m.cancel_to_silence.observe(value)
        for value in first:
            m.first_audio.observe(value)

    def session_observations(self, relay: Relay) -> None:
        """The session ended: final sync and its outcome."""
        core = relay.core
        core.news = False
        self._export_news(core)
        self.after_core_call(relay)
        self.flush()
        outcome = core.outcome
        self._m.sessions.labels(outcome.value if outcome else "error").inc()
