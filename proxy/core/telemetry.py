"""What a session counts for the metrics and the console, sans-I/O.

``SessionTelemetry`` (``core.telemetry``) counts drops by reason, overflows,
cancels and two timings (cancel-to-silence, first audio). The core only adds
and sets ``news``; its drain then takes what changed into a ``Report``
(proxy/core/drain.py) for the observer, so an ordinary audio delta costs one
attribute test (docs/design.md, Metrics).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

__all__ = ["DropCount", "DropReason", "SessionTelemetry", "SilenceWindow"]


class DropReason(enum.Enum):
    """Label values of ``dropped_*_total{reason}`` (docs/design.md, Metrics)."""

    CANCELLED_AUDIO = "cancelled_audio"
    LATE_AUDIO = "late_audio"
    OVERFLOW = "overflow"
    FAILED_RESPONSE = "failed_response"
    INVALID_CLIENT_FRAME = "invalid_client_frame"
    INVALID_UPSTREAM_FRAME = "invalid_upstream_frame"
    INPUT_BACKPRESSURE = "input_backpressure"  # client audio over max_input_audio_rate
    SESSION_CLOSED = "session_closed"  # engine output after the session began closing
    CLIENT_RATE_LIMITED = "client_rate_limited"  # client frames over max_client_frame_rate
    PLAYBACK_ANSWER = "playback_answer"  # the engine's answers to the sidecar's own acks


class DropCount:
    """Drops of one reason: since the observer last took them, and over the session's life."""

    def __init__(self) -> None:
        self.new_events = 0
        self.new_bytes = 0
        self.total_events = 0
        self.total_bytes = 0


class SilenceWindow:
    """One cancelled response's cancel-to-silence window: from the cancel to the last
    audio of that response written after it (equal when none was)."""

    def __init__(self, cancelled_at: float) -> None:
        self.cancelled_at = cancelled_at
        self.last_audio_at = cancelled_at


_NOTHING: Final[tuple[tuple[float, ...], tuple[float, ...]]] = ((), ())


class SessionTelemetry:
    """Counters and timings of one session.

    Args:
        max_silence_windows: cancel-to-silence windows kept open at once; the
            oldest is observed early when a new one would exceed it (the
            session's ``max_tombstones``, so it is bounded like the ledger).
    """

    def __init__(self, max_silence_windows: int) -> None:
        #: Something below (or an engine fact the observer reports) changed;
        #: the observer clears it after exporting.
        self.news = False
        #: Overflows of the session's own output bound (``overflows_total{policy}``).
        self.overflows = 0
        #: Responses tombstoned: cancelled, or failed by the overflow policy.
        self.cancels = 0
        self.drops: dict[DropReason, DropCount] = {reason: DropCount() for reason in DropReason}
        self._drops_dirty = False
        self._max_windows = max_silence_windows
        #: Open cancel-to-silence windows by response id. The core holds this very
        #: dict too (read per delivered audio event: one attribute away).
        self.silence_windows: dict[str, SilenceWindow] = {}
        #: Responses tombstoned since the last take, oldest first.
        self._cancelled: list[str] = []
        self._silence_observed: list[float] = []
        self._first_audio_observed: list[float] = []

    # -- drops -------------------------------------------------------------------------------

    def count_drop(self, reason: DropReason, size: int, *, events: int = 1) -> None:
        """``events`` frames of ``size`` bytes in all were dropped for ``reason``."""
        if events <= 0:
            return
        self._drops_dirty = True
        self.news = True
        count = self.drops[reason]
        count.new_events += events
        count.new_bytes += size
        count.total_events += events
        count.total_bytes += size

    def take_drops(self) -> dict[DropReason, tuple[int, int]]:
        """Drops by reason since the last call, as (events, bytes)."""
        if not self._drops_dirty:
            return {}
        self._drops_dirty = False
        out = {
            reason: (count.new_events, count.new_bytes)
            for reason, count in self.drops.items()
            if count.new_events or count.new_bytes
        }
        for count in self.drops.values():
            count.new_events = count.new_bytes = 0
        return out

    def drop_totals(self) -> dict[DropReason, tuple[int, int]]:
        """Drops by reason over the session's life, as (events, bytes)."""
        return {
            reason: (count.total_events, count.total_bytes) for reason, count in self.drops.items()
        }

    # -- timings -----------------------------------------------------------------------------

    def response_cancelled(self, response_id: str, now: float) -> None:
        """A response was tombstoned by a cancel: count it and open its silence window."""
        self.response_failed(response_id)
        windows = self.silence_windows
        if len(windows) >= self._max_windows:
            self.observe_silence(next(iter(windows)))
        windows[response_id] = SilenceWindow(now)

    def response_failed(self, response_id: str) -> None:
        """A response was tombstoned (cancelled, or failed by the overflow policy)."""
        self.cancels += 1
        self._cancelled.append(response_id)
        self.news = True

    def take_cancelled(self) -> list[str]:
        """Responses tombstoned since the last call, oldest first."""
        out, self._cancelled = self._cancelled, []
        return out

    def observe_silence(self, response_id: str) -> None:
        """No more audio of this response can follow: its window is a measurement."""
        window = self.silence_windows.pop(response_id, None)
        if window is not None:
            self._silence_observed.append(max(0.0, window.last_audio_at - window.cancelled_at))
            self.news = True

    def first_audio(self, seconds: float) -> None:
        """A response's first audio was written this long after the client asked for it."""
        self._first_audio_observed.append(seconds)
        self.news = True

    def take_observations(self) -> tuple[Sequence[float], Sequence[float]]:
        """(cancel_to_silence seconds, first_audio seconds) observed since last call."""
        if not self._silence_observed and not self._first_audio_observed:
            return _NOTHING
        silence, self._silence_observed = self._silence_observed, []
        first, self._first_audio_observed = self._first_audio_observed, []
        return silence, first

    def finish(self) -> None:
        """Session over: observe the windows still open (no more audio can follow)."""
        for response_id in list(self.silence_windows):
            self.observe_silence(response_id)
