"""The state of one simulated duplex session, and how it emits and closes.

:class:`SimulatedSession` holds what a session is (phase, ids, epoch, settings,
input, history, the active response, each reply's ledger, its attachment)
and answers queries about it; :meth:`SimulatedSession.emit` queues events through
the session's :class:`~engine_launcher.simulator.outbox.EngineOutbox`, which fails the
session on a 0.31+ output overflow. ``generation`` (responses) and
``duplex_session`` (input, open, resume) build on it. No I/O, no clock. Phases:
AWAITING_OPEN (no session yet) → OPEN → CLOSED (``session.closed`` queued;
nothing else is emitted afterwards). docs/design.md, Simulator.
"""

from __future__ import annotations

import enum
from typing import Final

from engine_launcher.simulator.audio import AudioBank
from engine_launcher.simulator.conversation import Conversation, InputBuffer
from engine_launcher.simulator.counters import SessionSlots, SimulatorStats
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.outbox import CloseFrame, EngineOutbox, Outgoing
from engine_launcher.simulator.playback_history import ACK_ONLY, AssistantRecord, PlaybackCursor
from engine_launcher.simulator.replay_journal import EngineJournal
from engine_launcher.simulator.responses import ResponseEvents, ResponseState
from engine_launcher.simulator.session_resume import EngineResumeRequest, ResumeCredential
from engine_launcher.simulator.session_update import SimulatedSettings
from engine_launcher.simulator.wire import IdFactory, Payload, error_payload, names_for

__all__ = [
    "MAX_ASSISTANT_RECORDS",
    "OUTPUT_BACKPRESSURE",
    "Phase",
    "SimulatedSession",
]


#: ``error.code``, failed ``response.done`` reason and ``session.closed`` reason of
#: an output overflow (0.31 and later).
OUTPUT_BACKPRESSURE: Final = "output_backpressure"


#: Assistant replies whose playback ledger and history text one session keeps
#: (unit: replies). When a session exceeds it, the oldest reply is forgotten: it
#: leaves the engine history (``/debug/history``) and later acks for it are
#: answered ``playback_item_not_found``. Real sessions have a handful of turns;
#: the bound only keeps a runaway test or bench session from growing forever.
MAX_ASSISTANT_RECORDS: Final = 1000


class Phase(enum.Enum):
    """Lifecycle of a session on one socket."""

    AWAITING_OPEN = "awaiting_open"
    OPEN = "open"
    CLOSED = "closed"


class SimulatedSession:
    """Protocol state of one simulated duplex session.

    The attributes below are read and changed by the event handlers.

    Args:
        config: simulator configuration (pace is applied by the shell).
        bank: precomputed output audio.
        stats: process-wide counters to update.
        model: model named in the query string, if any.

    Attributes:
        phase: lifecycle phase.
        session_id: ``duplex-<32hex>`` once open.
        epoch: cancellation fence; every accepted cancel advances it.
        turn_id: number of committed user turns.
        settings: effective session configuration.
        input: uncommitted input audio.
        history: conversation items.
        active: the response being produced, if any.
        last_response_id: the most recent response, active or not.
        records: what the engine remembers of each assistant reply (ledger,
            history text), oldest first, at most :data:`MAX_ASSISTANT_RECORDS`.
        current: the playback cursor of the latest response; a cancel, a
            barge-in or a clear replaces it with an empty one. Under
            ``ack_only`` a response cannot start while it holds unacknowledged
            audio (:attr:`playback_wait`).
        credential: digest of the current resume token (resumable sessions, once open).
        attachment_generation: 1 at the open, one more per resume.
        attached: a socket serves the session (it is not detached).
        detached_at: shell time of the detach, while detached.
        resume_request: a ``session.resume`` read as this socket's first
            message, for the shell to carry out (:meth:`take_resume_request`).
    """

    def __init__(
        self,
        config: SimulatorConfig,
        bank: AudioBank,
        stats: SimulatorStats,
        *,
        model: str | None = None,
        slots: SessionSlots | None = None,
    ) -> None:
        self.config = config
        self._slots = slots
        #: Whether this session holds one of ``slots`` (the shell gives it back).
        self.holds_slot = False
        self._stats = stats
        self._ids = IdFactory(deterministic=config.deterministic)
        self._builder = ResponseEvents(names_for(config.event_names), bank)
        self._outbox = EngineOutbox(config, stats, self._builder.audio_delta_type)
        self._new_responses: list[str] = []
        self.phase = Phase.AWAITING_OPEN
        self.session_id = ""
        self.epoch = 0
        self.turn_id = 0
        self.settings = SimulatedSettings(
            model=model or config.model,
            playback_commit_policy=config.playback_commit_policy,
            input_format=config.input_format,
        )
        self.input = InputBuffer()
        self.history = Conversation()
        self.active: ResponseState | None = None
        self.last_response_id: str | None = None
        self.records: dict[str, AssistantRecord] = {}
        self.current = PlaybackCursor()
        self.credential: ResumeCredential | None = None
        self.attachment_generation = 0
        self.attached = True
        self.detached_at: float | None = None
        self.resume_request: EngineResumeRequest | None = None

    # ------------------------------------------------------------------ queries

    @property
    def active_response_id(self) -> str | None:
        """Id of the response being produced, if any."""
        return self.active.response_id if self.active is not None else None

    def is_active(self, response_id: str) -> bool:
        """True while ``response_id`` is still being produced."""
        return self.active is not None and self.active.response_id == response_id

    @property
    def playback_wait(self) -> bool:
        """``ack_only`` and the latest response's audio is not all acknowledged.

        The engine then treats the turn as still the model's: ``response.create``
        is refused with ``response_already_active`` (docs/design.md, Simulator).
        """
        return self.settings.playback_commit_policy == ACK_ONLY and self.current.unacknowledged

    def record_for_item(self, item_id: str) -> AssistantRecord | None:
        """The assistant reply behind ``item_id`` (``item_<response_id>``), if remembered."""
        if not item_id.startswith("item_"):
            return None
        record = self.records.get(item_id.removeprefix("item_"))
        return record if record is not None and record.item_id == item_id else None

    def history_view(self) -> Payload:
        """The engine's conversation history as the model would see it (``/debug/history``)."""
        items: list[Payload] = []
        pending: list[Payload] = []
        for item in self.history.items():
            record = self.record_for_item(item["id"])
            if record is None:
                content = item.get("content") or [{}]
                first = content[0] if isinstance(content, list) and content else {}
                text = first.get("transcript") or first.get("text") or ""
                entry: Payload = {"id": item["id"], "role": item.get("role"), "text": text}
                if isinstance(item.get("audio_ms"), int):
                    entry["audio_ms"] = item["audio_ms"]
                items.append(entry)
                continue
            entry = {
                "id": record.item_id,
                "role": "assistant",
                "response_id": record.response_id,
                "text": record.text or "",
                "audio_ms": record.audio_ms,
                "full_text": record.full_text.strip(),
                "generated_ms": record.generated_ms,
            }
            (items if record.in_history else pending).append(entry)
        return {
            "playback_commit_policy": self.settings.playback_commit_policy,
            "epoch": self.epoch,
            "items": items,
            "pending": pending,
        }

    @property
    def journal(self) -> EngineJournal | None:
        """The replay journal (``None`` for the plain realtime handler, which numbers nothing)."""
        return self._outbox.journal

    @property
    def queued_events(self) -> int:
        """Events waiting in the output queue."""
        return self._outbox.events

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting in the output queue."""
        return self._outbox.bytes

    def next_outgoing(self, now: float = 0.0) -> Outgoing | None:
        """Take the next frame to send (numbered and journaled now), or ``None`` when idle.

        A :class:`~engine_launcher.simulator.outbox.CloseFrame` is always the last item ever
        returned. ``now`` is the shell's clock, for the journal's age bound.
        """
        return self._outbox.pop(now)

    def events_to_send(self, now: float = 0.0) -> list[Outgoing]:
        """Take every frame to send, in order. A :class:`~engine_launcher.simulator.outbox.CloseFrame`
        is always last."""
        out: list[Outgoing] = []
        while (item := self.next_outgoing(now)) is not None:
            out.append(item)
        return out

    def responses_to_start(self) -> list[str]:
        """Drain ids of responses the shell must now pace with :meth:`produce_chunk`."""
        started, self._new_responses = self._new_responses, []
        return started

    # ----------------------------------------------------------------- emitting

    def emit(self, payload: Payload, *, journal: bool = True) -> None:
        """Queue ``payload``, numbered when taken for sending.

        ``journal=False``: an event the engine's transport sends itself, with no
        ``server_event_seq`` and not replayed by a resume.
        """
        if self.phase is Phase.CLOSED:
            # session.closed is always the last event (docs/engine-protocol.md, Server events).
            return
        if not self._outbox.put(payload, journal=journal):
            self._fail_output()

    def _fail_output(self) -> None:
        """0.31+: the client reads too slowly; fail the response and close the session.

        Like the engine: the failed response's queued audio is removed, then
        ``error{rate_limit_error, output_backpressure}`` (no ``event_id``) and a
        failed ``response.done{output_backpressure}`` go into the reserve (left
        out if even that is full), then ``session.closed{output_backpressure}``
        and close 1000. What was queued before stays in order ahead of them.
        The session cannot be resumed.
        """
        if self._outbox.failed:
            return
        self._outbox.failed = True
        self._stats.output_overflows += 1
        resp = self.active
        if resp is not None:
            self._stats.removed_audio_events += self._outbox.remove_audio(resp.response_id)
        self.emit(
            error_payload(OUTPUT_BACKPRESSURE, "duplex session pending output limit exceeded")
        )
        if resp is not None:
            record = self._record(resp)
            record.end(ACK_ONLY, late=True, cancelled=False)
            self.emit(self._builder.failed(resp, record, reason=OUTPUT_BACKPRESSURE))
            self.active = None
        self.request_close(OUTPUT_BACKPRESSURE, 1000)

    def error(
        self, code: str, message: str, event: Payload | None = None, *, journal: bool = True
    ) -> None:
        """Queue an ``error`` envelope, echoing the client event's ``event_id``.

        Pass ``event=None`` for errors that name no client event, ``journal=False``
        for those the engine's transport sends (no ``server_event_seq``).
        """
        client_id = event.get("event_id") if event is not None else None
        self.emit(
            error_payload(code, message, client_id if isinstance(client_id, str) else None),
            journal=journal,
        )

    def new_item_id(self) -> str:
        """A fresh user item id, ``item_<32hex>``."""
        return "item_" + self._ids.hex32()

    def session_object(self) -> Payload:
        """The ``session`` object of ``session.created``/``session.updated``."""
        s = self.settings
        obj: Payload = {
            "id": self.session_id,
            "object": "realtime.session",
            "model": s.model,
            "state": "active",
            "turn_state": "speaking" if self.active is not None else "listening",
            "epoch": self.epoch,
            "turn_id": self.turn_id,
            "active_response_id": self.active_response_id,
            "modalities": list(s.modalities),
            "turn_detection": s.turn_detection,
            "formats": {"input": s.input_format, "output": "pcm16"},
            "audio": {
                "input": {
                    "format": s.input_format,
                    "sample_rate_hz": s.input_rate,
                    "turn_detection": s.turn_detection,
                },
                "output": {"format": "pcm16", "sample_rate_hz": self.config.sample_rate},
            },
            "overlap_policy": "barge_in_on_speech" if s.server_vad else "listen_only",
            "playback_commit_policy": s.playback_commit_policy,
            "capabilities": {
                "implementation_level": "simulated",
                "supports_barge_in": True,
                "supports_session_resume": self.config.resumable,
                "supports_audio_truncate": self.config.supports_audio_truncate,
                "chunk_period_ms": self.config.chunk_ms,
            },
            "extra_body": dict(s.extra_body),
            "ref_audio": s.ref_audio_present,
        }
        obj.update(s.echo)
        return obj

    def request_close(self, reason: str, code: int) -> None:
        """Queue ``session.closed`` (when open) and the close frame; idempotent."""
        if self.phase is Phase.CLOSED:
            return
        if self.phase is Phase.OPEN:
            # Wheel 0.30 ``SessionClosed`` always renders ``event`` (the internal close event).
            internal = {"type": "session.closed", "session_id": self.session_id, "reason": reason}
            self.emit({**internal, "event": dict(internal)})
        self.active = None
        self._outbox.put_final(CloseFrame(code, reason))
        self.phase = Phase.CLOSED

    def _record(self, resp: ResponseState) -> AssistantRecord:
        """The ledger of ``resp`` (re-created if the record bound evicted it mid-response)."""
        record = self.records.get(resp.response_id)
        if record is None:
            record = AssistantRecord(
                response_id=resp.response_id, item_id=resp.item_id, turn_id=resp.turn_id
            )
            self.records[resp.response_id] = record
        return record
