"""SessionCore: one session's policy, sans-I/O (docs/design.md, Session core).

Inputs are frames and facts with ``now``: ``receive_client``, ``receive_upstream``,
``written``, the lifecycle facts (``end``, ``upstream_lost``, ``shed``,
``client_gone``) and ``on_timer``. Output is one ``drain(now, room)``: what to
write to the client, what to send upstream, the close code, the next deadline
and a report for the observer. Reporters read ``SessionView``
(proxy/core/view.py), never this type: only the relay calls it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

from proxy.core import notices
from proxy.core.buffer import Entry, Offer
from proxy.core.capabilities import EngineCapabilities, EngineVersion
from proxy.core.client_limits import ClientLimits
from proxy.core.drain import NOTHING, Drain, Report
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
from proxy.core.input_audio import InputAudio, Refused
from proxy.core.journal import ReplayJournal
from proxy.core.ledger import CancellationLedger, Verdict
from proxy.core.lifecycle import (
    CLOSE_ABNORMAL_ENGINE,
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    EndReason,
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
from proxy.core.usage import UsageMeter, UsageRecord
from proxy.core.view import PlaybackTotals, SessionStatistics

__all__ = [
    "CLOSE_ABNORMAL_ENGINE",
    "CLOSE_GOING_AWAY",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "ENGINE_FULL_CODE",
    "ClientDecision",
    "DropReason",
    "EndReason",
    "InvalidState",
    "Outcome",
    "OverflowPolicy",
    "SessionCore",
    "SessionSettings",
    "SessionState",
    "SessionStatistics",
    "check_session_settings",
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

#: While the client streams, a due playback ack waits this many ack intervals
#: for a client frame to ride along with before the timer sends it alone.
ACK_RIDE_WAIT: Final = 1.0

#: Client playback acknowledgements (vLLM-Omni's name and its alias).
_PLAYBACK_ACKS: Final = frozenset({"playback.ack", "audio.playback_ack"})

#: The engine's own output bound (0.31+): seen, it tells the version.
_ENGINE_BACKPRESSURE_CODE: Final = "output_backpressure"


#: Separates the engine's resume token from the sidecar's mark on the ones it issues.
_TOKEN_MARK: Final = "~"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _item_audio_seconds(audio: InputAudio, body: dict[str, Any] | None) -> float:
    """Seconds of the audio parts of a ``conversation.item.create``, as the engine reads them.

    A part in a format the engine does not decode is skipped (the engine skips
    it too); a refused rate refuses the item.
    """
    item = (body or {}).get("item")
    content = item.get("content") if isinstance(item, dict) else None
    if not isinstance(content, list):
        return 0.0
    total = 0.0
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_audio", "audio"):
            continue
        data = part.get("audio") or part.get("data")
        if not isinstance(data, str) or not data:
            continue
        try:
            total += audio.seconds(len(data), part)
        except Refused as refused:
            if refused.code != "unsupported_audio_format":
                raise
    return total


def check_session_settings(settings: SessionSettings) -> None:
    """Build, and throw away, the parts a session builds from ``settings``.

    Raises:
        ValueError: a value a part refuses; the message starts with the
            field's name ("max_tombstones must be >= 1").
    """
    CancellationLedger(max_tombstones=settings.max_tombstones, tombstone_ttl=settings.tombstone_ttl)
    ClientLimits(settings)
    PlaybackLedger(settings.playback)


class ClientDecision(NamedTuple):
    """What became of a client frame: its event (None: over the frame rate, not
    parsed) and whether its original text goes upstream.

    A named tuple: built per client frame, and cheaper than a frozen dataclass.
    """

    event: ClientEvent | None
    forward: bool


_OVER_RATE: Final = ClientDecision(None, forward=False)


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
        self._engine_full_reported = False
        #: An engine frame larger than this can never be queued (the whole budget).
        self._max_frame_bytes = settings.buffer.max_pending_output_bytes
        #: While pacing holds the next audio delta back: when it may go.
        self._paced_until: float | None = None
        #: When playback acks are next due (None: no ack timer needed).
        self._ack_at: float | None = None
        #: When a client frame last went upstream (due acks ride along with the next).
        self._forwarded_at = -math.inf
        self._overflows_reported = 0
        self._late_evicted_reported = 0
        self._out = Drain()
        # -- resume (docs/design.md, Resume) --
        #: The engine offers resume for this session and the sidecar holds it on a drop.
        self.resumable = False
        #: The engine's own resume token, and a digest of the one a client must present.
        self._engine_token = ""
        self._token_digest = b""
        #: The engine's last ``session`` object (``session.resumed`` repeats it).
        self._session_object: dict[str, Any] | None = None
        self.generation = 0
        #: When the client dropped (None: attached), and when its grace ends.
        self.detached_at: float | None = None
        self._grace_at: float | None = None
        self._journal: ReplayJournal | None = None
        #: ``session.resumed`` and the replay, written before anything queued.
        self._replay: deque[Entry] = deque()
        self._replayed = 0
        self._resume_expired = False
        #: The client's first message was a session.resume, passed to the engine.
        self._resuming = False

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
            return _OVER_RATE
        event = classify_client(text)
        if not event.is_valid:
            self._reject(event.kind.value, event.detail, now, size=event.size)
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
        elif event.kind is ClientKind.AUDIO_APPEND or event.type == "conversation.item.create":
            if not self._take_input_audio(event, now):
                return ClientDecision(event, forward=False)
        elif event.kind is ClientKind.SESSION_UPDATE:
            self.limits.input.on_client_update(event.body)
        elif event.kind is ClientKind.SESSION_RESUME and self.session_id is None:
            self._resuming = True  # passed to the engine (docs/design.md, Resume)
        elif event.kind is ClientKind.EVENT_ACK and self._journal is not None:
            acked = (event.body or {}).get("server_event_seq")
            if type(acked) is int:
                self._journal.ack(acked)
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
        out = self._to_upstream
        limit = self.settings.max_pending_input_bytes
        if limit and upstream_backlog + sum(map(len, out)) + event.size > limit:
            self.end(
                now,
                EndReason.INPUT_BACKPRESSURE,
                f"the engine is not accepting input; more than {limit} bytes are waiting",
            )
            return ClientDecision(event, forward=False)
        out.append(text)
        self._forwarded_at = now
        if self.playback.acking:
            out.extend(self.playback.acks_due(now))
        return ClientDecision(event, forward=True)

    def _take_input_audio(self, event: ClientEvent, now: float) -> bool:
        """Charge the frame's input audio as the engine will hear it, within
        ``max_input_audio_rate``; False: refused (an ``error`` is queued)."""
        limits = self.limits
        try:
            if event.kind is ClientKind.AUDIO_APPEND:
                seconds = limits.input.seconds(event.audio_chars, event.body)
            else:
                seconds = _item_audio_seconds(limits.input, event.body)
        except Refused as refused:
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

    def receive_client_binary(self, size: int, now: float) -> bool:
        """A binary client frame: not part of the protocol, answered with an ``error``.

        Returns:
            False when it was over the frame rate (not answered).
        """
        if not self._admit(size, now):
            return False
        self._reject(
            "binary_unsupported",
            "binary frames are not supported; send JSON text frames",
            now,
            size=size,
        )
        return True

    def receive_client_ping(self, unanswered_pings: int, now: float) -> bool:
        """A client ping; ``unanswered_pings`` wait behind a client that is not reading.

        Each counts as one event of the output budget: a client that pings
        without reading ends with the overflow sequence (1008).

        Returns:
            True when this ping overflowed the session.
        """
        budget = self.settings.buffer.max_pending_output_events
        if unanswered_pings + len(self.buffer) > budget and self.state is SessionState.OPEN:
            self.control_overflow(now)
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
            self.end(now, EndReason.CLIENT_RATE_LIMITED)
        return False

    @property
    def flooded(self) -> bool:
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

    # -- the engine's frames -----------------------------------------------------------------------

    def receive_upstream(self, text: str, now: float) -> UpstreamEvent:
        """Take an engine frame: filter, queue, or apply the overflow policy.

        Never blocks and never raises. Returns the classified event (the
        shell counts it and sees, e.g., the engine's ``session.closed``).
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
                self.limits.input.on_engine_session(event.body)
                self._note_resume(event.body)
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
            if (
                self._resuming
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
            return event
        elif kind is EventKind.SESSION_REPLACED:
            # Another socket resumed the engine session: it lives on there, so
            # this one ends without asking the engine to close it.
            self.upstream_close_sent = True
            self._close(event, CLOSE_NORMAL, Outcome.UPSTREAM_CLOSED, now)
            return event
        elif kind is EventKind.OTHER and event.type == "session.updated" and event.body:
            playback.on_session(event.body)
            self.limits.input.on_engine_session(event.body)

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

    def receive_upstream_binary(self, size: int) -> None:
        """An engine binary frame: not part of the protocol, dropped and counted."""
        self.telemetry.count_drop(DropReason.INVALID_UPSTREAM_FRAME, size)

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
            self.playback.learn(EngineVersion.V0_31)

    def _note_session_id(self, event: UpstreamEvent) -> None:
        body = event.body or {}
        session = body.get("session")
        if isinstance(session, dict) and isinstance(session.get("id"), str):
            self.session_id = session["id"]
        elif isinstance(body.get("session_id"), str):
            self.session_id = body["session_id"]

    def _note_resume(self, body: dict[str, Any]) -> None:
        """``session.created`` / ``session.resumed``: whether and how this session resumes."""
        session = body.get("session")
        if isinstance(session, dict):
            self._session_object = session
            capabilities = session.get("capabilities")
            supported = (
                isinstance(capabilities, dict)
                and capabilities.get("supports_session_resume") is True
            )
        else:
            supported = self.resumable  # a resumed session keeps what it was
        generation = body.get("attachment_generation")
        if type(generation) is int:
            self.generation = generation
        token = body.get("resume_token")
        if not (supported and isinstance(token, str) and token):
            return
        if self.settings.client_resume_grace > 0:
            self.resumable = True
            self._engine_token = token.split(_TOKEN_MARK, 1)[0]
            self._token_digest = _digest(token)
            if self._journal is None:
                settings = self.settings
                self._journal = ReplayJournal(
                    settings.resume_journal_bytes, settings.resume_journal_ttl
                )

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

    # -- output -----------------------------------------------------------------------------------

    def drain(self, now: float, room: int) -> Drain:
        """Everything the shell has to do now; the same object every call, read at once.

        Args:
            room: bytes the client transport may take now; events are taken
                while they fit (one event larger than the room goes alone);
                0 takes none (the client is not writable).
        """
        out = self._out
        buffer = self.buffer
        if room > 0 and (buffer.pending_events or buffer.closure_pending or self._replay):
            entries = self._take(now, room)
            out.to_client = entries
            out.close_code = self.close_code if entries and entries[-1].closure else None
        else:
            out.to_client = NOTHING
            out.close_code = None
        if self._to_upstream:
            out.to_upstream, self._to_upstream = self._to_upstream, []
        else:
            out.to_upstream = NOTHING
        deadline = self._ack_at
        paced = self._paced_until
        if paced is not None and (deadline is None or paced < deadline):
            deadline = paced
        grace = self._grace_at
        if grace is not None and (deadline is None or grace < deadline):
            deadline = grace
        out.deadline = deadline
        out.pending_bytes = buffer.pending_bytes
        out.pending_events = buffer.pending_events
        out.report = self._report() if self.telemetry.news or self.playback.news else None
        return out

    def _take(self, now: float, room: int) -> list[Entry]:
        """Take events to write now, re-checking each at the last moment, within ``room``."""
        buffer = self.buffer
        playback = self.playback
        # A closing session delivers what is left at once (its close deadline runs).
        pacing = playback.settings.pacing and self.state is SessionState.OPEN
        self._paced_until = None
        taken: list[Entry] = []
        size = 0
        replay = self._replay
        while replay and (not taken or size + replay[0].event.size <= room):
            again = replay.popleft()  # written before, or the resumed notice: no budget
            taken.append(again)
            size += again.event.size
        while size < room and (buffer.pending_events or buffer.closure_pending):
            if pacing or size:
                head = buffer.peek()
                if head is None:
                    break
                if size and size + head.event.size > room:
                    break  # a full room: only a first event may exceed it, alone
                if pacing and head.event.is_audio and not head.closure:
                    when = playback.release_at(head.event, now, buffer.pending_bytes)
                    if when is not None:
                        self._paced_until = when
                        break
            entry = buffer.pop()
            if entry is None:
                break
            event = entry.event
            if event.is_audio:
                # cancelled_at, not verdict(): the intake already judged this
                # event, and verdict() counts late audio (it would count twice).
                rid = event.response_id
                if rid is not None and self.ledger.cancelled_at(rid) is not None:
                    self.telemetry.count_drop(DropReason.CANCELLED_AUDIO, event.size)
                    continue
                playback.released(event, now)
            taken.append(entry)
            size += event.size
            if entry.closure:
                break
        return taken

    def written(self, entries: Sequence[Entry], now: float) -> None:
        """The shell wrote these entries (a drain's ``to_client``) to the client."""
        self._out.to_client = NOTHING  # written: nothing here keeps a large frame alive
        usage = self.usage
        silence = self._silence
        create_time = self._create_time
        journal = self._journal
        for entry in entries:
            event = entry.event
            rid = event.response_id
            if journal is not None and event.seq is not None:
                journal.record(event.seq, entry, now)
            if entry.closure:
                self.state = next_state(self.state, SessionEvent.CLOSURE_DELIVERED)
                continue
            if event.is_audio:
                usage.delivered_chars += event.audio_chars
                if rid is None:
                    continue
                window = silence.get(rid)
                if window is not None:
                    window.last_audio_at = now
                created = create_time.pop(rid, None)
                if created is not None:
                    self.telemetry.first_audio(max(0.0, now - created))
            elif event.kind is EventKind.RESPONSE_DONE and rid is not None:
                self.playback.done_delivered(rid)
                self.ledger.on_done_delivered(rid, now)
                # Time has moved on: tombstones whose TTL passed go now, not only
                # when an event of their response happens to arrive.
                self.ledger.expire(now)
                create_time.pop(rid, None)
                self.telemetry.observe_silence(rid)
        if self._ack_at is None and self.playback.acking:
            self._arm_acks(self.playback.next_ack_at(now), now)

    def not_written(self, entries: Sequence[Entry]) -> None:
        """The shell could not write these entries (the connection is gone)."""
        self._out.to_client = NOTHING
        for entry in entries:
            self.telemetry.count_drop(DropReason.SESSION_CLOSED, entry.event.size)

    # -- time -----------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When ``on_timer`` must next be called (None: no deadline)."""
        deadline = self._ack_at
        for at in (self._paced_until, self._grace_at):
            if at is not None and (deadline is None or at < deadline):
                deadline = at
        return deadline

    def on_timer(self, now: float) -> None:
        """Time passed: paced audio may be released, acks may be due, a grace may end."""
        if self._grace_at is not None and now >= self._grace_at:
            # The dropped client never came back: a normal end (session.close upstream).
            self._grace_at = self.detached_at = None
            self._resume_expired = True
            self.telemetry.news = True
            self.client_gone()
        if self._paced_until is not None and now >= self._paced_until:
            self._paced_until = None
        if self._ack_at is not None and now >= self._ack_at:
            self._ack_at = None
            if self.state is SessionState.OPEN:
                playback = self.playback
                self._to_upstream.extend(playback.acks_due(now))
                when = playback.next_ack_at(now)
                if when is not None and when <= now:
                    when = now + playback.settings.ack_interval  # nothing new was heard yet
                self._arm_acks(when, now)

    def _arm_acks(self, when: float | None, now: float) -> None:
        """Set the ack deadline; while the client streams, an interval late.

        A due ack rides along with the next client frame sent upstream (one
        write for both); the timer only sends what found no ride within an
        interval (``ACK_RIDE_WAIT``).
        """
        if when is None:
            return
        interval = self.playback.settings.ack_interval
        if now - self._forwarded_at < interval:
            when += interval * ACK_RIDE_WAIT
        self._ack_at = when

    # -- resume (docs/design.md, Resume) ----------------------------------------------------------

    def client_detached(self, now: float) -> bool:
        """The client's connection ended without ``session.close``.

        Returns:
            True when the session is held for ``client_resume_grace`` (it is
            resumable and not over); False: the shell ends it (``client_gone``).
        """
        if (
            not self.resumable
            or self.client_close_requested
            or self.state is SessionState.CLOSED
            or self.detached_at is not None
        ):
            return False
        self.detached_at = now
        self._grace_at = now + self.settings.client_resume_grace
        self._replay.clear()
        return True

    def resume_token_matches(self, token: str) -> bool:
        """The token a ``session.resume`` presents is this session's current one."""
        return bool(self._token_digest) and hmac.compare_digest(_digest(token), self._token_digest)

    def next_resume_token(self, nonce: str) -> str:
        """The token the next resume of this session will need (the engine's, marked)."""
        return f"{self._engine_token}{_TOKEN_MARK}{nonce}"

    def reattach(self, cursor: int, now: float, *, token: str) -> bool:
        """A client resumed this session: ``session.resumed``, then what it missed.

        Args:
            cursor: the last ``server_event_seq`` the client received.
            token: the token its next resume will need (``next_resume_token``).

        Returns:
            False when what was written after ``cursor`` is no longer kept
            (the client must resync); the session stays as it was.
        """
        journal = self._journal
        replay = journal.after(cursor, now, self._still_audible) if journal is not None else []
        if replay is None:
            return False
        self.detached_at = self._grace_at = None
        self.generation += 1
        self._token_digest = _digest(token)
        resumed = notices.session_resumed(
            self._new_id(),
            self.session_id,
            self._session_object,
            generation=self.generation,
            resume_token=token,
        )
        self._replay = deque([Entry(resumed, now), *replay])
        self._replayed += len(replay)
        self.telemetry.news = True
        return True

    def _still_audible(self, entry: Entry) -> bool:
        """Replay keeps every event but audio of a response cancelled since."""
        event = entry.event
        rid = event.response_id
        return not (
            event.is_audio and rid is not None and self.ledger.cancelled_at(rid) is not None
        )

    # -- reports ----------------------------------------------------------------------------------

    def _report(self) -> Report:
        telemetry = self.telemetry
        playback = self.playback
        telemetry.news = False
        playback.news = False
        silence, first = telemetry.take_observations()
        overflows = telemetry.overflows - self._overflows_reported
        self._overflows_reported = telemetry.overflows
        evicted = self.ledger.late_after_eviction
        late = evicted - self._late_evicted_reported
        self._late_evicted_reported = evicted
        engine_full = self.engine_full and not self._engine_full_reported
        self._engine_full_reported = self.engine_full
        replayed, self._replayed = self._replayed, 0
        expired, self._resume_expired = self._resume_expired, False
        return Report(
            drops=telemetry.take_drops(),
            overflows=overflows,
            overflow_policy=self.settings.overflow_policy.value,
            cancelled=telemetry.take_cancelled(),
            silence=silence,
            first_audio=first,
            lead_at_cancel=playback.take_lead_observations(),
            own_ack_errors=playback.take_own_errors(),
            learned=playback.take_learned(),
            late_after_eviction=late,
            engine_full=engine_full,
            replayed=replayed,
            resume_expired=expired,
        )

    def finish(self) -> None:
        """Session over: observe what is still open (no more audio can follow)."""
        self.telemetry.finish()

    # -- the read-only view (proxy/core/view.py) --------------------------------------------------

    @property
    def pending_bytes(self) -> int:
        return self.buffer.pending_bytes

    @property
    def pending_events(self) -> int:
        return self.buffer.pending_events

    @property
    def closing(self) -> bool:
        return self.buffer.closed

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

    @property
    def resume_grace_ends_at(self) -> float | None:
        return self._grace_at

    def tombstoned(self) -> list[str]:
        return self.ledger.tombstoned()

    def drop_totals(self) -> dict[DropReason, tuple[int, int]]:
        return self.telemetry.drop_totals()

    def playback_totals(self) -> PlaybackTotals:
        p = self.playback
        return PlaybackTotals(
            p.audio_sent,
            p.acks_sent,
            p.truncations_client,
            p.truncations_sidecar,
            p.paced_bound_releases,
        )

    def playback_view(self, now: float) -> dict[str, Any]:
        return self.playback.view(now)

    def quota_seconds(self) -> float:
        return self.usage.quota_seconds()

    def usage_record(self, key: str, session_seconds: float, now: float) -> UsageRecord:
        return self.usage.record(key, session_seconds, self.playback.heard(now))
