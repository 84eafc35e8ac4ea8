"""What the playback ledger keeps: its settings, one item's playback, the answers it awaits.

The values and small records :mod:`proxy.core.playback` works with,
kept apart so the ledger's own module holds only its decisions. I/O-free.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Final

from proxy.core.ratelimit import BYTES_PER_SAMPLE

__all__ = [
    "ACK_EVENT_PREFIX",
    "ANSWER_CODES",
    "ANSWER_TIMEOUT",
    "DEFAULT_ACK_INTERVAL",
    "DEFAULT_MAX_AUDIO_LEAD",
    "DEFAULT_MAX_PACED_AUDIO_BYTES",
    "DEFAULT_OUTPUT_FORMAT",
    "DEFAULT_OUTPUT_RATE",
    "MAX_CLIENT_TRUNCATED",
    "MAX_ITEMS",
    "MAX_OUTSTANDING",
    "AckErrorCode",
    "AckMode",
    "Awaited",
    "ItemPlayback",
    "PlaybackSettings",
    "audio_seconds",
]

#: ``event_id`` prefix of the acks the sidecar writes (their errors are ours too).
ACK_EVENT_PREFIX: Final = "event_sidecar_ack_"
#: Output audio defaults (vLLM-Omni and OpenAI Realtime: pcm16 at 24 kHz).
DEFAULT_OUTPUT_FORMAT: Final = "pcm16"
DEFAULT_OUTPUT_RATE: Final = 24_000
_G711_RATE: Final = 8_000
#: Items remembered per session; the oldest finished one is dropped beyond it.
MAX_ITEMS: Final = 64
#: Items the client truncated itself, remembered per session (oldest dropped).
MAX_CLIENT_TRUNCATED: Final = 256
#: Acks/truncations (ours and the client's) awaiting the engine's answer
#: (oldest forgotten beyond).
MAX_OUTSTANDING: Final = 256
#: Seconds after which an unanswered ack or truncation is forgotten: the
#: engine answers within milliseconds, and one it never answers (an error
#: code we do not know, without event_id) must not shift every later answer
#: onto the wrong frame for the rest of the session.
ANSWER_TIMEOUT: Final = 10.0
#: Defaults of :class:`PlaybackSettings`, also the defaults of the settings
#: ``max_audio_lead``, ``max_paced_audio_bytes`` and ``playback_ack_interval``.
DEFAULT_MAX_AUDIO_LEAD: Final = 0.5
DEFAULT_MAX_PACED_AUDIO_BYTES: Final = 1024 * 1024
DEFAULT_ACK_INTERVAL: Final = 0.25


class AckMode(enum.Enum):
    AUTO = "auto"
    OFF = "off"
    ALWAYS = "always"


class AckErrorCode(enum.Enum):
    """Engine errors that answer an ack or a truncation (``engine_ack_errors_total{code}``).

    All but ``OTHER`` may come without an ``event_id`` and are then matched
    by order; ``OTHER`` is any other code of an error that named our frame.
    """

    PLAYBACK_ACK_TOO_LATE = "playback_ack_too_late"
    PLAYBACK_ITEM_NOT_FOUND = "playback_item_not_found"
    PLAYBACK_ITEM_MISMATCH = "playback_item_mismatch"
    BAD_EVENT = "bad_event"
    INVALID_EVENT = "invalid_event"
    ITEM_NOT_FOUND = "item_not_found"
    OTHER = "other"


#: Error codes that answer an ack or a truncation even without an ``event_id``.
ANSWER_CODES: Final = {code.value: code for code in AckErrorCode if code is not AckErrorCode.OTHER}


class Awaited:
    """One ack or truncation sent to the engine and not answered yet."""

    __slots__ = ("event_id", "item_id", "item_truncate", "own", "sent_at", "truncated", "truncates")

    def __init__(
        self,
        *,
        own: bool,
        item_truncate: bool,
        truncates: bool,
        event_id: str | None,
        item_id: str | None,
        sent_at: float,
    ) -> None:
        self.own = own
        self.sent_at = sent_at
        #: conversation.item.truncate: answered truncated, then acknowledged.
        self.item_truncate = item_truncate
        #: It truncates history (that, or a playback.ack with truncate: true).
        self.truncates = truncates
        self.event_id = event_id
        self.item_id = item_id
        self.truncated = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaybackSettings:
    """The ledger's settings (seconds and bytes)."""

    pacing: bool = False
    max_audio_lead: float = DEFAULT_MAX_AUDIO_LEAD
    max_paced_audio_bytes: int = DEFAULT_MAX_PACED_AUDIO_BYTES
    ack: AckMode = AckMode.AUTO
    ack_interval: float = DEFAULT_ACK_INTERVAL
    #: The client reports what it played (``playback.ack`` of its own: the phone front
    #: door's marks); until it does, nothing of an item was heard (no wall-clock estimate).
    client_reports: bool = False


def audio_seconds(chars: int, audio_format: str | None, sample_rate_hz: int | None) -> float:
    """Seconds of mono audio in ``chars`` of base64 of ``audio_format`` at ``sample_rate_hz``."""
    fmt = audio_format or DEFAULT_OUTPUT_FORMAT
    width = BYTES_PER_SAMPLE.get(fmt, 2)
    if sample_rate_hz and sample_rate_hz > 0:
        rate = sample_rate_hz
    else:
        rate = _G711_RATE if width == 1 else DEFAULT_OUTPUT_RATE
    return (chars * 3 // 4) / width / rate


@dataclass(slots=True)
class ItemPlayback:
    """One response item's audio as the client got it."""

    response_id: str
    item_id: str | None
    started_at: float | None = None
    sent: float = 0.0  # audio seconds released to the client
    acked_ms: int = -1  # played_ms of the last ack the sidecar wrote
    heard_ms: int = -1  # played_ms the client reported (its own playback.ack; Twilio's marks)
    last_ack_at: float = -math.inf
    seconds_per_char: float = 0.0  # base64 character -> audio seconds, from the first delta
    done: bool = False  # its response.done was delivered: no more audio
    finished: bool = False  # final ack or truncation written; nothing more to say

    def played(self, now: float) -> float:
        """Audio seconds the client has played by ``now`` (estimate)."""
        if self.started_at is None:
            return 0.0
        if self.heard_ms >= 0:
            # The client said what it played: that, not the wall clock, is the truth.
            return min(self.sent, self.heard_ms / 1000)
        return min(self.sent, max(0.0, now - self.started_at))

    def lead(self, now: float) -> float:
        """Audio seconds in the client, sent and not yet played."""
        return self.sent - self.played(now)
