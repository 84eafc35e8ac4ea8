"""The resume journal: events written to the client, kept for a resume (docs/design.md, Resume).

Only events with a ``server_event_seq``, and only their frame text (a replay
parses it again), counted as held: ``sys.getsizeof`` of the text plus
``ENTRY_OVERHEAD_BYTES``. Bounded by ``resume_journal_bytes``, by the room the
session's output budget leaves (``room``) and by ``resume_journal_ttl``,
oldest first; ``session.event_ack`` trims it. A cursor older than what was
dropped is a gap. Sans-I/O: ``now`` is passed in.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from typing import Final

__all__ = ["ENTRY_OVERHEAD_BYTES", "ReplayJournal"]

#: What one kept event costs beside its text (bytes): its record (a 4-tuple),
#: the float and int in it, the deque's slot and a share of the response id
#: (CPython 3.11, 64-bit; bench/resume_memory.py measures it).
ENTRY_OVERHEAD_BYTES: Final = 200


class ReplayJournal:
    """Frames written to the client, by their engine ``server_event_seq``.

    Args:
        max_bytes: what the kept events may cost together (``resume_journal_bytes``).
        ttl: seconds an event is kept after it was written.
    """

    __slots__ = ("_entries", "_last", "_max_bytes", "_ttl", "bytes", "dropped_upto")

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self._max_bytes = max_bytes
        self._ttl = ttl
        #: (seq, written at, text, response id of an audio delta), oldest first.
        self._entries: deque[tuple[int, float, str, str | None]] = deque()
        #: What the kept events cost (bytes, as ``ENTRY_OVERHEAD_BYTES`` counts).
        self.bytes = 0
        self._last = 0
        #: The highest seq no longer here (acknowledged, expired or pushed out).
        self.dropped_upto = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, seq: int, text: str, audio_of: str | None, now: float, room: int) -> None:
        """``text`` (with ``server_event_seq`` ``seq``) was written to the client.

        Args:
            audio_of: the response an audio delta belongs to (None: not audio,
                or audio of no response): a replay leaves out audio of a
                response cancelled since.
            room: what the session's output budget has left beside its queue;
                the journal keeps no more than that, nor ``max_bytes``.

        A seq not above the last one recorded (a replayed event) is kept once.
        """
        if seq <= self._last:
            return
        self._last = seq
        self._entries.append((seq, now, text, audio_of))
        self.bytes += sys.getsizeof(text) + ENTRY_OVERHEAD_BYTES
        self.trim(min(self._max_bytes, room))

    def trim(self, limit: int) -> int:
        """Drop the oldest events until the journal costs at most ``limit``.

        Returns:
            the bytes freed.
        """
        before = self.bytes
        entries = self._entries
        while self.bytes > limit and entries:
            self._drop_oldest()
        return before - self.bytes

    def ack(self, seq: int) -> None:
        """The client has everything up to ``seq``."""
        entries = self._entries
        while entries and entries[0][0] <= seq:
            self._drop_oldest()

    def expire(self, now: float) -> None:
        entries = self._entries
        while entries and now - entries[0][1] > self._ttl:
            self._drop_oldest()

    def after(self, cursor: int, now: float, keep: Callable[[str], bool]) -> list[str] | None:
        """The frames written after ``cursor``, oldest first, but audio for which
        ``keep(response id)`` is False.

        Returns:
            None when something after ``cursor`` is no longer kept (a gap).
        """
        self.expire(now)
        if cursor < self.dropped_upto:
            return None
        return [
            text
            for seq, _, text, audio_of in self._entries
            if seq > cursor and (audio_of is None or keep(audio_of))
        ]

    def _drop_oldest(self) -> None:
        seq, _, text, _ = self._entries.popleft()
        self.bytes -= sys.getsizeof(text) + ENTRY_OVERHEAD_BYTES
        self.dropped_upto = max(self.dropped_upto, seq)
