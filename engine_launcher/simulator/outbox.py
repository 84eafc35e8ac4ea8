"""A session's outbox: how each produced event is numbered, sized and queued, per release.

On 0.30 every event is numbered (``event_id``, ``server_event_seq``) as it is
produced and queued without bound; on 0.31 and later it is numbered when taken
for sending, the :class:`~engine_launcher.simulator.delivery.OutputQueue` is
bounded, a cleared response's queued audio is removed as the clear passes, and
an overflow is reported back so that the session can fail
(``output_backpressure``). The plain realtime handler (``--session-mode
realtime``) gives events ids but no ``server_event_seq``. A :class:`CloseFrame`
is always the last item. Sans-I/O, like the session that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from engine_launcher.simulator.counters import SimulatorStats
from engine_launcher.simulator.delivery import OutputEntry, OutputOverflow, OutputQueue
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.wire import IdFactory, dumps

__all__ = ["CloseFrame", "Outbox", "Outgoing"]

Payload = dict[str, Any]

# Events that may use the output reserve (0.31 and later).
_RESERVE_TYPES: Final = frozenset({"error", "response.done"})


@dataclass(frozen=True, slots=True)
class CloseFrame:
    """Instruction to the shell: close the socket with ``code``/``reason`` (last item)."""

    code: int
    reason: str


Outgoing = str | CloseFrame


class Outbox:
    """The numbering and queueing rules of one session's output.

    Args:
        config: simulator configuration (release, session mode, output limits).
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
        #: 0.31 and later: bounded, numbered when sent, a cancel removes queued audio.
        self.bounded = config.at_least("0.31")
        #: The duplex handler numbers events; the plain realtime handler does not.
        self.numbered = config.session_mode == "duplex"
        #: An output overflow happened: only the failure's own events go in now.
        self.failed = False

    @property
    def events(self) -> int:
        """Events waiting in the output queue."""
        return self._out.events

    @property
    def bytes(self) -> int:
        """Bytes waiting in the output queue."""
        return self._out.bytes

    def pop(self) -> Outgoing | None:
        """Take the next frame to send (numbered now on 0.31+), or ``None`` when idle."""
        item = self._out.pop()
        if isinstance(item, OutputEntry):
            if item.text is not None:
                return item.text
            assert item.payload is not None
            return self.stamp(item.payload)
        if item is None or isinstance(item, CloseFrame | str):
            return item  # a close, or a frame sent outside the journal
        assert isinstance(item, dict)
        return self.stamp(item)

    def stamp(self, payload: Payload) -> str:
        """Number ``payload`` (``event_id``, ``server_event_seq``) and serialize it."""
        payload["event_id"] = "event_" + self._event_ids.hex32()
        # docs/engine-protocol.md, Conventions: session.created is not journaled and has no seq.
        # The plain realtime handler (--session-mode realtime) numbers nothing.
        if self.numbered and payload["type"] != "session.created":
            self._seq += 1
            payload["server_event_seq"] = self._seq
        return dumps(payload)

    def put(self, payload: Payload) -> bool:
        """Queue ``payload``; on 0.30 it is numbered now, on 0.31+ when taken for sending.

        Returns ``False`` when it overflowed the bounds (0.31+): the session must fail.
        """
        kind = payload["type"]
        if kind == "error":
            self._stats.errors_sent += 1
        if not self.bounded:
            text = self.stamp(payload)
            self._out.put(OutputEntry(text=text, payload=None, size=len(text)))
            return True
        if kind == "session.closed":
            self._out.put_final(payload)  # its own slot, outside the bounds
            return True
        if self.failed and kind not in _RESERVE_TYPES:
            return True  # after an overflow only the failure's own events go in
        if kind == "output_audio_buffer.cleared" and isinstance(payload.get("response_id"), str):
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
        try:
            self._out.put(
                OutputEntry(text=None, payload=payload, size=size, audio_of=audio_of),
                may_reserve=kind in _RESERVE_TYPES,
            )
        except OutputOverflow:
            return False
        return True

    def put_final(self, item: object) -> None:
        """Queue ``item`` (a frame, ``session.closed`` or a :class:`CloseFrame`) after all else."""
        self._out.put_final(item)

    def put_outside_journal(self, payload: Payload) -> None:
        """Queue an event the engine sends outside the session journal: an
        ``event_id`` but no ``server_event_seq``, after everything queued."""
        payload["event_id"] = "event_" + self._event_ids.hex32()
        self._out.put_final(dumps(payload))

    def remove_audio(self, response_id: str) -> int:
        """Drop the queued audio deltas of ``response_id``; how many were dropped."""
        return self._out.remove_audio(response_id)
