"""Quotas per named API key: concurrent sessions, sessions per minute, audio per day.

Sans-I/O: wall time (Unix seconds) is passed in; the UTC minute window and day
are computed from it. The shell (proxy/edge/quota_store.py) asks
:class:`LocalQuotaBook` without a shared store and uses the same window
arithmetic for its Redis keys. What each limit counts and how ``Retry-After``
is computed: docs/design.md, Quotas. A limit of 0 is no limit.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MAX_SESSIONS_RETRY_AFTER",
    "KeyQuota",
    "LocalQuotaBook",
    "QuotaKind",
    "QuotaRefusal",
    "day_window",
    "minute_window",
    "refusal_for",
    "seconds_to_next_minute",
    "seconds_to_utc_midnight",
]

SECONDS_PER_MINUTE: Final = 60
SECONDS_PER_DAY: Final = 86_400
#: ``Retry-After`` of a ``max_sessions`` refusal (seconds).
MAX_SESSIONS_RETRY_AFTER: Final = 1


class QuotaKind(enum.Enum):
    """Label values of ``quota_rejections_total{quota}`` and the JSON body's ``quota``."""

    MAX_SESSIONS = "max_sessions"
    SESSIONS_PER_MINUTE = "sessions_per_minute"
    AUDIO_SECONDS_PER_DAY = "audio_seconds_per_day"


@dataclass(frozen=True, slots=True)
class KeyQuota:
    """The limits of one named key (0: no limit)."""

    max_sessions: int = 0
    sessions_per_minute: int = 0
    audio_seconds_per_day: float = 0.0

    @property
    def limited(self) -> bool:
        return bool(self.max_sessions or self.sessions_per_minute or self.audio_seconds_per_day)

    def limit(self, kind: QuotaKind) -> float:
        """The configured limit of ``kind`` (0: none)."""
        return float(getattr(self, kind.value))


@dataclass(frozen=True, slots=True)
class QuotaRefusal:
    """Why a session was not admitted: the quota, its limit, and when to retry."""

    kind: QuotaKind
    limit: float
    retry_after: int


def minute_window(wall: float) -> int:
    """The index of the UTC minute ``wall`` falls in."""
    return int(wall // SECONDS_PER_MINUTE)


def day_window(wall: float) -> int:
    """The index of the UTC day ``wall`` falls in (days since 1970-01-01)."""
    return int(wall // SECONDS_PER_DAY)


def seconds_to_next_minute(wall: float) -> int:
    """Whole seconds (at least 1) until the next UTC minute starts."""
    return max(1, math.ceil((minute_window(wall) + 1) * SECONDS_PER_MINUTE - wall))


def seconds_to_utc_midnight(wall: float) -> int:
    """Whole seconds (at least 1) until the next UTC midnight."""
    return max(1, math.ceil((day_window(wall) + 1) * SECONDS_PER_DAY - wall))


def refusal_for(kind: QuotaKind, quota: KeyQuota, wall: float) -> QuotaRefusal:
    """The refusal of ``kind`` at ``wall``, with its ``Retry-After``."""
    if kind is QuotaKind.SESSIONS_PER_MINUTE:
        retry = seconds_to_next_minute(wall)
    elif kind is QuotaKind.AUDIO_SECONDS_PER_DAY:
        retry = seconds_to_utc_midnight(wall)
    else:
        retry = MAX_SESSIONS_RETRY_AFTER
    return QuotaRefusal(kind, quota.limit(kind), retry)


class LocalQuotaBook:
    """Counts per key name in this process: open sessions, this minute's, today's audio.

    Counts belong to the key *name*, so they carry over when the key file is
    reloaded with new limits; the limits are passed in with every call.
    """

    __slots__ = ("_active", "_audio", "_minute")

    def __init__(self) -> None:
        self._active: dict[str, int] = {}
        #: name -> (minute window, sessions admitted in it)
        self._minute: dict[str, tuple[int, int]] = {}
        #: name -> (UTC day, audio seconds used that day)
        self._audio: dict[str, tuple[int, float]] = {}

    def admit(self, name: str, quota: KeyQuota, wall: float) -> QuotaRefusal | None:
        """Admit one session of ``name`` (counted) or refuse it (nothing counted).

        Checked in order: audio today, open sessions, sessions this minute.
        """
        limit = quota.audio_seconds_per_day
        if limit and self.audio_used(name, wall) >= limit:
            return refusal_for(QuotaKind.AUDIO_SECONDS_PER_DAY, quota, wall)
        active = self._active.get(name, 0)
        if quota.max_sessions and active >= quota.max_sessions:
            return refusal_for(QuotaKind.MAX_SESSIONS, quota, wall)
        window = minute_window(wall)
        at, count = self._minute.get(name, (window, 0))
        if at != window:
            count = 0
        if quota.sessions_per_minute and count >= quota.sessions_per_minute:
            return refusal_for(QuotaKind.SESSIONS_PER_MINUTE, quota, wall)
        self._minute[name] = (window, count + 1)
        self._active[name] = active + 1
        return None

    def release(self, name: str) -> None:
        """One admitted session of ``name`` ended."""
        left = self._active.get(name, 0) - 1
        if left > 0:
            self._active[name] = left
        else:
            self._active.pop(name, None)

    def charge_audio(self, name: str, seconds: float, wall: float) -> float:
        """Add ``seconds`` of audio to today's count of ``name``; returns today's total."""
        day = day_window(wall)
        at, used = self._audio.get(name, (day, 0.0))
        total = (used if at == day else 0.0) + max(0.0, seconds)
        self._audio[name] = (day, total)
        return total

    def audio_used(self, name: str, wall: float) -> float:
        """Audio seconds ``name`` used in the UTC day of ``wall``."""
        at, used = self._audio.get(name, (day_window(wall), 0.0))
        return used if at == day_window(wall) else 0.0

    def active(self, name: str) -> int:
        """Sessions of ``name`` open now (admitted, not released)."""
        return self._active.get(name, 0)

    def sessions_this_minute(self, name: str, wall: float) -> int:
        at, count = self._minute.get(name, (minute_window(wall), 0))
        return count if at == minute_window(wall) else 0
