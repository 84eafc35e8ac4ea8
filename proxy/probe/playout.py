"""What a listener hears: the 1x playout model, and the audio helpers the probe sizes and sends.

:class:`PlayoutBuffer` models a client that plays every received delta at 1x
and never clears its buffer (the "old answer heard after barge-in" figure);
:func:`base64_decoded_length` sizes a delta without decoding it;
:func:`voice_like_pcm16` is the generated input signal. Sans-I/O: times are
passed in. The benchmarks use :class:`PlayoutBuffer` too (bench/bargeinclient.py).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "GENERATED_SAMPLE_RATE_HZ",
    "PlayoutBuffer",
    "base64_decoded_length",
    "voice_like_pcm16",
]

#: Rate of the generated input signal, and of what we declare in each append.
GENERATED_SAMPLE_RATE_HZ: Final = 16_000


@dataclass(slots=True)
class _Track:
    """One response's audio in a :class:`PlayoutBuffer`, seconds and monotonic times."""

    received: float = 0.0
    #: (start, end) play times of its deltas not yet fully played at the last add.
    unplayed: deque[tuple[float, float]] = field(default_factory=deque)
    cancelled_at: float | None = None
    unplayed_at_cancel: float = 0.0
    after_cancel: float = 0.0


class PlayoutBuffer:
    """A client that plays received audio at 1x and never clears its buffer.

    Sans-I/O: times are passed in (monotonic seconds). Each delta starts to
    play when it arrives or when the audio queued before it has played,
    whichever is later, so playback of a response starts at its first delta and
    runs at real time; audio arriving faster than that accumulates. On a cancel
    nothing is dropped: that is the client without a "clear" the figure is
    about (a phone bridge, a naive browser player). Responses are keyed by the
    caller (the probe uses ``response_id``).

    Times must not go backwards. Memory is bounded by the audio still queued:
    a response keeps only the deltas not yet fully played, and nothing per
    delta once it is cancelled.
    """

    def __init__(self) -> None:
        self._free_at = -math.inf  # when everything queued so far has played
        self._tracks: dict[str, _Track] = {}

    def add(self, key: str, seconds: float, now: float) -> None:
        """Queue one received delta of response ``key`` that plays ``seconds``."""
        start = max(now, self._free_at)
        end = start + seconds
        self._free_at = end
        track = self._tracks.setdefault(key, _Track())
        track.received += seconds
        if track.cancelled_at is not None:
            track.after_cancel += seconds  # played in full, after the cancel
            return
        while track.unplayed and track.unplayed[0][1] <= now:
            track.unplayed.popleft()
        track.unplayed.append((start, end))

    def cancel(self, key: str, now: float) -> None:
        """Record the barge-in on ``key`` at ``now``; only the first one counts."""
        track = self._tracks.setdefault(key, _Track())
        if track.cancelled_at is not None:
            return
        track.cancelled_at = now
        track.unplayed_at_cancel = sum(
            end - max(start, now) for start, end in track.unplayed if end > now
        )
        track.unplayed.clear()

    def played_at_cancel(self, key: str) -> float | None:
        """Seconds of ``key`` played when it was cancelled (the listener's position)."""
        track = self._tracks.get(key)
        if track is None or track.cancelled_at is None:
            return None
        return max(0.0, track.received - track.after_cancel - track.unplayed_at_cancel)

    def heard_after_cancel(self, key: str) -> float | None:
        """Seconds of ``key`` played after its cancel: buffered then + arrived since."""
        track = self._tracks.get(key)
        if track is None or track.cancelled_at is None:
            return None
        return track.unplayed_at_cancel + track.after_cancel

    def total_heard_after_cancel(self) -> float | None:
        """:meth:`heard_after_cancel` summed over cancelled responses; None if none was."""
        heard = [self.heard_after_cancel(key) for key in self._tracks]
        values = [value for value in heard if value is not None]
        return sum(values) if values else None


def base64_decoded_length(text: str) -> int:
    """Return how many bytes ``text`` decodes to, without decoding it.

    Args:
        text: Canonical base64 (no whitespace).

    Returns:
        ``len * 3 // 4`` minus the padding.
    """
    padding = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return max(0, len(text) * 3 // 4 - padding)


def voice_like_pcm16(seconds: float, sample_rate_hz: int = GENERATED_SAMPLE_RATE_HZ) -> bytes:
    """Generate a signal that voice activity detectors take for speech.

    A harmonic-rich tone around 130 Hz with a slow pitch contour, amplitude
    modulated at about four syllables per second.

    Args:
        seconds: Length of the signal.
        sample_rate_hz: Sample rate.

    Returns:
        PCM16 little-endian mono samples.
    """
    two_pi = 2.0 * math.pi
    samples = array("h")
    phase = 0.0
    for n in range(max(0, round(seconds * sample_rate_hz))):
        t = n / sample_rate_hz
        pitch_hz = 130.0 + 25.0 * math.sin(two_pi * 0.7 * t)
        phase = (phase + two_pi * pitch_hz / sample_rate_hz) % two_pi
        envelope = 0.5 - 0.5 * math.cos(two_pi * 4.0 * t)
        harmonics = sum(math.sin(k * phase) / k for k in range(1, 6))  # |sum| < 2
        samples.append(int(0.3 * 32767 * envelope * harmonics / 2.0))
    if sys.byteorder == "big":
        samples.byteswap()
    return samples.tobytes()
