"""Wire vocabulary of the vLLM-Omni 0.30 duplex realtime protocol.

Event names, client aliases, error codes and their ``error.type``, and id
formats, as described in docs/engine-protocol.md. Pure data and
small pure functions; no I/O.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "BETA_NAMES",
    "CLIENT_ALIASES",
    "ENGINE_ERROR_TYPES",
    "GA_NAMES",
    "MAX_CLIENT_MESSAGE_BYTES",
    "OPENAI_CLIENT_EVENTS",
    "OPENAI_UNHANDLED_EVENTS",
    "AudioEventNames",
    "IdFactory",
    "Payload",
    "dumps",
    "error_payload",
    "error_type_for",
    "flat_error",
    "is_false_flag",
    "names_for",
]

#: One decoded JSON event, as every simulator module handles it.
Payload = dict[str, Any]

# docs/engine-protocol.md, Framing and limits: client frames above 15 MiB are answered with
# event_too_large.
MAX_CLIENT_MESSAGE_BYTES: Final = 15 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AudioEventNames:
    """The four audio event names that differ between 0.28 and 0.30."""

    audio_delta: str
    transcript_delta: str
    audio_done: str
    transcript_done: str


# docs/engine-protocol.md, Version differences: 0.30 uses the GA names, 0.28 the beta ones.
GA_NAMES: Final = AudioEventNames(
    audio_delta="response.output_audio.delta",
    transcript_delta="response.output_audio_transcript.delta",
    audio_done="response.output_audio.done",
    transcript_done="response.output_audio_transcript.done",
)
BETA_NAMES: Final = AudioEventNames(
    audio_delta="response.audio.delta",
    transcript_delta="response.audio_transcript.delta",
    audio_done="response.audio.done",
    transcript_done="response.audio_transcript.done",
)


def names_for(naming: str) -> AudioEventNames:
    """Return the audio event names for ``--event-names`` (``ga`` or ``beta``)."""
    return BETA_NAMES if naming == "beta" else GA_NAMES


# docs/engine-protocol.md, Client events: aliases the server accepts, mapped to the canonical type.
CLIENT_ALIASES: Final[dict[str, str]] = {
    "close": "session.close",
    "close_session": "session.close",
    "input.commit": "input_audio_buffer.commit",
    "input_text.append": "input.text.append",
    "push_text": "input.text.append",
    "signal_turn": "turn.signal",
    "audio.playback_ack": "playback.ack",
}

# --session-mode realtime (0.31+): the plain realtime handler validates client
# events against the OpenAI Realtime schema, with no aliases. These it handles;
OPENAI_CLIENT_EVENTS: Final = frozenset(
    {
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "response.create",
        "response.cancel",
        "conversation.item.create",
        "conversation.item.delete",
        "conversation.item.retrieve",
        "conversation.item.truncate",
    }
)
# these pass the schema but are answered "Unknown event type" (with the event_id);
# every other type fails the schema (invalid_event without an event_id).
OPENAI_UNHANDLED_EVENTS: Final = frozenset({"output_audio_buffer.clear"})

_RATE_LIMIT: Final = "rate_limit_error"
_SERVER: Final = "server_error"

# docs/engine-protocol.md, Terminal events and errors: error.type is derived from the code; unknown
# codes default to
# invalid_request_error, so only the non-default ones are listed.
ENGINE_ERROR_TYPES: Final[dict[str, str]] = {
    "resource_exhausted": _RATE_LIMIT,
    "input_backpressure": _RATE_LIMIT,
    "output_backpressure": _RATE_LIMIT,
    "internal_error": _SERVER,
    "runtime_append_failed": _SERVER,
    "runtime_abort_failed": _SERVER,
    "engine_error": _SERVER,
    "commit_aborted": _SERVER,
    "server_vad_unavailable": _SERVER,
}


def error_type_for(code: str) -> str:
    """Return the ``error.type`` the engine derives from ``code``."""
    return ENGINE_ERROR_TYPES.get(code, "invalid_request_error")


def error_payload(code: str, message: str, client_event_id: str | None = None) -> dict[str, Any]:
    """Build the T1 error envelope body (without ``event_id``/seq stamps).

    Args:
        code: one of the codes of docs/engine-protocol.md, Terminal events and errors.
        message: human-readable text.
        client_event_id: the rejected client event's ``event_id``, echoed back.
    """
    error: dict[str, Any] = {"type": error_type_for(code), "code": code, "message": message}
    if client_event_id is not None:
        error["event_id"] = client_event_id
    return {"type": "error", "error": error}


def flat_error(text: str, code: str) -> str:
    """Route-level rejection: the flat shape of docs/engine-protocol.md, Routes, serialized."""
    return dumps({"type": "error", "error": text, "code": code})


def dumps(obj: dict[str, Any]) -> str:
    """Serialize one event as compact JSON text (one text frame)."""
    return orjson.dumps(obj).decode("utf-8")


def is_false_flag(value: str | None) -> bool:
    """True for the query-string spellings of "off" (docs/engine-protocol.md, Opening a session)."""
    return value is not None and value.strip().lower() in ("0", "false", "no", "off")


class IdFactory:
    """Source of hex ids: random, or a counter in ``--deterministic`` mode.

    A deterministic factory is created per session, so two sessions fed the
    same input produce the same ids and therefore byte-identical frames.

    Args:
        deterministic: count up instead of drawing random ids.
    """

    __slots__ = ("_counter", "_deterministic")

    def __init__(self, *, deterministic: bool) -> None:
        self._deterministic = deterministic
        self._counter = 0

    def hex32(self) -> str:
        """Return a 32-hex-digit id (a uuid4 hex when random)."""
        if self._deterministic:
            self._counter += 1
            return f"{self._counter:032x}"
        return uuid.uuid4().hex

    def token(self) -> str:
        """A resume token: 32 random bytes, URL-safe base64 (a counter when deterministic).

        ``--deterministic`` tokens are guessable: a test knob only.
        """
        if self._deterministic:
            self._counter += 1
            return f"token-{self._counter:032x}"
        return secrets.token_urlsafe(32)

    def hex8(self) -> str:
        """Return an 8-hex-digit id."""
        if self._deterministic:
            self._counter += 1
            return f"{self._counter:08x}"
        return secrets.token_hex(4)
