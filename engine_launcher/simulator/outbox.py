"""A session's outbox: how each produced event is numbered, journaled and queued, per release.

Events wait unnumbered in the :class:`~engine_launcher.simulator.delivery.OutputQueue`
(unbounded on 0.30, bounded from 0.31, where a cancel removes queued audio
first) and get ``event_id`` and ``server_event_seq`` when taken, at which point
a numbered frame enters the session's
:class:`~engine_launcher.simulator.replay_journal.EngineJournal`. The plain
realtime handler (``--session-mode realtime``) numbers nothing. A
:class:`CloseFrame` is always the last item. Sans-I/O. docs/design.md, Simulator.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from engine_launcher.simulator.counters import SimulatorStats
from engine_launcher.simulator.delivery import OutputEntry, OutputOverflow, OutputQueue
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.replay_journal import EngineJournal, frame_bytes
from engine_launcher.simulator.wire import IdFactory, Payload, dumps

__all__ = ["CloseFrame", "EngineOutbox", "Outgoing"]


# Events that may use the output reserve (0.31 and later).
_RESERVE_TYPES: Final = frozenset({"error", "response.done"})


@dataclass(frozen=True, slots=True)
class CloseFrame:
    """Instruction to the shell: close the socket with ``code``/``reason`` (last item)."""

    code: int
    reason: str


Outgoing = str | CloseFrame


class EngineOutbox:
    """The numbering, journaling and queueing rules of one session's output.

    Args:
        config: simulator configuration (release, session mode, output and
            journal limits).
        stats: process-wide counters to update.
        audio_delta_type: the audio delta event name in use (its size is
            counted without serializing the audio twice).
    """

    def __init__(
        self, config: SimulatorConfig, stats: SimulatorStats, audio_delta_type: str
    ) -> None:
        self._stats = stats
        self._audio_delta_type = audio_delta_type
        # A separate counter for event ids: they follow send order only, so
        # object ids stay the same whatever interleaving the pace produces.
        self._event_ids = IdFactory(deterministic=config.deterministic)
        self._seq = 0
        self._out = OutputQueue(config.output_limits)
        # Frames that go before anything still queued: a resume's
        # session.resumed and replay (bounded by the journal's bytes), or the
        # frame held back behind a journal_overflow notice.
        self._ready: deque[str] = deque()
        #: 0.31 and later: bounded; a cancel or clear removes queued audio.
        self.bounded = config.release.bounded_output
        self.drops_cancelled_audio = config.release.drops_cancelled_audio
        #: The duplex handler numbers events; the plain realtime handler does not.
        self.numbered = config.session_mode == "duplex"
        #: Numbered frames a resume may replay (the duplex handler only).
        self.journal = EngineJournal(config.journal_limits) if self.numbered else None
        #: An output overflow happened: only the failure's own events go in now.
        self.failed = False
        #: Named in ``session.resync_required`` (set when the session opens).
        self.session_id = ""

    @property
    def events(self) -> int:
        """Events waiting in the output queue."""
        return self._out.events + len(self._ready)

    @property
    def bytes(self) -> int:
        """Bytes waiting in the output queue."""
        return self._out.bytes

    def pop(self, now: float = 0.0) -> Outgoing | None:
        """Take the next frame to send, numbered and journaled now, or ``None`` when idle.

        Args:
            now: seconds on the shell's clock, for the journal's age bound.
        """
        if self._ready:
            return self._ready.popleft()
        item = self._out.pop()
        if isinstance(item, OutputEntry):
            return self._number(item.payload, journal=item.journal, now=now)
        if item is None or isinstance(item, CloseFrame | str):
            return item  # a close, or a frame sent outside the journal
        assert isinstance(item, dict)
        return self._number(item, journal=True, now=now)

    def _number(self, payload: Payload, *, journal: bool, now: float) -> str:
        """Give ``payload`` its ``event_id`` and, when journaled, its ``server_event_seq``."""
        payload["event_id"] = "event_" + self._event_ids.hex32()
        log = self.journal
        # docs/engine-protocol.md, Conventions: session.created is not journaled and has no seq.
        if log is None or not journal or log.overflowed or payload["type"] == "session.created":
            return dumps(payload)
        payload["server_event_seq"] = seq = self._seq + 1
        text = dumps(payload)
        size = frame_bytes(text)
        if log.fits(size, now):
            self._seq = seq
            log.record(seq, text, size, now)
            return text
        # docs/engine-protocol.md, Resume: the journal overflowed. One
        # session.resync_required, then this and every later frame unnumbered.
        self._stats.journal_overflows += 1
        del payload["server_event_seq"]
        notice = self.unnumbered(
            {
                "type": "session.resync_required",
                "session_id": self.session_id,
                "reason": "journal_overflow",
            }
        )
        payload["event_id"] = "event_" + self._event_ids.hex32()
        self._ready.append(dumps(payload))
        return notice

    def unnumbered(self, payload: Payload) -> str:
        """Serialize a frame sent outside the journal: an ``event_id``, no ``server_event_seq``."""
        payload["event_id"] = "event_" + self._event_ids.hex32()
        return dumps(payload)

    def put(self, payload: Payload, *, journal: bool = True) -> bool:
        """Queue ``payload``, to be numbered when taken.

        Args:
            payload: the event.
            journal: give it a ``server_event_seq`` and journal it (errors the
                engine's transport sends itself are not).

        Returns ``False`` when it overflowed the bounds (0.31+): the session must fail.
        """
        kind = payload["type"]
        if kind == "error":
            self._stats.errors_sent += 1
        if self.bounded and kind == "session.closed":
            self._out.put_final(payload)  # its own slot, outside the bounds
            return True
        if self.failed and kind not in _RESERVE_TYPES:
            return True  # after an overflow only the failure's own events go in
        if (
            self.drops_cancelled_audio
            and kind == "output_audio_buffer.cleared"
            and isinstance(payload.get("response_id"), str)
        ):
            # The engine removes a cleared response's queued audio as the clear passes.
            self._stats.removed_audio_events += self._out.remove_audio(payload["response_id"])
        audio_of: str | None = None
        delta = payload.get("delta")
        if kind == self._audio_delta_type and isinstance(delta, str):
            audio_of = payload.get("response_id")
            # Count base64 audio by its characters, without serializing it twice.
            size = len(delta) + len(dumps({**payload, "delta": ""}))
        else:
            size = len(dumps(payload))
        entry = OutputEntry(payload=payload, size=size, audio_of=audio_of, journal=journal)
        try:
            self._out.put(entry, may_reserve=kind in _RESERVE_TYPES)
        except OutputOverflow:
            return False
        return True

    def put_final(self, item: object) -> None:
        """Queue ``item`` (a frame, ``session.closed`` or a :class:`CloseFrame`) after all else."""
        self._out.put_final(item)

    def put_outside_journal(self, payload: Payload) -> None:
        """Queue an event the engine sends outside the session journal: an
        ``event_id`` but no ``server_event_seq``, after everything queued."""
        self._out.put_final(self.unnumbered(payload))

    def put_ready(self, frames: list[str]) -> None:
        """Send ``frames`` before anything queued, replacing frames still waiting there.

        A resume's ``session.resumed`` and replay: a later resume supersedes
        what an earlier one had not sent yet (it replays from its own cursor).
        """
        self._ready.clear()
        self._ready.extend(frames)

    def remove_audio(self, response_id: str) -> int:
        """Drop the queued audio deltas of ``response_id``; how many were dropped."""
        return self._out.remove_audio(response_id)
