"""How a session ends: its states, their transitions, and the closing sequences.

Rule: every change of ``state`` goes through :func:`next_state`, which looks
the (state, event) pair up in ``TRANSITIONS``; a missing pair is an illegal
transition and raises :class:`InvalidState` naming both.

    OPEN ──closure_queued──▶ CLOSING ──closure_delivered──▶ CLOSED
      │                         │
      └────── client_gone ──────┴──────────────────────────▶ CLOSED (absorbing)

``closure_queued``: the closure notice (``session.closed``) took the output
buffer's closure slot: output overflow, engine lost, shutdown, a limit the
client ran into, or the engine's own ``session.closed``. In CLOSING ordinary
engine events are no longer accepted (the buffer refuses them after closure);
what was queued is still delivered, then the notice, then the client is closed
with ``close_code``. ``closure_delivered`` and ``client_gone`` may also come
once the session is CLOSED (a closure written after the client's socket
ended, a second end report); they change nothing.

:class:`SessionLifecycle` is the half of ``SessionCore`` (proxy/core/session_core.py)
that holds this state and the sequences that move it: the proxy's own ends
(``end``, ``shutdown``, ``end_for_quota``), engine loss, the client going away,
and the overflow policy (docs/design.md, Overflow policy): ``close_session``
purges the active response's queued audio, queues ``error`` (rate_limit_error /
output_backpressure) and a failed ``response.done`` for that response, asks
the engine to cancel it and to close the session, and closes the client with
1008 after ``session.closed``. ``fail_response`` does the same without closing,
drops every later event of the failed response, and falls back to
``close_session`` when there is no response to fail or the session is still
full after the failure.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final

from proxy.core import notices
from proxy.core.buffer import OutputBuffer
from proxy.core.events import EventKind, UpstreamEvent
from proxy.core.ledger import CancellationLedger
from proxy.core.session_settings import OverflowPolicy, SessionSettings
from proxy.core.telemetry import DropReason, SessionTelemetry

__all__ = [
    "CLOSE_ABNORMAL_ENGINE",
    "CLOSE_GOING_AWAY",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "TRANSITIONS",
    "InvalidState",
    "Outcome",
    "SessionEvent",
    "SessionLifecycle",
    "SessionState",
    "next_state",
]

CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001
CLOSE_POLICY_VIOLATION: Final = 1008
CLOSE_ABNORMAL_ENGINE: Final = 1011


class SessionState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class SessionEvent(enum.Enum):
    CLOSURE_QUEUED = "closure_queued"  # session.closed took the buffer's closure slot
    CLOSURE_DELIVERED = "closure_delivered"  # ...and was written to the client
    CLIENT_GONE = "client_gone"  # the client socket is closed


class InvalidState(Exception):
    """A session event that makes no sense in the session's current state.

    The core's own (the core imports nothing outside it, so not
    ``proxy.errors.InvalidState``); an ``Exception`` rather than a
    ``RuntimeError`` so that mypyc compiles it.
    """

    def __init__(self, state: SessionState, event: SessionEvent) -> None:
        super().__init__(f"no session transition from {state.value} on {event.value}")
        self.state = state
        self.event = event


TRANSITIONS: Final[dict[SessionState, dict[SessionEvent, SessionState]]] = {
    SessionState.OPEN: {
        SessionEvent.CLOSURE_QUEUED: SessionState.CLOSING,
        SessionEvent.CLIENT_GONE: SessionState.CLOSED,
    },
    SessionState.CLOSING: {
        SessionEvent.CLOSURE_DELIVERED: SessionState.CLOSED,
        SessionEvent.CLIENT_GONE: SessionState.CLOSED,
    },
    SessionState.CLOSED: {
        SessionEvent.CLOSURE_DELIVERED: SessionState.CLOSED,
        SessionEvent.CLIENT_GONE: SessionState.CLOSED,
    },
}


def next_state(state: SessionState, event: SessionEvent) -> SessionState:
    """The state after ``event``.

    Raises:
        InvalidState: the pair is not in ``TRANSITIONS``.
    """
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise InvalidState(state, event) from None


class Outcome(enum.Enum):
    """Label values of ``sessions_total{outcome}``."""

    CLIENT_CLOSED = "client_closed"
    UPSTREAM_CLOSED = "upstream_closed"
    OVERFLOW = "overflow"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    SHUTDOWN = "shutdown"
    ERROR = "error"
    RATE_LIMITED = "rate_limited"


class SessionLifecycle:
    """A session's state, its output side, and every way it ends. Sync, I/O-free.

    ``SessionCore`` adds the intake of both peers and delivery; the shell only
    ever builds a ``SessionCore``.

    Args:
        settings: limits and policy.
        new_event_id: returns a fresh ``event_id`` for events the proxy writes.
    """

    def __init__(self, settings: SessionSettings, new_event_id: Callable[[], str]) -> None:
        self.settings = settings
        self._new_id = new_event_id
        self.buffer = OutputBuffer(settings.buffer)
        self.ledger = CancellationLedger(
            max_tombstones=settings.max_tombstones, tombstone_ttl=settings.tombstone_ttl
        )
        #: What the observer exports (proxy/core/telemetry.py).
        self.telemetry = SessionTelemetry(settings.max_tombstones)
        self.state = SessionState.OPEN
        self.outcome: Outcome | None = None
        self.close_code: int | None = None
        self.session_id: str | None = None
        self.client_close_requested = False
        self.upstream_close_sent = False
        self._to_upstream: list[str] = []
        #: Closing because of an overflow: later engine output counts as dropped for it.
        self._overflowed = False

    # -- overflow ---------------------------------------------------------------------------------

    def _response_to_fail(self, event: UpstreamEvent) -> str | None:
        rid = event.response_id
        if (
            rid is not None
            and event.kind is EventKind.RESPONSE_DONE
            and self.ledger.is_open(rid)
            and self.ledger.cancelled_at(rid) is None
        ):
            return rid  # convert the not-yet-queued completion into the failure
        return self.ledger.active_response()

    def _fail_response(
        self,
        response_id: str,
        reason: DropReason,
        now: float,
        *,
        error: UpstreamEvent | None = None,
        done_reason: str = "output_backpressure",
    ) -> None:
        """Purge, tombstone (failed), queue error + failed done, cancel upstream."""
        if self.ledger.cancel(response_id, now, failed=True):
            self.telemetry.cancels += 1
        removed, removed_bytes = self.buffer.invalidate(response_id)
        self.telemetry.count_drop(reason, removed_bytes, events=removed)
        if error is None:
            self._queue_backpressure_error(now)
        else:
            self.buffer.offer(error, now)
        done = notices.response_failed(self._new_id(), response_id, done_reason)
        if self.buffer.offer(done, now).accepted:
            self.ledger.on_done_received(response_id)
        else:
            # No room even in the reserve: the response is over for the client anyway.
            self.ledger.on_done_delivered(response_id, now)
            self.telemetry.observe_silence(response_id)
        self._to_upstream.append(notices.response_cancel(response_id))

    def _queue_backpressure_error(self, now: float) -> None:
        error = notices.error_event(
            self._new_id(),
            "output_backpressure",
            "client is not reading output fast enough; pending output exceeded "
            f"{self.settings.buffer.max_pending_output_bytes} bytes or "
            f"{self.settings.buffer.max_pending_output_events} events",
        )
        self.buffer.offer(error, now)

    def _refuse_oversized(self, event: UpstreamEvent, now: float) -> None:
        """An engine frame larger than the whole output budget can never be
        queued, whatever the client does: drop it and fail its response at
        once, with an error that names the frame's size (not an overflow of a
        client that does not read). The session stays open."""
        self.telemetry.count_drop(DropReason.OVERFLOW, event.size)
        self.telemetry.news = True
        limit = self.settings.buffer.max_pending_output_bytes
        target = self._response_to_fail(event) if event.response_id is None else event.response_id
        detail = f" for response {target}" if target is not None else ""
        error = notices.error_event(
            self._new_id(),
            "upstream_frame_too_large",
            f"the engine sent a {event.size}-byte {event.type or 'frame'}{detail}, larger "
            f"than the session's whole output budget ({limit} bytes); it was dropped",
        )
        # A response whose terminal is already queued is not failed again:
        # never a second response.done for one response.
        if target is not None and self.ledger.is_producing(target):
            self._fail_response(
                target,
                DropReason.FAILED_RESPONSE,
                now,
                error=error,
                done_reason="upstream_frame_too_large",
            )
        else:
            self.buffer.offer(error, now)

    def _overflow(self, event: UpstreamEvent, now: float) -> None:
        self.telemetry.overflows += 1
        self.telemetry.news = True
        target = self._response_to_fail(event)
        if self.settings.overflow_policy is OverflowPolicy.FAIL_RESPONSE and target is not None:
            self._fail_response(target, DropReason.FAILED_RESPONSE, now)
            if event.response_id == target:
                self.telemetry.count_drop(DropReason.FAILED_RESPONSE, event.size)
                return
            retry = self.buffer.offer(event, now)
            if retry.accepted:
                if event.kind is EventKind.RESPONSE_DONE and event.response_id is not None:
                    self.ledger.on_done_received(event.response_id)
                return
            target = None  # still full with nothing left to fail: close the session
        self.close_for_overflow(now, target=target, dropped=event)

    def control_overflow(self, now: float) -> None:
        """The client keeps sending control frames (pings) whose answers it does
        not read: their answers count against the event budget, so this is an
        overflow like any other (the ``close_session`` sequence, 1008)."""
        if self.state is not SessionState.OPEN:
            return
        self.telemetry.overflows += 1
        self.telemetry.news = True
        self.close_for_overflow(now, target=self.ledger.active_response())

    def close_for_overflow(
        self,
        now: float,
        *,
        target: str | None = None,
        dropped: UpstreamEvent | None = None,
    ) -> None:
        """The ``close_session`` sequence; also used to shed this session
        when the process-wide pending total is exceeded.
        """
        if self.state is not SessionState.OPEN:
            return
        if dropped is None:
            # Shedding for the process-wide cap: the registry counts it under
            # policy="process_total", so it is not a session overflow here.
            target = self.ledger.active_response()
        if dropped is not None:
            self.telemetry.count_drop(DropReason.OVERFLOW, dropped.size)
        if target is not None:
            self._fail_response(target, DropReason.OVERFLOW, now)
        else:
            self._queue_backpressure_error(now)
        self._overflowed = True
        self._request_upstream_close("output_backpressure")
        self._close(
            notices.session_closed(self._new_id(), self.session_id, "output_backpressure"),
            CLOSE_POLICY_VIOLATION,
            Outcome.OVERFLOW,
            now,
        )

    # -- lifecycle ---------------------------------------------------------------------------------

    def upstream_lost(self, now: float, *, clean: bool = False) -> None:
        """The engine socket ended without ``session.closed``.

        Args:
            clean: the engine closed normally (1000) rather than vanishing; the
                client then gets ``session.closed`` {reason upstream_closed} and 1000.
        """
        if self.state is not SessionState.OPEN:
            return
        if clean:
            notice = notices.session_closed(self._new_id(), self.session_id, "upstream_closed")
            self._close(notice, CLOSE_NORMAL, self._closed_outcome(), now)
            return
        error = notices.error_event(
            self._new_id(), "engine_unavailable", "the engine connection was lost"
        )
        self.buffer.offer(error, now)
        notice = notices.session_closed(self._new_id(), self.session_id, "engine_unavailable")
        self._close(notice, CLOSE_ABNORMAL_ENGINE, Outcome.ENGINE_UNAVAILABLE, now)

    def shutdown(self, now: float) -> None:
        """The proxy is shutting down: close with ``session.closed`` {shutdown} and 1001."""
        self.end(now, reason="shutdown", code=CLOSE_GOING_AWAY, outcome=Outcome.SHUTDOWN)

    def end(
        self,
        now: float,
        *,
        reason: str,
        code: int,
        outcome: Outcome,
        error_code: str | None = None,
        error_message: str = "",
    ) -> None:
        """End the session on the proxy's initiative (shutdown, a limit).

        Queues an optional ``error``, then ``session.closed`` {reason}; asks the
        engine to close; the client is closed with ``code`` after delivery.
        """
        if self.state is not SessionState.OPEN:
            return
        if error_code is not None:
            error = notices.error_event(self._new_id(), error_code, error_message)
            self.buffer.offer(error, now)
        self._request_upstream_close(reason)
        notice = notices.session_closed(self._new_id(), self.session_id, reason)
        self._close(notice, code, outcome, now)

    def client_gone(self) -> None:
        """The client socket is closed: nothing more can be delivered."""
        if self.outcome is None:
            self.outcome = Outcome.CLIENT_CLOSED
        if self.state is not SessionState.CLOSED:
            stranded = self.buffer.statistics()
            self.telemetry.count_drop(
                DropReason.SESSION_CLOSED, stranded.pending_bytes, events=stranded.pending_events
            )
        self.state = next_state(self.state, SessionEvent.CLIENT_GONE)
        self._request_upstream_close("client_close")

    def _request_upstream_close(self, reason: str) -> None:
        if not self.upstream_close_sent:
            self.upstream_close_sent = True
            self._to_upstream.append(notices.session_close(reason))

    def _close(self, notice: UpstreamEvent, code: int, outcome: Outcome, now: float) -> None:
        compact = notices.compact_session_closed(self._new_id(), self.session_id)
        if self.buffer.close(notice, compact=compact, now=now):
            self.state = next_state(self.state, SessionEvent.CLOSURE_QUEUED)
            self.close_code = code
            self.outcome = outcome

    def end_for_quota(self, now: float, message: str) -> None:
        """The key's day audio quota ran out (docs/design.md, Quotas).

        Queues ``error`` {rate_limit_error, quota_exceeded}, then
        ``session.closed`` {quota_exceeded}; the client is closed with 1008,
        as for the other limits a client runs into.
        """
        self.end(
            now,
            reason="quota_exceeded",
            code=CLOSE_POLICY_VIOLATION,
            outcome=Outcome.RATE_LIMITED,
            error_code="quota_exceeded",
            error_message=message,
        )

    def _closed_outcome(self) -> Outcome:
        return Outcome.CLIENT_CLOSED if self.client_close_requested else Outcome.UPSTREAM_CLOSED

    # -- outputs for the shell -------------------------------------------------------------------

    @property
    def has_upstream_commands(self) -> bool:
        return bool(self._to_upstream)

    def events_to_upstream(self) -> list[str]:
        """Frames the proxy itself must send to the engine (cancel, close)."""
        out, self._to_upstream = self._to_upstream, []
        return out
