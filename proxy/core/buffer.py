"""OutputBuffer: the bounded queue between engine intake and client delivery.

One per session (docs/design.md, Output buffer). Events are charged their UTF-8
size against the ordinary budget; ``error`` and ``response.done`` may use a
small reserve; the final ``session.closed`` has a closure slot outside both.
An offer that does not fit is refused (``Offer.REJECTED_FULL``): the buffer
never blocks and never drops on its own; the session policy decides. Sans-I/O:
``now`` is passed in and only stored for queue-delay figures.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Final

from proxy.core.events import EventKind, UpstreamEvent

__all__ = [
    "DEFAULT_MAX_CLOSE_NOTICE_BYTES",
    "DEFAULT_MAX_PENDING_OUTPUT_BYTES",
    "DEFAULT_MAX_PENDING_OUTPUT_EVENTS",
    "DEFAULT_OUTPUT_RESERVE_BYTES",
    "DEFAULT_OUTPUT_RESERVE_EVENTS",
    "BufferLimits",
    "BufferStatistics",
    "Entry",
    "Offer",
    "OutputBuffer",
]

BYTES: Final = 1
KIB: Final = 1024 * BYTES
MIB: Final = 1024 * KIB

DEFAULT_MAX_PENDING_OUTPUT_BYTES: Final = 2 * MIB
DEFAULT_MAX_PENDING_OUTPUT_EVENTS: Final = 512
DEFAULT_OUTPUT_RESERVE_BYTES: Final = 64 * KIB
DEFAULT_OUTPUT_RESERVE_EVENTS: Final = 8
DEFAULT_MAX_CLOSE_NOTICE_BYTES: Final = 4096

_RESERVE_KINDS: Final = frozenset({EventKind.ERROR, EventKind.RESPONSE_DONE})


class Offer(enum.Enum):
    """Outcome of ``OutputBuffer.offer``."""

    ACCEPTED = "accepted"
    ACCEPTED_RESERVE = "accepted_reserve"
    REJECTED_FULL = "rejected_full"
    REJECTED_CLOSED = "rejected_closed"

    @property
    def accepted(self) -> bool:
        return self is Offer.ACCEPTED or self is Offer.ACCEPTED_RESERVE


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferLimits:
    """Bounds of one session's output buffer (sizes in bytes, counts in events)."""

    max_pending_output_bytes: int = DEFAULT_MAX_PENDING_OUTPUT_BYTES
    max_pending_output_events: int = DEFAULT_MAX_PENDING_OUTPUT_EVENTS
    output_reserve_bytes: int = DEFAULT_OUTPUT_RESERVE_BYTES
    output_reserve_events: int = DEFAULT_OUTPUT_RESERVE_EVENTS
    max_close_notice_bytes: int = DEFAULT_MAX_CLOSE_NOTICE_BYTES

    def __post_init__(self) -> None:
        for name in (
            "max_pending_output_bytes",
            "max_pending_output_events",
            "output_reserve_bytes",
            "output_reserve_events",
            "max_close_notice_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(slots=True)
class Entry:
    """A queued event. ``reserved`` tells which budget it was charged to."""

    event: UpstreamEvent
    enqueued_at: float
    reserved: bool = False
    closure: bool = False

    # Written out: built per queued event (see UpstreamEvent.__init__).
    def __init__(
        self,
        event: UpstreamEvent,
        enqueued_at: float,
        reserved: bool = False,
        closure: bool = False,
    ) -> None:
        self.event = event
        self.enqueued_at = enqueued_at
        self.reserved = reserved
        self.closure = closure


@dataclass(frozen=True, slots=True)
class BufferStatistics:
    """A snapshot for metrics and /debug/sessions."""

    pending_bytes: int
    pending_events: int
    reserve_bytes: int
    reserve_events: int
    peak_pending_bytes: int
    invalidated_events: int
    invalidated_bytes: int
    rejected_full: int
    closure_pending: bool
    closed: bool


class OutputBuffer:
    """Bounded FIFO with a reserve, a closure slot and per-response invalidation.

    Args:
        limits: the session's bounds.
    """

    __slots__ = (
        "_closed",
        "_closure",
        "_closure_taken",
        "_invalidated_bytes",
        "_invalidated_events",
        "_limits",
        "_ordinary_bytes",
        "_ordinary_events",
        "_peak_bytes",
        "_queue",
        "_rejected_full",
        "_reserve_bytes",
        "_reserve_events",
        "closure_pending",
        "pending_bytes",
        "pending_events",
    )

    def __init__(self, limits: BufferLimits) -> None:
        self._limits = limits
        self._queue: deque[Entry] = deque()
        self._ordinary_bytes = 0
        self._ordinary_events = 0
        self._reserve_bytes = 0
        self._reserve_events = 0
        self._peak_bytes = 0
        self._closure: Entry | None = None
        self._closed = False
        self._closure_taken = False
        self._invalidated_events = 0
        self._invalidated_bytes = 0
        self._rejected_full = 0
        #: Output bytes and events queued (both budgets), kept current: read per event.
        self.pending_bytes = 0
        self.pending_events = 0
        #: The closure notice waits to be taken.
        self.closure_pending = False

    # -- producer side -----------------------------------------------------------

    @property
    def limits(self) -> BufferLimits:
        return self._limits

    @property
    def closed(self) -> bool:
        """True once a closure notice was accepted; offers are then refused."""
        return self._closed

    def offer(self, event: UpstreamEvent, now: float) -> Offer:
        """Queue an event if its budget allows; never blocks.

        Returns:
            ACCEPTED or ACCEPTED_RESERVE when queued; REJECTED_FULL when
            neither budget has room (the caller applies its overflow policy);
            REJECTED_CLOSED after ``close``.
        """
        if self._closed:
            return Offer.REJECTED_CLOSED
        limits = self._limits
        size = event.size
        if (
            self._ordinary_events < limits.max_pending_output_events
            and self._ordinary_bytes + size <= limits.max_pending_output_bytes
        ):
            self._ordinary_events += 1
            self._ordinary_bytes += size
            self._queue.append(Entry(event, now))
            self._added(size)
            return Offer.ACCEPTED
        if (
            event.kind in _RESERVE_KINDS
            and self._reserve_events < limits.output_reserve_events
            and self._reserve_bytes + size <= limits.output_reserve_bytes
        ):
            self._reserve_events += 1
            self._reserve_bytes += size
            self._queue.append(Entry(event, now, reserved=True))
            self._added(size)
            return Offer.ACCEPTED_RESERVE
        self._rejected_full += 1
        return Offer.REJECTED_FULL

    def close(self, notice: UpstreamEvent, *, compact: UpstreamEvent, now: float) -> bool:
        """Place the final notification in the closure slot.

        Args:
            notice: the ``session.closed`` to deliver last.
            compact: used instead when ``notice`` exceeds ``max_close_notice_bytes``.

        Returns:
            True if this call closed the buffer; False if it was already closed
            (duplicate closes are harmless).
        """
        if self._closed:
            return False
        chosen = notice if notice.size <= self._limits.max_close_notice_bytes else compact
        self._closure = Entry(chosen, now, closure=True)
        self._closed = True
        self.closure_pending = True
        return True

    def invalidate(self, response_id: str) -> tuple[int, int]:
        """Remove queued audio deltas of one response; everything else keeps its order.

        Returns:
            (events, bytes) removed from the queue.
        """
        removed_events = 0
        removed_bytes = 0
        if not any(e.event.response_id == response_id and e.event.is_audio for e in self._queue):
            return 0, 0
        kept: deque[Entry] = deque()
        for entry in self._queue:
            ev = entry.event
            if ev.is_audio and ev.response_id == response_id:
                removed_events += 1
                removed_bytes += ev.size
                self._release(entry)
            else:
                kept.append(entry)
        self._queue = kept
        self._invalidated_events += removed_events
        self._invalidated_bytes += removed_bytes
        return removed_events, removed_bytes

    # -- consumer side -------------------------------------------------------------

    def peek(self) -> Entry | None:
        """The entry ``pop`` would return next, without taking it."""
        if self._queue:
            return self._queue[0]
        if self._closure is not None and not self._closure_taken:
            return self._closure
        return None

    def pop(self) -> Entry | None:
        """Take the next event to write, out of the budget; the closure comes last, once.

        Returns:
            the entry, or None when nothing is ready.
        """
        if self._queue:
            entry = self._queue.popleft()
            self._release(entry)
            return entry
        if self.closure_pending:
            self._closure_taken = True
            self.closure_pending = False
            return self._closure
        return None

    def statistics(self) -> BufferStatistics:
        return BufferStatistics(
            pending_bytes=self._ordinary_bytes + self._reserve_bytes,
            pending_events=self._ordinary_events + self._reserve_events,
            reserve_bytes=self._reserve_bytes,
            reserve_events=self._reserve_events,
            peak_pending_bytes=self._peak_bytes,
            invalidated_events=self._invalidated_events,
            invalidated_bytes=self._invalidated_bytes,
            rejected_full=self._rejected_full,
            closure_pending=self._closure is not None and not self._closure_taken,
            closed=self._closed,
        )

    # -- internals -------------------------------------------------------------------

    def _release(self, entry: Entry) -> None:
        size = entry.event.size
        if entry.reserved:
            self._reserve_events -= 1
            self._reserve_bytes -= size
        else:
            self._ordinary_events -= 1
            self._ordinary_bytes -= size
        self.pending_bytes -= size
        self.pending_events -= 1

    def _added(self, size: int) -> None:
        self.pending_events += 1
        total = self.pending_bytes = self.pending_bytes + size
        self._peak_bytes = max(self._peak_bytes, total)
