"""Event classification for both directions of a realtime session.

The relay forwards the original frame text and parses only what a decision
needs (house rule 3). Engine audio deltas are classified without parsing their
base64 payload (it is cut out and the small rest is parsed, ``_splice_payload``);
everything else, every client frame included, is parsed with orjson. Anything unusual falls back to a full
parse, so a hostile frame can make classification slower, never wrong. Sans-I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "AUDIO_DELTA_TYPES",
    "ENGINE_FULL_CODE",
    "ClientEvent",
    "ClientKind",
    "EventKind",
    "UpstreamEvent",
    "classify_client",
    "classify_upstream",
    "error_code",
    "frame_size",
    "is_engine_full",
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
    SESSION_REPLACED = "session_replaced"  # another socket resumed the engine session
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
    SESSION_RESUME = "session_resume"
    EVENT_ACK = "event_ack"
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
    # A resume the engine answered (passed through): the session as it stands.
    "session.resumed": EventKind.SESSION_CREATED,
    "session.closed": EventKind.SESSION_CLOSED,
    "session.replaced": EventKind.SESSION_REPLACED,
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
    "session.resume": ClientKind.SESSION_RESUME,
    "session.event_ack": ClientKind.EVENT_ACK,
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
    #: An audio delta's base64 length and the fields the playback ledger reads
    #: (``item_id``, ``format``, ``sample_rate_hz``), when the frame has them.
    audio_chars: int = 0
    audio_meta: dict[str, Any] | None = None
    #: ``kind is EventKind.AUDIO_DELTA``, read several times per event: a field, not a call.
    is_audio: bool = False
    #: The engine's ``server_event_seq`` (its resume cursor), when the frame has one.
    seq: int | None = None

    # Written out (dataclass keeps it): built per engine event, and mypyc
    # compiles this one natively where it would interpret the generated one.
    def __init__(
        self,
        text: str,
        size: int,
        type: str,
        kind: EventKind,
        response_id: str | None = None,
        status: str | None = None,
        action: str | None = None,
        body: dict[str, Any] | None = None,
        audio_chars: int = 0,
        audio_meta: dict[str, Any] | None = None,
        seq: int | None = None,
    ) -> None:
        self.text = text
        self.size = size
        self.type = type
        self.kind = kind
        self.response_id = response_id
        self.status = status
        self.action = action
        self.body = body
        self.audio_chars = audio_chars
        self.audio_meta = audio_meta
        self.is_audio = kind is EventKind.AUDIO_DELTA
        self.seq = seq


@dataclass(slots=True)  # treat as immutable (see UpstreamEvent)
class ClientEvent:
    """A client frame as the proxy sees it.

    Attributes:
        text: the original frame text.
        size: UTF-8 size in bytes.
        type: top-level ``type`` ("" when invalid).
        kind: what the proxy does with it.
        response_id: ``response_id`` named by a cancel or clear.
        cancels: True when this event interrupts output (docs/design.md, Cancellation).
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

    # Written out for the same reason as UpstreamEvent's (built per client frame).
    def __init__(
        self,
        text: str,
        size: int,
        type: str,
        kind: ClientKind,
        response_id: str | None = None,
        cancels: bool = False,
        audio_chars: int = 0,
        event_id: str | None = None,
        detail: str = "",
        body: dict[str, Any] | None = None,
    ) -> None:
        self.text = text
        self.size = size
        self.type = type
        self.kind = kind
        self.response_id = response_id
        self.cancels = cancels
        self.audio_chars = audio_chars
        self.event_id = event_id
        self.detail = detail
        self.body = body

    @property
    def is_valid(self) -> bool:
        return self.kind not in (ClientKind.INVALID_JSON, ClientKind.BAD_EVENT)


# --- payload splice ------------------------------------------------------------


def _splice_payload(text: str, key: str) -> tuple[dict[str, Any], int] | None:
    """Parse a frame without its bulk: the string value of ``key``.

    The value's characters are checked for what could end or escape a JSON
    string (a quote is where it ends; a backslash sends the frame to the full
    parser), then the frame is parsed with the value cut out, which is small.
    That one parse validates everything else: structure, ``type``, repeated
    keys (the last one wins, as in a full parse). If the cut was not the
    top-level ``key`` (a nested one came first) the parsed ``key`` is not the
    empty string, and if ``key`` appears again after the value the frame may
    hold a duplicate: both send the frame to the full parser. Raw control
    characters inside the value (which make the frame invalid JSON) are not
    checked: only engine frames take this path, and an engine writes its JSON
    with a serializer (a client's append is parsed whole, ``classify_client``).

    Returns:
        (the frame's object with ``key`` = "", the value's length), or None.
    """
    marker = '"' + key + '"'
    at = text.find(marker)
    if at < 0:
        return None
    i = at + len(marker)
    if text.startswith(':"', i):  # compact JSON: the common case
        start = i + 2
    else:
        i = _skip_ws(text, i)
        if not text.startswith(":", i):
            return None
        i = _skip_ws(text, i + 1)
        if not text.startswith('"', i):
            return None
        start = i + 1
    end = text.find('"', start)
    if end < 0 or text.find("\\", start, end) >= 0:
        return None
    if text.find(marker, end) >= 0:
        return None  # the key again (a duplicate, or nested): only a full parse decides
    try:
        doc = orjson.loads(text[:start] + text[end:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get(key) != "":
        return None
    return doc, end - start


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


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
        spliced = _splice_payload(text, "delta")
        if spliced is not None:
            doc = spliced[0]
            audio_type = doc.get("type")
            if isinstance(audio_type, str) and audio_type in AUDIO_DELTA_TYPES:
                seq = doc.get("server_event_seq")
                return UpstreamEvent(
                    text,
                    size,
                    audio_type,
                    EventKind.AUDIO_DELTA,
                    response_id=_str_or_none(doc.get("response_id")),
                    audio_chars=spliced[1],
                    audio_meta=doc,
                    seq=seq if type(seq) is int else None,
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
    audio_chars = 0
    if kind is EventKind.AUDIO_DELTA:
        delta = body.get("delta")
        audio_chars = len(delta) if isinstance(delta, str) else 0
    seq = body.get("server_event_seq")
    return UpstreamEvent(
        text,
        size,
        event_type,
        kind,
        response_id=response_id,
        status=status,
        action=action,
        body=body,
        audio_chars=audio_chars,
        audio_meta=body if kind is EventKind.AUDIO_DELTA else None,
        seq=seq if type(seq) is int else None,
    )


# --- client --------------------------------------------------------------------


def classify_client(text: str) -> ClientEvent:
    """Classify a client frame. Never raises.

    Every frame is parsed whole, exactly as the engine's parser reads it (an
    append too: cutting its audio out and checking that alone for what JSON
    forbids cost more than orjson's whole parse, 1.6 us per 80 ms of 24 kHz).

    Returns:
        a ClientEvent; INVALID_JSON / BAD_EVENT when the frame must not be
        forwarded (the relay answers with an ``error`` event instead).
    """
    size = frame_size(text)
    body = _parse_object(text)
    if isinstance(body, str):
        detail = (
            "frame is not valid JSON"
            if body == "invalid_json"
            else ("frame must be a JSON object with a string 'type'")
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
        text,
        size,
        event_type,
        kind,
        response_id=response_id,
        cancels=cancels,
        audio_chars=audio_chars,
        event_id=event_id,
        body=body,
    )


#: The engine's error when it has no room for one more session (0.31+; the
#: message says which limit: duplex_session_capacity_exhausted, or
#: replica_capacity_exhausted with replica placement).
ENGINE_FULL_CODE: Final = "resource_exhausted"


def error_code(event: UpstreamEvent) -> object:
    """``error.code`` of an engine ``error`` (None when it has none)."""
    error = (event.body or {}).get("error")
    return error.get("code") if isinstance(error, dict) else None


def is_engine_full(event: UpstreamEvent) -> bool:
    """An engine ``error`` {resource_exhausted}: it has no room for another session."""
    return event.kind is EventKind.ERROR and error_code(event) == ENGINE_FULL_CODE
