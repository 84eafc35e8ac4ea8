"""Input audio is charged as the engine will hear it (docs/design.md, Usage).

The seconds an append (or an audio part of ``conversation.item.create``)
counts for usage, the day quota and ``max_input_audio_rate`` come from the
format and rate the engine applies: the engine's own session echo, the
frame's own fields with the engine's precedence, and the longer reading
where two are possible. What the engine refuses is refused here too.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import pytest

from proxy.core.input_audio import InputAudio, InputAudioRefused
from proxy.core.session_core import DropReason
from tests.proxy.core import helpers as h
from tests.proxy.core.helpers import SessionPair, dumps, make_settings

#: 32,000 raw bytes: 1 s of pcm16 at 16 kHz.
ONE_SECOND = base64.b64encode(bytes(32_000)).decode()
CHARS = len(ONE_SECOND)


def seconds(audio: InputAudio, **fields: Any) -> float:
    return audio.seconds(CHARS, fields)


class TestReading:
    def test_the_default_is_pcm16_at_16khz(self) -> None:
        assert seconds(InputAudio()) == pytest.approx(1.0, rel=1e-3)

    @pytest.mark.parametrize(
        ("fields", "expected"),
        [
            ({"sample_rate_hz": 32_000}, 0.5),
            ({"format": "pcm_f32le"}, 0.5),
            ({"format": "g711_ulaw"}, 4.0),  # one byte a sample, 8 kHz unless named
            ({"format": "audio/g711_alaw", "sample_rate_hz": 16_000}, 2.0),
            ({"format": {"type": "audio/pcmu", "rate": 8_000}}, 4.0),
            # A rate named inside the format object is the rate (not the 16 kHz default).
            ({"format": {"type": "audio/pcm", "rate": 24_000}}, 2 / 3),
            ({"format": {"type": "audio/pcm", "sample_rate_hz": 8_000}}, 2.0),
            ({"format": {"type": "audio/pcmu", "rate": 16_000}}, 2.0),
            ({"input_audio_format": "pcm16", "sample_rate": 8_000}, 2.0),
        ],
    )
    def test_a_frame_names_its_own_format_and_rate(
        self, fields: dict[str, Any], expected: float
    ) -> None:
        assert seconds(InputAudio(), **fields) == pytest.approx(expected, rel=1e-3)

    @pytest.mark.parametrize("rate", [2_000_000_000, 7_999, 192_001, 44_100.5, True, "16000"])
    def test_a_rate_the_engine_refuses_is_refused(self, rate: object) -> None:
        with pytest.raises(InputAudioRefused) as refused:
            seconds(InputAudio(), sample_rate_hz=rate)
        assert refused.value.code == "bad_event"

    def test_a_format_the_engine_does_not_decode_is_refused(self) -> None:
        with pytest.raises(InputAudioRefused) as refused:
            seconds(InputAudio(), format="opus")
        assert refused.value.code == "unsupported_audio_format"

    def test_the_engines_session_echo_sets_the_reading(self) -> None:
        audio = InputAudio()
        audio.on_engine_session(
            {"session": {"audio": {"input": {"format": "pcm16", "sample_rate_hz": 24_000}}}}
        )
        assert seconds(audio) == pytest.approx(32_000 / 48_000, rel=1e-3)

    @pytest.mark.parametrize(
        "session",
        [
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24_000}}}},
            {"input_audio_format": {"type": "audio/pcm", "sample_rate_hz": 24_000}},
        ],
    )
    def test_a_rate_inside_the_sessions_format_object_sets_the_reading(
        self, session: dict[str, Any]
    ) -> None:
        audio = InputAudio()
        audio.on_engine_session({"session": session})
        assert seconds(audio) == pytest.approx(32_000 / 48_000, rel=1e-3)

    def test_a_client_update_the_engine_refuses_changes_nothing(self) -> None:
        audio = InputAudio()
        audio.on_client_update({"session": {"sample_rate_hz": 2_000_000_000}})
        assert seconds(audio) == pytest.approx(1.0, rel=1e-3), "never ~0 s"

    def test_until_the_engine_answers_the_longer_of_both_readings_is_charged(self) -> None:
        audio = InputAudio()
        audio.on_engine_session(
            {"session": {"input_audio_format": "pcm16", "sample_rate_hz": 48_000}}
        )
        audio.on_client_update({"session": {"sample_rate_hz": 8_000}})
        assert seconds(audio) == pytest.approx(2.0, rel=1e-3), "8 kHz until the engine confirms"
        audio.on_engine_session(
            {"session": {"input_audio_format": "pcm16", "sample_rate_hz": 48_000}}
        )
        assert seconds(audio) == pytest.approx(1 / 3, rel=1e-3), "the engine kept 48 kHz"


class TestInTheSession:
    def test_an_append_at_a_refused_rate_is_answered_and_not_forwarded(self) -> None:
        p = SessionPair()
        text = dumps(
            {
                "type": "input_audio_buffer.append",
                "event_id": "c1",
                "audio": ONE_SECOND,
                "sample_rate_hz": 2_000_000_000,
            }
        )
        assert not p.client(text).forward
        (error,) = p.deliver()
        assert (error.body["error"]["code"], error.body["error"]["event_id"]) == ("bad_event", "c1")
        assert p.core.usage.input_seconds == 0.0
        assert p.core.drop_totals()[DropReason.INVALID_CLIENT_FRAME][0] == 1

    @pytest.mark.parametrize("part_type", ["input_audio", "audio"])
    def test_audio_in_conversation_item_create_is_charged(self, part_type: str) -> None:
        """Both part types the engine decodes are charged: ``input_audio`` and ``audio``."""
        p = SessionPair()
        item = {
            "type": "message",
            "role": "user",
            "content": [
                {"type": part_type, "audio": ONE_SECOND},
                {"type": part_type, "audio": ONE_SECOND, "format": "g711_ulaw"},
                {"type": part_type, "audio": ONE_SECOND, "format": "opus"},  # skipped
                {"type": "input_text", "text": "hi"},
            ],
        }
        assert p.client(dumps({"type": "conversation.item.create", "item": item})).forward
        assert p.core.usage.input_seconds == pytest.approx(5.0, rel=1e-3)

    def test_an_append_naming_a_rate_inside_its_format_object_is_charged_at_it(self) -> None:
        p = SessionPair()
        append = {
            "type": "input_audio_buffer.append",
            "audio": ONE_SECOND,
            "format": {"type": "audio/pcm", "rate": 32_000},
        }
        assert p.client(dumps(append)).forward
        assert p.core.usage.input_seconds == pytest.approx(0.5, rel=1e-3)

    def test_audio_in_conversation_item_create_is_rate_limited(self) -> None:
        settings = dataclasses.replace(
            make_settings(), max_input_audio_rate=1.0, input_burst_seconds=2.0
        )
        p = SessionPair(settings=settings)
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_audio", "audio": ONE_SECOND}] * 3,
        }
        assert not p.client(dumps({"type": "conversation.item.create", "item": item})).forward
        (error,) = p.deliver()
        assert error.body["error"]["code"] == "input_backpressure"

    def test_the_engines_session_created_sets_what_appends_count(self) -> None:
        p = SessionPair()
        created = {
            "type": "session.created",
            "session": {"id": "s1", "input_audio_format": "g711_ulaw"},
        }
        p.upstream(dumps(created))
        p.client(h.dumps({"type": "input_audio_buffer.append", "audio": ONE_SECOND}))
        assert p.core.usage.input_seconds == pytest.approx(4.0, rel=1e-3)
