"""Per-session output queue of a simulated engine (no I/O, no clock).

0.30: unbounded, strictly FIFO; 0.31 and later: bounded in bytes and events
with a reserve and a closure slot, queued audio removable on a cancel
(docs/design.md, Simulator). Entries are numbered when taken. An event
that fits nowhere raises :class:`OutputOverflow` and the session fails; the
queue only stores entries, stamping and serializing are the session's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from engine_launcher.simulator.wire import Payload

__all__ = [
    "DEFAULT_OUTPUT_LIMITS",
    "OutputEntry",
    "OutputLimits",
    "OutputOverflow",
    "OutputQueue",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputLimits:
    """Bounds of one session's queued output (0.31 and later).

    Attributes:
        max_bytes: queued bytes (unit: bytes of JSON, base64 audio included)
            ordinary events may use.
        max_events: queued events (unit: events) ordinary events may use.
        reserve_bytes: extra bytes only ``error`` and ``response.done`` may use.
        reserve_events: extra events only ``error`` and ``response.done`` may use.
    """

    max_bytes: int
    max_events: int
    reserve_bytes: int
    reserve_events: int

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_events, self.reserve_bytes, self.reserve_events) <= 0:
            raise ValueError("output queue limits must be positive")


#: The engine's own defaults (``duplex_session`` in vLLM-Omni 0.31 and 0.32):
#: 2 MiB / 512 events, and a 64 KiB / 8-event reserve.
DEFAULT_OUTPUT_LIMITS: Final = OutputLimits(
    max_bytes=2 * 1024 * 1024, max_events=512, reserve_bytes=64 * 1024, reserve_events=8
)


class OutputOverflow(Exception):
    """An event fits neither the session's output budget nor its reserve."""


@dataclass(slots=True, kw_only=True)
class OutputEntry:
    """One queued event, not numbered yet.

    Attributes:
        payload: the event.
        size: bytes it counts against the bounds (and the queue's byte gauge).
        reserved: it was admitted into the reserve.
        audio_of: the response it is an audio delta of, if it is one.
        journal: it gets a ``server_event_seq`` and is journaled when taken.
    """

    payload: Payload
    size: int
    reserved: bool = False
    audio_of: str | None = None
    journal: bool = True


class OutputQueue:
    """FIFO of one session's output: unbounded (``limits=None``) or bounded.

    Args:
        limits: the bounds (0.31 and later); ``None`` queues without limit (0.30).
    """

    __slots__ = ("_bytes", "_entries", "_final", "_limits", "_reserved_bytes", "_reserved_events")

    def __init__(self, limits: OutputLimits | None) -> None:
        self._limits = limits
        self._entries: deque[OutputEntry] = deque()
        self._bytes = 0
        self._reserved_bytes = 0
        self._reserved_events = 0
        self._final: list[object] = []

    @property
    def events(self) -> int:
        """Queued events (the final slot not included)."""
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Queued bytes, reserve included."""
        return self._bytes + self._reserved_bytes

    def put(self, entry: OutputEntry, *, may_reserve: bool = False) -> None:
        """Queue ``entry`` at the end.

        Args:
            entry: the event.
            may_reserve: it is an ``error`` or ``response.done``, which may
                use the reserve once the ordinary budget is spent.

        Raises:
            OutputOverflow: bounded, and it fits neither budget (nothing queued).
        """
        limits = self._limits
        if limits is not None:
            over = self._bytes + entry.size > limits.max_bytes or (
                len(self._entries) - self._reserved_events >= limits.max_events
            )
            if over and (
                not may_reserve
                or self._reserved_bytes + entry.size > limits.reserve_bytes
                or self._reserved_events >= limits.reserve_events
            ):
                raise OutputOverflow("session pending output limit exceeded")
            entry.reserved = over
        self._entries.append(entry)
        if entry.reserved:
            self._reserved_bytes += entry.size
            self._reserved_events += 1
        else:
            self._bytes += entry.size

    def put_final(self, item: object) -> None:
        """Queue what must come after everything else (``session.closed``, the close).

        Outside every bound, like the engine's single ``session.closed`` slot.
        """
        self._final.append(item)

    def remove_audio(self, response_id: str) -> int:
        """Remove the queued audio deltas of ``response_id``; return how many.

        Everything else keeps its exact order.
        """
        kept: deque[OutputEntry] = deque()
        removed = 0
        for entry in self._entries:
            if entry.audio_of == response_id:
                self._release(entry)
                removed += 1
            else:
                kept.append(entry)
        self._entries = kept
        return removed

    def pop(self) -> OutputEntry | object | None:
        """The next item: a queued :class:`OutputEntry`, then the final items, then ``None``."""
        if self._entries:
            entry = self._entries.popleft()
            self._release(entry)
            return entry
        if self._final:
            return self._final.pop(0)
        return None

    def _release(self, entry: OutputEntry) -> None:
        if entry.reserved:
            self._reserved_bytes -= entry.size
            self._reserved_events -= 1
        else:
            self._bytes -= entry.size
