"""SessionCore: the per-session policy, free of I/O.

The aiohttp relay feeds it frames (``receive_client``, ``receive_upstream``)
and lifecycle facts (``upstream_lost``, ``shutdown``, ``client_gone``), takes
events to write (``next_delivery``/``delivered``) and frames to send upstream
(``events_to_upstream``), and closes the client with ``close_code`` once the
closure notice was delivered. Everything that decides forward / drop / fail /
close lives here, so every interleaving can be tested without sockets.

States (transitions only forward):

    OPEN ──overflow / engine lost / shutdown / engine's session.closed──▶ CLOSING
    OPEN, CLOSING ──closure delivered or client gone──▶ CLOSED

In CLOSING the closure notice is queued; ordinary upstream events are no
longer accepted (the buffer refuses them after closure).

Overflow (docs/design.md, Overflow policy): ``close_session`` purges the active response's queued
audio, queues ``error`` (rate_limit_error / output_backpressure) and a failed
``response.done`` for that response, asks the engine to cancel it and to close
the session, and closes the client with 1008 after ``session.closed``.
``fail_response`` does the same without closing, drops every later event of the
failed response, and falls back to ``close_session`` when there is no response
to fail or the session is still full after the failure.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from omni_sidecar.core import notices
from omni_sidecar.core.buffer import BufferLimits, BufferStatistics, Entry, Offer, OutputBuffer
from omni_sidecar.core.capabilities import EngineCapabilities, EngineVersion
from omni_sidecar.core.events import (
    ClientEvent,
    ClientKind,
    EventKind,
    UpstreamEvent,
    classify_client,
    classify_upstream,
)
from omni_sidecar.core.ledger import (
    DEFAULT_MAX_TOMBSTONES,
    DEFAULT_TOMBSTONE_TTL,
    CancellationLedger,
    LedgerStatistics,
    Verdict,
)
from omni_sidecar.core.playback import PlaybackLedger, PlaybackSettings
from omni_sidecar.core.ratelimit import TokenBucket, audio_bytes_per_second
from omni_sidecar.core.usage import UsageMeter

__all__ = [
    "CLOSE_ABNORMAL_ENGINE",
    "CLOSE_GOING_AWAY",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "ENGINE_FULL_CODE",
    "ClientDecision",
    "DropReason",
    "Outcome",
    "OverflowPolicy",
    "SessionCore",
    "SessionSettings",
    "SessionState",
    "SessionStatistics",
    "is_engine_full",
]

CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001
CLOSE_POLICY_VIOLATION: Final = 1008
CLOSE_ABNORMAL_ENGINE: Final = 1011

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


_NOTHING: Final[tuple[tuple[float, ...], tuple[float, ...]]] = ((), ())

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


#: A rate-limited frame less than this many seconds after the previous one
#: continues the same rate-limit episode (one error per episode).
_RATE_EPISODE_GAP: Final = 1.0


class OverflowPolicy(enum.Enum):
    CLOSE_SESSION = "close_session"
    FAIL_RESPONSE = "fail_response"


class SessionState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class DropReason(enum.Enum):
    """Label values of ``dropped_*_total{reason}`` (docs/design.md, Metrics)."""

    CANCELLED_AUDIO = "cancelled_audio"
    LATE_AUDIO = "late_audio"
    OVERFLOW = "overflow"
    FAILED_RESPONSE = "failed_response"
    INVALID_CLIENT_FRAME = "invalid_client_frame"
    INVALID_UPSTREAM_FRAME = "invalid_upstream_frame"
    INPUT_BACKPRESSURE = "input_backpressure"  # client audio over max_input_audio_rate
    SESSION_CLOSED = "session_closed"  # engine output after the session began closing
    CLIENT_RATE_LIMITED = "client_rate_limited"  # client frames over max_client_frame_rate
    PLAYBACK_ANSWER = "playback_answer"  # the engine's answers to the sidecar's own acks


class Outcome(enum.Enum):
    """Label values of ``sessions_total{outcome}``."""

    CLIENT_CLOSED = "client_closed"
    UPSTREAM_CLOSED = "upstream_closed"
    OVERFLOW = "overflow"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    SHUTDOWN = "shutdown"
    ERROR = "error"
    RATE_LIMITED = "rate_limited"


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSettings:
    """Value object with everything the policy needs."""

    buffer: BufferLimits = field(default_factory=BufferLimits)
    overflow_policy: OverflowPolicy = OverflowPolicy.CLOSE_SESSION
    interrupt_on_speech_started: bool = False
    max_tombstones: int = DEFAULT_MAX_TOMBSTONES
    tombstone_ttl: float = DEFAULT_TOMBSTONE_TTL
    #: Appended audio seconds per wall second (0 = off), bursts up to
    #: ``input_burst_seconds`` of audio.
    max_input_audio_rate: float = 0.0
    input_burst_seconds: float = 10.0
    #: Client data frames per second (0 = off) and the burst allowed above it.
    #: Frames over it are dropped with one ``error`` {client_rate_limited} per
    #: episode; an episode longer than ``client_rate_limit_close_after`` seconds
    #: ends the session with 1008.
    max_client_frame_rate: float = 0.0
    client_frame_burst: float = 0.0
    client_rate_limit_close_after: float = 2.0
    #: Pacing, acks on the client's behalf, truncation (omni_sidecar.core.playback).
    playback: PlaybackSettings = field(default_factory=PlaybackSettings)

    def __post_init__(self) -> None:
        paced = self.playback.max_paced_audio_bytes
        if self.playback.pacing and paced > self.buffer.max_pending_output_bytes:
            raise ValueError(
                f"max_paced_audio_bytes ({paced}) must not exceed max_pending_output_bytes "
                f"({self.buffer.max_pending_output_bytes}): held audio would overflow the session"
            )


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


class SessionCore:
    """Per-session policy. Sync, I/O-free; ``now`` is a float of seconds.

    Args:
        settings: limits and policy.
        new_event_id: returns a fresh ``event_id`` for events the proxy writes.
        capabilities: what this session's engine does (omni_sidecar.core.capabilities).
    """

    def __init__(
        self,
        settings: SessionSettings,
        *,
        new_event_id: Callable[[], str],
        capabilities: EngineCapabilities | None = None,
    ) -> None:
        self.settings = settings
        self._new_id = new_event_id
        self.buffer = OutputBuffer(settings.buffer)
        self.ledger = CancellationLedger(
            max_tombstones=settings.max_tombstones, tombstone_ttl=settings.tombstone_ttl
        )
        self.state = SessionState.OPEN
        self.outcome: Outcome | None = None
        self.close_code: int | None = None
        self.session_id: str | None = None
        self.client_close_requested = False
        self.upstream_close_sent = False
        self._to_upstream: list[str] = []
        # drops by reason: [events since take_drops, bytes since, events total, bytes total]
        self._drops: dict[DropReason, list[int]] = {r: [0, 0, 0, 0] for r in DropReason}
        self._drops_dirty = False
        #: Set when drops, overflows or timing observations changed; the shell
        #: clears it after exporting them (keeps the per-event path cheap).
        self.news = False
        self._overflows = 0
        self._cancels = 0
        self._overflowed = False
        # cancel_to_silence: response → [cancelled_at, last audio write after it]
        self._silence: dict[str, list[float]] = {}
        self._silence_observed: list[float] = []
        # first_audio: response.create times waiting for their response.created
        # Responses the client asked for (response.create, or a commit with
        # response_create) whose response.created has not arrived yet:
        # (time asked, client event_id). A cancel without a response id also
        # covers these: they are "born cancelled" when their response.created
        # arrives, so a cancel racing a create leaks no audio.
        self._pending_creates: deque[tuple[float, str | None]] = deque(maxlen=_MAX_PENDING_CREATES)
        self._born_cancelled = 0
        self._create_time: dict[str, float] = {}
        self._first_audio_observed: list[float] = []
        self._input_bucket = TokenBucket(
            settings.max_input_audio_rate, settings.input_burst_seconds
        )
        self._input_bytes_per_second = audio_bytes_per_second(None, None)
        rate = settings.max_client_frame_rate
        self._frame_bucket = TokenBucket(rate, settings.client_frame_burst or 2 * rate)
        self._limited_since: float | None = None
        self._last_limited = 0.0
        self.playback = PlaybackLedger(settings.playback, capabilities)
        #: What this session used (omni_sidecar/core/usage.py), for its usage record.
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
        if self._frame_bucket.take(1.0, now):
            return True
        self._count_drop(DropReason.CLIENT_RATE_LIMITED, size)
        if self.state is not SessionState.OPEN:
            return False
        settings = self.settings
        if self._limited_since is None or now - self._last_limited > _RATE_EPISODE_GAP:
            self._limited_since = now
            burst = settings.client_frame_burst or 2 * settings.max_client_frame_rate
            error = notices.error_event(
                self._new_id(),
                "client_rate_limited",
                f"more than {settings.max_client_frame_rate:g} frames per second "
                f"(burst {burst:g}); frames are dropped",
            )
            self.buffer.offer(error, now)
        self._last_limited = now
        if now - self._limited_since >= settings.client_rate_limit_close_after:
            self.end(
                now,
                reason="client_rate_limited",
                code=CLOSE_POLICY_VIOLATION,
                outcome=Outcome.RATE_LIMITED,
            )
        return False

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
            seconds = event.audio_chars * 0.75 / self._input_bytes_per_second
            if not self._input_bucket.take(seconds, now):
                self.reject_client_frame(
                    "input_backpressure",
                    "input audio arrives faster than "
                    f"{self.settings.max_input_audio_rate:g}x real time; frame dropped",
                    now,
                    client_event_id=event.event_id,
                    size=event.size,
                    reason=DropReason.INPUT_BACKPRESSURE,
                )
                return ClientDecision(event, forward=False)
            self.usage.input_seconds += seconds
        elif event.kind is ClientKind.SESSION_UPDATE:
            self._note_input_format(event)
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
        self._count_drop(reason, size)
        if self.state is SessionState.OPEN:
            error = notices.error_event(
                self._new_id(), code, message, client_event_id=client_event_id
            )
            self.buffer.offer(error, now)

    def _note_input_format(self, event: ClientEvent) -> None:
        """Track the session's input audio format for the input rate limit."""
        session = (event.body or {}).get("session")
        if not isinstance(session, dict):
            return
        fmt = session.get("input_audio_format")
        rate = session.get("sample_rate_hz")
        audio = session.get("audio")
        if isinstance(audio, dict) and isinstance(audio.get("input"), dict):
            spec = audio["input"].get("format")
            if isinstance(spec, dict):
                fmt = spec.get("type", fmt)
                rate = spec.get("rate", rate)
            elif isinstance(spec, str):
                fmt = spec
        if fmt is None and rate is None:
            return
        self._input_bytes_per_second = audio_bytes_per_second(
            fmt if isinstance(fmt, str) else None, rate if isinstance(rate, int) else None
        )

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
            self._count_drop(DropReason.INVALID_UPSTREAM_FRAME, event.size)
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
            self._count_drop(reason, event.size)
            return event
        rid = event.response_id
        playback = self.playback
        if playback.awaiting_answers and playback.swallow(event, now):
            # It answers the sidecar's own ack: the client never asked for it.
            self._count_drop(DropReason.PLAYBACK_ANSWER, event.size)
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
            self._count_drop(DropReason.LATE_AUDIO, event.size)
            return event
        if verdict is Verdict.FAILED:
            self._count_drop(DropReason.FAILED_RESPONSE, event.size)
            return event
        if verdict is Verdict.EVICTED:
            self.news = True  # late_audio_after_eviction changed

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
            self.news = True
        elif code == _ENGINE_BACKPRESSURE_CODE:
            self.playback.learn(EngineVersion.V0_31)
            self.news = True

    def _closed_outcome(self) -> Outcome:
        return Outcome.CLIENT_CLOSED if self.client_close_requested else Outcome.UPSTREAM_CLOSED

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
            self.news = True
        if self.ledger.cancel(response_id, now):
            self._cancels += 1
            if len(self._silence) >= self.settings.max_tombstones:
                oldest = next(iter(self._silence))
                self._observe_silence(oldest)
            self._silence[response_id] = [now, now]
        removed, removed_bytes = self.buffer.invalidate(response_id)
        self._count_drop(DropReason.CANCELLED_AUDIO, removed_bytes, events=removed)

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
            self._cancels += 1
        removed, removed_bytes = self.buffer.invalidate(response_id)
        self._count_drop(reason, removed_bytes, events=removed)
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
            self._observe_silence(response_id)
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
        self._count_drop(DropReason.OVERFLOW, event.size)
        self.news = True
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
        self._overflows += 1
        self.news = True
        target = self._response_to_fail(event)
        if self.settings.overflow_policy is OverflowPolicy.FAIL_RESPONSE and target is not None:
            self._fail_response(target, DropReason.FAILED_RESPONSE, now)
            if event.response_id == target:
                self._count_drop(DropReason.FAILED_RESPONSE, event.size)
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
        self._overflows += 1
        self.news = True
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
            self._count_drop(DropReason.OVERFLOW, dropped.size)
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
            self._count_drop(
                DropReason.SESSION_CLOSED, stranded.pending_bytes, events=stranded.pending_events
            )
        self.state = SessionState.CLOSED
        self._request_upstream_close("client_close")

    def _request_upstream_close(self, reason: str) -> None:
        if not self.upstream_close_sent:
            self.upstream_close_sent = True
            self._to_upstream.append(notices.session_close(reason))

    def _close(self, notice: UpstreamEvent, code: int, outcome: Outcome, now: float) -> None:
        compact = notices.compact_session_closed(self._new_id(), self.session_id)
        if self.buffer.close(notice, compact=compact, now=now):
            self.state = SessionState.CLOSING
            self.close_code = code
            self.outcome = outcome

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
                self._count_drop(DropReason.CANCELLED_AUDIO, event.size)
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
            self.state = SessionState.CLOSED
            return
        if event.is_audio:
            self.usage.delivered_chars += event.audio_chars
        if rid is None:
            return
        if event.is_audio:
            silence = self._silence.get(rid)
            if silence is not None:
                silence[1] = now
            created = self._create_time.pop(rid, None)
            if created is not None:
                self._first_audio_observed.append(max(0.0, now - created))
                self.news = True
        elif event.kind is EventKind.RESPONSE_DONE:
            self.playback.done_delivered(rid)
            self.ledger.on_done_delivered(rid, now)
            # Time has moved on: tombstones whose TTL passed go now, not only
            # when an event of their response happens to arrive.
            self.ledger.expire(now)
            self._create_time.pop(rid, None)
            self._observe_silence(rid)

    def still_valid(self, entry: Entry) -> bool:
        """Re-check an entry taken earlier, just before it is written."""
        event = entry.event
        rid = event.response_id
        return not (
            event.is_audio and rid is not None and self.ledger.cancelled_at(rid) is not None
        )

    def drop_taken(self, entry: Entry, reason: DropReason) -> None:
        """An entry taken for writing will not be written after all."""
        self._count_drop(reason, entry.event.size)

    def _observe_silence(self, response_id: str) -> None:
        window = self._silence.pop(response_id, None)
        if window is not None:
            self._silence_observed.append(max(0.0, window[1] - window[0]))
            self.news = True

    # -- outputs for the shell -------------------------------------------------------------------------

    @property
    def has_upstream_commands(self) -> bool:
        return bool(self._to_upstream)

    def events_to_upstream(self) -> list[str]:
        """Frames the proxy itself must send to the engine (cancel, close)."""
        out, self._to_upstream = self._to_upstream, []
        return out

    def take_observations(self) -> tuple[Sequence[float], Sequence[float]]:
        """(cancel_to_silence seconds, first_audio seconds) observed since last call."""
        if not self._silence_observed and not self._first_audio_observed:
            return _NOTHING
        silence, self._silence_observed = self._silence_observed, []
        first, self._first_audio_observed = self._first_audio_observed, []
        return silence, first

    def finish(self) -> None:
        """Session over: observe what is still open (no more audio can follow)."""
        for response_id in list(self._silence):
            self._observe_silence(response_id)

    def take_drops(self) -> dict[DropReason, tuple[int, int]]:
        """Drops by reason since the last call, as (events, bytes)."""
        if not self._drops_dirty:
            return {}
        self._drops_dirty = False
        out = {r: (v[0], v[1]) for r, v in self._drops.items() if v[0] or v[1]}
        for v in self._drops.values():
            v[0] = v[1] = 0
        return out

    @property
    def overflow_count(self) -> int:
        return self._overflows

    def statistics(self) -> SessionStatistics:
        return SessionStatistics(
            state=self.state,
            session_id=self.session_id,
            buffer=self.buffer.statistics(),
            ledger=self.ledger.statistics(),
            drops=self.drop_totals(),
            overflows=self._overflows,
            cancels=self._cancels,
            active_response=self.ledger.active_response(),
            open_responses=tuple(self.ledger.open_responses()),
        )

    def drop_totals(self) -> dict[DropReason, tuple[int, int]]:
        """Drops by reason over the session's life, as (events, bytes)."""
        return {r: (v[2], v[3]) for r, v in self._drops.items()}

    def _count_drop(self, reason: DropReason, size: int, *, events: int = 1) -> None:
        if events <= 0:
            return
        self._drops_dirty = True
        self.news = True
        counter = self._drops[reason]
        counter[0] += events
        counter[1] += size
        counter[2] += events
        counter[3] += size
