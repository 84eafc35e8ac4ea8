"""OpenAI's shapes of the objects the engine shapes differently (sans-I/O).

The session object of ``session.created`` / ``session.updated``, the response
object of ``response.created`` / ``response.done``, items, and ``error``, in
the GA or the beta schema of the ``openai`` package's server-event models.
What the engine adds that OpenAI has no field for stays under keys a stock
parser ignores: ``vllm_omni`` on the session, ``engine_metadata`` on a
response (OpenAI's ``metadata`` is the client's, strings only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from proxy.core.audio_formats import AudioFormat
from proxy.core.dialect.tables import EngineDialect, Flavour, Vocabulary

__all__ = [
    "EXTENSION_KEY",
    "as_object",
    "error_body",
    "fix_item",
    "fix_response",
    "frame_text",
    "session_object",
    "sets_turn_detection",
]

#: Where engine extensions of the session object go.
EXTENSION_KEY: Final = "vllm_omni"
#: What a session's ``vllm_omni`` keeps of the engine's session object.
_SESSION_EXTENSIONS: Final = (
    "capabilities",
    "state",
    "turn_state",
    "epoch",
    "overlap_policy",
    "playback_commit_policy",
)
_ITEM_STATUSES: Final = frozenset({"completed", "incomplete", "in_progress", None})
_ERROR_TYPES: Final = frozenset(
    {"invalid_request_error", "server_error", "rate_limit_error", "authentication_error"}
)


def _strings(value: object) -> dict[str, str] | None:
    """OpenAI's ``metadata``: up to 16 string pairs, or None."""
    if not isinstance(value, Mapping):
        return None
    return {str(k): v for k, v in value.items() if isinstance(v, str)}


def session_object(
    engine: Mapping[str, Any],
    *,
    vocab: Vocabulary,
    input_format: AudioFormat,
    output_format: AudioFormat,
    turn_detection: dict[str, Any] | None,
    engine_formats: tuple[AudioFormat, AudioFormat],
) -> dict[str, Any]:
    """The client's session object from the engine's (``session`` of its event).

    Formats are the client's (the sidecar converts); ``turn_detection`` is
    what is in effect; the engine's own formats and capabilities go under
    ``vllm_omni``.
    """
    modalities = engine.get("modalities") or engine.get("output_modalities") or ["audio"]
    audio_out = "audio" in modalities if isinstance(modalities, list) else True
    extension: dict[str, Any] = {k: engine[k] for k in _SESSION_EXTENSIONS if k in engine}
    extension["model"] = engine.get("model")
    extension["engine_audio"] = {
        "input": engine_formats[0].engine_fields(),
        "output": engine_formats[1].engine_fields(),
    }
    instructions = engine.get("instructions")
    voice = engine.get("voice")
    if vocab.flavour is Flavour.GA:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": engine.get("id"),
            "model": engine.get("model"),
            "output_modalities": ["audio"] if audio_out else ["text"],
            "instructions": instructions if isinstance(instructions, str) else "",
            "audio": {
                "input": {
                    "format": input_format.openai_ga(),
                    "transcription": None,
                    "noise_reduction": None,
                    "turn_detection": turn_detection,
                },
                "output": {
                    "format": output_format.openai_ga(),
                    "voice": voice if isinstance(voice, str) else "alloy",
                    "speed": 1.0,
                },
            },
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            "tracing": None,
            "truncation": "auto",
            "prompt": None,
            "expires_at": 0,
            EXTENSION_KEY: extension,
        }
    beta: dict[str, Any] = {
        # No "model": the beta schema knows only OpenAI's model names (it is under vllm_omni).
        "id": engine.get("id"),
        "object": "realtime.session",
        "modalities": ["audio", "text"] if audio_out else ["text"],
        "instructions": instructions if isinstance(instructions, str) else "",
        "input_audio_format": input_format.openai_beta(),
        "output_audio_format": output_format.openai_beta(),
        "input_audio_transcription": None,
        "turn_detection": turn_detection,
        "tools": [],
        "tool_choice": "auto",
        "temperature": 0.8,
        "max_response_output_tokens": "inf",
        EXTENSION_KEY: extension,
    }
    if isinstance(voice, str):
        beta["voice"] = voice
    return beta


def fix_item(item: object, vocab: Vocabulary) -> None:
    """An item in place: assistant audio parts in the flavour's content type, and
    OpenAI's item statuses (a cancelled item is ``incomplete``) and types."""
    if not isinstance(item, dict):
        return
    if item.get("status") not in _ITEM_STATUSES:
        item["status"] = "incomplete"  # the engine's cancelled / failed
    if "type" not in item and "role" in item:
        item["type"] = "message"  # the engine's history items name only their role
    content = item.get("content")
    if not isinstance(content, list):
        return
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("output_audio", "audio"):
            part["type"] = vocab.assistant_audio


def fix_response(
    response: dict[str, Any],
    *,
    vocab: Vocabulary,
    engine: EngineDialect,
    metadata: dict[str, str] | None,
) -> None:
    """A response object in place: the client's ``metadata`` (the engine's moves to
    ``engine_metadata``), OpenAI's status reasons, the flavour's item shapes."""
    own = response.pop("metadata", None)
    if own is not None:
        response["engine_metadata"] = own
    response["metadata"] = _strings(metadata)
    modalities = response.pop("modalities", None)
    if vocab.flavour is Flavour.GA:
        audio = not isinstance(modalities, list) or "audio" in modalities
        response["output_modalities"] = ["audio"] if audio else ["text"]
    elif isinstance(modalities, list):
        response["modalities"] = modalities
    output = response.get("output")
    if isinstance(output, list):
        for item in output:
            fix_item(item, vocab)
    details = response.get("status_details")
    if isinstance(details, dict):
        kind = details.get("type")
        reason = details.pop("reason", None)
        if kind == "cancelled" or kind == "incomplete":
            details["reason"] = engine.status_reasons.get(str(reason), "client_cancelled")
        elif kind == "failed":
            error = details.get("error")
            if not isinstance(error, dict):
                details["error"] = {"type": "server_error", "code": str(reason or "failed")}
        elif kind != "completed":
            response["status_details"] = None


def error_body(body: Mapping[str, Any], codes: Mapping[str, str]) -> dict[str, Any]:
    """``error`` in OpenAI's envelope (the flat route-level shape too), with
    OpenAI's code where ``codes`` has one."""
    error = body.get("error")
    if isinstance(error, Mapping):
        out = {k: v for k, v in error.items() if k in ("code", "message", "param", "event_id")}
        kind = error.get("type")
    else:  # {"type": "error", "error": "<text>", "code": ...}
        out = {"message": str(error or ""), "code": body.get("code")}
        kind = None
    out["type"] = kind if kind in _ERROR_TYPES else "invalid_request_error"
    if not isinstance(out.get("message"), str):
        out["message"] = str(out.get("code") or "error")
    if out.get("code") is not None and not isinstance(out["code"], str):
        out["code"] = str(out["code"])
    if out.get("code") in codes:
        out["code"] = codes[out["code"]]
    return {"type": "error", "event_id": body.get("event_id"), "error": out}


def sets_turn_detection(body: dict[str, Any]) -> bool:
    """Whether a ``session.update`` names turn detection (the GA or the beta place)."""
    session = as_object(body.get("session"))
    return "turn_detection" in session or "turn_detection" in as_object(
        as_object(session.get("audio")).get("input")
    )


def as_object(value: object) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def frame_text(body: dict[str, Any]) -> str:
    """A frame's text (orjson: compact)."""
    return orjson.dumps(body).decode()
