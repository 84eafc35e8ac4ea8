"""Sans-I/O core of one simulated duplex session.

Like websockets' ``Protocol``, :class:`DuplexSession` does no I/O and never
reads a clock: the server shell feeds it client frames (``receive_*``), asks it
to produce the next audio chunk when the pace says so (``produce_*``), and
takes what it must send one frame at a time (``next_outgoing``) in order.
Output goes through the session's :class:`~omni_sidecar.simulator.delivery.OutputQueue`:
on 0.30 every event is numbered (``event_id``, ``server_event_seq``) as it is
produced and queued without bound; on 0.31 and later it is numbered when
taken for sending, the queue is bounded, and overflow fails the session
(``output_backpressure``).

Phases: AWAITING_OPEN (no session yet) → OPEN → CLOSED (``session.closed``
queued; nothing else is emitted afterwards). What each client event does is
in :mod:`omni_sidecar.simulator.handlers`; this module owns the state and
the response lifecycle (start, produce, complete, cancel).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from omni_sidecar.simulator.audio import AudioBank
from omni_sidecar.simulator.config import SimulatorConfig
from omni_sidecar.simulator.conversation import Conversation, InputBuffer
from omni_sidecar.simulator.delivery import OutputEntry, OutputOverflow, OutputQueue
from omni_sidecar.simulator.playback import ACK_ONLY, AssistantRecord, PlaybackCursor
from omni_sidecar.simulator.protocol import (
    CLIENT_ALIASES,
    OPENAI_CLIENT_EVENTS,
    OPENAI_UNHANDLED_EVENTS,
    IdFactory,
    dumps,
    error_payload,
    names_for,
)
from omni_sidecar.simulator.responses import ResponseEvents, ResponseState
from omni_sidecar.simulator.settings import SessionSettings

__all__ = [
    "MAX_ASSISTANT_RECORDS",
    "OPENING_EVENTS",
    "OUTPUT_BACKPRESSURE",
    "CloseFrame",
    "DuplexSession",
    "Outgoing",
    "Phase",
    "SimulatorStats",
]

# First messages that open (or resume) a session themselves instead of
# triggering a default open (docs/engine-protocol.md, Opening a session).
OPENING_EVENTS: Final = frozenset({"session.update", "session.resume"})

Payload = dict[str, Any]

#: ``error.code``, failed ``response.done`` reason and ``session.closed`` reason of
#: an output overflow (0.31 and later).
OUTPUT_BACKPRESSURE: Final = "output_backpressure"

# Events that may use the output reserve (0.31 and later).
_RESERVE_TYPES: Final = frozenset({"error", "response.done"})

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


@dataclass(frozen=True, slots=True)
class CloseFrame:
    """Instruction to the shell: close the socket with ``code``/``reason`` (last item)."""

    code: int
    reason: str


Outgoing = str | CloseFrame


class SessionSlots:
    """``duplex_session.max_sessions``: open sessions of one process (no I/O).

    Args:
        limit: most open sessions; ``None`` means no limit.
    """

    __slots__ = ("limit", "taken")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0

    def take(self) -> bool:
        """Claim a slot for a session being opened; ``False`` when full."""
        if self.limit is not None and self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def release(self) -> None:
        """Give back a slot claimed by :meth:`take`."""
        self.taken -= 1


@dataclass(slots=True)
class SimulatorStats:
    """Process-wide counters, shared by all sessions (rendered by ``/metrics``)."""

    sessions_active: int = 0
    sessions_total: int = 0
    #: Sessions opened (``session.created`` sent): on connect with ``model=`` and
    #: autostart on, or by the first client event. A socket that closes before
    #: either (a readiness handshake) opens none.
    sessions_opened: int = 0
    events_sent: int = 0
    bytes_sent: int = 0
    responses_completed: int = 0
    responses_cancelled: int = 0
    late_audio_events: int = 0
    removed_audio_events: int = 0
    output_overflows: int = 0
    capacity_rejections: int = 0
    errors_sent: int = 0
    outbox_events: int = 0
    outbox_bytes: int = 0


class DuplexSession:
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
        self.config = config
        self._slots = slots
        #: Whether this session holds one of ``slots`` (the shell gives it back).
        self.holds_slot = False
        #: Client event type -> handler (``handlers.HANDLERS``); passed in so that
        #: this module, which the handlers operate on, does not import them.
        self._handlers = handlers
        self._stats = stats
        self._ids = IdFactory(deterministic=config.deterministic)
        # A separate counter for event ids: they follow send order only, so
        # object ids stay the same whatever interleaving the pace produces.
        self._event_ids = IdFactory(deterministic=config.deterministic)
        self._builder = ResponseEvents(names_for(config.event_names), bank)
        self._seq = 0
        self._out = OutputQueue(config.output_limits)
        self._bounded = config.at_least("0.31")
        self._numbered = config.session_mode == "duplex"
        self._output_failed = False
        self._new_responses: list[str] = []
        self.phase = Phase.AWAITING_OPEN
        self.session_id = ""
        self.epoch = 0
        self.turn_id = 0
        self.settings = SessionSettings(
            model=model or config.model, playback_commit_policy=config.playback_commit_policy
        )
        self.input = InputBuffer()
        self.history = Conversation()
        self.active: ResponseState | None = None
        self.last_response_id: str | None = None
        self.records: dict[str, AssistantRecord] = {}
        self.current = PlaybackCursor()

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

    def release_playback_wait(self) -> bool:
        """An idle cancel trigger while ``ack_only`` audio is unacknowledged.

        The engine cuts the last reply's history at the acknowledged position,
        advances the epoch and starts an empty cursor; the client sees only
        ``output_audio_buffer.cleared``. Returns ``False`` (nothing done) when
        there is no wait.
        """
        if not self.playback_wait:
            return False
        record = self.records.get(self.last_response_id or "")
        if record is not None:
            record.truncate(self.current.committed_ms)
        self.epoch += 1
        self.current = PlaybackCursor()
        self.emit({"type": "output_audio_buffer.cleared", "response_id": self.last_response_id})
        return True

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
    def queued_events(self) -> int:
        """Events waiting in the output queue."""
        return self._out.events

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting in the output queue."""
        return self._out.bytes

    def next_outgoing(self) -> Outgoing | None:
        """Take the next frame to send (numbered now on 0.31+), or ``None`` when idle.

        A :class:`CloseFrame` is always the last item ever returned.
        """
        item = self._out.pop()
        if isinstance(item, OutputEntry):
            if item.text is not None:
                return item.text
            assert item.payload is not None
            return self._stamp(item.payload)
        if item is None or isinstance(item, CloseFrame | str):
            return item  # a close, or a frame sent outside the journal
        assert isinstance(item, dict)
        return self._stamp(item)

    def events_to_send(self) -> list[Outgoing]:
        """Take every frame to send, in order. A :class:`CloseFrame` is always last."""
        out: list[Outgoing] = []
        while (item := self.next_outgoing()) is not None:
            out.append(item)
        return out

    def responses_to_start(self) -> list[str]:
        """Drain ids of responses the shell must now pace with :meth:`produce_chunk`."""
        started, self._new_responses = self._new_responses, []
        return started

    # ----------------------------------------------------------------- emitting

    def _stamp(self, payload: Payload) -> str:
        """Number ``payload`` (``event_id``, ``server_event_seq``) and serialize it."""
        payload["event_id"] = "event_" + self._event_ids.hex32()
        # docs/engine-protocol.md, Conventions: session.created is not journaled and has no seq.
        # The plain realtime handler (--session-mode realtime) numbers nothing.
        if self._numbered and payload["type"] != "session.created":
            self._seq += 1
            payload["server_event_seq"] = self._seq
        return dumps(payload)

    def emit(self, payload: Payload) -> None:
        """Queue ``payload``; on 0.30 it is numbered now, on 0.31+ when taken for sending."""
        if self.phase is Phase.CLOSED:
            # session.closed is always the last event (docs/engine-protocol.md, Server events).
            return
        kind = payload["type"]
        if kind == "error":
            self._stats.errors_sent += 1
        if not self._bounded:
            text = self._stamp(payload)
            self._out.put(OutputEntry(text=text, payload=None, size=len(text)))
            return
        if kind == "session.closed":
            self._out.put_final(payload)  # its own slot, outside the bounds
            return
        if self._output_failed and kind not in _RESERVE_TYPES:
            return  # after an overflow only the failure's own events go in
        if kind == "output_audio_buffer.cleared" and isinstance(payload.get("response_id"), str):
            # The engine removes a cleared response's queued audio as the clear passes.
            self._stats.removed_audio_events += self._out.remove_audio(payload["response_id"])
        audio_of: str | None = None
        delta = payload.get("delta")
        if kind == self._builder.audio_delta_type and isinstance(delta, str):
            audio_of = payload.get("response_id")
            # Count base64 audio by its characters, without serializing it twice.
            size = len(delta) + len(dumps({**payload, "delta": ""}))
        else:
            size = len(dumps(payload))
        try:
            self._out.put(
                OutputEntry(text=None, payload=payload, size=size, audio_of=audio_of),
                may_reserve=kind in _RESERVE_TYPES,
            )
        except OutputOverflow:
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
        if self._output_failed:
            return
        self._output_failed = True
        self._stats.output_overflows += 1
        resp = self.active
        if resp is not None:
            self._stats.removed_audio_events += self._out.remove_audio(resp.response_id)
        self.emit(
            error_payload(OUTPUT_BACKPRESSURE, "duplex session pending output limit exceeded")
        )
        if resp is not None:
            record = self._record(resp)
            record.end(ACK_ONLY, late=True, cancelled=False)
            self.emit(self._builder.failed(resp, record, reason=OUTPUT_BACKPRESSURE))
            self.active = None
        self.request_close(OUTPUT_BACKPRESSURE, 1000)

    def error(self, code: str, message: str, event: Payload | None = None) -> None:
        """Queue an ``error`` envelope, echoing the client event's ``event_id``.

        Pass ``event=None`` for errors that name no client event.
        """
        client_id = event.get("event_id") if event is not None else None
        self.emit(error_payload(code, message, client_id if isinstance(client_id, str) else None))

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
                "supports_session_resume": True,
                "supports_audio_truncate": self.config.supports_audio_truncate,
                "chunk_period_ms": self.config.chunk_ms,
            },
            "extra_body": dict(s.extra_body),
            "ref_audio": s.ref_audio_present,
        }
        obj.update(s.echo)
        return obj

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
        self.session_id = "duplex-" + self._ids.hex32()
        self.phase = Phase.OPEN
        self._stats.sessions_opened += 1
        self.emit(
            {
                "type": "session.created",
                "session": self.session_object(),
                "attachment_generation": 1,
                "resume_token": self._ids.hex32(),
            }
        )
        # docs/engine-protocol.md, Server events: session.created is immediately followed by
        # session.updated (the plain realtime handler sends session.created alone).
        if self._numbered:
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
        if self.config.at_least("0.32"):
            payload["error"]["retryable"] = True
        payload["event_id"] = "event_" + self._event_ids.hex32()
        self._out.put_final(dumps(payload))
        self._out.put_final(CloseFrame(1000, ""))
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
        if not self._numbered and event_type not in OPENAI_CLIENT_EVENTS:
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
            self._out.put_final(CloseFrame(1000, "config_timeout"))
            self.phase = Phase.CLOSED

    def request_close(self, reason: str, code: int) -> None:
        """Queue ``session.closed`` (when open) and the close frame; idempotent."""
        if self.phase is Phase.CLOSED:
            return
        if self.phase is Phase.OPEN:
            # Wheel 0.30 ``SessionClosed`` always renders ``event`` (the internal close event).
            internal = {"type": "session.closed", "session_id": self.session_id, "reason": reason}
            self.emit({**internal, "event": dict(internal)})
        self.active = None
        self._out.put_final(CloseFrame(code, reason))
        self.phase = Phase.CLOSED

    # --------------------------------------------------------------- responses

    def start_response(self) -> None:
        """Accept a response: emit ``response.created`` … ``response.speak``."""
        rid = f"resp-{self.session_id}-{self.epoch}-{self._ids.hex8()}"
        resp = ResponseState(
            response_id=rid,
            item_id="item_" + rid,
            epoch=self.epoch,
            turn_id=self.turn_id,
            total_chunks=self.config.chunks_per_response,
            chunk_ms=self.config.chunk_ms,
            previous_item_id=self.history.last_item_id,
        )
        self.active = resp
        self.last_response_id = rid
        record = AssistantRecord(response_id=rid, item_id=resp.item_id, turn_id=self.turn_id)
        self.records[rid] = record
        while len(self.records) > MAX_ASSISTANT_RECORDS:
            del self.records[next(iter(self.records))]
        self.current = record.cursor
        self.history.pending_input = False
        for payload in self._builder.opening(resp, self.settings.modalities):
            self.emit(payload)
        self._new_responses.append(rid)

    def produce_chunk(self, response_id: str) -> None:
        """Emit the next audio + transcript delta; finish the response after the last."""
        resp = self.active
        if resp is None or resp.response_id != response_id or self.phase is not Phase.OPEN:
            return
        record = self._record(resp)
        for payload in self._builder.chunk(resp, self.session_id, record):
            self.emit(payload)
        if resp.remaining <= 0:
            committed = record.end(
                self.settings.playback_commit_policy,
                late=self.turn_id > record.turn_id,
                cancelled=False,
            )
            for payload in self._builder.completed(resp, record, committed=committed):
                self.emit(payload)
            self.history.add({"id": resp.item_id, "role": "assistant"})
            self.active = None
            self._stats.responses_completed += 1

    def _record(self, resp: ResponseState) -> AssistantRecord:
        """The ledger of ``resp`` (re-created if the record bound evicted it mid-response)."""
        record = self.records.get(resp.response_id)
        if record is None:
            record = AssistantRecord(
                response_id=resp.response_id, item_id=resp.item_id, turn_id=resp.turn_id
            )
            self.records[resp.response_id] = record
        return record

    def produce_listen(self) -> None:
        """``response.listen``: the model keeps listening (idle timer or silence)."""
        if self.phase is Phase.OPEN and self.active is None:
            # Wheel 0.30 ``Listen``: session_id/epoch at the top, the internal event
            # as ``response.metadata``; no response_id (none was pre-created).
            internal = {
                "type": "response.listen",
                "session_id": self.session_id,
                "epoch": self.epoch,
            }
            self.emit(
                {
                    "type": "response.listen",
                    "session_id": self.session_id,
                    "epoch": self.epoch,
                    "response": {
                        "object": "realtime.response",
                        "status": "listening",
                        "metadata": internal,
                    },
                }
            )

    def cancel_active(self, reason: str, *, output_cleared: bool = False) -> None:
        """Accept a cancel of the active response.

        Advances the epoch, flushes the late audio, then emits the cancel
        terminal sequence of docs/engine-protocol.md, Cancellation in the engine.

        Args:
            reason: ``status_details.reason`` of the cancelled ``response.done``.
            output_cleared: the trigger was ``output_audio_buffer.clear``.
        """
        resp = self.active
        if resp is None:
            return
        self.epoch += 1
        # The released engines' flaw (docs/engine-protocol.md, Late audio after a cancel): audio
        # already produced
        # and queued is still delivered ahead of the cancelled response.done,
        # and never more than the response had left.
        record = self._record(resp)
        # 0.31 and later remove the cancelled response's audio that is still
        # queued and produce no more: no late audio, and (numbered when sent)
        # no gap in server_event_seq.
        if self._bounded:
            self._stats.removed_audio_events += self._out.remove_audio(resp.response_id)
        late = min(self.config.late_audio, resp.remaining)
        for _ in range(late):
            for payload in self._builder.chunk(resp, self.session_id, record):
                self.emit(payload)
        self._stats.late_audio_events += late
        # The engine ends a cancelled response as if the policy were ack_only:
        # history keeps only what the client acknowledged, whatever the policy.
        record.end(ACK_ONLY, late=self.turn_id > record.turn_id, cancelled=True)
        for payload in self._builder.cancelled(
            resp, record, reason=reason, new_epoch=self.epoch, output_cleared=output_cleared
        ):
            self.emit(payload)
        self.current = PlaybackCursor()
        self.history.add({"id": resp.item_id, "role": "assistant"})
        self.active = None
        self._stats.responses_cancelled += 1
