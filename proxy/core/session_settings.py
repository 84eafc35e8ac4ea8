"""``SessionSettings``: everything a session's policy needs, as one value object.

Built once per session by the shell (proxy/edge/state.py, ``session_settings``)
from the sidecar's settings; the core's parts (``SessionCore``, ``ClientLimits``,
the buffer and ledger) read their limits from it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

from proxy.core.buffer import BufferLimits
from proxy.core.ledger import DEFAULT_MAX_TOMBSTONES, DEFAULT_TOMBSTONE_TTL
from proxy.core.playback import PlaybackSettings

__all__ = [
    "DEFAULT_CLIENT_FRAME_BURST",
    "DEFAULT_CLIENT_RESUME_GRACE",
    "DEFAULT_MAX_CLIENT_FRAME_RATE",
    "DEFAULT_MAX_INPUT_AUDIO_RATE",
    "DEFAULT_MAX_PENDING_INPUT_BYTES",
    "DEFAULT_RESUME_JOURNAL_BYTES",
    "DEFAULT_RESUME_JOURNAL_TTL",
    "OverflowPolicy",
    "SessionSettings",
]

# The defaults a session runs with, written once: proxy/settings declares its settings
# with these, so ``SessionSettings()`` is what the default configuration builds
# (tests/proxy/core/test_session_settings.py checks the two agree).
#: Appended audio seconds per wall second.
DEFAULT_MAX_INPUT_AUDIO_RATE: Final = 4.0
#: Client data frames per second, and the burst above it (frames).
DEFAULT_MAX_CLIENT_FRAME_RATE: Final = 200.0
DEFAULT_CLIENT_FRAME_BURST: Final = 400.0
#: Client bytes the engine link may hold unsent (bytes).
DEFAULT_MAX_PENDING_INPUT_BYTES: Final = 16 * 1024 * 1024
#: Seconds a dropped resumable session is held for a ``session.resume``.
DEFAULT_CLIENT_RESUME_GRACE: Final = 30.0
#: What a held session keeps of what it wrote, for the replay: bytes and seconds.
DEFAULT_RESUME_JOURNAL_BYTES: Final = 2 * 1024 * 1024
DEFAULT_RESUME_JOURNAL_TTL: Final = 60.0


class OverflowPolicy(enum.Enum):
    """What a session does when its output budget overflows (``overflow_policy``)."""

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
    max_input_audio_rate: float = DEFAULT_MAX_INPUT_AUDIO_RATE
    input_burst_seconds: float = 10.0
    #: Client data frames per second (0 = off) and the burst allowed above it.
    #: Frames over it are dropped with one ``error`` {client_rate_limited} per
    #: episode; an episode longer than ``client_rate_limit_close_after`` seconds
    #: ends the session with 1008.
    max_client_frame_rate: float = DEFAULT_MAX_CLIENT_FRAME_RATE
    client_frame_burst: float = DEFAULT_CLIENT_FRAME_BURST
    client_rate_limit_close_after: float = 2.0
    #: Client bytes the engine link may hold unsent (0 = off); forwarding more
    #: ends the session (``error`` {input_backpressure}, 1008).
    max_pending_input_bytes: int = DEFAULT_MAX_PENDING_INPUT_BYTES
    #: A resumable session whose client drops without ``session.close`` is held
    #: this long for a ``session.resume`` (0 = off: the session ends at once).
    client_resume_grace: float = DEFAULT_CLIENT_RESUME_GRACE
    #: What a held session keeps of the events it wrote, for the replay
    #: (proxy/core/journal.py): bytes, and seconds after each was written.
    resume_journal_bytes: int = DEFAULT_RESUME_JOURNAL_BYTES
    resume_journal_ttl: float = DEFAULT_RESUME_JOURNAL_TTL
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
