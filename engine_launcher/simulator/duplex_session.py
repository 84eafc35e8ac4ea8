"""Sans-I/O core of one simulated duplex session: opening, resuming, client input.

:class:`DuplexSession` does no I/O and reads no clock: the shell feeds it
client frames (``receive_*``), asks for the next audio chunk when the pace
says so (``produce_*``), takes what to send in order (``next_outgoing``) and
tells it when its socket dropped (``detach``), its grace ran out (``expire``)
or a new socket resumes it (``resume``), passing the time. What each client
event does is in :mod:`engine_launcher.simulator.handlers`. docs/design.md,
Simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import orjson

from engine_launcher.simulator.audio import AudioBank
from engine_launcher.simulator.counters import SessionSlots, SimulatorStats
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.generation import ResponseGeneration
from engine_launcher.simulator.outbox import CloseFrame
from engine_launcher.simulator.replay_journal import Replay, ReplayProblem
from engine_launcher.simulator.session_resume import (
    SESSION_RESUME_CONFLICT,
    UNKNOWN_SESSION,
    UNSUPPORTED_SESSION_RESUME,
    EngineResumeRequest,
    Refusal,
    ResumeCredential,
    Resumed,
    ResyncRequired,
)
from engine_launcher.simulator.session_state import Phase
from engine_launcher.simulator.wire import (
    CLIENT_ALIASES,
    OPENAI_CLIENT_EVENTS,
    OPENAI_UNHANDLED_EVENTS,
    Payload,
    error_payload,
)

__all__ = ["OPENING_EVENTS", "DuplexSession"]

# First messages that open (or resume) a session themselves instead of
# triggering a default open (docs/engine-protocol.md, Opening a session).
OPENING_EVENTS: Final = frozenset({"session.update", "session.resume"})


class DuplexSession(ResponseGeneration):
    """One simulated duplex session.

    Args:
        config: simulator configuration (pace is applied by the shell).
        bank: precomputed output audio.
        stats: process-wide counters to update.
        handlers: client event type -> handler (``handlers.HANDLERS``); passed
            in so that the session, which the handlers operate on, does not
            import them.
        model: model named in the query string, if any.
        slots: the process's open-session slots, if limited.

    Its attributes are those of
    :class:`~engine_launcher.simulator.session_state.SimulatedSession`.
    """

    def __init__(
        self,
        config: SimulatorConfig,
        bank: AudioBank,
        stats: SimulatorStats,
        *,
        handlers: Mapping[str, Callable[[DuplexSession, dict[str, Any]], None]],
        model: str | None = None,
        slots: SessionSlots | None = None,
    ) -> None:
        super().__init__(config, bank, stats, model=model, slots=slots)
        self._handlers = handlers

    # ------------------------------------------------------------------ opening

    def open(self) -> None:
        """Open the session: ``session.created`` (no seq) then ``session.updated``."""
        if self.phase is not Phase.AWAITING_OPEN:
            return
        if self._slots is not None:
            if not self._slots.take():
                self._reject_capacity(self._slots.limit or 0)
                return
            self.holds_slot = True
        self.session_id = self._outbox.session_id = "duplex-" + self._ids.hex32()
        self.phase = Phase.OPEN
        self._stats.sessions_opened += 1
        created: Payload = {"type": "session.created", "session": self.session_object()}
        if self.config.resumable:
            # docs/engine-protocol.md, Resume: the credentials ride at the top level.
            token = self._ids.token()
            self.credential = ResumeCredential(token)
            self.attachment_generation = 1
            created["attachment_generation"] = 1
            created["resume_token"] = token
        self.emit(created)
        # docs/engine-protocol.md, Server events: session.created is immediately followed by
        # session.updated (the plain realtime handler sends session.created alone).
        if self._outbox.numbered:
            self.emit({"type": "session.updated", "session": self.session_object()})

    def _reject_capacity(self, limit: int) -> None:
        """``duplex_session.max_sessions`` reached: the open is refused, then close 1000.

        The engine sends the error outside the session journal (no
        ``server_event_seq``) and its handler returns, which closes the socket
        normally. 0.32 marks the error ``retryable``.
        """
        self._stats.capacity_rejections += 1
        self._stats.errors_sent += 1
        payload = error_payload(
            "resource_exhausted", f"duplex_session_capacity_exhausted: limit={limit}"
        )
        if self.config.release.open_rejections_retryable:
            payload["error"]["retryable"] = True
        self._outbox.put_outside_journal(payload)
        self._outbox.put_final(CloseFrame(1000, ""))
        self.phase = Phase.CLOSED

    # ------------------------------------------------------------------ feeding

    def receive_text(self, text: str) -> None:
        """Handle one client text frame."""
        if self.phase is Phase.CLOSED:
            return
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            self.error("invalid_json", "message is not valid JSON")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self.error("bad_event", "event must be an object with a string type")
            return
        event_type: str = event["type"]
        if not self._outbox.numbered and event_type not in OPENAI_CLIENT_EVENTS:
            self._invalid_event(event, event_type)
            return
        kind = CLIENT_ALIASES.get(event_type, event_type)
        if self.phase is Phase.AWAITING_OPEN and kind not in OPENING_EVENTS:
            # docs/engine-protocol.md, Opening a session: any other first message opens a default
            # session
            # and is then executed as a command.
            self.open()
        handler = self._handlers.get(kind)
        if handler is None:
            self.error("unknown_event", f"unknown event type {event_type!r}", event)
            return
        handler(self, event)

    def _invalid_event(self, event: Payload, event_type: str) -> None:
        """``--session-mode realtime``: a client event outside the OpenAI Realtime handler.

        Duplex-only events (``playback.ack``, ``barge_in``, ``turn.signal``,
        ``input.cancel``, ``session.resume``, aliases ...) fail its schema and are
        answered without the client's ``event_id``; ``output_audio_buffer.clear``
        passes the schema and is answered as an unknown type, with it.
        """
        known = event_type in OPENAI_UNHANDLED_EVENTS
        client_id = event.get("event_id") if known else None
        message = (
            f"Unknown event type: {event_type}" if known else "Invalid or unrecognized client event"
        )
        payload = error_payload("invalid_event", message)
        payload["error"]["param"] = None
        payload["error"]["event_id"] = client_id if isinstance(client_id, str) else None
        self.emit(payload)

    def receive_binary(self) -> None:
        """Binary frames are not part of the protocol (docs/engine-protocol.md, Framing and
        limits)."""
        self.error("bad_event", "binary frames are not supported")

    def receive_oversized(self, size: int) -> None:
        """A client frame above 15 MiB (docs/engine-protocol.md, Framing and limits)."""
        self.error("event_too_large", f"event of {size} bytes exceeds 15 MiB")

    def receive_open_timeout(self) -> None:
        """No first message within the open deadline: ``config_timeout``, then close."""
        if self.phase is Phase.AWAITING_OPEN:
            self.error("config_timeout", "no first message received in time")
            self._outbox.put_final(CloseFrame(1000, "config_timeout"))
            self.phase = Phase.CLOSED

    # ------------------------------------------------------------------ resume

    def take_resume_request(self) -> EngineResumeRequest | None:
        """The ``session.resume`` this socket opened with, once (for the shell to carry out)."""
        request, self.resume_request = self.resume_request, None
        return request

    def refuse_resume(self, outcome: Refusal | ResyncRequired) -> None:
        """This socket's ``session.resume`` failed: say why outside any journal, then close 1000."""
        if isinstance(outcome, Refusal):
            self._outbox.put_outside_journal(error_payload(outcome.code, outcome.message))
        else:
            self._outbox.put_outside_journal(
                {
                    "type": "session.resync_required",
                    "session_id": outcome.session_id,
                    "reason": outcome.reason,
                }
            )
        self._outbox.put_final(CloseFrame(1000, ""))
        self.phase = Phase.CLOSED

    def hand_over(self) -> None:
        """This socket resumed another session: this (never opened) one ends without a word."""
        self._outbox.put_final(CloseFrame(1000, ""))
        self.phase = Phase.CLOSED

    def detach(self, now: float) -> bool:
        """The attached socket dropped without ``session.close``.

        A resumable open session detaches (it keeps producing into its journal
        until :meth:`resume` or :meth:`expire`); any other ends at once, its
        ``session.closed {disconnect}`` sent to nobody. Returns whether it detached.
        """
        if self.phase is Phase.OPEN and self.credential is not None:
            self.attached = False
            self.detached_at = now
            return True
        self.request_close("disconnect", 1000)
        return False

    def grace_over(self, now: float) -> bool:
        """Detached for at least ``--disconnect-grace`` seconds."""
        return (
            self.phase is Phase.OPEN
            and self.detached_at is not None
            and now - self.detached_at >= self.config.disconnect_grace
        )

    def expire(self) -> None:
        """The grace ran out: ``session.expired {disconnect_grace_expired}``, then close 1000.

        Journaled like any event; a detached session sends it to nobody.
        """
        if self.phase is not Phase.OPEN:
            return
        reason = "disconnect_grace_expired"
        self.emit({"type": "session.expired", "session_id": self.session_id, "reason": reason})
        self.active = None
        self._outbox.put_final(CloseFrame(1000, reason))
        self.phase = Phase.CLOSED

    def resume(
        self, request: EngineResumeRequest, now: float
    ) -> Refusal | ResyncRequired | Resumed:
        """Attach a new socket (docs/engine-protocol.md, Resume).

        Checks, in the engine's order: the session is alive, it resumes, the
        token is its token (an unknown id, an expired session and a wrong token
        get the one answer), the journal still holds everything after the
        cursor. On success the token rotates, the generation advances, and
        ``session.resumed`` then the replay go out before anything queued.
        """
        sid = request.session_id
        if self.phase is not Phase.OPEN or self.grace_over(now):
            ResumeCredential.verify_unknown(request.resume_token)
            return UNKNOWN_SESSION
        credential = self.credential
        if credential is None:
            message = f"session does not support resume: {sid}"
            return Refusal(UNSUPPORTED_SESSION_RESUME, message)
        if not credential.verify(request.resume_token):
            if credential.was_replaced(request.resume_token):
                # It was good until the last resume: two resumes raced, this one lost.
                message = f"another resume took session {sid} first"
                return Refusal(SESSION_RESUME_CONFLICT, message)
            return UNKNOWN_SESSION
        assert self.journal is not None  # resumable sessions are duplex ones
        replay = self.journal.replay_after(request.cursor, now)
        if replay is ReplayProblem.GAP:
            return ResyncRequired(sid, ReplayProblem.GAP.value)
        if not isinstance(replay, Replay):
            message = f"last_received_server_event_seq {request.cursor} was never sent"
            return Refusal(SESSION_RESUME_CONFLICT, message)
        token = self._ids.token()
        credential.rotate(token)
        replaced = self.attachment_generation if self.attached else None
        self.attachment_generation += 1
        self.attached = True
        self.detached_at = None
        self._stats.resumes += 1
        resumed = self._outbox.unnumbered(
            {
                "type": "session.resumed",
                "session_id": sid,
                "session": self.session_object(),
                "attachment_generation": self.attachment_generation,
                "resume_token": token,
            }
        )
        self._outbox.put_ready([resumed, *replay.frames])
        return Resumed(replaced)

    def replaced_frame(self, generation: int) -> str:
        """``session.replaced`` for the socket of ``generation``, which a resume took over."""
        return self._outbox.unnumbered(
            {
                "type": "session.replaced",
                "session_id": self.session_id,
                "attachment_generation": generation,
            }
        )
