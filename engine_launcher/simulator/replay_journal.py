"""A session's replay journal: the numbered frames a resume may have to send again.

Every frame that carries ``server_event_seq`` is recorded as it is numbered; a
``session.event_ack`` drops what it acknowledges, age drops the rest, and a
byte bound stops journaling for good. Sans-I/O: time is an argument.
docs/design.md, Simulator (Resume).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DEFAULT_JOURNAL_LIMITS",
    "EngineJournal",
    "JournalLimits",
    "Replay",
    "ReplayProblem",
    "frame_bytes",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalLimits:
    """Bounds of one session's journal (the engine's ``resume_replay_*`` settings).

    Attributes:
        max_bytes: journaled bytes (unit: bytes of the frames' JSON text). A
            frame that would go past it overflows the journal: the session
            sends ``session.resync_required {journal_overflow}`` once and
            journals (and numbers) nothing more.
        ttl_s: seconds a frame stays journaled without an ack; older ones are
            dropped, and a resume from before them is a ``journal_gap``.
    """

    max_bytes: int
    ttl_s: float

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or not self.ttl_s > 0:
            raise ValueError("journal limits must be positive")


#: vLLM-Omni's defaults: ``resume_replay_max_bytes_per_session`` 8 MiB and
#: ``resume_replay_ttl_s`` 60 s.
DEFAULT_JOURNAL_LIMITS: Final = JournalLimits(max_bytes=8 * 1024 * 1024, ttl_s=60.0)


def frame_bytes(text: str) -> int:
    """UTF-8 size of a frame's text (its length when ASCII, the usual case)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class ReplayProblem(enum.Enum):
    """Why the journal cannot replay from a cursor."""

    #: Frames after the cursor were dropped (acked, aged out) or never kept (overflow).
    GAP = "journal_gap"
    #: The cursor is past the last numbered frame: it names nothing this session sent.
    AHEAD = "ahead"


@dataclass(frozen=True, slots=True)
class Replay:
    """The frames after a cursor, oldest first."""

    frames: list[str]


class EngineJournal:
    """Numbered frames of one session, bounded by :class:`JournalLimits`.

    Args:
        limits: its byte and age bounds.
    """

    __slots__ = ("_bytes", "_dropped_through", "_entries", "_limits", "last_seq", "overflowed")

    def __init__(self, limits: JournalLimits) -> None:
        self._limits = limits
        self._entries: deque[tuple[int, float, str, int]] = deque()
        self._bytes = 0
        # Highest seq no longer journaled (acked or aged out): a resume from
        # before it cannot be bridged.
        self._dropped_through = 0
        #: Highest seq recorded.
        self.last_seq = 0
        #: The byte bound was hit: nothing is journaled any more.
        self.overflowed = False

    @property
    def bytes(self) -> int:
        """Journaled bytes."""
        return self._bytes

    @property
    def frames(self) -> int:
        """Journaled frames."""
        return len(self._entries)

    def fits(self, size: int, now: float) -> bool:
        """Whether a frame of ``size`` bytes can be journaled now (after aging out old ones).

        ``False`` marks the journal overflowed for good.
        """
        self.prune(now)
        if not self.overflowed and self._bytes + size > self._limits.max_bytes:
            self.overflowed = True
            while self._entries:  # no replay is possible any more: free them
                self._drop()
        return not self.overflowed

    def record(self, seq: int, text: str, size: int, now: float) -> None:
        """Keep the frame numbered ``seq`` (after :meth:`fits` said yes)."""
        self._entries.append((seq, now, text, size))
        self._bytes += size
        self.last_seq = seq

    def acknowledge(self, seq: int) -> bool:
        """Drop every frame up to ``seq``; ``False`` (nothing done) when ``seq`` is ahead."""
        if seq > self.last_seq:
            return False
        while self._entries and self._entries[0][0] <= seq:
            self._drop()
        self._dropped_through = max(self._dropped_through, seq)
        return True

    def prune(self, now: float) -> None:
        """Drop frames older than the TTL."""
        cutoff = now - self._limits.ttl_s
        while self._entries and self._entries[0][1] <= cutoff:
            self._dropped_through = max(self._dropped_through, self._entries[0][0])
            self._drop()

    def replay_after(self, cursor: int, now: float) -> Replay | ReplayProblem:
        """The frames numbered after ``cursor``, or why they cannot all be sent."""
        self.prune(now)
        if self.overflowed or cursor < self._dropped_through:
            return ReplayProblem.GAP
        if cursor > self.last_seq:
            return ReplayProblem.AHEAD
        return Replay([text for seq, _, text, _ in self._entries if seq > cursor])

    def _drop(self) -> None:
        _, _, _, size = self._entries.popleft()
        self._bytes -= size
