"""How a session ends: its states, the transition table and the closing sequences.

Every change of ``state`` goes through :func:`next_state` (``SESSION_TRANSITIONS``; a
missing pair raises :class:`InvalidState`); the table and its events are in
docs/design.md, Session core. :class:`SessionLifecycle` is the base of
``SessionCore``: the proxy's own ends (``end`` with an :class:`EndReason`,
``ENDINGS`` says how each closes), engine loss, the client going away, and
the overflow policy's sequences (docs/design.md, Overflow policy).
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
    "CLOSE_SERVICE_RESTART",
    "ENDINGS",
    "SESSION_TRANSITIONS",
    "EndReason",
    "Fact",
    "InvalidState",
    "Outcome",
    "SessionEvent",
    "SessionLifecycle",
    "SessionPhase",
    "SessionState",
    "next_state",
]

CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001
CLOSE_POLICY_VIOLATION: Final = 1008
CLOSE_ABNORMAL_ENGINE: Final = 1011
#: "Service restart" (RFC 6455 §7.4.1, IANA registry): the session was handed over,
#: the client reconnects and resumes it on another sidecar (docs/design.md, Resume).
CLOSE_SERVICE_RESTART: Final = 1012


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


SESSION_TRANSITIONS: Final[dict[SessionState, dict[SessionEvent, SessionState]]] = {
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
        InvalidState: the pair is not in ``SESSION_TRANSITIONS``.
    """
    try:
        return SESSION_TRANSITIONS[state][event]
    except KeyError:
        raise InvalidState(state, event) from None


class SessionPhase(enum.Enum):
    """Where a session stands, as its shell acts on it (``SessionCore.phase``).

    ``state`` with what the shell needs besides: whether the session waits for
    a resume, or was handed over (then it ends for this sidecar without
    ``session.closed``, whatever ``state`` says).
    """

    OPEN = "open"  # relaying
    HELD = "held"  # open, its client dropped: waiting for a resume
    CLOSING = "closing"  # the closure notice is queued: delivering the last events
    CLOSED = "closed"
    HANDED_OVER = "handed_over"  # left to the engine to resume elsewhere: close 1012


class Fact(enum.Enum):
    """What the shell saw happen, besides frames: the one lifecycle input
    (``SessionCore.receive``, with an :class:`EndReason` for the proxy's own ends).

    ``amount`` is a size in bytes or a count where the member says so.
    """

    TIMER = "timer"  # the drain's deadline passed
    CLIENT_PING = "client_ping"  # amount: pings the client has not read the answer of
    CLIENT_CLOSED = "client_closed"  # its connection ended with a close frame (or at shutdown)
    CLIENT_DROPPED = "client_dropped"  # ...without one: held for a resume where it may be
    RESUME_ABANDONED = "resume_abandoned"  # nobody resumes it now: a held session ends
    CLIENT_GONE = "client_gone"  # the shell is done with the client: the session is over
    UPSTREAM_BINARY = "upstream_binary"  # amount: bytes of an engine binary frame (dropped)
    UPSTREAM_CLOSED = "upstream_closed"  # the engine link closed normally, no session.closed
    ENGINE_LOST = "engine_lost"  # the engine link or the engine itself is gone
    SHED = "shed"  # the process-wide output cap is passed and this session is the largest
    FAILED = "failed"  # the shell's session task failed
    FINISHED = "finished"  # the session's task is over: settle what is still open


class EndReason(enum.Enum):
    """Why the proxy ends a session on its own initiative; the value is ``session.closed``'s reason."""

    SHUTDOWN = "shutdown"
    CLIENT_IDLE = "client_idle_timeout"
    MAX_DURATION = "max_session_duration"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    QUOTA_EXCEEDED = "quota_exceeded"
    INPUT_BACKPRESSURE = "input_backpressure"
    CLIENT_RATE_LIMITED = "client_rate_limited"


class Outcome(enum.Enum):
    """Label values of ``sessions_total{outcome}``."""

    CLIENT_CLOSED = "client_closed"
    UPSTREAM_CLOSED = "upstream_closed"
    OVERFLOW = "overflow"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    SHUTDOWN = "shutdown"
    ERROR = "error"
    RATE_LIMITED = "rate_limited"
    #: The sidecar drained: the session left the engine without ``session.close``
    #: and its client was told to resume elsewhere (close 1012).
    HANDED_OVER = "handed_over"


#: How each of the proxy's own endings closes the client: (close code, outcome,
#: whether an ``error`` {reason} precedes ``session.closed``).
ENDINGS: Final[dict[EndReason, tuple[int, Outcome, bool]]] = {
    EndReason.SHUTDOWN: (CLOSE_GOING_AWAY, Outcome.SHUTDOWN, False),
    EndReason.CLIENT_IDLE: (CLOSE_NORMAL, Outcome.CLIENT_CLOSED, False),
    EndReason.MAX_DURATION: (CLOSE_NORMAL, Outcome.CLIENT_CLOSED, False),
    EndReason.UPSTREAM_TIMEOUT: (CLOSE_NORMAL, Outcome.CLIENT_CLOSED, False),
    EndReason.QUOTA_EXCEEDED: (CLOSE_POLICY_VIOLATION, Outcome.RATE_LIMITED, True),
    EndReason.INPUT_BACKPRESSURE: (CLOSE_POLICY_VIOLATION, Outcome.OVERFLOW, True),
    EndReason.CLIENT_RATE_LIMITED: (CLOSE_POLICY_VIOLATION, Outcome.RATE_LIMITED, False),
}


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
        #: Handed over at a drain: nothing more goes to this client, no ``session.close``
        #: upstream (docs/design.md, Start-up and shutdown).
        self.handing_over = False

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
            self.telemetry.response_failed(response_id)
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
        self._close_for_overflow(now, target=target, dropped=event)

    def _control_overflow(self, now: float) -> None:
        """The client keeps sending control frames (pings) whose answers it does
        not read: their answers count against the event budget, so this is an
        overflow like any other (the ``close_session`` sequence, 1008)."""
        if self.state is not SessionState.OPEN:
            return
        self.telemetry.overflows += 1
        self.telemetry.news = True
        self._close_for_overflow(now, target=self.ledger.active_response())

    def _shed(self, now: float) -> None:
        """The process-wide pending cap is exceeded and this is the largest session."""
        self._close_for_overflow(now)

    def _failed(self) -> None:
        """The shell's session task failed: the session's outcome is ``error``."""
        if self.outcome is None:
            self.outcome = Outcome.ERROR

    def _close_for_overflow(
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

    def _upstream_lost(self, now: float, *, clean: bool = False) -> None:
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

    def _end(self, now: float, reason: EndReason, message: str = "") -> None:
        """End the session on the proxy's initiative (``ENDINGS`` says how).

        Queues an ``error`` {reason} with ``message`` where the ending has one,
        then ``session.closed`` {reason}; asks the engine to close; the client
        is closed with the ending's code after delivery.
        """
        if self.state is not SessionState.OPEN:
            return
        code, outcome, with_error = ENDINGS[reason]
        if with_error:
            error = notices.error_event(self._new_id(), reason.value, message)
            self.buffer.offer(error, now)
        self._request_upstream_close(reason.value)
        notice = notices.session_closed(self._new_id(), self.session_id, reason.value)
        self._close(notice, code, outcome, now)

    def _client_gone(self) -> None:
        """The client socket is closed: nothing more can be delivered."""
        if self.outcome is None:
            self.outcome = Outcome.CLIENT_CLOSED
        if self.state is not SessionState.CLOSED and not self.handing_over:
            # Handed over: what is queued is replayed by the engine to the next sidecar.
            stranded = self.buffer.statistics()
            self.telemetry.count_drop(
                DropReason.SESSION_CLOSED, stranded.pending_bytes, events=stranded.pending_events
            )
        self.state = next_state(self.state, SessionEvent.CLIENT_GONE)
        self._request_upstream_close("client_close")

    def _close_frame(self) -> tuple[int, bytes]:
        """The client's close frame: the session's code (1000 when none was set)
        and its outcome as the reason."""
        code = CLOSE_NORMAL if self.close_code is None else self.close_code
        return code, b"" if self.outcome is None else self.outcome.value.encode()

    def _request_upstream_close(self, reason: str) -> None:
        if not self.upstream_close_sent:
            self.upstream_close_sent = True
            self._to_upstream.append(notices.session_close(reason))

    def _close(self, notice: UpstreamEvent, code: int, outcome: Outcome, now: float) -> None:
        if self.handing_over:
            return  # the session lives on elsewhere: this client only gets its 1012
        compact = notices.compact_session_closed(self._new_id(), self.session_id)
        if self.buffer.close(notice, compact=compact, now=now):
            self.state = next_state(self.state, SessionEvent.CLOSURE_QUEUED)
            self.close_code = code
            self.outcome = outcome

    def _closed_outcome(self) -> Outcome:
        return Outcome.CLIENT_CLOSED if self.client_close_requested else Outcome.UPSTREAM_CLOSED
