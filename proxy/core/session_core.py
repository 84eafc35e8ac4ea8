"""SessionCore: the per-session policy, free of I/O.

The aiohttp relay feeds it frames (``receive_client``, ``receive_upstream``)
and lifecycle facts (``upstream_lost``, ``shutdown``, ``client_gone``), takes
events to write (``next_delivery``/``delivered``) and frames to send upstream
(``events_to_upstream``), and closes the client with ``close_code`` once the
closure notice was delivered. Everything that decides forward / drop / fail /
close lives here and in the modules it is built from, so every interleaving
can be tested without sockets:

* proxy/core/lifecycle.py: ``SessionLifecycle``, the base class: the states
  (OPEN → CLOSING → CLOSED, a transition table), the closing sequences and
  the overflow policy;
* proxy/core/client_limits.py: the client frame rate and input audio rate;
* proxy/core/telemetry.py: what the observer exports (drops, overflows,
  cancels, timings), as ``core.telemetry``;
* this module: the intake of both peers, cancellation and delivery.

The names the shell imports from here (states, outcomes, close codes, drop
reasons, settings) are re-exported from those modules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, NamedTuple

from proxy.core import notices
from proxy.core.buffer import BufferStatistics, Entry, Offer
from proxy.core.capabilities import EngineCapabilities, EngineVersion
from proxy.core.client_limits import ClientLimits
from proxy.core.events import (
    ClientEvent,
    ClientKind,
    EventKind,
    UpstreamEvent,
    classify_client,
    classify_upstream,
)
from proxy.core.ledger import LedgerStatistics, Verdict
from proxy.core.lifecycle import (
    CLOSE_ABNORMAL_ENGINE,
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    InvalidState,
    Outcome,
    SessionEvent,
    SessionLifecycle,
    SessionState,
    next_state,
)
from proxy.core.playback import PlaybackLedger
from proxy.core.session_settings import OverflowPolicy, SessionSettings
from proxy.core.telemetry import DropReason
from proxy.core.usage import UsageMeter

__all__ = [
    "CLOSE_ABNORMAL_ENGINE",
    "CLOSE_GOING_AWAY",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "ENGINE_FULL_CODE",
    "ClientDecision",
    "DropReason",
    "InvalidState",
    "Outcome",
    "OverflowPolicy",
    "SessionCore",
    "SessionSettings",
    "SessionState",
    "SessionStatistics",
    "is_engine_full",
]


#: A response request still unanswered after this long no longer counts as in flight.
_CREATE_IN_FLIGHT: Final = 10.0

#: Error codes with which the engine refuses to start a response (docs/engine-protocol.md, Terminal
#: events and errors).
_CREATE_REFUSALS: Final = frozenset(
    {"response_create_without_input", "response_already_active", "input_audio_buffer_empty"}
)


def _commit_creates_response(event: ClientEvent) -> bool:
    """An ``input_audio_buffer.commit`` that also asks for a response."""
    if event.type not in ("input_audio_buffer.commit", "input.commit") or event.body is None:
        return False
    return bool(event.body.get("response_create") or event.body.get("create_response"))


#: Response creations remembered for first-audio timing (oldest dropped).
_MAX_PENDING_CREATES: Final = 64

#: Client playback acknowledgements (vLLM-Omni's name and its alias).
_PLAYBACK_ACKS: Final = frozenset({"playback.ack", "audio.playback_ack"})

#: The engine's error when it has no room for one more session (0.31+; the
#: message says which limit: duplex_session_capacity_exhausted, or
#: replica_capacity_exhausted with replica placement).
ENGINE_FULL_CODE: Final = "resource_exhausted"
#: The engine's own output bound (0.31+): seen, it tells the version.
_ENGINE_BACKPRESSURE_CODE: Final = "output_backpressure"


def _error_code(event: UpstreamEvent) -> object:
    error = (event.body or {}).get("error")
    return error.get("code") if isinstance(error, dict) else None


def is_engine_full(event: UpstreamEvent) -> bool:
    """An engine ``error`` {resource_exhausted}: it has no room for another session."""
    return event.kind is EventKind.ERROR and _error_code(event) == ENGINE_FULL_CODE


class ClientDecision(NamedTuple):
    """What to do with a client frame: forward its original text or not.

    A named tuple: built per client frame, and cheaper than a frozen dataclass.
    """

    event: ClientEvent
    forward: bool


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    state: SessionState
    session_id: str | None
    buffer: BufferStatistics
    ledger: LedgerStatistics
    drops: dict[DropReason, tuple[int, int]]
    overflows: int
    cancels: int
    active_response: str | None
    open_responses: tuple[str, ...]


class SessionCore(SessionLifecycle):
    """Per-session policy. Sync, I/O-free; ``now`` is a float of seconds.

    Args:
        settings: limits and policy.
        new_event_id: returns a fresh ``event_id`` for events the proxy writes.
        capabilities: what this session's engine does (proxy.core.capabilities).
    """

    def __init__(
        self,
        settings: SessionSettings,
        *,
        new_event_id: Callable[[], str],
        capabilities: EngineCapabilities | None = None,
    ) -> None:
        super().__init__(settings, new_event_id)
        # The telemetry's open cancel-to-silence windows, held here too: read
        # per delivered audio event, so one attribute away.
        self._silence = self.telemetry.silence_windows
        # Responses the client asked for (response.create, or a commit with
        # response_create) whose response.created has not arrived yet:
        # (time asked, client event_id). A cancel without a response id also
        # covers these: they are "born cancelled" when their response.created
        # arrives, so a cancel racing a create leaks no audio.
        self._pending_creates: deque[tuple[float, str | None]] = deque(maxlen=_MAX_PENDING_CREATES)
        self._born_cancelled = 0
        # first_audio: when each created response was asked for.
        self._create_time: dict[str, float] = {}
        #: Frame rate and input audio rate (proxy/core/client_limits.py).
        self.limits = ClientLimits(settings)
        self.playback = PlaybackLedger(settings.playback, capabilities)
        #: What this session used (proxy/core/usage.py), for its usage record.
        self.usage = UsageMeter()
        #: The engine refused to open this session: it is full (``error``
        #: {resource_exhausted} before ``session.created``). Passed through to
        #: the client; the shell keeps new sessions off that engine a while.
        self.engine_full = False
        #: An engine frame larger than this can never be queued (the whole budget).
        self._max_frame_bytes = settings.buffer.max_pending_output_bytes
        #: While pacing holds the next audio delta back: when it may go.
        self.paced_until: float | None = None

    # -- client frame rate --------------------------------------------------------------

    def admit_client_frame(self, size: int, now: float) -> bool:
        """Count one client data frame against ``max_client_frame_rate``.

        Returns:
            False when the frame must be dropped (not read further, not
            forwarded). The first frame of a rate-limit episode queues one
            ``error`` {rate_limit_error, client_rate_limited}; an episode that
            lasts ``client_rate_limit_close_after`` seconds ends the session
            (``session.closed`` {client_rate_limited}, close 1008).
        """
        limits = self.limits
        if limits.frame_bucket.take(1.0, now):
            return True
        self.telemetry.count_drop(DropReason.CLIENT_RATE_LIMITED, size)
        if self.state is not SessionState.OPEN:
            return False
        if limits.episode_begins(now):
            error = notices.error_event(
                self._new_id(), "client_rate_limited", limits.frame_rate_message()
            )
            self.buffer.offer(error, now)
        if limits.episode_too_long(now):
            self.end(
                now,
                reason="client_rate_limited",
                code=CLOSE_POLICY_VIOLATION,
                outcome=Outcome.RATE_LIMITED,
            )
        return False

    # -- client → upstream ---------------------------------------------------------------

    def receive_client(self, text: str, now: float) -> ClientDecision:
        """Classify a client frame and act on cancel triggers at once.

        Returns:
            whether to forward the original text upstream. Invalid frames are
            answered with an ``error`` to this client and not forwarded.
        """
        event = classify_client(text)
        if not event.is_valid:
            self.reject_client_frame(
                event.kind.value, event.detail, now, client_event_id=None, size=event.size
            )
            return ClientDecision(event, forward=False)
        if self.state is not SessionState.OPEN:
            if event.cancels and self.state is SessionState.CLOSING:
                # Queued output is still being delivered: a cancel must still
                # silence it at once (docs/design.md, Cancellation), even though nothing more
                # goes upstream.
                self._cancel_from_client(event, now)
            return ClientDecision(event, forward=False)
        if event.cancels:
            self._cancel_from_client(event, now)
        elif event.kind is ClientKind.AUDIO_APPEND:
            limits = self.limits
            seconds = event.audio_chars * 0.75 / limits.input_bytes_per_second
            if not limits.input_bucket.take(seconds, now):
                self.reject_client_frame(
                    "input_backpressure",
                    limits.input_rate_message(),
                    now,
                    client_event_id=event.event_id,
                    size=event.size,
                    reason=DropReason.INPUT_BACKPRESSURE,
                )
                return ClientDecision(event, forward=False)
            self.usage.input_seconds += seconds
        elif event.kind is ClientKind.SESSION_UPDATE:
            self.limits.note_input_format(event.body)
        elif event.kind is ClientKind.RESPONSE_CREATE or (
            event.kind is ClientKind.OTHER and _commit_creates_response(event)
        ):
            self._pending_creates.append((now, event.event_id))
        elif event.kind is ClientKind.SESSION_CLOSE:
            self.client_close_requested = True
            self.upstream_close_sent = True
        elif event.type in _PLAYBACK_ACKS:
            if not self.playback.on_client_ack(event.event_id, now):
                return ClientDecision(event, forward=False)  # playback_ack = always
        elif event.type == "conversation.item.truncate":
            item_id = (event.body or {}).get("item_id")
            self.playback.on_client_truncate(
                item_id if isinstance(item_id, str) else None, event.event_id, now
            )
        return ClientDecision(event, forward=True)

    def reject_client_frame(
        self,
        code: str,
        message: str,
        now: float,
        *,
        client_event_id: str | None = None,
        size: int = 0,
        reason: DropReason = DropReason.INVALID_CLIENT_FRAME,
    ) -> None:
        """Answer a bad client frame with an ``error`` to this client only."""
        self.telemetry.count_drop(reason, size)
        if self.state is SessionState.OPEN:
            error = notices.error_event(
                self._new_id(), code, message, client_event_id=client_event_id
            )
            self.buffer.offer(error, now)

    def _cancel_from_client(self, event: ClientEvent, now: float) -> None:
        named = event.response_id
        if named is not None and event.kind in (
            ClientKind.RESPONSE_CANCEL,
            ClientKind.OUTPUT_AUDIO_BUFFER_CLEAR,
        ):
            self._cancel(named, now)
        else:
            self._cancel_all_open(now)
            # ...and the responses requested, not refused, and not created yet.
            # A request older than _CREATE_IN_FLIGHT was answered some way we
            # did not recognise; it must not cancel a later response.
            self._born_cancelled = sum(
                1 for asked, _ in self._pending_creates if now - asked < _CREATE_IN_FLIGHT
            )

    # -- upstream → client -----------------------------------------------------------------

    def receive_upstream(self, text: str, now: float) -> UpstreamEvent:
        """Take an engine frame: filter, queue, or apply the overflow policy.

        Never blocks and never raises. Returns the classified event so the
        shell can see, e.g., the engine's ``session.closed``.
        """
        event = classify_upstream(text)
        kind = event.kind
        if kind is EventKind.MALFORMED:
            self.telemetry.count_drop(DropReason.INVALID_UPSTREAM_FRAME, event.size)
            return event
        # Usage counts what the engine produced, before any filter drops it.
        usage = self.usage
        if kind is EventKind.AUDIO_DELTA:
            usage.out_chars += event.audio_chars
            if not usage.seconds_per_char:
                usage.seconds_per_char = self.playback.seconds_of(event, chars=1)
        elif kind is EventKind.RESPONSE_CREATED:
            usage.responses_started += 1
        elif kind is EventKind.RESPONSE_DONE:
            usage.on_response_done(event.status, event.body)
        if self.state is not SessionState.OPEN:
            reason = DropReason.OVERFLOW if self._overflowed else DropReason.SESSION_CLOSED
            self.telemetry.count_drop(reason, event.size)
            return event
        rid = event.response_id
        playback = self.playback
        if playback.awaiting_answers and playback.swallow(event, now):
            # It answers the sidecar's own ack: the client never asked for it.
            self.telemetry.count_drop(DropReason.PLAYBACK_ANSWER, event.size)
            return event
        if kind is EventKind.SESSION_CREATED:
            self._note_session_id(event)
            if event.body is not None:
                playback.on_session(event.body)
        elif kind is EventKind.RESPONSE_CREATED and rid is not None:
            self.ledger.on_created(rid)
            if self._pending_creates:
                self._create_time[rid] = self._pending_creates.popleft()[0]
            if self._born_cancelled > 0:
                self._born_cancelled -= 1
                self._cancel(rid, now)
        elif kind is EventKind.ERROR:
            self._forget_rejected_create(event)
            self._note_engine_error(event)
        elif kind is EventKind.RESPONSE_DONE:
            if rid is not None and event.status in ("cancelled", "failed"):
                self._cancel(rid, now)
        elif kind is EventKind.OUTPUT_AUDIO_CLEARED:
            if rid is not None:
                self._cancel(rid, now)
            else:
                self._cancel_all_open(now)
        elif kind is EventKind.OVERLAP_DECISION:
            if event.action == "barge_in":
                self._cancel_all_open(now)
        elif kind is EventKind.SPEECH_STARTED:
            if self.settings.interrupt_on_speech_started:
                self._cancel_all_open(now)
        elif kind is EventKind.SESSION_CLOSED:
            self._close(event, CLOSE_NORMAL, self._closed_outcome(), now)
            return event
        elif kind is EventKind.OTHER and event.type == "session.updated" and event.body:
            playback.on_session(event.body)

        if rid is None and event.body is not None:
            rid = self._response_of_item(event.body)
        verdict = self.ledger.verdict(rid, is_audio=event.is_audio, now=now)
        if verdict is Verdict.CANCELLED:
            self.telemetry.count_drop(DropReason.LATE_AUDIO, event.size)
            return event
        if verdict is Verdict.FAILED:
            self.telemetry.count_drop(DropReason.FAILED_RESPONSE, event.size)
            return event
        if verdict is Verdict.EVICTED:
            self.telemetry.news = True  # late_audio_after_eviction changed

        if event.size > self._max_frame_bytes:
            self._refuse_oversized(event, now)
            return event
        offer = self.buffer.offer(event, now)
        if offer.accepted:
            if kind is EventKind.RESPONSE_DONE and rid is not None:
                self.ledger.on_done_received(rid)
        elif offer is Offer.REJECTED_FULL:
            self._overflow(event, now)
        return event

    def _response_of_item(self, body: dict[str, object]) -> str | None:
        """The response an assistant item event belongs to (``item_<response_id>``).

        The real engine's ``conversation.item.*`` events carry no response_id;
        without this, events of a failed response would still reach the client.
        """
        item = body.get("item")
        item_id = item.get("id") if isinstance(item, dict) else body.get("item_id")
        if isinstance(item_id, str) and item_id.startswith("item_"):
            candidate = item_id[5:]
            if self.ledger.is_open(candidate) or self.ledger.cancelled_at(candidate) is not None:
                return candidate
        return None

    def _note_engine_error(self, event: UpstreamEvent) -> None:
        """What an engine error says about the engine (passed through either way)."""
        code = _error_code(event)
        if code == ENGINE_FULL_CODE and self.session_id is None and not self.engine_full:
            self.engine_full = True
            self.telemetry.news = True
        elif code == _ENGINE_BACKPRESSURE_CODE:
            self.playback.learn(EngineVersion.V0_31)
            self.telemetry.news = True

    def _note_session_id(self, event: UpstreamEvent) -> None:
        body = event.body or {}
        session = body.get("session")
        if isinstance(session, dict) and isinstance(session.get("id"), str):
            self.session_id = session["id"]

    # -- cancellation ---------------------------------------------------------------------------

    def _cancel(self, response_id: str, now: float) -> None:
        told = self.playback.on_cancel(response_id, now)
        if told:
            # What the user heard goes to the engine before anything else we send.
            self._to_upstream.extend(told)
            self.telemetry.news = True
        if self.ledger.cancel(response_id, now):
            self.telemetry.response_cancelled(response_id, now)
        removed, removed_bytes = self.buffer.invalidate(response_id)
        self.telemetry.count_drop(DropReason.CANCELLED_AUDIO, removed_bytes, events=removed)

    def _cancel_all_open(self, now: float) -> None:
        for response_id in self.ledger.open_responses():
            self._cancel(response_id, now)

    def _forget_rejected_create(self, event: UpstreamEvent) -> None:
        """An ``error`` answering a response request: that response never comes.

        Matched by the echoed ``error.event_id`` when the client set one,
        else by the codes the engine uses to refuse a response.
        """
        error = (event.body or {}).get("error")
        if not isinstance(error, dict) or not self._pending_creates:
            return
        echoed = error.get("event_id")
        pending = self._pending_creates
        index = None
        if isinstance(echoed, str):
            index = next((i for i, (_, eid) in enumerate(pending) if eid == echoed), None)
        elif error.get("code") in _CREATE_REFUSALS:
            index = 0
        if index is None:
            return
        del pending[index]
        self._born_cancelled = min(self._born_cancelled, len(pending))

    # -- delivery ------------------------------------------------------------------------------------

    def next_delivery(self, now: float) -> Entry | None:
        """Take the next event to write, re-checking it at the last moment.

        Returns:
            the entry to write now, or None when nothing is ready. The caller
            writes it without awaiting in between, then calls ``delivered``.
        """
        buffer = self.buffer
        playback = self.playback
        # A closing session delivers what is left at once (its close deadline runs).
        pacing = playback.settings.pacing and self.state is SessionState.OPEN
        self.paced_until = None
        while True:
            if pacing:
                head = buffer.peek()
                if head is not None and head.event.is_audio and not head.closure:
                    when = playback.release_at(head.event, now, buffer.pending_bytes)
                    if when is not None:
                        self.paced_until = when
                        return None
            entry = buffer.get_nowait()
            if entry is None:
                return None
            event = entry.event
            # cancelled_at, not verdict(): the intake already judged this event,
            # and verdict() counts late audio (it would be counted twice).
            if event.is_audio and (
                not buffer.held_is_valid
                or (
                    event.response_id is not None
                    and self.ledger.cancelled_at(event.response_id) is not None
                )
            ):
                self.telemetry.count_drop(DropReason.CANCELLED_AUDIO, event.size)
                buffer.release_held()
                continue
            if event.is_audio:
                playback.released(event, now)
            return entry

    def ready(self) -> bool:
        """Something can be written now (output queued and not held by pacing)."""
        return self.paced_until is None and self.buffer.has_output()

    def ride_along_acks(self, now: float) -> None:
        """Queue the playback acks due now, to go with a frame sent to the engine anyway."""
        if self.state is SessionState.OPEN:
            self._to_upstream.extend(self.playback.acks_due(now))

    def playback_tick(self, now: float) -> float | None:
        """Queue the playback acks due now; return when to call again (None: idle)."""
        if self.state is not SessionState.OPEN:
            return None
        playback = self.playback
        self._to_upstream.extend(playback.acks_due(now))
        when = playback.next_ack_at(now)
        if when is not None and when <= now:
            when = now + playback.settings.ack_interval  # nothing new was heard yet
        return when

    def delivered(self, entry: Entry, now: float, *, release: bool = True) -> None:
        """The entry was written to the client.

        Args:
            release: release the buffer's held event (False when the shell
                released it already, e.g. for a batch of writes).
        """
        if release:
            self.buffer.release_held()
        event = entry.event
        rid = event.response_id
        if entry.closure:
            self.state = next_state(self.state, SessionEvent.CLOSURE_DELIVERED)
            return
        if event.is_audio:
            self.usage.delivered_chars += event.audio_chars
        if rid is None:
            return
        if event.is_audio:
            window = self._silence.get(rid)
            if window is not None:
                window.last_audio_at = now
            created = self._create_time.pop(rid, None)
            if created is not None:
                self.telemetry.first_audio(max(0.0, now - created))
        elif event.kind is EventKind.RESPONSE_DONE:
            self.playback.done_delivered(rid)
            self.ledger.on_done_delivered(rid, now)
            # Time has moved on: tombstones whose TTL passed go now, not only
            # when an event of their response happens to arrive.
            self.ledger.expire(now)
            self._create_time.pop(rid, None)
            self.telemetry.observe_silence(rid)

    def still_valid(self, entry: Entry) -> bool:
        """Re-check an entry taken earlier, just before it is written."""
        event = entry.event
        rid = event.response_id
        return not (
            event.is_audio and rid is not None and self.ledger.cancelled_at(rid) is not None
        )

    def drop_taken(self, entry: Entry, reason: DropReason) -> None:
        """An entry taken for writing will not be written after all."""
        self.telemetry.count_drop(reason, entry.event.size)

    # -- outputs for the shell -------------------------------------------------------------------------

    def finish(self) -> None:
        """Session over: observe what is still open (no more audio can follow)."""
        self.telemetry.finish()

    def statistics(self) -> SessionStatistics:
        telemetry = self.telemetry
        return SessionStatistics(
            state=self.state,
            session_id=self.session_id,
            buffer=self.buffer.statistics(),
            ledger=self.ledger.statistics(),
            drops=telemetry.drop_totals(),
            overflows=telemetry.overflows,
            cancels=telemetry.cancels,
            active_response=self.ledger.active_response(),
            open_responses=tuple(self.ledger.open_responses()),
        )

    def drop_totals(self) -> dict[DropReason, tuple[int, int]]:
        """Drops by reason over the session's life, as (events, bytes)."""
        return self.telemetry.drop_totals()
