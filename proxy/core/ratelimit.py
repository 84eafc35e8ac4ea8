"""Token bucket for appended input audio, with time passed in."""

from __future__ import annotations

__all__ = ["BYTES_PER_SAMPLE", "TokenBucket"]

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
    # The engine's other spellings of G.711 (it lower-cases first).
    "audio/g711_ulaw": 1,
    "audio/g711_alaw": 1,
    "g711-ulaw": 1,
    "g711-alaw": 1,
    "ulaw": 1,
    "mulaw": 1,
    "alaw": 1,
}


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
