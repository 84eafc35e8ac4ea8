"""Response generation: how a session starts, streams, completes and cancels a response.

:class:`ResponseGeneration` adds the response lifecycle to
:class:`~engine_launcher.simulator.session_state.SimulatedSession`: ``response.created``
… ``response.speak`` on start, one audio + transcript delta per
:meth:`~ResponseGeneration.produce_chunk` (the shell paces the calls), the
terminal events on completion or cancel, and what each release does with
audio still queued when a response is cancelled (0.30 delivers it late, 0.31+
removes it). The events themselves are built by
:mod:`engine_launcher.simulator.responses`. No I/O, no clock.
"""

from __future__ import annotations

from engine_launcher.simulator.playback_history import ACK_ONLY, AssistantRecord, PlaybackCursor
from engine_launcher.simulator.responses import ResponseState
from engine_launcher.simulator.session_state import MAX_ASSISTANT_RECORDS, Phase, SimulatedSession

__all__ = ["ResponseGeneration"]


class ResponseGeneration(SimulatedSession):
    """The response lifecycle of a session: start, produce, complete, cancel."""

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
        if self._outbox.drops_cancelled_audio:
            self._stats.removed_audio_events += self._outbox.remove_audio(resp.response_id)
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
