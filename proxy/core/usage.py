"""Usage accounting of one session: audio seconds, responses and engine tokens.

Sans-I/O: the session core feeds it where it already classifies events, and
the shell turns the end-of-session :class:`UsageRecord` into the access line,
the usage file and the per-key counters (docs/design.md, Usage: what ``in``,
``out``, ``delivered`` and ``heard`` count). Output audio is counted in base64
characters per delta and converted to seconds once, at the end.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "KEY_NAME_PATTERN",
    "UNNAMED_KEY",
    "AudioDirection",
    "ResponseOutcome",
    "UsageMeter",
    "UsageRecord",
]

#: What a key's name may be (docs/security.md): it becomes a metric label value.
KEY_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: The ``key`` label of sessions whose key has no name, and of sessions when auth is off.
UNNAMED_KEY: Final = "unnamed"


class AudioDirection(enum.Enum):
    """Label values of ``usage_audio_seconds_total{direction}``."""

    IN = "in"
    OUT = "out"
    DELIVERED = "delivered"
    HEARD = "heard"


class ResponseOutcome(enum.Enum):
    """Label values of ``usage_responses_total{outcome}``: how a response ended.

    ``incomplete`` is any other ``response.done`` status; ``unfinished`` is a
    response created and never done when the session ended.
    """

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INCOMPLETE = "incomplete"
    UNFINISHED = "unfinished"


_STATUS_OUTCOMES: Final = {
    "completed": ResponseOutcome.COMPLETED,
    "cancelled": ResponseOutcome.CANCELLED,
    "failed": ResponseOutcome.FAILED,
}


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one session used; :meth:`fields` is its JSON form (the usage file's line)."""

    key: str
    session_seconds: float
    audio_seconds: dict[AudioDirection, float]
    responses_started: int
    responses: dict[ResponseOutcome, int]
    input_tokens: int
    output_tokens: int
    total_tokens: int

    def fields(self) -> dict[str, Any]:
        """Flat, JSON-ready fields (seconds rounded to milliseconds)."""
        out: dict[str, Any] = {
            "key": self.key,
            "session_seconds": round(self.session_seconds, 3),
        }
        for direction in AudioDirection:
            out[f"audio_{direction.value}_seconds"] = round(self.audio_seconds[direction], 3)
        out["responses_started"] = self.responses_started
        for outcome in ResponseOutcome:
            out[f"responses_{outcome.value}"] = self.responses[outcome]
        out["input_tokens"] = self.input_tokens
        out["output_tokens"] = self.output_tokens
        out["total_tokens"] = self.total_tokens
        return out


def _count(value: object) -> int:
    """A token count from the wire: a non-negative int, else 0 (never trusted further)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return 0


class UsageMeter:
    """Counts one session's usage; the session core calls it, the shell reads :meth:`record`."""

    __slots__ = (
        "delivered_chars",
        "input_seconds",
        "input_tokens",
        "out_chars",
        "output_tokens",
        "responses_done",
        "responses_started",
        "seconds_per_char",
        "total_tokens",
    )

    def __init__(self) -> None:
        self.input_seconds = 0.0
        #: base64 characters of audio deltas from the engine / written to the client.
        self.out_chars = 0
        self.delivered_chars = 0
        #: Audio seconds per base64 character of output (0 until the first delta).
        self.seconds_per_char = 0.0
        self.responses_started = 0
        self.responses_done = dict.fromkeys(ResponseOutcome, 0)
        self.input_tokens = self.output_tokens = self.total_tokens = 0

    def quota_seconds(self) -> float:
        """Audio seconds this session counts against its key's day quota so far.

        Client input forwarded to the engine plus engine output delivered to
        the client (docs/design.md, Quotas): what the key's user sent and got.
        """
        return self.input_seconds + self.delivered_chars * self.seconds_per_char

    def on_response_done(self, status: str | None, body: dict[str, Any] | None) -> None:
        """A ``response.done`` from the engine: its outcome and any ``response.usage``.

        Args:
            status: ``response.status`` as classified.
            body: the already parsed frame (nothing is parsed or serialized here).
        """
        self.responses_done[_STATUS_OUTCOMES.get(status or "", ResponseOutcome.INCOMPLETE)] += 1
        if body is None:
            return
        response = body.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(usage, dict):
            return
        given_in = _count(usage.get("input_tokens"))
        given_out = _count(usage.get("output_tokens"))
        total = _count(usage.get("total_tokens")) or given_in + given_out
        self.input_tokens += given_in
        self.output_tokens += given_out
        self.total_tokens += total

    def record(self, key: str, session_seconds: float, heard_seconds: float) -> UsageRecord:
        """The session's usage as it ends.

        Args:
            key: the key's name (or :data:`UNNAMED_KEY`); never the key itself.
            session_seconds: how long the session lasted.
            heard_seconds: the playback ledger's estimate (proxy/core/playback.py).
        """
        per_char = self.seconds_per_char
        responses = dict(self.responses_done)
        done = sum(responses.values())
        responses[ResponseOutcome.UNFINISHED] = max(0, self.responses_started - done)
        delivered = self.delivered_chars * per_char
        return UsageRecord(
            key=key,
            session_seconds=max(0.0, session_seconds),
            audio_seconds={
                AudioDirection.IN: self.input_seconds,
                AudioDirection.OUT: self.out_chars * per_char,
                AudioDirection.DELIVERED: delivered,
                AudioDirection.HEARD: max(0.0, min(heard_seconds, delivered)),
            },
            responses_started=self.responses_started,
            responses=responses,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            total_tokens=self.total_tokens,
        )
