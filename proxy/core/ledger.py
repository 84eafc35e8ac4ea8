"""CancellationLedger: which responses are open, cancelled or failed.

Engine response ids are never reused, so remembered cancelled ids
("tombstones") are enough to drop late audio (docs/design.md, Cancellation).
A response is open from its ``response.created`` at intake until its
``response.done`` was delivered; a cancel naming none applies to every open
one. Bounded: ``max_tombstones`` tombstones (LRU, evictions counted) and as
many remembered evicted ids; a tombstone expires ``tombstone_ttl`` seconds
after its ``response.done`` was delivered. Sans-I/O: ``now`` is passed in.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DEFAULT_MAX_TOMBSTONES",
    "DEFAULT_TOMBSTONE_TTL",
    "CancellationLedger",
    "LedgerStatistics",
    "Verdict",
]

DEFAULT_MAX_TOMBSTONES: Final = 256
DEFAULT_TOMBSTONE_TTL: Final = 60.0


class Verdict(enum.Enum):
    """What to do with an event of a response."""

    LIVE = "live"  # forward
    CANCELLED = "cancelled"  # audio of a cancelled response: drop
    FAILED = "failed"  # any event of a response failed by the proxy: drop
    EVICTED = "evicted"  # its tombstone was evicted or expired: forward, count


@dataclass(slots=True)
class _Tombstone:
    failed: bool
    cancelled_at: float
    expires_at: float | None  # set once the response's done has passed


@dataclass(slots=True)
class _Open:
    done_received: bool = False


@dataclass(frozen=True, slots=True)
class LedgerStatistics:
    open_responses: int
    tombstones: int
    evictions: int
    expirations: int
    late_after_eviction: int


class CancellationLedger:
    """Tracks open and cancelled responses of one session.

    Args:
        max_tombstones: most cancelled ids remembered (LRU).
        tombstone_ttl: seconds a tombstone outlives its response's done.
    """

    __slots__ = (
        "_evicted",
        "_evictions",
        "_expirations",
        "_late_after_eviction",
        "_max",
        "_open",
        "_tombs",
        "_ttl",
    )

    def __init__(
        self,
        *,
        max_tombstones: int = DEFAULT_MAX_TOMBSTONES,
        tombstone_ttl: float = DEFAULT_TOMBSTONE_TTL,
    ) -> None:
        if max_tombstones < 1:
            raise ValueError("max_tombstones must be >= 1")
        self._max = max_tombstones
        self._ttl = tombstone_ttl
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._tombs: OrderedDict[str, _Tombstone] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._evictions = 0
        self._expirations = 0
        self._late_after_eviction = 0

    # -- lifecycle -----------------------------------------------------------------

    def on_created(self, response_id: str) -> None:
        """The engine's ``response.created`` passed intake."""
        self._open[response_id] = _Open()
        self._open.move_to_end(response_id)
        while len(self._open) > self._max:
            self._open.popitem(last=False)

    def on_done_received(self, response_id: str) -> None:
        """A terminal for this response passed intake (engine's or the proxy's)."""
        state = self._open.get(response_id)
        if state is not None:
            state.done_received = True

    def on_done_delivered(self, response_id: str, now: float) -> None:
        """The response's terminal was written to the client (or dropped for good)."""
        self._open.pop(response_id, None)
        tomb = self._tombs.get(response_id)
        if tomb is not None and tomb.expires_at is None:
            tomb.expires_at = now + self._ttl

    def open_responses(self) -> list[str]:
        """Created and not yet done-delivered, oldest first."""
        return list(self._open)

    def active_response(self) -> str | None:
        """The newest response still producing output (no terminal received, not cancelled)."""
        for response_id in reversed(self._open):
            if not self._open[response_id].done_received and response_id not in self._tombs:
                return response_id
        return None

    def is_open(self, response_id: str) -> bool:
        return response_id in self._open

    def is_producing(self, response_id: str) -> bool:
        """Open, its terminal not received yet, and not cancelled: it can still be failed."""
        record = self._open.get(response_id)
        return record is not None and not record.done_received and response_id not in self._tombs

    # -- cancellation ----------------------------------------------------------------

    def cancel(self, response_id: str, now: float, *, failed: bool = False) -> bool:
        """Tombstone a response. Returns True if it was not cancelled before.

        ``failed=True`` (the proxy failed it on overflow) drops every later
        event of the response, not only its audio.
        """
        tomb = self._tombs.get(response_id)
        if tomb is not None:
            tomb.failed = tomb.failed or failed
            self._tombs.move_to_end(response_id)
            return False
        done_passed = response_id not in self._open
        self._tombs[response_id] = _Tombstone(
            failed=failed,
            cancelled_at=now,
            expires_at=now + self._ttl if done_passed else None,
        )
        self._evicted.pop(response_id, None)
        while len(self._tombs) > self._max:
            old, _ = self._tombs.popitem(last=False)
            self._remember_evicted(old)
            self._evictions += 1
        return True

    def cancelled_at(self, response_id: str) -> float | None:
        tomb = self._tombs.get(response_id)
        return None if tomb is None else tomb.cancelled_at

    def verdict(self, response_id: str | None, *, is_audio: bool, now: float) -> Verdict:
        """Decide about an event of ``response_id`` (None: not response-bound)."""
        if response_id is None:
            return Verdict.LIVE
        tomb = self._tombs.get(response_id)
        if tomb is not None:
            if tomb.expires_at is not None and now >= tomb.expires_at:
                del self._tombs[response_id]
                self._remember_evicted(response_id)
                self._expirations += 1
            else:
                self._tombs.move_to_end(response_id)
                if tomb.failed:
                    return Verdict.FAILED
                return Verdict.CANCELLED if is_audio else Verdict.LIVE
        if is_audio and response_id in self._evicted:
            self._late_after_eviction += 1
            return Verdict.EVICTED
        return Verdict.LIVE

    def expire(self, now: float) -> int:
        """Drop tombstones whose TTL passed; returns how many."""
        expired = [
            rid
            for rid, tomb in self._tombs.items()
            if tomb.expires_at is not None and now >= tomb.expires_at
        ]
        for rid in expired:
            del self._tombs[rid]
            self._remember_evicted(rid)
        self._expirations += len(expired)
        return len(expired)

    @property
    def late_after_eviction(self) -> int:
        """Audio deltas let through because their tombstone was gone."""
        return self._late_after_eviction

    def cancels_settling(self) -> int:
        """Cancelled responses whose terminal has not been written to the client yet.

        Until it is, late audio of such a response may be numbered after the
        last event the client received (docs/engine-protocol.md, Late audio
        after a cancel): a replay from that cursor would hold it.
        """
        return sum(1 for rid in self._tombs if rid in self._open)

    def tombstoned(self) -> list[str]:
        return list(self._tombs)

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(
            open_responses=len(self._open),
            tombstones=len(self._tombs),
            evictions=self._evictions,
            expirations=self._expirations,
            late_after_eviction=self._late_after_eviction,
        )

    def _remember_evicted(self, response_id: str) -> None:
        self._evicted[response_id] = None
        self._evicted.move_to_end(response_id)
        while len(self._evicted) > self._max:
            self._evicted.popitem(last=False)
