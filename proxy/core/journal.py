"""The resume journal: events written to the client, kept for a resume (docs/design.md, Resume).

A client whose connection drops resumes with the last ``server_event_seq`` it
received; what it was written after that (in flight when the connection
died) is replayed from here, then what the session queued while it was away.
Only events with a ``server_event_seq`` are kept. Bounded by
``resume_journal_bytes`` (oldest dropped first) and ``resume_journal_ttl``;
the client's ``session.event_ack`` trims it. A cursor older than what was
dropped cannot be replayed (a gap). Sans-I/O: ``now`` is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from proxy.core.buffer import Entry

__all__ = ["ReplayJournal"]


class ReplayJournal:
    """Entries written to the client, by their engine ``server_event_seq``.

    Args:
        max_bytes: what the kept events may weigh together (their frame sizes).
        ttl: seconds an event is kept after it was written.
    """

    __slots__ = ("_bytes", "_entries", "_last", "_max_bytes", "_ttl", "dropped_upto")

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self._max_bytes = max_bytes
        self._ttl = ttl
        #: (seq, written at, entry), oldest first.
        self._entries: deque[tuple[int, float, Entry]] = deque()
        self._bytes = 0
        self._last = 0
        #: The highest seq no longer here (acknowledged, expired or pushed out).
        self.dropped_upto = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, seq: int, entry: Entry, now: float) -> None:
        """``entry`` (with ``server_event_seq`` ``seq``) was written to the client.

        A seq not above the last one recorded (a replayed event) is kept once.
        """
        if seq <= self._last:
            return
        self._last = seq
        self._entries.append((seq, now, entry))
        self._bytes += entry.event.size
        while self._bytes > self._max_bytes and self._entries:
            self._drop_oldest()

    def ack(self, seq: int) -> None:
        """The client has everything up to ``seq``."""
        entries = self._entries
        while entries and entries[0][0] <= seq:
            self._drop_oldest()

    def expire(self, now: float) -> None:
        entries = self._entries
        while entries and now - entries[0][1] > self._ttl:
            self._drop_oldest()

    def after(self, cursor: int, now: float, keep: Callable[[Entry], bool]) -> list[Entry] | None:
        """What was written after ``cursor``, oldest first, for which ``keep`` holds.

        Returns:
            None when something after ``cursor`` is no longer kept (a gap).
        """
        self.expire(now)
        if cursor < self.dropped_upto:
            return None
        return [entry for seq, _, entry in self._entries if seq > cursor and keep(entry)]

    def _drop_oldest(self) -> None:
        seq, _, entry = self._entries.popleft()
        self._bytes -= entry.event.size
        self.dropped_upto = max(self.dropped_upto, seq)
