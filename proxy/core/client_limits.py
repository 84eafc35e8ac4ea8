"""The limits a session applies to what its client sends: two token buckets.

``max_client_frame_rate``/``client_frame_burst`` (client data frames per
second; refusals less than ``_RATE_EPISODE_GAP`` apart are one episode, which
gets one ``error`` and ends the session after ``client_rate_limit_close_after``)
and ``max_input_audio_rate``/``input_burst_seconds`` (appended audio seconds
per second). Both off at 0 (docs/design.md, Relay shell). ``ClientLimits``
decides; ``SessionCore`` acts.
"""

from __future__ import annotations

from typing import Final

from proxy.core.input_audio import InputAudio
from proxy.core.ratelimit import TokenBucket
from proxy.core.session_settings import SessionSettings

__all__ = ["ClientLimits"]

#: A rate-limited frame less than this many seconds after the previous one
#: continues the same rate-limit episode (one error per episode).
_RATE_EPISODE_GAP: Final = 1.0


class ClientLimits:
    """One session's client frame rate and input audio rate limits."""

    def __init__(self, settings: SessionSettings) -> None:
        self.max_frame_rate = settings.max_client_frame_rate
        self.frame_burst = settings.client_frame_burst or 2 * settings.max_client_frame_rate
        self.close_after = settings.client_rate_limit_close_after
        self.max_input_audio_rate = settings.max_input_audio_rate
        #: Client data frames (one token each).
        self.frame_bucket = TokenBucket(self.max_frame_rate, self.frame_burst)
        #: Appended input audio, in seconds of audio.
        self.input_bucket = TokenBucket(settings.max_input_audio_rate, settings.input_burst_seconds)
        #: The input audio format the engine applies (seconds of an append).
        self.input = InputAudio()
        self._limited_since: float | None = None
        self._last_limited = 0.0

    # -- frame rate ----------------------------------------------------------------------------

    def episode_begins(self, now: float) -> bool:
        """A frame was refused: whether it starts a new rate-limit episode."""
        since = self._limited_since
        begins = since is None or now - self._last_limited > _RATE_EPISODE_GAP
        if begins:
            self._limited_since = now
        self._last_limited = now
        return begins

    def episode_too_long(self, now: float) -> bool:
        """The current episode has lasted ``client_rate_limit_close_after`` seconds."""
        since = self._limited_since
        return since is not None and now - since >= self.close_after

    def frame_rate_message(self) -> str:
        return (
            f"more than {self.max_frame_rate:g} frames per second "
            f"(burst {self.frame_burst:g}); frames are dropped"
        )

    # -- input audio rate ------------------------------------------------------------------------

    def input_rate_message(self) -> str:
        return (
            "input audio arrives faster than "
            f"{self.max_input_audio_rate:g}x real time; frame dropped"
        )
