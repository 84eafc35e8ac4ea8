"""The output half of a session: drain, what was written, deadlines, reports.

``SessionCore`` (proxy/core/session_core.py) takes the frames and facts in;
this half says what goes out: one ``drain(now, room)`` per shell turn (what to
write and send, the deadline, how the client closes), what the session does
when its deadline passes, the hand-over at a sidecar's drain, and the
read-only view reporters see (proxy/core/view.py). Sans-I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Final

from proxy.core import notices
from proxy.core.buffer import Entry
from proxy.core.capabilities import EngineCapabilities
from proxy.core.drain import NOTHING, Drain, Report
from proxy.core.events import EventKind, classify_upstream
from proxy.core.lifecycle import (
    CLOSE_SERVICE_RESTART,
    Outcome,
    SessionEvent,
    SessionLifecycle,
    SessionPhase,
    SessionState,
    next_state,
)
from proxy.core.playback import PlaybackLedger
from proxy.core.response_requests import ResponseRequests
from proxy.core.resume_state import HandOver, ResumeState
from proxy.core.resume_token import ResumeTokens
from proxy.core.session_settings import SessionSettings
from proxy.core.telemetry import DropReason
from proxy.core.usage import UsageMeter, UsageRecord
from proxy.core.view import PlaybackTotals, SessionStatistics

__all__ = ["ACK_RIDE_WAIT", "SessionOutput"]

#: While the client streams, a due playback ack waits this many ack intervals
#: for a client frame to ride along with before the timer sends it alone.
ACK_RIDE_WAIT: Final = 1.0

#: What a requested hand-over waits for (anything else drains as before).
_MAY_MOVE: Final = frozenset({HandOver.NOW, HandOver.CANCEL_SETTLING, HandOver.OPENING})


class SessionOutput(SessionLifecycle):
    """What a session writes and when; the base of ``SessionCore``.

    Args:
        settings: limits and policy.
        new_event_id: returns a fresh ``event_id`` for events the proxy writes.
        capabilities: what this session's engine does (proxy.core.capabilities).
    """

    def __init__(
        self,
        settings: SessionSettings,
        new_event_id: Callable[[], str],
        capabilities: EngineCapabilities | None,
    ) -> None:
        super().__init__(settings, new_event_id)
        # The telemetry's open cancel-to-silence windows, held here too: read
        # per delivered audio event, so one attribute away.
        self._silence = self.telemetry.silence_windows
        #: Responses asked for and not created yet (proxy/core/response_requests.py).
        self.requests = ResponseRequests()
        self._asked_at = self.requests.asked_at
        self.playback = PlaybackLedger(settings.playback, capabilities)
        #: What this session used (proxy/core/usage.py), for its usage record.
        self.usage = UsageMeter()
        #: The engine refused to open this session: it is full (``error``
        #: {resource_exhausted} before ``session.created``). Passed through to
        #: the client; the shell keeps new sessions off that engine a while.
        self.engine_full = False
        self._engine_full_reported = False
        #: While pacing holds the next audio delta back: when it may go.
        self._paced_until: float | None = None
        #: When playback acks are next due (None: no ack timer needed).
        self._ack_at: float | None = None
        #: When a client frame last went upstream (due acks ride along with the next).
        self._forwarded_at = -math.inf
        self._overflows_reported = 0
        self._late_evicted_reported = 0
        self._out = Drain()
        #: Token, grace and replay (proxy/core/resume_state.py).
        self.resume = ResumeState(
            settings.client_resume_grace,
            settings.resume_journal_bytes,
            settings.resume_journal_ttl,
            ResumeTokens(settings.resume_secret),
        )
        #: Its client resumes after a 1012: it said so, or it has resumed (``SessionCore``).
        self.client_resumes = False
        #: A drain asked for a hand-over (done at the first moment it may be).
        self.hand_over_requested = False
        #: The core refused a ``session.resume`` since the last report (``SessionCore``).
        self._resume_refused = False

    # -- output -----------------------------------------------------------------------------------

    def drain(self, now: float, room: int) -> Drain:
        """Everything the shell has to do now; the same object every call, read at once.

        The events taken count as written (the shell writes them at once, in
        one transport call: the room it gave says its transport is open). A
        requested hand-over that may begin now begins here, after them.

        Args:
            room: bytes the client transport may take now; events are taken
                while they fit (one event larger than the room goes alone);
                0 takes none (the client is not writable). A session held
                for a resume takes none either (it has no client).
        """
        out = self._out
        buffer = self.buffer
        resume = self.resume
        if (
            room > 0
            and resume.detached_at is None  # held: no client to write to
            and (buffer.pending_events or buffer.closure_pending or resume.replay)
            and not self.handing_over  # the engine replays it to the next sidecar
        ):
            entries = self._take(now, room)
            out.to_client = entries
            if entries:
                self._written(entries, now)
        else:
            out.to_client = NOTHING
        if self.hand_over_requested and self._hand_over_due():
            self._hand_over()  # 1012, no session.close
        if self._to_upstream:
            out.to_upstream, self._to_upstream = self._to_upstream, []
        else:
            out.to_upstream = NOTHING
        out.deadline = self._next_deadline()
        out.close = (
            None
            if self.state is SessionState.OPEN and not self.handing_over
            else self._close_frame()
        )
        out.pending_bytes = buffer.pending_bytes
        out.pending_events = buffer.pending_events
        out.journal_bytes = self.journal_bytes
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
        replay = self.resume.replay
        while replay and (not taken or size + len(replay[0]) <= room):
            # Written before, or the resumed notice: no budget; parsed again only now.
            again = Entry(classify_upstream(replay.popleft()), now)
            taken.append(again)
            size += again.event.size
        # What queued meanwhile goes after the whole replay, never into a room it left:
        # clients drop every seq at or below the last they saw (docs/design.md, Resume).
        while not replay and size < room and (buffer.pending_events or buffer.closure_pending):
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

    def _written(self, entries: Sequence[Entry], now: float) -> None:
        """What a drain takes for the client is written: journal it, time it, count it."""
        usage = self.usage
        silence = self._silence
        asked_at = self._asked_at
        journal = self.resume.journal
        room = self.settings.buffer.max_pending_output_bytes - self.buffer.pending_bytes
        for entry in entries:
            event = entry.event
            rid = event.response_id
            if journal is not None and event.seq is not None:
                journal.record(event.seq, event.text, rid if event.is_audio else None, now, room)
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
                created = asked_at.pop(rid, None)
                if created is not None:
                    self.telemetry.first_audio(max(0.0, now - created))
            elif event.kind is EventKind.SESSION_CREATED:
                self.resume.token_delivered = True  # the engine's token (or ours on it)
            elif event.kind is EventKind.RESPONSE_DONE and rid is not None:
                self.playback.done_delivered(rid)
                self.ledger.on_done_delivered(rid, now)
                # Time has moved on: tombstones whose TTL passed go now, not only
                # when an event of their response happens to arrive.
                self.ledger.expire(now)
                asked_at.pop(rid, None)
                self.telemetry.observe_silence(rid)
        if self._ack_at is None and self.playback.acking:
            self._arm_acks(self.playback.next_ack_at(now), now)

    # -- time -----------------------------------------------------------------------------------

    def _next_deadline(self) -> float | None:
        """When ``Fact.TIMER`` is next due (None: no deadline). Read by every drain:
        compared one by one, no tuple built per call."""
        deadline = self._ack_at
        paced = self._paced_until
        if paced is not None and (deadline is None or paced < deadline):
            deadline = paced
        grace = self.resume.grace_at
        if grace is not None and (deadline is None or grace < deadline):
            deadline = grace
        return deadline

    def _on_timer(self, now: float) -> None:
        """Time passed: paced audio may be released, acks may be due, a grace may end."""
        if self.resume.grace_over(now):
            # The dropped client never came back: a normal end (session.close upstream).
            self.telemetry.news = True
            self._client_gone()
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

    def _still_audible(self, response_id: str) -> bool:
        """Replay keeps every event but audio of a response cancelled since."""
        return self.ledger.cancelled_at(response_id) is None

    def _journal_gives_way(self) -> None:
        """The journal and the queue share the session's output budget; the queue
        comes first (docs/design.md, Resume): the journal's oldest go."""
        journal = self.resume.journal
        if journal is not None and journal.bytes:
            room = self.settings.buffer.max_pending_output_bytes - self.buffer.pending_bytes
            if journal.bytes > room:
                journal.trim(room)

    def trim_journal(self, excess: int) -> int:
        """Free ``excess`` bytes of the resume journal, oldest first (the process's
        output cap is passed); a resume from before them gets ``session.resync_required``.

        Returns:
            the bytes freed.
        """
        journal = self.resume.journal
        if journal is None:
            return 0
        return journal.trim(max(0, journal.bytes - excess))

    # -- resume (docs/design.md, Resume) ----------------------------------------------------------

    def _client_ended(self, now: float, *, dropped: bool) -> bool:
        """The client's connection ended; ``dropped``: without a close frame.

        Returns:
            True when the session is held for ``client_resume_grace`` (a drop,
            the session resumable, not closing by the client's own
            ``session.close``); otherwise it ends (``client_gone``).
        """
        resume = self.resume
        if self.state is SessionState.CLOSED:
            resume.release()
            return False
        if (
            self.handing_over
            or not dropped
            or not resume.resumable
            or self.client_close_requested
            or resume.held
        ):
            resume.release()  # held and ended meanwhile (shutdown, replaced): nobody to tell
            self._client_gone()
            return False
        resume.detach(now)
        return True

    def attach(self, cursor: int, now: float) -> tuple[bool, str | None]:
        """A client resumed this session on a new connection: ``session.resumed``,
        then what it missed after ``cursor`` (the last ``server_event_seq`` it got).

        Returns:
            (attached, notice). Attached: the notice, when the session was not
            held, is the ``session.replaced`` for the connection it leaves (the
            old one still looked alive). Not attached: the session ended or is
            handed over (no notice: the engine replays it elsewhere), or what
            followed ``cursor`` is no longer kept: the notice is the new
            connection's ``session.resync_required`` {journal_gap}; the session
            stays as it was.
        """
        resume = self.resume
        if self.state is SessionState.CLOSED or self.handing_over or self.hand_over_requested:
            return False, None
        held = resume.held
        token = resume.next_token()

        def resumed(generation: int) -> str:
            notice = notices.session_resumed(
                self._new_id(),
                self.session_id,
                resume.session_object,
                generation=generation,
                resume_token=token,
            )
            return notice.text

        if not resume.reattach(cursor, now, token, self._still_audible, resumed):
            gap = notices.session_resync_required(self._new_id(), self.session_id, "journal_gap")
            return False, gap.text
        self.client_resumes = True
        self.telemetry.news = True
        if held:
            return True, None
        # The connection left gets its attachment generation, the one before the current.
        replaced = notices.session_replaced(self._new_id(), self.session_id, resume.generation - 1)
        return True, replaced.text

    # -- hand-over at drain (docs/design.md, Start-up and shutdown) ------------------------------

    def _hand_over_wait(self) -> HandOver:
        """Whether the session can be handed over now (``NOW``), or why not.

        A session is handed over when the engine keeps it for a resume and its
        client resumes; a live one only once every cancelled response's terminal
        reached the client: the engine replays after the client's cursor, and
        in 0.30 late audio of a cancel is numbered before that terminal.
        """
        if self.state is not SessionState.OPEN or self.client_close_requested:
            return HandOver.ENDING
        if not self.resume.resumable:
            return HandOver.OPENING if self.session_id is None else HandOver.NOT_RESUMABLE
        if self.resume.held:
            return HandOver.NOW  # held: its client resumes wherever it reconnects
        if not self.client_resumes:
            return HandOver.CLIENT_CANNOT_RESUME
        if not self.resume.token_delivered:
            return HandOver.OPENING  # its client could not present the engine's token
        if self.ledger.cancels_settling() or self.requests.born_cancelled:
            return HandOver.CANCEL_SETTLING
        return HandOver.NOW

    def request_hand_over(self) -> HandOver:
        """The sidecar drains: hand the session over as soon as it may be.

        Returns:
            ``_hand_over_wait()`` now; unless it is ``NOW``, ``CANCEL_SETTLING`` or
            ``OPENING`` the session is not handed over and drains as it would have.
        """
        wait = self._hand_over_wait()
        if wait in _MAY_MOVE and not self.handing_over:
            self.hand_over_requested = True
        return wait

    def _hand_over_due(self) -> bool:
        """A requested hand-over may begin now (``drain`` then begins it)."""
        return (
            self.hand_over_requested
            and not self.handing_over
            and self._hand_over_wait() is HandOver.NOW
        )

    def _hand_over(self) -> None:
        """Begin the hand-over: nothing more is written to the client (it gets close
        1012), the client's frames still go upstream until its close, and the
        engine is left without ``session.close`` (it keeps the session for its grace).
        """
        self.hand_over_requested = False
        self.handing_over = True
        self.upstream_close_sent = True  # never session.close: the session lives on
        self.close_code = CLOSE_SERVICE_RESTART
        self.outcome = Outcome.HANDED_OVER
        self.resume.release()  # a held one is not the sidecar's to end: the engine's grace runs
        self.telemetry.news = True

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
        replayed, expired = self.resume.take_report()
        refused, self._resume_refused = self._resume_refused, False
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
            resume_refused=refused,
        )

    # -- the read-only view (proxy/core/view.py) --------------------------------------------------

    @property
    def pending_bytes(self) -> int:
        return self.buffer.pending_bytes

    @property
    def pending_events(self) -> int:
        return self.buffer.pending_events

    @property
    def output_waiting(self) -> bool:
        """Events wait for the client: queued ones, the closure notice, or a resume's
        ``session.resumed`` and replay, which go out the moment it attaches, whatever
        is queued (docs/design.md, Resume)."""
        buffer = self.buffer
        return bool(buffer.pending_events or buffer.closure_pending or self.resume.replay)

    @property
    def phase(self) -> SessionPhase:
        """Where the session stands, as the shell acts on it (``SessionPhase``)."""
        if self.handing_over:
            return SessionPhase.HANDED_OVER
        state = self.state
        if state is SessionState.OPEN:
            return SessionPhase.HELD if self.resume.held else SessionPhase.OPEN
        return SessionPhase.CLOSING if state is SessionState.CLOSING else SessionPhase.CLOSED

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
    def journal_bytes(self) -> int:
        journal = self.resume.journal
        return 0 if journal is None else journal.bytes

    @property
    def resumable(self) -> bool:
        return self.resume.resumable

    @property
    def held(self) -> bool:
        return self.resume.held

    @property
    def detached_at(self) -> float | None:
        return self.resume.detached_at

    @property
    def resume_grace_ends_at(self) -> float | None:
        return self.resume.grace_at

    @property
    def generation(self) -> int:
        """Attachments after the first (the engine's ``attachment_generation``)."""
        return self.resume.generation

    def resume_token_matches(self, token: str) -> bool:
        return self.resume.token_matches(token)

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
