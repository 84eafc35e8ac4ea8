"""OpenAI's shapes of the engine's objects, each validated by the ``openai`` package."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from proxy.core.audio_formats import G711_ULAW, NEMOTRON_INPUT, NEMOTRON_OUTPUT, OPENAI_PCM16
from proxy.core.capabilities import EngineVersion
from proxy.core.dialect.shapes import (
    as_object,
    error_body,
    fix_item,
    fix_response,
    session_object,
    sets_turn_detection,
)
from proxy.core.dialect.tables import BETA, GA, engine_dialect

realtime = pytest.importorskip("openai.types.realtime")
beta = pytest.importorskip("openai.types.beta.realtime")

ENGINE_SESSION: dict[str, Any] = {
    "id": "duplex-1",
    "model": "omni-sim",
    "modalities": ["audio", "text"],
    "capabilities": {"supports_audio_truncate": False},
    "epoch": 3,
}


def test_a_ga_session_has_formats_as_objects_and_the_engines_under_vllm_omni() -> None:
    session = session_object(
        ENGINE_SESSION, vocab=GA, input_format=OPENAI_PCM16, output_format=G711_ULAW,
        turn_detection=None, engine_formats=(NEMOTRON_INPUT, NEMOTRON_OUTPUT),
    )  # fmt: skip
    realtime.RealtimeSessionCreateRequest.model_validate(session)
    assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert session["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    assert session["vllm_omni"]["engine_audio"]["output"]["sample_rate_hz"] == 22050


def test_a_beta_session_names_formats_and_leaves_the_model_to_vllm_omni() -> None:
    session = session_object(
        ENGINE_SESSION, vocab=BETA, input_format=OPENAI_PCM16, output_format=OPENAI_PCM16,
        turn_detection=None, engine_formats=(NEMOTRON_INPUT, NEMOTRON_OUTPUT),
    )  # fmt: skip
    beta.session.Session.model_validate(session)
    assert "model" not in session and session["vllm_omni"]["model"] == "omni-sim"
    assert session["input_audio_format"] == "pcm16"


def test_a_failed_response_carries_an_error_and_the_metadata_is_strings() -> None:
    response: dict[str, Any] = {
        "id": "r", "object": "realtime.response", "status": "failed", "output": [],
        "status_details": {"type": "failed", "reason": "output_backpressure"},
        "metadata": {"epoch": 1},
    }  # fmt: skip
    fix_response(response, vocab=GA, engine=engine_dialect(EngineVersion.V0_31),
                 metadata={"k": "v"})  # fmt: skip
    realtime.RealtimeResponse.model_validate(response)
    assert response["status_details"]["error"]["code"] == "output_backpressure"
    assert response["metadata"] == {"k": "v"} and response["engine_metadata"] == {"epoch": 1}


def test_an_item_gets_openais_type_status_and_audio_part() -> None:
    item: dict[str, Any] = {"id": "i", "role": "assistant", "status": "cancelled",
                            "content": [{"type": "output_audio", "transcript": "x"}]}  # fmt: skip
    fix_item(item, BETA)
    assert (item["type"], item["status"], item["content"][0]["type"]) == (
        "message", "incomplete", "audio"
    )  # fmt: skip


def test_errors_are_openais_envelope() -> None:
    flat = error_body({"type": "error", "error": "gone", "code": 7}, {})
    assert flat["error"] == {"message": "gone", "code": "7", "type": "invalid_request_error"}
    with pytest.raises(pydantic.ValidationError):
        realtime.RealtimeErrorEvent.model_validate(flat)  # no event_id yet
    mapped = error_body({"type": "error", "event_id": "e", "error": {"code": "a"}}, {"a": "b"})
    assert mapped["error"]["code"] == "b"


def test_turn_detection_is_found_in_the_ga_and_the_beta_place() -> None:
    assert sets_turn_detection({"session": {"turn_detection": None}})
    assert sets_turn_detection({"session": {"audio": {"input": {"turn_detection": None}}}})
    assert not sets_turn_detection({"session": {"audio": {"input": {}}}})
    assert as_object([1]) == {}
