"""Every live session, the process-wide pending-output total, engine capabilities.

``SessionRegistry`` knows every live relay (shutdown, engine loss, the
console) and an exact running total of pending output, reported by each
session's observer after every core call, so ``max_total_pending_output_bytes``
costs O(1) per event. It reads sessions through their ``SessionView`` only,
and keeps the final view of the last ``RECENT_CLOSED_SESSIONS`` sessions.
``CapabilityBook`` holds what the process knows of the engine
(docs/design.md, Engine capabilities).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol

from metrics import SidecarMetrics
from proxy.core.capabilities import EngineCapabilities, EngineVersion
from proxy.core.lifecycle import Outcome
from proxy.core.resume_state import HandOver
from proxy.core.usage import UNNAMED_KEY
from proxy.core.view import SessionView
from proxy.session.client_side import ClientSide
from proxy.session.observer import SessionObserver, SessionTracer
from proxy.session.timers import SessionTimers
from proxy.session.upstream_link import UpstreamLink

__all__ = ["RECENT_CLOSED_SESSIONS", "CapabilityBook", "SessionRegistry"]

log = logging.getLogger(__name__)


class LiveSession(Protocol):
    """What the registry needs of a live session (``proxy.session.relay.Relay`` has this
    shape; a Protocol here keeps ``proxy.session.relay`` → ``proxy.session.registry`` one-way)."""

    key: str
    view: SessionView
    started_at: float
    upstream: UpstreamLink
    side: ClientSide
    timers: SessionTimers
    log: logging.LoggerAdapter[logging.Logger]

    def shed(self) -> None: ...

    def trim_journal(self, excess: int) -> int: ...

    def attach(self, side: ClientSide, cursor: int) -> bool: ...

    def shutdown(self) -> None: ...

    def hand_over(self) -> HandOver: ...

    def engine_unavailable(self) -> None: ...


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
        #: that engine refused the session as full (set by proxy.edge.client_app.ProxyState).
        self.on_engine_full: Callable[[int | None], None] = lambda engine: None
        self.max_total = max_total_pending_output_bytes
        self.relays: dict[str, LiveSession] = {}
        self._key_ids: dict[str, str] = {}
        self._observers: dict[str, SessionObserver] = {}
        #: The route each session came in through (metrics/vocabulary.py FRONT_DOORS).
        self._front_doors: dict[str, str] = {}
        self._pending_bytes: dict[str, int] = {}
        self._pending_events: dict[str, int] = {}
        self._journal_bytes: dict[str, int] = {}
        self.total_pending_bytes = 0
        self.total_pending_events = 0
        #: Sessions marked to shed whose relay has not applied it yet (its next loop step).
        self._shedding: set[str] = set()
        #: What the sessions' resume journals hold (bytes): inside the cap with the pending output.
        self.total_journal_bytes = 0
        #: Final views of ended sessions, newest last (see RECENT_CLOSED_SESSIONS).
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_CLOSED_SESSIONS)
        #: Responses cancelled, all sessions, since start (the console's total).
        self.total_cancels = 0
        self._empty: asyncio.Event | None = None
        #: Set at shutdown: a session admitted after it is told to close at once.
        self.closing_all = False
        #: Set when the sidecar starts to drain: no session is held for a resume, and
        #: each session that ends is counted in ``drain_outcomes``.
        self.draining = False
        self.drain_outcomes: dict[str, int] = {"handed_over": 0, "drained": 0, "cut": 0}
        #: Set with ``draining`` when the engine outlives this sidecar: a session that
        #: registers during the drain (its handshake was in flight) is handed over too.
        self.handing_over = False
        # Read at scrape time: no gauge update on the per-event path.
        metrics.output_pending_bytes.set_function(lambda: self.total_pending_bytes)
        metrics.output_pending_events.set_function(lambda: self.total_pending_events)
        metrics.sessions_detached.set_function(self.detached)

    async def wait_empty(self) -> None:
        """Wait until no session is live."""
        if not self.relays:
            return
        if self._empty is None:
            self._empty = asyncio.Event()
        self._empty.clear()
        await self._empty.wait()

    def add(self, relay: LiveSession, *, key_id: str = "") -> None:
        """A live session (``key_id``: its API key's identity, which a resume must present)."""
        self.relays[relay.key] = relay
        self._key_ids[relay.key] = key_id
        self._pending_bytes[relay.key] = 0
        self._pending_events[relay.key] = 0
        self._journal_bytes[relay.key] = 0
        self.metrics.sessions_active.set(len(self.relays))

    def remove(self, relay: LiveSession) -> None:
        if relay.key in self.relays:
            self.recent.append(self.detail(relay.key) or {"id": relay.key})
            if self.draining:
                self._count_drained(relay.view.outcome)
        self.relays.pop(relay.key, None)
        self._key_ids.pop(relay.key, None)
        self._observers.pop(relay.key, None)
        self._shedding.discard(relay.key)
        self._front_doors.pop(relay.key, None)
        self.total_pending_bytes -= self._pending_bytes.pop(relay.key, 0)
        self.total_pending_events -= self._pending_events.pop(relay.key, 0)
        self.total_journal_bytes -= self._journal_bytes.pop(relay.key, 0)
        self.metrics.sessions_active.set(len(self.relays))
        if not self.relays and self._empty is not None:
            self._empty.set()

    def _count_drained(self, outcome: Outcome | None) -> None:
        """How a session live at the drain ended (drain_sessions_total{outcome})."""
        if outcome is Outcome.HANDED_OVER:
            label = "handed_over"
        elif outcome is Outcome.SHUTDOWN:
            label = "cut"  # the sidecar ended it: the deadline, or a second signal
        else:
            label = "drained"
        self.drain_outcomes[label] += 1
        self.metrics.drain_sessions.labels(label).inc()

    def observer(
        self,
        key: str,
        *,
        client_address: str = "",
        engine: int | None = None,
        key_name: str = UNNAMED_KEY,
        tracer: SessionTracer | None = None,
        front_door: str = "",
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
        if front_door:
            self._front_doors[key] = front_door
        return observer

    def holds(self, session_id: str) -> bool:
        """A live resumable session has this engine session id."""
        return any(
            r.view.session_id == session_id and r.view.resumable for r in self.relays.values()
        )

    def resumable(self, session_id: str, token: str, key_id: str) -> LiveSession | None:
        """The session a ``session.resume`` may take over: same id, token and key; else None."""
        for key, relay in self.relays.items():
            view = relay.view
            if view.session_id == session_id and view.resumable:
                token_ok = view.resume_token_matches(token)
                key_ok = hmac.compare_digest(self._key_ids.get(key, ""), key_id)
                return relay if token_ok and key_ok else None
        return None

    def detached(self) -> int:
        """Sessions held for a resume now."""
        return sum(1 for relay in self.relays.values() if relay.view.held)

    def resumable_of(self, key_id: str) -> int:
        """How many live sessions of ``key_id`` a resume could take over: held after a
        drop, or still attached (the old connection may be half-open, not noticed yet)."""
        return sum(
            1
            for key, relay in self.relays.items()
            if relay.view.resumable and hmac.compare_digest(self._key_ids.get(key, ""), key_id)
        )

    def relays_on(self, engine: int) -> list[LiveSession]:
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

    def update_pending(
        self, key: str, pending_bytes: int, pending_events: int, journal_bytes: int = 0
    ) -> None:
        """Record a session's current buffer and resume journal sizes; over the cap,
        free journals (largest first; pure core state, no output), then mark the
        largest session to shed if still over.

        Called from inside a session's drain: the shed is only marked here
        (``Relay.shed`` schedules it), never applied in this call.
        """
        if key not in self._pending_bytes:
            return
        self.total_pending_bytes += pending_bytes - self._pending_bytes[key]
        self.total_pending_events += pending_events - self._pending_events[key]
        self.total_journal_bytes += journal_bytes - self._journal_bytes[key]
        self._pending_bytes[key] = pending_bytes
        self._pending_events[key] = pending_events
        self._journal_bytes[key] = journal_bytes
        if self.max_total and self.total_pending_bytes + self.total_journal_bytes > self.max_total:
            self._trim_journals()
            if self.total_pending_bytes + self.total_journal_bytes > self.max_total:
                self._shed_largest()

    def _trim_journals(self) -> None:
        """A journal is only kept for a resume that may never come: it gives way to
        output before any session is shed (docs/design.md, Memory)."""
        journals = self._journal_bytes
        for key in sorted(journals, key=journals.__getitem__, reverse=True):
            excess = self.total_pending_bytes + self.total_journal_bytes - self.max_total
            if excess <= 0 or not journals[key]:
                return
            freed = self.relays[key].trim_journal(excess)
            journals[key] -= freed
            self.total_journal_bytes -= freed
            observer = self._observers.get(key)
            if observer is not None:
                observer.pending_changed()

    def _shed_largest(self) -> None:
        total = self.total_pending_bytes + self.total_journal_bytes
        if self._shedding:
            # A marked session's shed frees its output at its relay's next step:
            # until then its bytes do not make a second session the largest.
            self._shedding = {k for k in self._shedding if not self.relays[k].view.closing}
            total -= sum(self._pending_bytes[k] for k in self._shedding)
            if total <= self.max_total:
                return
        candidates = [
            key
            for key, relay in self.relays.items()
            if not relay.view.closing and key not in self._shedding
        ]
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
        self._shedding.add(key)
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
        return f"{key} {relay.view.session_id or ''} {address}"

    def _view(
        self, key: str, relay: LiveSession, now: float, *, max_ids: int | None = None
    ) -> dict[str, Any]:
        view = relay.view
        stats = view.statistics()
        cancelled = view.tombstoned()
        if max_ids is not None:
            cancelled = cancelled[-max_ids:] if max_ids else []
        buffer = stats.buffer
        observer = self._observers.get(key)
        playback = view.playback_view(now)
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
            "front_door": self._front_doors.get(key, "realtime"),
            "engine": observer.engine if observer is not None else None,
            "started_at": observer.started_at if observer is not None else None,
            "age_seconds": round(now - relay.started_at, 3),
            "state": stats.state.value,
            "detached": view.detached_at is not None,
            "resume_grace_left_seconds": (
                None
                if view.resume_grace_ends_at is None
                else round(max(0.0, view.resume_grace_ends_at - now), 3)
            ),
            "outcome": view.outcome.value if view.outcome is not None else None,
            "close_code": view.close_code,
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
            "overflowed": view.outcome is not None and view.outcome.value == "overflow",
            "cancels": stats.cancels,
            "dropped": {
                r.value: {"events": e, "bytes": b} for r, (e, b) in stats.drops.items() if e
            },
            "bytes_client_to_upstream": observer.c2u_bytes if observer is not None else 0,
            "bytes_upstream_to_client": observer.u2c_bytes if observer is not None else 0,
            "playback": playback,
            "playback_lead_ms": lead_ms,
        }

    def last_engine_frame(self, engine: int) -> float | None:
        """When a frame of engine replica ``engine`` last reached one of its live sessions.

        The event loop's monotonic seconds (what the relay's timers read), the
        latest over the replica's live sessions; None when it has none. The
        supervisor asks it before it restarts an engine whose health fails
        (docs/design.md, Engine supervision): frames still flowing mean busy,
        not dead. Pongs count: they come from the engine's own event loop.
        """
        latest: float | None = None
        for key, relay in self.relays.items():
            observer = self._observers.get(key)
            if observer is None or observer.engine != engine:
                continue
            at = relay.timers.last_upstream_frame
            if at <= relay.started_at:
                continue  # nothing from the engine yet: a session just opened says nothing
            if latest is None or at > latest:
                latest = at
        return latest
