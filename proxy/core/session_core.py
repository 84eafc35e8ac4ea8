"""SessionCore: one session's policy, sans-I/O (docs/design.md, Session core).

Inputs are frames and facts with ``now``: ``receive_client``,
``receive_client_binary``, ``receive_upstream``, every lifecycle fact through
``receive`` (a ``Fact``, or an ``EndReason`` for the proxy's own ends), a
resume's ``attach``, and the sidecar's ``request_hand_over`` and
``trim_journal``. Output is one ``drain(now, room)``: what to write to the
client, what to send upstream, the next deadline, how the client closes, and a
report for the observer; ``phase`` and ``output_waiting`` say where the
session stands. Reporters read ``SessionView`` (proxy/core/view.py), never this
type: only the relay calls it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final, NamedTuple

from proxy.core import notices
from proxy.core.buffer import Offer
from proxy.core.capabilities import EngineCapabilities, WireSign
from proxy.core.client_limits import ClientLimits
from proxy.core.events import (
    ENGINE_FULL_CODE,
    ClientEvent,
    ClientKind,
    EventKind,
    UpstreamEvent,
    classify_client,
    classify_upstream,
    error_code,
)
from proxy.core.input_audio import InputAudioRefused
from proxy.core.ledger import CancellationLedger, Verdict
from proxy.core.lifecycle import (
    CLOSE_ABNORMAL_ENGINE,
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    EndReason,
    Fact,
    InvalidState,
    Outcome,
    SessionPhase,
    SessionState,
)
from proxy.core.playback import PlaybackLedger
from proxy.core.response_requests import commit_creates_response
from proxy.core.resume_state import HandOver
from proxy.core.session_output import ACK_RIDE_WAIT, SessionOutput
from proxy.core.session_settings import OverflowPolicy, SessionSettings
from proxy.core.telemetry import DropReason
from proxy.core.view import SessionStatistics

__all__ = [
    "ACK_RIDE_WAIT",
    "CLOSE_ABNORMAL_ENGINE",
    "CLOSE_GOING_AWAY",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "ENGINE_FULL_CODE",
    "ClientDecision",
    "ClientVerdict",
    "DropReason",
    "EndReason",
    "Fact",
    "HandOver",
    "InvalidState",
    "Outcome",
    "OverflowPolicy",
    "SessionCore",
    "SessionPhase",
    "SessionSettings",
    "SessionState",
    "SessionStatistics",
    "check_session_settings",
]


#: Client playback acknowledgements (vLLM-Omni's name and its alias).
_PLAYBACK_ACKS: Final = frozenset({"playback.ack", "audio.playback_ack"})

#: The engine's own output bound (0.31+): seen, it tells the version.
_ENGINE_BACKPRESSURE_CODE: Final = "output_backpressure"


def check_session_settings(settings: SessionSettings) -> None:
    """Build, and throw away, the parts a session builds from ``settings``.

    Raises:
        ValueError: a value a part refuses; the message starts with the
            field's name ("max_tombstones must be >= 1").
    """
    CancellationLedger(max_tombstones=settings.max_tombstones, tombstone_ttl=settings.tombstone_ttl)
    ClientLimits(settings)
    PlaybackLedger(settings.playback)


class ClientVerdict(enum.Enum):
    """What the shell does about a client frame (``ClientDecision.verdict``)."""

    FORWARDED = "forwarded"  # its text goes upstream
    ANSWERED = "answered"  # not forwarded: refused with an error, or kept by the sidecar
    OVER_RATE = "over_rate"  # over the frame rate, not parsed: read the client slower
    CUT_OFF = "cut_off"  # the session ends for flooding: read none of the client's backlog
    CLOSE_ASKED = "close_asked"  # a forwarded session.close: the engine's answer is due


class ClientDecision(NamedTuple):
    """What became of a client frame: its event (None: over the frame rate, not
    parsed or a binary frame), whether its original text goes upstream, and
    what the shell does about it.

    A named tuple: built per client frame, and cheaper than a frozen dataclass.
    """

    event: ClientEvent | None
    forward: bool
    verdict: ClientVerdict


_OVER_RATE: Final = ClientDecision(None, False, ClientVerdict.OVER_RATE)
_CUT_OFF: Final = ClientDecision(None, False, ClientVerdict.CUT_OFF)
_BINARY_ANSWERED: Final = ClientDecision(None, False, ClientVerdict.ANSWERED)


class SessionCore(SessionOutput):
    """Per-session policy. Sync, I/O-free; ``now`` is a float of seconds.

    Args:
        settings: limits and policy.
        new_event_id: returns a fresh ``event_id`` for events the proxy writes.
        capabilities: what this session's engine does (proxy.core.capabilities).
        resuming: the client's ``session.resume`` was sent to the engine already.
        key_id: the id of the API key the session opened with ("" without auth):
            the client's resume tokens are bound to it (proxy/core/resume_token.py).
        client_resumes: the client's URL says it opens with its first message
            (``autostart=0``/``resume=1``, as a client that resumes does): a
            draining sidecar may hand the session over (docs/design.md, Resume).
    """

    def __init__(
        self,
        settings: SessionSettings,
        *,
        new_event_id: Callable[[], str],
        capabilities: EngineCapabilities | None = None,
        resuming: bool = False,
        key_id: str = "",
        client_resumes: bool = False,
    ) -> None:
        super().__init__(settings, new_event_id, capabilities)
        self.resume.key_id = key_id
        #: The client's ``session.resume`` went to the engine before the session was built.
        self.resume.passed_upstream = resuming
        self.client_resumes = client_resumes or resuming
        #: Frame rate and input audio rate (proxy/core/client_limits.py).
        self.limits = ClientLimits(settings)
        #: An engine frame larger than this can never be queued (the whole budget).
        self._max_frame_bytes = settings.buffer.max_pending_output_bytes

    # -- the client's frames -----------------------------------------------------------------

    def receive_client(self, text: str, now: float, *, upstream_backlog: int = 0) -> ClientDecision:
        """One client text frame: rate limit, classify, act on cancel triggers at once.

        Args:
            upstream_backlog: bytes the engine link holds unsent now
                (``max_pending_input_bytes`` counts them).

        Returns:
            the event (None: over the frame rate, not even parsed) and whether
            its original text goes upstream. What goes upstream is in the next
            drain, in order: what the frame makes the proxy tell the engine
            first (a cancel's truncation), then the frame, then acks riding
            along. A refused frame gets an ``error``.
        """
        if not self._admit(len(text), now):
            return _CUT_OFF if self._flooded else _OVER_RATE
        event = classify_client(text)
        if not event.is_valid:
            self._reject(event.kind.value, event.detail, now, size=event.size)
            return ClientDecision(event, False, ClientVerdict.ANSWERED)
        if self.state is not SessionState.OPEN:
            if event.cancels and self.state is SessionState.CLOSING:
                # Queued output is still being delivered: a cancel must still
                # silence it at once (docs/design.md, Cancellation), even though nothing more
                # goes upstream.
                self._cancel_from_client(event, now)
            return ClientDecision(event, False, ClientVerdict.ANSWERED)
        if event.cancels:
            self._cancel_from_client(event, now)
        elif event.kind is ClientKind.AUDIO_APPEND or event.type == "conversation.item.create":
            if not self._take_input_audio(event, now):
                return ClientDecision(event, False, ClientVerdict.ANSWERED)
        elif event.kind is ClientKind.SESSION_UPDATE:
            self.limits.input.on_client_update(event.body)
        elif event.kind is ClientKind.SESSION_RESUME:
            # The edge reads every message the engine would take as a resume before the
            # session starts (docs/design.md, Resume): one that reaches a session is never
            # passed on. Before the engine's session exists it gets the one refusal; later,
            # the engine's own answer to a resume on an open connection (which stays).
            if self.session_id is None:
                self._refuse_resume(now)
            else:
                message = "session.resume must be the first message of a new connection"
                code = "unsupported_session_resume"
                self._reject(code, message, now, client_event_id=event.event_id, size=event.size)
            return ClientDecision(event, False, ClientVerdict.ANSWERED)
        elif event.kind is ClientKind.EVENT_ACK:
            self.resume.ack(event.body)
        elif event.kind is ClientKind.RESPONSE_CREATE or (
            event.kind is ClientKind.OTHER and commit_creates_response(event)
        ):
            self.requests.asked(now, event.event_id)
        elif event.kind is ClientKind.SESSION_CLOSE:
            self.client_close_requested = True
            self.upstream_close_sent = True
        elif event.type in _PLAYBACK_ACKS:
            if not self.playback.on_client_ack(event.event_id, now, event.body):
                return ClientDecision(event, False, ClientVerdict.ANSWERED)  # playback_ack = always
        elif event.type == "conversation.item.truncate":
            item_id = (event.body or {}).get("item_id")
            self.playback.on_client_truncate(
                item_id if isinstance(item_id, str) else None, event.event_id, now
            )
        out = self._to_upstream
        limit = self.settings.max_pending_input_bytes
        if limit and upstream_backlog + sum(map(len, out)) + event.size > limit:
            self._end(
                now,
                EndReason.INPUT_BACKPRESSURE,
                f"the engine is not accepting input; more than {limit} bytes are waiting",
            )
            return ClientDecision(event, False, ClientVerdict.ANSWERED)
        out.append(text)
        self._forwarded_at = now
        if self.playback.acking:
            out.extend(self.playback.acks_due(now))
        if event.kind is ClientKind.SESSION_CLOSE:
            return ClientDecision(event, True, ClientVerdict.CLOSE_ASKED)
        return ClientDecision(event, True, ClientVerdict.FORWARDED)

    def _take_input_audio(self, event: ClientEvent, now: float) -> bool:
        """Charge the frame's input audio as the engine will hear it, within
        ``max_input_audio_rate``; False: refused (an ``error`` is queued)."""
        limits = self.limits
        try:
            if event.kind is ClientKind.AUDIO_APPEND:
                seconds = limits.input.seconds(event.audio_chars, event.body)
            else:
                seconds = limits.input.item_seconds(event.body)
        except InputAudioRefused as refused:
            self._reject(
                refused.code, refused.message, now, client_event_id=event.event_id, size=event.size
            )
            return False
        if not limits.input_bucket.take(seconds, now):
            self._reject(
                "input_backpressure",
                limits.input_rate_message(),
                now,
                client_event_id=event.event_id,
                size=event.size,
                reason=DropReason.INPUT_BACKPRESSURE,
            )
            return False
        self.usage.input_seconds += seconds
        return True

    def receive_client_binary(self, size: int, now: float) -> ClientDecision:
        """A binary client frame: not part of the protocol, answered with an ``error``
        (unless it is over the frame rate: then, as a text frame, not answered)."""
        if not self._admit(size, now):
            return _CUT_OFF if self._flooded else _OVER_RATE
        self._reject(
            "binary_unsupported",
            "binary frames are not supported; send JSON text frames",
            now,
            size=size,
        )
        return _BINARY_ANSWERED

    def _client_ping(self, unanswered_pings: int, now: float) -> bool:
        """A client ping; ``unanswered_pings`` wait behind a client that is not reading.

        Each counts as one event of the output budget: a client that pings
        without reading ends with the overflow sequence (1008).

        Returns:
            True when this ping overflowed the session.
        """
        budget = self.settings.buffer.max_pending_output_events
        if (
            unanswered_pings + self.buffer.pending_events > budget
            and self.state is SessionState.OPEN
        ):
            self._control_overflow(now)
            return True
        return False

    def _admit(self, size: int, now: float) -> bool:
        """Count one client data frame against ``max_client_frame_rate``.

        The first frame over it in an episode queues one ``error``
        {client_rate_limited}; an episode longer than
        ``client_rate_limit_close_after`` ends the session (1008).
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
            self._end(now, EndReason.CLIENT_RATE_LIMITED)
        return False

    @property
    def _flooded(self) -> bool:
        """The session ended because the client flooded it: read none of its backlog."""
        return self.outcome is Outcome.RATE_LIMITED and self.state is not SessionState.OPEN

    def _reject(
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

    def _refuse_resume(self, now: float) -> None:
        """A resume this session's key may not make: the one refusal, and the end
        (the engine opened no session, so nothing is asked of it)."""
        self.upstream_close_sent = True
        self._resume_refused = self.telemetry.news = True  # resumes_total{refused}
        self._close(notices.resume_refused(self._new_id()), CLOSE_NORMAL, Outcome.ERROR, now)

    def _cancel_from_client(self, event: ClientEvent, now: float) -> None:
        named = event.response_id
        if named is not None and event.kind in (
            ClientKind.RESPONSE_CANCEL,
            ClientKind.OUTPUT_AUDIO_BUFFER_CLEAR,
        ):
            self._cancel(named, now)
        else:
            self._cancel_all_open(now)
            self.requests.cancel_in_flight(now)  # ...and those asked for, not created yet

    # -- the engine's frames -----------------------------------------------------------------------

    def receive_upstream(self, text: str, now: float) -> UpstreamEvent:
        """Take an engine frame: filter, queue, or apply the overflow policy.

        Never blocks and never raises. Returns the classified event as the engine
        sent it (the shell counts it and sees, e.g., the engine's ``session.closed``),
        also when what is queued for the client is the sidecar's rewrite of it.
        """
        received = event = classify_upstream(text)
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
        if self.handing_over:
            return event  # not this client's any more: the engine replays it on resume
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
                self.limits.input.on_engine_session(event.body)
                client_token = self.resume.on_session(event.body, self.session_id)
                if client_token is not None:  # the client's copy is bound to its key
                    event = notices.with_resume_token(event, client_token)
        elif kind is EventKind.RESPONSE_CREATED and rid is not None:
            self.ledger.on_created(rid)
            if self.requests.created(rid):
                self._cancel(rid, now)  # born cancelled
        elif kind is EventKind.ERROR:
            self.requests.refused(event.body)
            self._note_engine_error(event)
            if (
                self.resume.passed_upstream
                and self.session_id is None
                and error_code(event) in notices.RESUME_REFUSALS
            ):
                event = notices.resume_refused(self._new_id())  # one answer for all
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
            return received
        elif kind is EventKind.SESSION_REPLACED:
            # Another socket resumed the engine session: it lives on there, so
            # this one ends without asking the engine to close it.
            self.upstream_close_sent = True
            self._close(event, CLOSE_NORMAL, Outcome.UPSTREAM_CLOSED, now)
            return received
        elif kind is EventKind.OTHER and event.type == "session.updated" and event.body:
            playback.on_session(event.body)
            self.limits.input.on_engine_session(event.body)

        if rid is None and event.body is not None:
            rid = self._response_of_item(event.body)
        verdict = self.ledger.verdict(rid, is_audio=event.is_audio, now=now)
        if verdict is Verdict.CANCELLED:
            self.telemetry.count_drop(DropReason.LATE_AUDIO, event.size)
            return received
        if verdict is Verdict.FAILED:
            self.telemetry.count_drop(DropReason.FAILED_RESPONSE, event.size)
            return received
        if verdict is Verdict.EVICTED:
            self.telemetry.news = True  # late_audio_after_eviction changed

        if event.size > self._max_frame_bytes:
            self._refuse_oversized(event, now)
            return received
        offer = self.buffer.offer(event, now)
        if offer.accepted:
            if kind is EventKind.RESPONSE_DONE and rid is not None:
                self.ledger.on_done_received(rid)
            if self.resume.journal is not None:
                self._journal_gives_way()
        elif offer is Offer.REJECTED_FULL:
            self._overflow(event, now)
        return received

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
        code = error_code(event)
        if code == ENGINE_FULL_CODE and self.session_id is None and not self.engine_full:
            self.engine_full = True
            self.telemetry.news = True
        elif code == _ENGINE_BACKPRESSURE_CODE:
            self.playback.learn(WireSign.OUTPUT_BACKPRESSURE)

    def _note_session_id(self, event: UpstreamEvent) -> None:
        body = event.body or {}
        session = body.get("session")
        if isinstance(session, dict) and isinstance(session.get("id"), str):
            self.session_id = session["id"]
        elif isinstance(body.get("session_id"), str):
            self.session_id = body["session_id"]

    # -- cancellation ---------------------------------------------------------------------------

    def _cancel(self, response_id: str, now: float) -> None:
        told = self.playback.on_cancel(response_id, now)
        if told:
            # What the user heard goes to the engine before anything else we send.
            self._to_upstream.extend(told)
        if self.ledger.cancel(response_id, now):
            self.telemetry.response_cancelled(response_id, now)
        removed, removed_bytes = self.buffer.invalidate(response_id)
        self.telemetry.count_drop(DropReason.CANCELLED_AUDIO, removed_bytes, events=removed)

    def _cancel_all_open(self, now: float) -> None:
        for response_id in self.ledger.open_responses():
            self._cancel(response_id, now)

    # -- lifecycle facts -----------------------------------------------------------------------

    def receive(
        self, fact: Fact | EndReason, now: float, *, amount: int = 0, message: str = ""
    ) -> bool:
        """What the shell saw happen, besides frames; an ``EndReason``: the proxy
        ends the session (``message`` goes in its ``error`` where the ending has one).

        Returns:
            True for a ``CLIENT_DROPPED`` session now held for a resume, and for a
            ``CLIENT_PING`` that overflowed the session; otherwise False.
        """
        if isinstance(fact, EndReason):
            self._end(now, fact, message)
        elif fact is Fact.TIMER:
            self._on_timer(now)
        elif fact is Fact.CLIENT_PING:
            return self._client_ping(amount, now)
        elif fact is Fact.CLIENT_CLOSED or fact is Fact.CLIENT_DROPPED:
            return self._client_ended(now, dropped=fact is Fact.CLIENT_DROPPED)
        elif fact is Fact.RESUME_ABANDONED:
            if self.resume.held:  # it ended while held (shutdown, replaced): nobody to tell
                self._client_ended(now, dropped=False)
        elif fact is Fact.CLIENT_GONE:
            if self.state is not SessionState.CLOSED:
                self._client_gone()  # over: session.close goes to the engine
        elif fact is Fact.UPSTREAM_BINARY:
            self.telemetry.count_drop(DropReason.INVALID_UPSTREAM_FRAME, amount)
        elif fact is Fact.UPSTREAM_CLOSED or fact is Fact.ENGINE_LOST:
            self._upstream_lost(now, clean=fact is Fact.UPSTREAM_CLOSED)
        elif fact is Fact.SHED:
            self._shed(now)
        elif fact is Fact.FAILED:
            self._failed()
        else:  # Fact.FINISHED: observe what is still open (no more audio can follow)
            self.telemetry.finish()
        return False
