"""Event classification for both directions of a realtime session.

The relay forwards the original frame text and parses only what a decision
needs (house rule 3). Most frames are audio: large, frequent and boring. They
are classified by a prefix scan that reads the top-level ``type`` and
``response_id`` without touching the base64 payload; everything else is small
and is parsed with orjson so that its fields can be trusted.

The scan is only trusted when the text before ``"delta"``/``"audio"`` is a flat
run of simple key/value pairs (no nested object, array or escape). Anything
else falls back to a full parse, so a hostile frame can make classification
slower, never wrong.

Nothing here performs I/O or reads a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "AUDIO_DELTA_TYPES",
    "ClientEvent",
    "ClientKind",
    "EventKind",
    "UpstreamEvent",
    "classify_client",
    "classify_upstream",
    "frame_size",
]

#: Audio delta names: GA (vLLM-Omni 0.30) and beta (0.28, OpenAI beta).
AUDIO_DELTA_TYPES: Final = frozenset({"response.output_audio.delta", "response.audio.delta"})

#: Frames at least this long whose prefix names an audio type take the scan path.
_SCAN_MIN_CHARS: Final = 1024


class EventKind(enum.Enum):
    """What an upstream (engine → client) event means to the proxy."""

    AUDIO_DELTA = "audio_delta"
    RESPONSE_CREATED = "response_created"
    RESPONSE_DONE = "response_done"
    RESPONSE_OTHER = "response_other"  # any other event carrying a response_id
    ERROR = "error"
    SESSION_CREATED = "session_created"
    SESSION_CLOSED = "session_closed"
    OUTPUT_AUDIO_CLEARED = "output_audio_cleared"
    OVERLAP_DECISION = "overlap_decision"
    SPEECH_STARTED = "speech_started"
    OTHER = "other"
    MALFORMED = "malformed"


class ClientKind(enum.Enum):
    """What a client → engine event means to the proxy."""

    RESPONSE_CANCEL = "response_cancel"
    OUTPUT_AUDIO_BUFFER_CLEAR = "output_audio_buffer_clear"
    BARGE_IN = "barge_in"
    TURN_SIGNAL = "turn_signal"
    INPUT_CANCEL = "input_cancel"
    RESPONSE_CREATE = "response_create"
    AUDIO_APPEND = "audio_append"
    SESSION_CLOSE = "session_close"
    SESSION_UPDATE = "session_update"
    OTHER = "other"
    INVALID_JSON = "invalid_json"
    BAD_EVENT = "bad_event"


_UPSTREAM_KINDS: Final[dict[str, EventKind]] = {
    "response.output_audio.delta": EventKind.AUDIO_DELTA,
    "response.audio.delta": EventKind.AUDIO_DELTA,
    "response.created": EventKind.RESPONSE_CREATED,
    "response.done": EventKind.RESPONSE_DONE,
    "error": EventKind.ERROR,
    "session.created": EventKind.SESSION_CREATED,
    "session.closed": EventKind.SESSION_CLOSED,
    "output_audio_buffer.cleared": EventKind.OUTPUT_AUDIO_CLEARED,
    "overlap.decision": EventKind.OVERLAP_DECISION,
    "input_audio_buffer.speech_started": EventKind.SPEECH_STARTED,
}

_CLIENT_KINDS: Final[dict[str, ClientKind]] = {
    "response.cancel": ClientKind.RESPONSE_CANCEL,
    "output_audio_buffer.clear": ClientKind.OUTPUT_AUDIO_BUFFER_CLEAR,
    "barge_in": ClientKind.BARGE_IN,
    "turn.signal": ClientKind.TURN_SIGNAL,
    "signal_turn": ClientKind.TURN_SIGNAL,
    "input.cancel": ClientKind.INPUT_CANCEL,
    "response.create": ClientKind.RESPONSE_CREATE,
    "input_audio_buffer.append": ClientKind.AUDIO_APPEND,
    "session.close": ClientKind.SESSION_CLOSE,
    "close": ClientKind.SESSION_CLOSE,
    "close_session": ClientKind.SESSION_CLOSE,
    "session.update": ClientKind.SESSION_UPDATE,
}

_TURN_SIGNAL_CANCELS: Final = frozenset({"barge_in", "response.cancel"})


def frame_size(text: str) -> int:
    """Exact UTF-8 size of a text frame; O(1) for ASCII, which audio always is."""
    # surrogatepass: a lone surrogate (never from a WebSocket, whose text is
    # strict UTF-8) must not make classification raise.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


@dataclass(slots=True)  # not frozen: 4x cheaper to build, and built per event
class UpstreamEvent:
    """An engine frame as the proxy sees it.

    Attributes:
        text: the original frame text, forwarded untouched.
        size: UTF-8 size in bytes.
        type: the top-level ``type`` ("" when malformed).
        kind: what the proxy does with it.
        response_id: top-level ``response_id``, when present.
        status: ``response.status`` of a ``response.done``.
        action: ``action`` of an ``overlap.decision``.
        body: the parsed object when it was parsed (never for scanned audio).
    """

    text: str
    size: int
    type: str
    kind: EventKind
    response_id: str | None = None
    status: str | None = None
    action: str | None = None
    body: dict[str, Any] | None = None

    @property
    def is_audio(self) -> bool:
        return self.kind is EventKind.AUDIO_DELTA


@dataclass(slots=True)  # treat as immutable (see UpstreamEvent)
class ClientEvent:
    """A client frame as the proxy sees it.

    Attributes:
        text: the original frame text.
        size: UTF-8 size in bytes.
        type: top-level ``type`` ("" when invalid).
        kind: what the proxy does with it.
        response_id: ``response_id`` named by a cancel or clear.
        cancels: True when this event interrupts output (DESIGN.md §4).
        audio_chars: length of the base64 ``audio`` of an append (0 otherwise).
        event_id: the client's ``event_id``, echoed in errors.
        detail: a short reason for INVALID_JSON / BAD_EVENT.
        body: the parsed object (None for scanned appends and invalid frames).
    """

    text: str
    size: int
    type: str
    kind: ClientKind
    response_id: str | None = None
    cancels: bool = False
    audio_chars: int = 0
    event_id: str | None = None
    detail: str = ""
    body: dict[str, Any] | None = None

    @property
    def is_valid(self) -> bool:
        return self.kind not in (ClientKind.INVALID_JSON, ClientKind.BAD_EVENT)


# --- prefix scan -------------------------------------------------------------


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def _leading_type(text: str) -> tuple[str, int] | None:
    """Read ``{"type": "X"`` at the very start; return (X, index after it)."""
    i = _skip_ws(text, 0)
    if not text.startswith("{", i):
        return None
    i = _skip_ws(text, i + 1)
    if not text.startswith('"type"', i):
        return None
    i = _skip_ws(text, i + 6)
    if not text.startswith(":", i):
        return None
    i = _skip_ws(text, i + 1)
    if not text.startswith('"', i):
        return None
    end = text.find('"', i + 1)
    if end < 0:
        return None
    value = text[i + 1 : end]
    if "\\" in value:
        return None
    return value, end + 1


def _find_key(text: str, key: str, start: int, end: int | None = None) -> int:
    """Index just after ``"key":`` used as a key (not a value), or -1."""
    marker = '"' + key + '"'
    stop = len(text) if end is None else end
    pos = text.find(marker, start, stop)
    while pos >= 0:
        j = pos - 1
        while j >= start and text[j] in " \t\r\n":
            j -= 1
        i = _skip_ws(text, pos + len(marker))
        if j >= 0 and text[j] in ",{" and text.startswith(":", i):
            return _skip_ws(text, i + 1)
        pos = text.find(marker, pos + 1, stop)
    return -1


def _flat_string_field(segment: str, key: str) -> str | None | bool:
    """Find top-level ``"key": "value"`` in a flat segment.

    Returns the value, None when absent, or False when the segment is not flat
    enough to trust (then the caller parses the whole frame).
    """
    if "{" in segment or "[" in segment or "\\" in segment:
        return False
    if segment.count('"' + key + '"') > 1:
        return False  # duplicate keys: let the parser decide (it keeps the last)
    i = _find_key(segment, key, 0)
    if i < 0:
        return None
    if segment.startswith("null", i):
        return None
    if not segment.startswith('"', i):
        return False
    end = segment.find('"', i + 1)
    if end < 0:
        return False
    return segment[i + 1 : end]


def _members(fragment: str) -> dict[str, Any] | None:
    """Parse a (possibly empty) run of JSON object members; None if invalid."""
    if not fragment.strip():
        return {}
    try:
        value = orjson.loads("{" + fragment + "}")
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _scan_payload(
    text: str, start: int, payload_key: str
) -> tuple[dict[str, Any], int] | None:
    """Validate a frame whose bulk is one plain string under ``payload_key``.

    The frame must read ``{"type":"X"`` + members + ``"key":"payload"`` +
    members + ``}``. The members before and after are small and are parsed
    with orjson; the payload is checked for quotes and escapes (base64 has
    neither), not parsed. Not checked: raw control characters inside the
    payload (an O(n) scan that would cost more than parsing the frame).
    A repeated ``type`` or payload key sends the frame to the full parser;
    other repeated members resolve like a full parse (the last one wins).

    Returns:
        (the other members, payload length), or None to parse the whole frame.
    """
    value_at = _find_key(text, payload_key, start)
    if value_at < 0 or not text.startswith('"', value_at):
        return None
    end = text.find('"', value_at + 1)
    if end < 0 or text.find("\\", value_at + 1, end) >= 0:
        return None
    before = text[start:value_at]
    # before = ',' [members ','] '"key":' ; after = [',' members] '}'
    lead = before[: before.rfind('"' + payload_key + '"')].strip()
    if not lead.startswith(","):
        return None
    members_before = lead[1:].strip()
    if members_before:
        if not members_before.endswith(","):
            return None
        members_before = members_before[:-1]
        if not members_before.strip():
            return None
    tail = text[end + 1 :].rstrip()
    if not tail.endswith("}"):
        return None
    members_after = tail[:-1].strip()
    if members_after:
        if not members_after.startswith(","):
            return None
        members_after = members_after[1:]
        if not members_after.strip():
            return None
    first = _members(members_before)
    second = _members(members_after)
    if first is None or second is None:
        return None
    if payload_key in first or payload_key in second or "type" in first or "type" in second:
        return None  # a second payload or type: only the full parser keeps the last one
    first.update(second)
    return first, end - value_at - 1


def _scan_payload_frame(text: str, start: int, payload_key: str) -> str | bool:
    """Scan a large frame whose bulk is one base64 string under payload_key.

    Returns the top-level response_id, or False if the frame must be parsed.
    """
    scanned = _scan_payload(text, start, payload_key)
    if scanned is None:
        return False
    response_id = scanned[0].get("response_id")
    return response_id if isinstance(response_id, str) else False


def _parse_object(text: str) -> dict[str, Any] | str:
    """Parse a frame; return the object, or an error code string."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return "invalid_json"
    if not isinstance(value, dict):
        return "bad_event"
    if not isinstance(value.get("type"), str):
        return "bad_event"
    return value


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


# --- upstream ------------------------------------------------------------------


def classify_upstream(text: str) -> UpstreamEvent:
    """Classify an engine frame. Never raises.

    Args:
        text: the frame exactly as received.

    Returns:
        an UpstreamEvent; ``kind`` is MALFORMED when the frame is not a JSON
        object with a string ``type``.
    """
    size = frame_size(text)
    if len(text) >= _SCAN_MIN_CHARS:
        lead = _leading_type(text)
        if lead is not None and lead[0] in AUDIO_DELTA_TYPES:
            scanned = _scan_payload_frame(text, lead[1], "delta")
            if not isinstance(scanned, bool):
                return UpstreamEvent(
                    text, size, lead[0], EventKind.AUDIO_DELTA, response_id=scanned
                )
    body = _parse_object(text)
    if isinstance(body, str):
        return UpstreamEvent(text, size, "", EventKind.MALFORMED)
    event_type: str = body["type"]
    kind = _UPSTREAM_KINDS.get(event_type)
    response_id = _str_or_none(body.get("response_id"))
    status = None
    action = None
    if kind is None:
        kind = EventKind.RESPONSE_OTHER if response_id is not None else EventKind.OTHER
    elif kind is EventKind.RESPONSE_DONE or kind is EventKind.RESPONSE_CREATED:
        response = body.get("response")
        if isinstance(response, dict):
            status = _str_or_none(response.get("status"))
            if response_id is None:
                response_id = _str_or_none(response.get("id"))
    elif kind is EventKind.OVERLAP_DECISION:
        action = _str_or_none(body.get("action"))
    return UpstreamEvent(
        text, size, event_type, kind, response_id=response_id, status=status,
        action=action, body=body,
    )


# --- client --------------------------------------------------------------------


def classify_client(text: str) -> ClientEvent:
    """Classify a client frame. Never raises.

    Large ``input_audio_buffer.append`` frames are scanned, not parsed: the
    proxy only needs their size and the length of their audio.

    Returns:
        a ClientEvent; INVALID_JSON / BAD_EVENT when the frame must not be
        forwarded (the relay answers with an ``error`` event instead).
    """
    size = frame_size(text)
    if len(text) >= _SCAN_MIN_CHARS:
        lead = _leading_type(text)
        if lead is not None and lead[0] == "input_audio_buffer.append":
            audio_chars, event_id = _scan_append_audio(text, lead[1])
            if audio_chars >= 0:
                return ClientEvent(
                    text, size, lead[0], ClientKind.AUDIO_APPEND, audio_chars=audio_chars,
                    event_id=event_id,
                )
    body = _parse_object(text)
    if isinstance(body, str):
        detail = "frame is not valid JSON" if body == "invalid_json" else (
            "frame must be a JSON object with a string 'type'"
        )
        kind = ClientKind.INVALID_JSON if body == "invalid_json" else ClientKind.BAD_EVENT
        return ClientEvent(text, size, "", kind, detail=detail)
    event_type: str = body["type"]
    event_id = _str_or_none(body.get("event_id"))
    kind = _CLIENT_KINDS.get(event_type, ClientKind.OTHER)
    response_id = _str_or_none(body.get("response_id"))
    cancels = kind in (
        ClientKind.RESPONSE_CANCEL,
        ClientKind.OUTPUT_AUDIO_BUFFER_CLEAR,
        ClientKind.BARGE_IN,
        ClientKind.INPUT_CANCEL,
    )
    if kind is ClientKind.TURN_SIGNAL:
        signal = body.get("event")  # may be any JSON value, e.g. an unhashable object
        cancels = isinstance(signal, str) and signal in _TURN_SIGNAL_CANCELS
    audio_chars = 0
    if kind is ClientKind.AUDIO_APPEND:
        audio = body.get("audio")
        audio_chars = len(audio) if isinstance(audio, str) else 0
    return ClientEvent(
        text, size, event_type, kind, response_id=response_id, cancels=cancels,
        audio_chars=audio_chars, event_id=event_id, body=body,
    )


def _scan_append_audio(text: str, start: int) -> tuple[int, str | None]:
    """(length of the base64 ``audio``, event_id) of a well-formed append, or (-1, None)."""
    scanned = _scan_payload(text, start, "audio")
    if scanned is None:
        return -1, None
    event_id = scanned[0].get("event_id")
    return scanned[1], event_id if isinstance(event_id, str) else None
