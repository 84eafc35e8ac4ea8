"""``SessionSettings``: everything a session's policy needs, as one value object.

Built once per session by the shell (proxy/edge/client_app.py, ``session_settings``)
from the sidecar's settings; the core's parts (``SessionCore``, ``ClientLimits``,
the buffer and ledger) read their limits from it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from proxy.core.buffer import BufferLimits
from proxy.core.ledger import DEFAULT_MAX_TOMBSTONES, DEFAULT_TOMBSTONE_TTL
from proxy.core.playback import PlaybackSettings

__all__ = ["OverflowPolicy", "SessionSettings"]


class OverflowPolicy(enum.Enum):
    CLOSE_SESSION = "close_session"
    FAIL_RESPONSE = "fail_response"


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSettings:
    """Value object with everything the policy needs."""

    buffer: BufferLimits = field(default_factory=BufferLimits)
    overflow_policy: OverflowPolicy = OverflowPolicy.CLOSE_SESSION
    interrupt_on_speech_started: bool = False
    max_tombstones: int = DEFAULT_MAX_TOMBSTONES
    tombstone_ttl: float = DEFAULT_TOMBSTONE_TTL
    #: Appended audio seconds per wall second (0 = off), bursts up to
    #: ``input_burst_seconds`` of audio.
    max_input_audio_rate: float = 0.0
    input_burst_seconds: float = 10.0
    #: Client data frames per second (0 = off) and the burst allowed above it.
    #: Frames over it are dropped with one ``error`` {client_rate_limited} per
    #: episode; an episode longer than ``client_rate_limit_close_after`` seconds
    #: ends the session with 1008.
    max_client_frame_rate: float = 0.0
    client_frame_burst: float = 0.0
    client_rate_limit_close_after: float = 2.0
    #: Client bytes the engine link may hold unsent (0 = off); forwarding more
    #: ends the session (``error`` {input_backpressure}, 1008).
    max_pending_input_bytes: int = 0
    #: A resumable session whose client drops without ``session.close`` is held
    #: this long for a ``session.resume`` (0 = off: the session ends at once).
    client_resume_grace: float = 0.0
    #: What a held session keeps of the events it wrote, for the replay
    #: (proxy/core/journal.py): bytes, and seconds after each was written.
    resume_journal_bytes: int = 2 * 1024 * 1024
    resume_journal_ttl: float = 60.0
    #: The secret that binds the resume tokens a client gets to its session and key
    #: (``resume_secret_file``; proxy/core/resume_token.py).
    resume_secret: bytes = b""
    #: Pacing, acks on the client's behalf, truncation (proxy.core.playback).
    playback: PlaybackSettings = field(default_factory=PlaybackSettings)

    def __post_init__(self) -> None:
        paced = self.playback.max_paced_audio_bytes
        if self.playback.pacing and paced > self.buffer.max_pending_output_bytes:
            raise ValueError(
                f"max_paced_audio_bytes ({paced}) must not exceed max_pending_output_bytes "
                f"({self.buffer.max_pending_output_bytes}): held audio would overflow the session"
            )
