"""Token bucket for appended input audio, with time passed in."""

from __future__ import annotations

__all__ = ["BYTES_PER_SAMPLE", "TokenBucket", "audio_bytes_per_second"]

#: Bytes per sample of the audio formats of vLLM-Omni and OpenAI Realtime.
BYTES_PER_SAMPLE: dict[str, int] = {
    "pcm16": 2,
    "pcm_s16le": 2,
    "s16le": 2,
    "audio/pcm": 2,
    "pcm_f32le": 4,
    "g711_ulaw": 1,
    "g711_alaw": 1,
    "audio/pcmu": 1,
    "audio/pcma": 1,
}


def audio_bytes_per_second(audio_format: str | None, sample_rate_hz: int | None) -> float:
    """Raw bytes per second of mono input audio; pcm16 at 16 kHz when unknown."""
    width = BYTES_PER_SAMPLE.get(audio_format or "pcm16", 2)
    rate = sample_rate_hz if sample_rate_hz and sample_rate_hz > 0 else 16_000
    return float(width * rate)


class TokenBucket:
    """Allows ``rate`` units per second on average and bursts up to ``capacity``.

    Args:
        rate: refill per second (0 disables the limit).
        capacity: the most that can be taken at once after idling.
    """

    __slots__ = ("_at", "_tokens", "capacity", "rate")

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self._tokens = capacity
        self._at: float | None = None

    def take(self, amount: float, now: float) -> bool:
        """Take ``amount`` if available; False (nothing taken) otherwise."""
        if self.rate <= 0:
            return True
        if self._at is not None and now > self._at:
            self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        if self._at is None or now > self._at:
            self._at = now
        if amount <= self._tokens:
            self._tokens -= amount
            return True
        return False

    @property
    def tokens(self) -> float:
        return self._tokens
