"""One phone call's translation, sans-I/O (proxy/core/twilio_call.py; docs/design.md,
Phone front door): Twilio's messages in, engine events out, and back."""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.audio_formats import (
    MINICPMO_INPUT,
    NEMOTRON_INPUT,
    AudioFormat,
    Encoding,
    decode_samples,
)
from proxy.core.turns import TurnDetector
from proxy.core.twilio_call import (
    ENGINE_GRACE_FRAMES,
    MAX_MARKS,
    BargeIn,
    CallOptions,
    CallStart,
    TwilioCall,
    parse_start,
    parse_twilio,
)

SID = "MZ1"
RID = "resp-1"
SILENT = b"\xff" * 160  # mu-law silence
LOUD = bytes([0x10, 0x90] * 80)  # mu-law near full scale, alternating sign
#: Frames of speech until the detector says it started: 64 ms of whole 32 ms windows.
SPEECH_FRAMES = 4


class LevelStream:
    """A stand-in voice-activity scorer: a 32 ms window at 8 kHz is speech when loud
    (the packaged model is tested on speech in tests/proxy/core/test_turns.py and
    through this door in tests/integration/test_twilio.py)."""

    rate = 8000
    window_samples = 256

    def probability(self, window: Any) -> float:
        return 1.0 if float(np.sqrt(np.mean(np.square(window)))) > 0.05 else 0.0

    def reset(self) -> None:
        pass


def call(
    mode: BargeIn = BargeIn.SIDECAR,
    engine_input: AudioFormat = MINICPMO_INPUT,
    output_rate: int = 8000,
) -> TwilioCall:
    """A call whose engine answers in PCM16 at ``output_rate`` (8 kHz: no resampler
    holding samples back, so frame counts are exact)."""
    options = CallOptions(engine_input=engine_input, barge_in=mode)
    c = TwilioCall(CallStart(SID), options, TurnDetector(LevelStream()))
    c.to_twilio(session_created(output_rate))
    return c


def session_created(rate: int) -> str:
    output = {"format": "pcm16", "sample_rate_hz": rate}
    return ev({"type": "session.created", "session": {"audio": {"output": output}}})


def media(payload: bytes) -> dict[str, Any]:
    encoded = base64.b64encode(payload).decode()
    return {"event": "media", "streamSid": SID, "media": {"payload": encoded}}


def ev(body: dict[str, Any]) -> str:
    return orjson.dumps(body).decode()


def delta(ms: int, *, rid: str = RID, rate: int = 8000) -> str:
    pcm = (np.sin(np.arange(rate * ms // 1000) / 5) * 8000).astype("<i2").tobytes()
    encoded = base64.b64encode(pcm).decode()
    return ev({"type": "response.output_audio.delta", "response_id": rid, "delta": encoded})


def created(rid: str = RID) -> str:
    return ev({"type": "response.created", "response_id": rid, "response": {"id": rid}})


def kinds(frames: list[str]) -> list[str]:
    return [orjson.loads(f)["event"] for f in frames]


def payloads(frames: list[str]) -> list[bytes]:
    return [
        base64.b64decode(orjson.loads(f)["media"]["payload"])
        for f in frames
        if orjson.loads(f)["event"] == "media"
    ]


def types(texts: list[str]) -> list[str]:
    return [orjson.loads(t)["type"] for t in texts]


class TestParsing:
    def test_only_json_objects_with_an_event_are_twilio_messages(self) -> None:
        assert parse_twilio("{") is None
        assert parse_twilio("[]") is None
        assert parse_twilio('{"event": 1}') is None
        assert parse_twilio('{"event": "media"}') == {"event": "media"}

    def test_start_gives_the_stream_and_its_string_parameters(self) -> None:
        body = {
            "event": "start",
            "start": {
                "streamSid": "MZ9",
                "callSid": "CA9",
                "accountSid": "AC9",
                "customParameters": {"voice": "v", "n": 3},
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            },
        }
        start = parse_start(body)
        assert isinstance(start, CallStart)
        assert (start.stream_sid, start.call_sid, start.account_sid) == ("MZ9", "CA9", "AC9")
        assert dict(start.custom) == {"voice": "v"}

    @pytest.mark.parametrize(
        "start",
        [
            None,
            {},
            {"streamSid": ""},
            {"streamSid": "MZ", "mediaFormat": {"encoding": "audio/x-alaw", "sampleRate": 8000}},
            {"streamSid": "MZ", "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 16000}},
            {"streamSid": "MZ", "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000,
                                                "channels": 2}},
        ],
    )  # fmt: skip
    def test_a_start_it_cannot_serve_is_refused_in_words(self, start: Any) -> None:
        assert isinstance(parse_start({"event": "start", "start": start}), str)


class TestSessionUpdate:
    def test_engine_turn_detection_asks_for_server_vad(self) -> None:
        update = orjson.loads(call(BargeIn.ENGINE).session_update())
        assert update["type"] == "session.update"
        session = update["session"]
        assert session["turn_detection"] == {"type": "server_vad"}
        assert (session["input_audio_format"], session["sample_rate_hz"]) == ("pcm16", 16000)
        assert "model" not in session and "voice" not in session

    def test_sidecar_turn_detection_asks_for_none_and_settings_name_the_session(self) -> None:
        options = CallOptions(
            engine_input=NEMOTRON_INPUT,
            barge_in=BargeIn.SIDECAR,
            model="m",
            voice="v",
            instructions="be brief",
        )
        c = TwilioCall(CallStart(SID), options, TurnDetector(LevelStream()))
        session = orjson.loads(c.session_update())["session"]
        assert session["turn_detection"] is None
        assert session["input_audio_format"] == "pcm_f32le"
        assert (session["model"], session["voice"], session["instructions"]) == (
            "m",
            "v",
            "be brief",
        )


class TestCallerAudio:
    @pytest.mark.parametrize(("engine_input", "width"), [(MINICPMO_INPUT, 2), (NEMOTRON_INPUT, 4)])
    def test_each_frame_is_one_append_in_the_engines_format(
        self, engine_input: AudioFormat, width: int
    ) -> None:
        c = call(engine_input=engine_input)
        total = 0
        for _ in range(50):  # one second
            out = c.from_twilio(media(SILENT))
            assert types(out.engine) in ([], ["input_audio_buffer.append"])
            for text in out.engine:
                total += len(base64.b64decode(orjson.loads(text)["audio"]))
        # 16 kHz: one second is 16000 samples (the resampler holds a few ms back).
        assert 15_000 * width <= total <= 16_000 * width

    def test_a_turn_ends_with_a_commit_that_asks_for_the_answer(self) -> None:
        c = call()
        events: list[dict[str, Any]] = []
        for payload in [LOUD] * 10 + [SILENT] * 40:
            events += [orjson.loads(t) for t in c.from_twilio(media(payload)).engine]
        commits = [e for e in events if e["type"] != "input_audio_buffer.append"]
        assert commits == [{"type": "input_audio_buffer.commit", "response_create": True}]

    def test_silence_alone_commits_nothing(self) -> None:
        c = call()
        events = [t for _ in range(100) for t in types(c.from_twilio(media(SILENT)).engine)]
        assert set(events) == {"input_audio_buffer.append"}

    def test_an_outbound_track_or_a_bad_payload_is_not_the_caller(self) -> None:
        c = call()
        outbound = {"event": "media", "media": {"track": "outbound", "payload": "/w=="}}
        assert c.from_twilio(outbound).engine == []
        assert c.from_twilio({"event": "media", "media": {"payload": "not base64!"}}).engine == []

    def test_stop_closes_the_session(self) -> None:
        out = call().from_twilio({"event": "stop", "streamSid": SID})
        assert out.stopped and types(out.engine) == ["session.close"]


class TestAnswerAudio:
    def test_deltas_become_160_byte_frames_and_a_mark_each(self) -> None:
        c = call()
        c.to_twilio(created())
        frames = c.to_twilio(delta(100))
        assert kinds(frames) == ["media"] * 5 + ["mark"]
        assert all(len(p) == 160 for p in payloads(frames))
        assert all(orjson.loads(f)["streamSid"] == SID for f in frames)

    def test_the_audio_end_flushes_a_padded_last_frame(self) -> None:
        c = call()
        frames = c.to_twilio(delta(30))  # 240 bytes at 8 kHz: one frame and a half
        frames += c.to_twilio(ev({"type": "response.output_audio.done", "response_id": RID}))
        got = payloads(frames)
        assert [len(p) for p in got] == [160, 160]
        assert got[-1].endswith(b"\xff" * 40)

    def test_the_output_format_comes_from_the_session(self) -> None:
        c = call(output_rate=22050)
        frames = c.to_twilio(delta(1000, rate=22050))
        frames += c.to_twilio(ev({"type": "response.output_audio.done", "response_id": RID}))
        assert len(payloads(frames)) == 50  # one second at 20 ms, not 0.92 s

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.integers(1, 240), min_size=1, max_size=12), st.sampled_from([22050, 24000]))
    def test_any_cut_of_an_answer_is_whole_frames_as_long_as_the_answer(
        self, cuts: list[int], rate: int
    ) -> None:
        c = call(output_rate=rate)
        frames: list[str] = []
        for ms in cuts:
            frames += c.to_twilio(delta(ms, rate=rate))
        frames += c.to_twilio(ev({"type": "response.output_audio.done", "response_id": RID}))
        got = payloads(frames)
        assert all(len(p) == 160 for p in got)
        samples_8k = sum(rate * ms // 1000 for ms in cuts) * 8000 / rate
        assert (
            len(got) == math.ceil(round(samples_8k) / 160)
            or abs(len(got) * 160 - samples_8k) <= 160
        )

    def test_events_twilio_does_not_speak_are_not_sent(self) -> None:
        c = call()
        for kind in ("response.output_audio_transcript.delta", "session.updated", "error"):
            assert c.to_twilio(ev({"type": kind})) == []
        assert c.to_twilio("not json") == []


class TestMarks:
    def test_an_echoed_mark_tells_the_session_what_was_heard(self) -> None:
        c = call()
        first = c.to_twilio(delta(100))
        c.to_twilio(delta(100))
        name = orjson.loads(first[-1])["mark"]["name"]
        out = c.from_twilio({"event": "mark", "streamSid": SID, "mark": {"name": name}})
        (ack,) = [orjson.loads(t) for t in out.engine]
        assert ack == {"type": "playback.ack", "response_id": RID, "played_ms": 100}

    def test_a_mark_says_the_frames_sent_not_the_audio_taken(self) -> None:
        # 24 kHz in: the resampler and the cutter hold part of the first 100 ms back.
        c = call(output_rate=24_000)
        frames = c.to_twilio(delta(100, rate=24_000))
        sent_ms = 20 * len(payloads(frames))
        assert sent_ms < 100
        name = orjson.loads(frames[-1])["mark"]["name"]
        (ack,) = c.from_twilio({"event": "mark", "mark": {"name": name}}).engine
        assert orjson.loads(ack)["played_ms"] == sent_ms

    def test_marks_a_clear_dropped_mean_nothing_was_heard(self) -> None:
        c = call()
        c.to_twilio(created())
        names = [orjson.loads(c.to_twilio(delta(100))[-1])["mark"]["name"] for _ in range(3)]
        assert kinds(c.to_twilio(ev({"type": "input_audio_buffer.speech_started"}))) == ["clear"]
        for name in names:
            assert c.from_twilio({"event": "mark", "mark": {"name": name}}).engine == []

    def test_marks_in_flight_are_bounded_and_the_last_echo_ends_playback(self) -> None:
        c = call()
        frames: list[str] = []
        for _ in range(MAX_MARKS + 10):
            frames = c.to_twilio(delta(20))
        assert c.playing
        c.from_twilio({"event": "mark", "mark": {"name": orjson.loads(frames[-1])["mark"]["name"]}})
        assert not c.playing

    def test_an_unknown_mark_is_ignored(self) -> None:
        assert call().from_twilio({"event": "mark", "mark": {"name": "m99"}}).engine == []


class TestBargeIn:
    @pytest.mark.parametrize(
        "trigger",
        [
            {"type": "input_audio_buffer.speech_started"},
            {"type": "overlap.decision", "action": "barge_in"},
            {"type": "output_audio_buffer.cleared", "response_id": RID},
            {"type": "response.done", "response": {"id": RID, "status": "cancelled"}},
        ],
    )
    def test_the_engines_cancel_clears_once_and_its_late_audio_never_goes_out(
        self, trigger: dict[str, Any]
    ) -> None:
        c = call(BargeIn.ENGINE)
        c.to_twilio(created())
        c.to_twilio(delta(100))
        assert kinds(c.to_twilio(ev(trigger))) == ["clear"]
        assert c.to_twilio(delta(100)) == [], "late audio of the cancelled answer"
        done = {"type": "response.done", "response": {"id": RID, "status": "cancelled"}}
        assert c.to_twilio(ev(done)) == []
        # The next answer plays.
        c.to_twilio(created("resp-2"))
        assert kinds(c.to_twilio(delta(20, rid="resp-2"))) == ["media", "mark"]

    def test_nothing_playing_nothing_to_clear(self) -> None:
        c = call()
        assert c.to_twilio(ev({"type": "input_audio_buffer.speech_started"})) == []

    def test_a_finished_answer_twilio_played_out_needs_no_clear(self) -> None:
        c = call()
        c.to_twilio(created())
        name = orjson.loads(c.to_twilio(delta(100))[-1])["mark"]["name"]
        c.to_twilio(ev({"type": "response.done", "response": {"id": RID, "status": "completed"}}))
        c.from_twilio({"event": "mark", "mark": {"name": name}})
        assert not c.playing

    def test_the_sidecar_hears_the_caller_over_an_answer_at_once(self) -> None:
        c = call(BargeIn.SIDECAR)
        c.to_twilio(created())
        c.to_twilio(delta(100))
        # Two 32 ms windows of speech (the detector's minimum) are whole after 4 frames.
        outs = [c.from_twilio(media(LOUD)) for _ in range(SPEECH_FRAMES)]
        assert [o.twilio for o in outs[:-1]] == [[]] * (SPEECH_FRAMES - 1)
        assert kinds(outs[-1].twilio) == ["clear"]
        assert "response.cancel" in types(outs[-1].engine)
        assert c.to_twilio(delta(100)) == []
        assert c.clears == c.clears_by_sidecar == 1

    def test_where_the_engine_listens_the_sidecar_waits_its_grace(self) -> None:
        c = call(BargeIn.ENGINE)
        c.to_twilio(created())
        c.to_twilio(delta(100))
        c.to_twilio(ev({"type": "response.done", "response": {"id": RID, "status": "completed"}}))
        # The engine is done generating; Twilio still plays: the engine will not barge in.
        outs = [c.from_twilio(media(LOUD)) for _ in range(SPEECH_FRAMES + ENGINE_GRACE_FRAMES)]
        cleared = [i for i, o in enumerate(outs) if o.twilio]
        assert cleared == [SPEECH_FRAMES - 1 + ENGINE_GRACE_FRAMES]
        assert kinds(outs[cleared[0]].twilio) == ["clear"]

    def test_where_the_engine_barged_in_the_sidecar_does_not_again(self) -> None:
        c = call(BargeIn.ENGINE)
        c.to_twilio(created())
        c.to_twilio(delta(100))
        outs = [c.from_twilio(media(LOUD)) for _ in range(SPEECH_FRAMES)]
        assert kinds(c.to_twilio(ev({"type": "input_audio_buffer.speech_started"}))) == ["clear"]
        outs += [c.from_twilio(media(LOUD)) for _ in range(ENGINE_GRACE_FRAMES + 5)]
        assert all(o.twilio == [] for o in outs)
        assert "response.cancel" not in [t for o in outs for t in types(o.engine)]
        assert (c.clears, c.clears_by_sidecar) == (1, 0)


def test_the_tests_loud_frame_is_loud_and_silent_frame_silent() -> None:
    loud, silent = decode_samples(Encoding.MULAW, LOUD), decode_samples(Encoding.MULAW, SILENT)
    assert isinstance(loud, np.ndarray) and isinstance(silent, np.ndarray)
    assert float(np.sqrt(np.mean(np.square(loud)))) > 0.4
    assert not silent.any()
