"""Event builders for one assistant response (docs/engine-protocol.md, Response sequence; Terminal
events and errors; Cancellation in the engine).

Each builder returns event payloads (dicts with ``type`` first and without the
``event_id``/``server_event_seq`` stamps, which the session adds in send
order). Every response-related event carries the top-level ``response_id``,
the identity a proxy keys its cancellation bookkeeping on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from engine_launcher.simulator.audio import AudioBank
from engine_launcher.simulator.playback_history import AssistantRecord
from engine_launcher.simulator.wire import AudioEventNames, Payload

__all__ = [
    "CANCEL_REASONS",
    "ResponseEvents",
    "ResponseState",
]

# status_details.reason of a cancelled response.done (docs/engine-protocol.md, Terminal events and
# errors).
CANCEL_REASONS: Final = frozenset(
    {"client_cancelled", "barge_in", "output_audio_buffer_clear", "turn_detected"}
)


@dataclass(slots=True, kw_only=True)
class ResponseState:
    """Progress of one response; owned by the session core.

    Attributes:
        response_id: ``resp-<session_id>-<epoch>-<8hex>``, never reused.
        item_id: ``item_<response_id>``, the assistant item.
        epoch: session epoch the response was started under.
        turn_id: user turn that the response answers.
        total_chunks: audio deltas of the uncut response.
        chunk_ms: audio length of one delta.
        previous_item_id: the conversation item before this one.
        next_chunk: index of the next chunk to produce.
    """

    response_id: str
    item_id: str
    epoch: int
    turn_id: int
    total_chunks: int
    chunk_ms: int
    previous_item_id: str | None
    next_chunk: int = 0
    transcript: list[str] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        """Chunks the response has left to produce."""
        return self.total_chunks - self.next_chunk

    @property
    def produced_ms(self) -> int:
        """Audio produced so far, in ms."""
        return self.next_chunk * self.chunk_ms


class ResponseEvents:
    """Builds the wire events of responses for one session.

    Args:
        names: GA or beta audio event names.
        bank: precomputed output audio.
    """

    __slots__ = ("_bank", "_names")

    def __init__(self, names: AudioEventNames, bank: AudioBank) -> None:
        self._names = names
        self._bank = bank

    def _item(self, resp: ResponseState, status: str) -> Payload:
        text = "".join(resp.transcript)
        content: list[Payload] = []
        if status != "in_progress":
            # The item's content part is "output_audio" (0.28 and 0.30 alike);
            # only the response.content_part.* ``part`` says "audio".
            content.append({"type": "output_audio", "transcript": text})
        return {
            "id": resp.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def opening(self, resp: ResponseState, modalities: list[str]) -> list[Payload]:
        """``response.created`` through ``response.speak``."""
        rid = resp.response_id
        item = self._item(resp, "in_progress")
        return [
            {
                "type": "response.created",
                "response_id": rid,
                "response": {
                    "id": rid,
                    "object": "realtime.response",
                    "status": "in_progress",
                    "status_details": None,
                    "modalities": list(modalities),
                    "output": [],
                    "metadata": {"duplex_event": {"epoch": resp.epoch, "turn_id": resp.turn_id}},
                },
            },
            {
                "type": "conversation.item.added",
                "response_id": rid,
                "previous_item_id": resp.previous_item_id,
                "item": item,
            },
            {
                "type": "conversation.item.created",
                "response_id": rid,
                "previous_item_id": resp.previous_item_id,
                "item": item,
            },
            {
                "type": "response.output_item.added",
                "response_id": rid,
                "output_index": 0,
                "item": item,
            },
            {
                "type": "response.content_part.added",
                "response_id": rid,
                "item_id": resp.item_id,
                "output_index": 0,
                "content_index": 0,
                "part": {"type": "audio", "transcript": ""},
            },
            {
                # Response-scoped like a delta (wheel 0.30 ``Speak``), no ``response`` object.
                "type": "response.speak",
                "response_id": rid,
                "item_id": resp.item_id,
                "output_index": 0,
                "content_index": 0,
                "metadata": {"epoch": resp.epoch, "model_speak": True},
            },
        ]

    def chunk(self, resp: ResponseState, session_id: str, record: AssistantRecord) -> list[Payload]:
        """The next audio delta and its transcript delta; advances ``resp`` and its ledger.

        ``metadata`` is what the 0.30 engine puts there: ``audio_duration_ms``
        and the single audio/text mark are cumulative over the response (audio
        up to the end of this delta, characters spoken by then), ``playback``
        is the response's ledger after this delta, ``end_of_turn`` is true on
        the last delta of an uncut response.
        """
        index = resp.next_chunk
        resp.next_chunk += 1
        text = self._bank.transcript(index)
        resp.transcript.append(text)
        total_ms = record.add_chunk(text, self._bank.chunk_ms)
        rid = resp.response_id
        return [
            {
                "type": self._names.audio_delta,
                "response_id": rid,
                "item_id": resp.item_id,
                "output_index": 0,
                "content_index": 0,
                "delta": self._bank.chunk(index),
                "format": "pcm16",
                "sample_rate_hz": self._bank.sample_rate,
                # metadata.epoch is the epoch the chunk was produced under: late
                # audio after a cancel carries the cancelled epoch (§3.3).
                "metadata": {
                    "session_id": session_id,
                    "epoch": resp.epoch,
                    "model_speak": True,
                    "end_of_turn": resp.remaining <= 0,
                    "playback": record.cursor.as_dict(),
                    "audio_duration_ms": total_ms,
                    "audio_text_marks": [
                        {"text_chars": len(record.full_text), "audio_end_ms": total_ms}
                    ],
                },
            },
            {
                "type": self._names.transcript_delta,
                "response_id": rid,
                "item_id": resp.item_id,
                "output_index": 0,
                "content_index": 0,
                "delta": text,
            },
        ]

    def _closing(self, resp: ResponseState, status: str) -> list[Payload]:
        """Audio done through ``conversation.item.done`` (shared by both endings)."""
        rid = resp.response_id
        text = "".join(resp.transcript)
        address = {"response_id": rid, "item_id": resp.item_id, "output_index": 0}
        item = self._item(resp, status)
        return [
            {"type": self._names.audio_done, **address, "content_index": 0},
            {
                "type": self._names.transcript_done,
                **address,
                "content_index": 0,
                "transcript": text,
            },
            {
                "type": "response.content_part.done",
                **address,
                "content_index": 0,
                "part": {"type": "audio", "transcript": text},
            },
            {
                "type": "response.output_item.done",
                "response_id": rid,
                "output_index": 0,
                "item": item,
            },
            {
                "type": "conversation.item.done",
                "response_id": rid,
                "previous_item_id": resp.previous_item_id,
                "item": item,
            },
        ]

    def _done(self, resp: ResponseState, status: str, details: Payload, meta: Payload) -> Payload:
        rid = resp.response_id
        return {
            "type": "response.done",
            "response_id": rid,
            "response": {
                "id": rid,
                "object": "realtime.response",
                "status": status,
                "status_details": details,
                "output": [self._item(resp, status)],
                "metadata": meta,
            },
        }

    @property
    def audio_delta_type(self) -> str:
        """The audio delta event name in use (GA or beta)."""
        return self._names.audio_delta

    def failed(self, resp: ResponseState, record: AssistantRecord, *, reason: str) -> Payload:
        """``response.done`` of a response the engine failed (0.31+ output overflow).

        Only the terminal: the engine converts the response's ending into a
        failed one and sends nothing else of it.
        """
        meta = {
            "epoch": resp.epoch,
            "turn_id": resp.turn_id,
            "committed": False,
            "status": "failed",
            "status_details": {"type": "failed", "reason": reason},
            "playback": record.cursor.as_dict(),
        }
        return self._done(resp, "failed", {"type": "failed", "reason": reason}, meta)

    def completed(
        self, resp: ResponseState, record: AssistantRecord, *, committed: bool
    ) -> list[Payload]:
        """Normal ending: closing markers, ``response.done`` (completed), rate limits.

        Args:
            resp: the finished response.
            record: its ledger (``metadata.playback``).
            committed: whether the reply entered history at its end (under
                ``ack_only`` without acks it did not).
        """
        meta = {
            "epoch": resp.epoch,
            "turn_id": resp.turn_id,
            "committed": committed,
            "committed_ms": record.audio_ms if committed else 0,
            "playback": record.cursor.as_dict(),
        }
        return [
            *self._closing(resp, "completed"),
            self._done(resp, "completed", {"type": "completed", "reason": "stop"}, meta),
            {"type": "rate_limits.updated", "rate_limits": []},
        ]

    def cancelled(
        self,
        resp: ResponseState,
        record: AssistantRecord,
        *,
        reason: str,
        new_epoch: int,
        output_cleared: bool,
    ) -> list[Payload]:
        """Cancel terminal sequence of docs/engine-protocol.md, Cancellation in the engine.

        Args:
            resp: the cancelled response.
            record: its ledger at the cancel (late audio included).
            reason: one of :data:`CANCEL_REASONS`.
            new_epoch: the session epoch after the cancel.
            output_cleared: prepend ``output_audio_buffer.cleared``.
        """
        events: list[Payload] = []
        if output_cleared:
            events.append({"type": "output_audio_buffer.cleared", "response_id": resp.response_id})
        meta = {
            "reason": reason,
            "cancelled_epoch": resp.epoch,
            "epoch": new_epoch,
            "turn_id": resp.turn_id,
            "committed": False,
            # What history kept: the acknowledged position (0 when the client never acked).
            "committed_ms": record.cursor.committed_ms,
            "playback": record.cursor.as_dict(),
        }
        events.extend(self._closing(resp, "cancelled"))
        events.append(self._done(resp, "cancelled", {"type": "cancelled", "reason": reason}, meta))
        events.append({"type": "rate_limits.updated", "rate_limits": []})
        return events
