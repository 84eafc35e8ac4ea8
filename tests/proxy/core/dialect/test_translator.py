"""OpenAIDialect without sockets: client frames in, engine frames out, and back.

Every event the dialect writes is checked against the ``openai`` package's own
server-event model of its type (tests/integration/openai_models.py).
"""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any

import numpy as np
import pytest

from proxy.core.audio_formats import Encoding
from proxy.core.capabilities import EngineVersion
from proxy.core.dialect import Flavour, OpenAIDialect, engine_dialect
from tests.integration.openai_models import ServerEvents

pytest.importorskip("openai")

RID = "resp-1"
ITEM = "item_resp-1"


def dialect(flavour: Flavour = Flavour.GA, version: EngineVersion = EngineVersion.V0_30) -> Any:
    """A dialect past the client's first frame (which carries OpenAI's default turn
    detection to the engine: test_the_first_frame_...)."""
    counter = itertools.count()
    d = OpenAIDialect(flavour, engine_dialect(version), lambda: f"event_{next(counter)}")
    d.from_client('{"type":"session.update","session":{}}')
    return d


def out(d: OpenAIDialect, *bodies: dict[str, Any]) -> list[dict[str, Any]]:
    """What the client gets for these engine events, each validated against openai's model."""
    validator = ServerEvents(d.flavour.value)
    texts = [text for body in bodies for text in d.to_client(json.dumps(body))]
    return [validator.validate(text) for text in texts]


def engine_session(
    input_format: str = "pcm16", input_rate: int = 16000, output_rate: int = 24000, **extra: Any
) -> dict[str, Any]:
    return {
        "type": "session.created",
        "event_id": "event_e1",
        "resume_token": "secret",
        "attachment_generation": 1,
        "session": {
            "id": "duplex-1",
            "object": "realtime.session",
            "model": "omni-sim",
            "modalities": ["audio", "text"],
            "turn_detection": None,
            "audio": {
                "input": {"format": input_format, "sample_rate_hz": input_rate},
                "output": {"format": "pcm16", "sample_rate_hz": output_rate},
            },
            "capabilities": {"supports_audio_truncate": False, **extra},
        },
    }


def pcm16(samples: int, rate: int = 24000) -> str:
    t = np.arange(samples) / rate
    tone = (0.3 * 32767 * np.sin(2 * np.pi * 440 * t)).astype("<i2")
    return base64.b64encode(tone.tobytes()).decode()


def delta(chunk: str, rid: str = RID, **extra: Any) -> dict[str, Any]:
    return {
        "type": "response.output_audio.delta",
        "event_id": "event_d",
        "response_id": rid,
        "item_id": f"item_{rid}",
        "output_index": 0,
        "content_index": 0,
        "delta": chunk,
        **extra,
    }


def sent(d: OpenAIDialect, body: dict[str, Any]) -> list[dict[str, Any]]:
    """What goes to the engine for one client event (no reply to the client)."""
    step = d.from_client(json.dumps(body))
    assert step.replies == ()
    return [json.loads(text) for text in step.forward]


def forwarded(d: OpenAIDialect, body: dict[str, Any]) -> dict[str, Any]:
    (one,) = sent(d, body)
    assert isinstance(one, dict)
    return one


# -- client -> engine ----------------------------------------------------------------------


def test_an_append_reaches_the_engine_in_its_input_format() -> None:
    d = dialect()
    out(d, engine_session("pcm_f32le", 16000, 22050))
    sent = forwarded(
        d, {"type": "input_audio_buffer.append", "event_id": "c1", "audio": pcm16(2400)}
    )
    assert sent["event_id"] == "c1"
    raw = base64.b64decode(sent["audio"])
    # 100 ms at 24 kHz -> 16 kHz f32le (what the resampler has given out so far).
    assert len(raw) % 4 == 0 and 1500 <= len(raw) // 4 <= 1600
    assert d.engine_input.encoding is Encoding.F32LE


def test_an_append_that_is_not_base64_is_answered_and_not_forwarded() -> None:
    d = dialect()
    step = d.from_client('{"type":"input_audio_buffer.append","event_id":"c2","audio":"%%"}')
    assert step.forward == ()
    (reply,) = step.replies
    error = json.loads(reply)["error"]
    assert error["code"] == "invalid_base64" and error["event_id"] == "c2"


def test_response_create_commits_uncommitted_input_first() -> None:
    d = dialect()
    forwarded(d, {"type": "input_audio_buffer.append", "audio": pcm16(480)})
    *tail, commit = sent(d, {"type": "response.create", "event_id": "c3"})
    assert commit == {
        "type": "input_audio_buffer.commit",
        "response_create": True,
        "event_id": "c3",
    }
    assert [e["type"] for e in tail] == ["input_audio_buffer.append"]  # what the resampler held
    # Input committed by the client: the create goes as it is.
    forwarded(d, {"type": "input_audio_buffer.append", "audio": pcm16(480)})
    sent(d, {"type": "input_audio_buffer.commit"})
    assert forwarded(d, {"type": "response.create"}) == {"type": "response.create"}


def test_response_create_with_no_input_at_all_is_answered_on_a_turn_of_silence() -> None:
    """A greeting (Pipecat's first context frame, LiveKit's generate_reply before the
    user spoke): OpenAI answers the conversation so far; the engine needs a turn."""
    d = dialect()
    out(d, engine_session("pcm_f32le", 16000, 22050))
    append, commit = sent(d, {"type": "response.create", "event_id": "c5"})
    assert base64.b64decode(append["audio"]) == b"\x00" * 4 * 1600  # 100 ms of f32le silence
    assert commit == {"type": "input_audio_buffer.commit", "response_create": True,
                      "event_id": "c5", "is_speech": True}  # fmt: skip
    # What the client committed and no response answered yet: a plain create.
    sent(d, {"type": "input_audio_buffer.commit"})
    assert forwarded(d, {"type": "response.create"}) == {"type": "response.create"}


def test_the_engines_response_already_active_is_openais_code() -> None:
    error = {"type": "error", "event_id": "e", "error": {
        "type": "invalid_request_error", "code": "response_already_active", "message": "busy"}}  # fmt: skip
    (got,) = out(dialect(), error)
    assert got["error"]["code"] == "conversation_already_has_active_response"


def test_a_commit_carries_the_whole_turn_to_the_engine() -> None:
    d = dialect()
    out(d, engine_session())  # PCM16 16 kHz in: 24 -> 16 kHz holds ~20 ms (LQ)
    engine_bytes = 0
    for _ in range(5):
        appended = forwarded(d, {"type": "input_audio_buffer.append", "audio": pcm16(960)})
        engine_bytes += len(base64.b64decode(appended["audio"]))
    *tail, commit = sent(d, {"type": "input_audio_buffer.commit"})
    assert commit == {"type": "input_audio_buffer.commit"}
    engine_bytes += sum(len(base64.b64decode(a["audio"])) for a in tail)
    assert abs(engine_bytes // 2 - 5 * 640) <= 1  # 200 ms at 16 kHz, within a sample


def test_semantic_vad_is_asked_as_the_engines_server_vad_and_shown_in_effect() -> None:
    d = dialect(version=EngineVersion.V0_32)
    sent = forwarded(
        d,
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "instructions": "Be brief.",
                "output_modalities": ["audio"],
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcmu"},
                        "turn_detection": {
                            "type": "semantic_vad",
                            "eagerness": "auto",
                            "create_response": True,
                        },
                    },
                    "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"},
                },
            },
        },
    )
    assert sent["session"] == {
        "instructions": "Be brief.",
        "voice": "alloy",
        "modalities": ["audio", "text"],
        "turn_detection": {"type": "server_vad"},
    }
    (updated,) = out(d, {**engine_session(), "type": "session.updated"})
    session = updated["session"]
    assert session["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert session["audio"]["input"]["turn_detection"]["create_response"] is False
    assert session["vllm_omni"]["engine_audio"]["output"]["sample_rate_hz"] == 24000
    assert "resume_token" not in updated


def test_a_format_openai_does_not_have_is_an_error_and_the_rest_applies() -> None:
    d = dialect()
    step = d.from_client(
        json.dumps(
            {
                "type": "session.update",
                "event_id": "c4",
                "session": {"instructions": "x", "audio": {"input": {"format": "flac"}}},
            }
        )
    )
    (update,) = step.forward
    assert json.loads(update)["session"] == {"instructions": "x"}
    (reply,) = step.replies
    assert json.loads(reply)["error"]["code"] == "unsupported_audio_format"


def test_truncate_on_an_engine_without_it_is_answered_and_the_item_rest_dropped() -> None:
    d = dialect()
    out(d, engine_session())
    step = d.from_client(
        json.dumps(
            {
                "type": "conversation.item.truncate",
                "item_id": ITEM,
                "content_index": 0,
                "audio_end_ms": 640,
            }
        )
    )
    assert step.forward == ()
    (reply,) = step.replies
    (truncated,) = out(d, json.loads(reply))
    assert truncated["type"] == "conversation.item.truncated"
    assert truncated["audio_end_ms"] == 640 and truncated["item_id"] == ITEM
    transcript = {
        "type": "response.output_audio_transcript.delta",
        "event_id": "e",
        "response_id": RID,
        "item_id": ITEM,
        "output_index": 0,
        "content_index": 0,
        "delta": "late",
    }
    assert out(d, delta(pcm16(480)), transcript) == []


def test_truncate_on_an_engine_that_truncates_goes_in_its_samples() -> None:
    d = dialect()
    out(d, engine_session(output_rate=22050, supports_audio_truncate=True))
    sent = forwarded(
        d,
        {"type": "conversation.item.truncate", "item_id": ITEM, "content_index": 0,
         "audio_end_ms": 1000},
    )  # fmt: skip
    assert sent["audio_end_ms"] == 1000


# -- engine -> client ----------------------------------------------------------------------


def test_response_created_carries_the_clients_metadata_and_not_the_engines() -> None:
    d = dialect()
    d.from_client(json.dumps({"type": "response.create", "response": {"metadata": {"k": "v"}}}))
    response = {
        "id": RID,
        "object": "realtime.response",
        "status": "in_progress",
        "status_details": None,
        "modalities": ["audio", "text"],
        "output": [],
        "metadata": {"duplex_event": {"epoch": 0}},
    }
    (created,) = out(d, {"type": "response.created", "event_id": "e", "response": response})
    assert created["response"]["metadata"] == {"k": "v"}
    assert created["response"]["engine_metadata"] == {"duplex_event": {"epoch": 0}}
    done_response = {
        **response,
        "status": "cancelled",
        "status_details": {"type": "cancelled", "reason": "barge_in"},
        "output": [
            {
                "id": ITEM,
                "object": "realtime.item",
                "type": "message",
                "role": "assistant",
                "status": "cancelled",
                "content": [{"type": "output_audio", "transcript": "Hel"}],
            }
        ],
    }
    (done,) = out(d, {"type": "response.done", "event_id": "e", "response": done_response})
    assert done["response"]["metadata"] == {"k": "v"}
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert done["response"]["output"][0]["status"] == "incomplete"


def test_errors_for_a_stock_clients_defaults_are_not_shown_others_are_reshaped() -> None:
    d = dialect()
    hidden = {
        "type": "error",
        "event_id": "e",
        "error": {"type": "invalid_request_error", "code": "response_not_active", "message": "x"},
    }
    flat = {"type": "error", "error": "Realtime API is not available", "code": "unsupported"}
    (error,) = out(d, hidden, flat)
    assert error["error"]["code"] == "unsupported"
    assert error["error"]["message"] == "Realtime API is not available"


def test_engine_extensions_are_not_sent_and_known_shapes_pass_as_they_are() -> None:
    d = dialect()
    speak = {"type": "response.speak", "response_id": RID, "metadata": {}}
    committed = {"type": "input_audio_buffer.committed", "event_id": "e", "item_id": "i",
                 "previous_item_id": None, "event": {"turn_id": 1}}  # fmt: skip
    closed = {"type": "session.closed", "reason": "client_close"}
    kept = json.dumps(committed)
    assert d.to_client(json.dumps(speak)) == [] and d.to_client(json.dumps(closed)) == []
    (text,) = d.to_client(kept)
    assert text is kept  # not re-serialized


def test_the_engines_second_announcement_of_an_item_is_dropped() -> None:
    item = {"id": ITEM, "object": "realtime.item", "type": "message", "role": "assistant",
            "status": "in_progress", "content": []}  # fmt: skip
    added = {"type": "conversation.item.added", "event_id": "e", "previous_item_id": None,
             "item": item}  # fmt: skip
    created = {**added, "type": "conversation.item.created"}
    assert [e["type"] for e in out(dialect(), added, created)] == ["conversation.item.added"]
    beta = out(dialect(Flavour.BETA), added, created)
    assert [e["type"] for e in beta] == ["conversation.item.created"]


@pytest.mark.parametrize("flavour", [Flavour.GA, Flavour.BETA])
def test_22_05_khz_audio_reaches_the_client_at_24_khz_lasting_as_long(flavour: Flavour) -> None:
    d = dialect(flavour)
    out(d, engine_session("pcm_f32le", 16000, 22050))
    chunk = 1764  # Nemotron's 80 ms packets
    got = out(d, *(delta(pcm16(chunk, 22050)) for _ in range(10)))
    done = {"type": "response.output_audio.done", "event_id": "e", "response_id": RID,
            "item_id": ITEM, "output_index": 0, "content_index": 0}  # fmt: skip
    got += out(d, done)
    name = "response.output_audio.delta" if flavour is Flavour.GA else "response.audio.delta"
    assert [e["type"] for e in got[:-1]] == [name] * (len(got) - 1)
    assert got[-1]["type"] == name.replace("delta", "done")
    samples = sum(len(base64.b64decode(e["delta"])) // 2 for e in got[:-1])
    assert abs(samples - round(10 * chunk * 24000 / 22050)) <= 1
    assert all("sample_rate_hz" not in e for e in got)


def test_a_cancelled_responses_held_audio_never_reaches_the_next() -> None:
    d = dialect()
    out(d, engine_session(output_rate=22050))
    out(d, delta(pcm16(1764, 22050)))
    cancelled = {"type": "response.done", "event_id": "e", "response": {
        "id": RID, "object": "realtime.response", "status": "cancelled",
        "status_details": {"type": "cancelled", "reason": "client_cancelled"}, "output": []}}  # fmt: skip
    out(d, cancelled)
    done = {"type": "response.output_audio.done", "event_id": "e", "response_id": "resp-2",
            "item_id": "item_resp-2", "output_index": 0, "content_index": 0}  # fmt: skip
    got = out(d, delta(pcm16(1764, 22050), "resp-2"), done)
    samples = sum(len(base64.b64decode(e["delta"])) // 2 for e in got[:-1])
    assert abs(samples - 1920) <= 1  # 80 ms at 24 kHz: nothing of the cancelled one


def test_24_khz_pcm16_to_a_24_khz_client_is_the_engines_own_audio() -> None:
    d = dialect()
    out(d, engine_session())
    chunk = pcm16(4800)
    (got,) = out(d, delta(chunk))
    assert got["delta"] == chunk


def test_a_beta_client_gets_24_khz_audio_renamed_and_otherwise_as_the_engine_wrote_it() -> None:
    d = dialect(Flavour.BETA)
    out(d, engine_session())
    chunk = pcm16(4800)
    engine = json.dumps(delta(chunk))
    (text,) = d.to_client(engine)
    assert text == engine.replace("response.output_audio.delta", "response.audio.delta")
    assert ServerEvents("beta").validate(text)["delta"] == chunk


def test_an_append_in_the_engines_own_format_passes_as_it_is() -> None:
    d = dialect()
    out(d, engine_session(input_rate=24000))
    text = json.dumps({"type": "input_audio_buffer.append", "audio": pcm16(480)})
    (forward,) = d.from_client(text).forward
    assert forward is text


def test_a_g711_client_hears_8_khz_mu_law_and_speaks_a_law() -> None:
    d = dialect()
    out(d, engine_session())
    sent(
        d,
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "audio": {
                    "input": {"format": {"type": "audio/pcma"}},
                    "output": {"format": {"type": "audio/pcmu"}},
                },
            },
        },
    )
    (updated,) = out(d, {**engine_session(), "type": "session.updated"})
    assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    done = {"type": "response.output_audio.done", "event_id": "e", "response_id": RID,
            "item_id": ITEM, "output_index": 0, "content_index": 0}  # fmt: skip
    got = out(d, delta(pcm16(2400)), done)  # 100 ms at 24 kHz
    mulaw = b"".join(base64.b64decode(e["delta"]) for e in got[:-1])
    assert abs(len(mulaw) - 800) <= 1  # 8 kHz, one byte a sample
    alaw = base64.b64encode(b"\xd5" * 160).decode()  # 20 ms of A-law silence
    appended = forwarded(d, {"type": "input_audio_buffer.append", "audio": alaw})
    assert len(base64.b64decode(appended["audio"])) % 2 == 0  # PCM16 at 16 kHz


def test_a_retrieved_history_item_is_an_openai_item() -> None:
    """The engine's history names an assistant item by its role only (what the Agents
    SDK's retrieve after an interrupt got, and failed to validate)."""
    retrieved = {"type": "conversation.item.retrieved", "event_id": "e",
                 "item": {"id": ITEM, "role": "assistant",
                          "content": [{"type": "output_audio", "transcript": ""}]}}  # fmt: skip
    (item,) = out(dialect(), retrieved)
    assert item["item"]["type"] == "message"


def test_the_first_frame_asks_the_engine_for_openais_default_turn_detection() -> None:
    counter = itertools.count()
    d = OpenAIDialect(Flavour.GA, engine_dialect(EngineVersion.V0_30), lambda: f"e{next(counter)}")
    (created,) = out(d, engine_session())
    assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    update, append = d.from_client(
        json.dumps({"type": "input_audio_buffer.append", "audio": pcm16(480)})
    ).forward
    assert json.loads(update) == {
        "type": "session.update",
        "session": {"turn_detection": {"type": "server_vad"}},
    }
    assert json.loads(append)["type"] == "input_audio_buffer.append"
    # Once only, and not when the client's first frame sets turn detection itself.
    assert len(d.from_client('{"type":"input_audio_buffer.clear"}').forward) == 1
    d = OpenAIDialect(Flavour.GA, engine_dialect(EngineVersion.V0_30), lambda: f"e{next(counter)}")
    none = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}
    (only,) = d.from_client(json.dumps(none)).forward
    assert json.loads(only)["session"] == {"turn_detection": None}


@pytest.mark.parametrize(
    "interrupt",
    [
        ("engine", {"type": "input_audio_buffer.speech_started", "event_id": "e",
                    "audio_start_ms": 0, "item_id": "item_u"}),
        ("engine", {"type": "overlap.decision", "action": "barge_in"}),
        ("client", {"type": "response.cancel"}),
        ("client", {"type": "output_audio_buffer.clear"}),
    ],
)  # fmt: skip
def test_an_interrupted_answers_held_audio_is_not_flushed_at_its_done(
    interrupt: tuple[str, dict[str, Any]],
) -> None:
    d = dialect()
    out(d, engine_session(output_rate=22050))
    out(d, delta(pcm16(1764, 22050)))
    side, event = interrupt
    if side == "engine":
        out(d, event)
    else:
        d.from_client(json.dumps(event))
    done = {"type": "response.output_audio.done", "event_id": "e", "response_id": RID,
            "item_id": ITEM, "output_index": 0, "content_index": 0}  # fmt: skip
    assert [e["type"] for e in out(d, done)] == ["response.output_audio.done"]
