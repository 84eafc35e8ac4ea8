"""OpenAI's turn detection as a state machine (proxy/core/turns.py).

The detector is driven through its public API with a stand-in model whose score
for a window is the window's mean level, so a "signal" here is a sequence of
levels: 0.9 is speech, 0.0 silence, 0.4 a doubtful window. The boundaries follow
OpenAI's server_vad: ``speech_started`` carries the onset less the prefix
padding, ``speech_stopped`` the end of the silence that ended the turn, then the
commit and the response; barge-in cancels the response in progress. The real
model on real speech: tests/proxy/core/test_voice_activity.py (docs/design.md,
Turn detection).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.audio_formats import AudioError, AudioErrorKind, Samples
from proxy.core.turns import (
    DEFAULT_TURN_DETECTION,
    SEMANTIC_SILENCE_MS,
    TURN_DETECTION_OFF,
    CancelResponse,
    CommitInput,
    CreateResponse,
    Eagerness,
    SpeechStarted,
    SpeechStopped,
    TurnDetection,
    TurnDetectionError,
    TurnDetector,
    TurnEvent,
    TurnMode,
    parse_turn_detection,
    turn_detection_from_session,
)

WINDOW_MS = 32


class LevelStream:
    """A stand-in model: a window's score is its mean absolute level."""

    def __init__(self, rate: int = 16_000) -> None:
        self.rate = rate
        self.window_samples = rate * WINDOW_MS // 1000
        self.calls = 0
        self.resets = 0

    def probability(self, window: Samples) -> float:
        assert window.shape == (self.window_samples,)
        self.calls += 1
        return float(np.abs(window).mean())

    def reset(self) -> None:
        self.resets += 1


def levels(*parts: tuple[float, int], rate: int = 16_000) -> Samples:
    """Constant stretches: (level, milliseconds) each."""
    return np.concatenate(
        [np.full(ms * rate // 1000, level, dtype=np.float32) for level, ms in parts]
    )


def feed(
    detector: TurnDetector, samples: Samples, chunk_ms: int = 20, rate: int = 16_000
) -> list[tuple[int, TurnEvent]]:
    """Feed in chunks; each event with the position (ms) at which it came out."""
    step = chunk_ms * rate // 1000
    out: list[tuple[int, TurnEvent]] = []
    for start in range(0, len(samples), step):
        for event in detector.receive_samples(samples[start : start + step]):
            out.append((detector.position_ms, event))
    return out


def events_only(timed: list[tuple[int, TurnEvent]]) -> list[TurnEvent]:
    return [event for _, event in timed]


# Silence 1024 ms, speech 1024 ms, silence 1024 ms: every boundary on a 32 ms window.
ONE_TURN = levels((0.0, 1024), (0.9, 1024), (0.0, 1024))


class TestServerVad:
    def test_silence_starts_no_turn(self) -> None:
        detector = TurnDetector(LevelStream())
        assert feed(detector, levels((0.0, 3000))) == []
        assert not detector.in_speech

    def test_a_turn_has_openai_boundaries(self) -> None:
        detector = TurnDetector(LevelStream())
        timed = feed(detector, ONE_TURN)
        assert events_only(timed) == [
            # onset 1024 less the default 300 ms of prefix padding
            SpeechStarted(audio_start_ms=724),
            # silence from 2048; 500 ms of it is 16 windows: 2560 (the silence included)
            SpeechStopped(audio_end_ms=2560),
            CommitInput(audio_end_ms=2560),
            CreateResponse(),
        ]
        # Started once two windows of speech are in (64 ms debounce), i.e. at 1088 ms,
        # given out with the 20 ms chunk that completes it.
        assert 1088 <= timed[0][0] < 1088 + 20
        assert 2560 <= timed[1][0] < 2560 + 20

    def test_prefix_padding_and_silence_duration_are_the_clients(self) -> None:
        config = TurnDetection(prefix_padding_ms=100, silence_duration_ms=200)
        detector = TurnDetector(LevelStream(), config)
        assert events_only(feed(detector, ONE_TURN))[:2] == [
            SpeechStarted(audio_start_ms=924),
            SpeechStopped(audio_end_ms=2048 + 224),  # 200 ms is 7 windows: 224
        ]

    def test_the_padding_does_not_reach_before_the_buffer(self) -> None:
        detector = TurnDetector(LevelStream())
        signal = levels((0.0, 96), (0.9, 320), (0.0, 544), (0.9, 320), (0.0, 640))
        started = [e for e in events_only(feed(detector, signal)) if isinstance(e, SpeechStarted)]
        # At the session's start, and after the first turn's commit at 416 + 512 = 928.
        assert started == [SpeechStarted(audio_start_ms=0), SpeechStarted(audio_start_ms=928)]

    def test_a_blip_shorter_than_the_debounce_starts_no_turn(self) -> None:
        detector = TurnDetector(LevelStream())
        blips = levels((0.0, 320), (0.9, 32), (0.0, 320), (0.9, 32), (0.0, 320))
        assert feed(detector, blips) == []
        assert events_only(feed(detector, levels((0.9, 64))))[:1] == [
            SpeechStarted(audio_start_ms=1024 - 300)
        ]

    def test_a_pause_shorter_than_the_silence_keeps_the_turn(self) -> None:
        detector = TurnDetector(LevelStream())
        signal = levels((0.0, 320), (0.9, 512), (0.0, 448), (0.9, 512), (0.0, 1024))
        events = events_only(feed(detector, signal))
        assert [type(e) for e in events] == [
            SpeechStarted,
            SpeechStopped,
            CommitInput,
            CreateResponse,
        ]
        assert events[1] == SpeechStopped(audio_end_ms=320 + 512 + 448 + 512 + 512)

    def test_doubtful_windows_keep_speech_going(self) -> None:
        # Hysteresis: in speech, 0.4 (above 0.5 - 0.15) is not silence; 0.3 is.
        detector = TurnDetector(LevelStream())
        doubtful = levels((0.0, 320), (0.9, 320), (0.4, 1024))
        assert [type(e) for e in events_only(feed(detector, doubtful))] == [SpeechStarted]
        assert detector.in_speech
        stopped = events_only(feed(detector, levels((0.3, 512))))
        assert stopped[0] == SpeechStopped(audio_end_ms=320 + 320 + 1024 + 512)

    def test_threshold_is_the_clients(self) -> None:
        detector = TurnDetector(LevelStream(), TurnDetection(threshold=0.95))
        assert feed(detector, ONE_TURN) == []
        detector = TurnDetector(LevelStream(), TurnDetection(threshold=0.2))
        assert feed(detector, levels((0.0, 320), (0.3, 512), (0.0, 1024)))

    def test_any_rate_the_stream_takes(self) -> None:
        detector = TurnDetector(LevelStream(rate=8_000))
        signal = levels((0.0, 1024), (0.9, 1024), (0.0, 1024), rate=8_000)
        assert events_only(feed(detector, signal, rate=8_000))[:2] == [
            SpeechStarted(audio_start_ms=724),
            SpeechStopped(audio_end_ms=2560),
        ]


class TestResponses:
    def test_speech_during_a_response_cancels_it(self) -> None:
        detector = TurnDetector(LevelStream())
        detector.receive_response_active(True)
        events = events_only(feed(detector, ONE_TURN))
        assert events == [
            SpeechStarted(audio_start_ms=724),
            CancelResponse(),
            SpeechStopped(audio_end_ms=2560),
            CommitInput(audio_end_ms=2560),
            CreateResponse(),  # the cancelled response is no longer in progress
        ]

    def test_barge_in_comes_with_the_start_not_later(self) -> None:
        detector = TurnDetector(LevelStream())
        detector.receive_response_active(True)
        timed = feed(detector, ONE_TURN)
        assert timed[0][0] == timed[1][0]
        assert timed[1][0] - 1024 <= 64 + 20  # debounce + one chunk after the onset

    def test_no_cancel_without_a_response(self) -> None:
        detector = TurnDetector(LevelStream())
        detector.receive_response_active(True)
        detector.receive_response_active(False)
        assert CancelResponse() not in events_only(feed(detector, ONE_TURN))

    def test_interrupt_response_off_lets_the_response_play(self) -> None:
        detector = TurnDetector(LevelStream(), TurnDetection(interrupt_response=False))
        detector.receive_response_active(True)
        events = events_only(feed(detector, ONE_TURN))
        # No cancel; and no second response while the first is in progress.
        assert events == [
            SpeechStarted(audio_start_ms=724),
            SpeechStopped(audio_end_ms=2560),
            CommitInput(audio_end_ms=2560),
        ]

    def test_create_response_off_commits_only(self) -> None:
        detector = TurnDetector(LevelStream(), TurnDetection(create_response=False))
        assert CreateResponse() not in events_only(feed(detector, ONE_TURN))
        assert CommitInput(audio_end_ms=2560) in events_only(
            feed(TurnDetector(LevelStream()), ONE_TURN)
        )


class TestOffAndClear:
    def test_off_scores_nothing_and_says_nothing(self) -> None:
        stream = LevelStream()
        detector = TurnDetector(stream, TURN_DETECTION_OFF)
        assert feed(detector, ONE_TURN) == []
        assert stream.calls == 0
        assert detector.position_ms == 3072

    def test_turning_off_mid_turn_drops_it_and_on_again_starts_fresh(self) -> None:
        stream = LevelStream()
        detector = TurnDetector(stream)
        feed(detector, levels((0.0, 320), (0.9, 320)))
        assert detector.in_speech
        detector.configure(TURN_DETECTION_OFF)
        assert not detector.in_speech
        assert feed(detector, levels((0.9, 200), (0.0, 1000))) == []
        detector.configure(DEFAULT_TURN_DETECTION)
        assert stream.resets == 1
        started = events_only(feed(detector, levels((0.9, 320))))
        # Onset at 1840, padded: with detection off no commit moved the buffer's start.
        assert started == [SpeechStarted(audio_start_ms=1540)]

    def test_clear_ends_the_turn_without_events(self) -> None:
        detector = TurnDetector(LevelStream())
        feed(detector, levels((0.0, 320), (0.9, 640)))
        detector.clear()  # input_audio_buffer.commit or .clear from the client
        assert not detector.in_speech
        assert feed(detector, levels((0.0, 1024))) == []
        # The next turn's padding stops at the clear (960 ms).
        detector2 = TurnDetector(LevelStream())
        feed(detector2, levels((0.0, 320), (0.9, 640)))
        detector2.clear()
        assert events_only(feed(detector2, levels((0.9, 96))))[0] == SpeechStarted(960)

    def test_semantic_vad_waits_by_eagerness(self) -> None:
        for eagerness, silence in SEMANTIC_SILENCE_MS.items():
            config = TurnDetection(mode=TurnMode.SEMANTIC_VAD, eagerness=eagerness)
            detector = TurnDetector(LevelStream(), config)
            signal = levels((0.0, 1024), (0.9, 1024), (0.0, 2048))
            stopped = [
                e for e in events_only(feed(detector, signal)) if isinstance(e, SpeechStopped)
            ]
            windows = -(-silence // WINDOW_MS)
            assert stopped == [SpeechStopped(2048 + windows * WINDOW_MS)], eagerness
        assert SEMANTIC_SILENCE_MS[Eagerness.AUTO] == SEMANTIC_SILENCE_MS[Eagerness.MEDIUM]
        assert SEMANTIC_SILENCE_MS[Eagerness.HIGH] < SEMANTIC_SILENCE_MS[Eagerness.LOW]


class TestAudioInput:
    def test_pcm16_is_the_same_audio(self) -> None:
        pcm = (ONE_TURN * 32767).astype("<i2").tobytes()
        detector = TurnDetector(LevelStream())
        events: list[TurnEvent] = []
        for start in range(0, len(pcm), 640):
            out = detector.receive_pcm16(pcm[start : start + 640])
            assert not isinstance(out, AudioError)
            events += out
        assert events == events_only(feed(TurnDetector(LevelStream()), ONE_TURN))

    def test_pcm16_that_is_not_whole_samples_is_refused(self) -> None:
        detector = TurnDetector(LevelStream())
        out = detector.receive_pcm16(b"\x00\x01\x02")
        assert isinstance(out, AudioError)
        assert out.kind is AudioErrorKind.INVALID_AUDIO
        assert detector.position_ms == 0

    @settings(max_examples=200, deadline=None)
    @given(
        parts=st.lists(
            st.tuples(st.sampled_from([0.0, 0.3, 0.4, 0.9]), st.integers(1, 800)),
            min_size=1,
            max_size=12,
        ),
        cuts=st.lists(st.integers(0, 160_000), max_size=60),
        active=st.booleans(),
        padding=st.sampled_from([0, 300]),
    )
    def test_any_chunking_gives_the_same_events(
        self, parts: list[tuple[float, int]], cuts: list[int], active: bool, padding: int
    ) -> None:
        signal = levels(*parts)
        config = TurnDetection(prefix_padding_ms=padding)

        def run(bounds: list[int]) -> list[tuple[int, TurnEvent]]:
            detector = TurnDetector(LevelStream(), config)
            detector.receive_response_active(active)
            out: list[tuple[int, TurnEvent]] = []
            edges = [0, *sorted(b for b in bounds if b < len(signal)), len(signal)]
            for lo, hi in itertools.pairwise(edges):
                out += [(e_position(e), e) for e in detector.receive_samples(signal[lo:hi])]
            return out

        assert run(cuts) == run([])


def e_position(event: TurnEvent) -> int:
    if isinstance(event, SpeechStarted):
        return event.audio_start_ms
    if isinstance(event, SpeechStopped | CommitInput):
        return event.audio_end_ms
    return -1


OPENAI_DEFAULT = {
    "type": "server_vad",
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": 500,
    "create_response": True,
    "interrupt_response": True,
    "idle_timeout_ms": None,
}


class TestConfig:
    def test_the_default_is_openais(self) -> None:
        assert DEFAULT_TURN_DETECTION.to_openai() == OPENAI_DEFAULT
        assert parse_turn_detection({"type": "server_vad"}) == DEFAULT_TURN_DETECTION
        assert parse_turn_detection({}) == DEFAULT_TURN_DETECTION

    def test_null_turns_it_off(self) -> None:
        assert parse_turn_detection(None) == TURN_DETECTION_OFF
        assert TURN_DETECTION_OFF.to_openai() is None

    def test_fields_are_read_and_reported(self) -> None:
        value = {
            "type": "server_vad",
            "threshold": 0.7,
            "prefix_padding_ms": 200,
            "silence_duration_ms": 800,
            "create_response": False,
            "interrupt_response": False,
        }
        config = parse_turn_detection(value)
        assert isinstance(config, TurnDetection)
        assert config.to_openai() == {**value, "idle_timeout_ms": None}
        assert parse_turn_detection({"threshold": 1}) == TurnDetection(threshold=1.0)

    def test_idle_timeout_is_accepted_and_reported_as_not_in_effect(self) -> None:
        config = parse_turn_detection({"type": "server_vad", "idle_timeout_ms": 5000})
        assert config == DEFAULT_TURN_DETECTION

    def test_semantic_vad(self) -> None:
        config = parse_turn_detection({"type": "semantic_vad", "eagerness": "high"})
        assert config == TurnDetection(mode=TurnMode.SEMANTIC_VAD, eagerness=Eagerness.HIGH)
        assert isinstance(config, TurnDetection)
        assert config.silence_ms == SEMANTIC_SILENCE_MS[Eagerness.HIGH]
        assert config.to_openai() == {
            "type": "semantic_vad",
            "eagerness": "high",
            "create_response": True,
            "interrupt_response": True,
        }
        auto = parse_turn_detection({"type": "semantic_vad"})
        assert isinstance(auto, TurnDetection)
        assert auto.eagerness is Eagerness.AUTO

    @pytest.mark.parametrize(
        ("value", "code", "param"),
        [
            ("server_vad", "invalid_type", "p"),
            ({"type": "vad"}, "invalid_value", "p.type"),
            ({"threshold": 1.5}, "invalid_value", "p.threshold"),
            ({"threshold": -0.1}, "invalid_value", "p.threshold"),
            ({"threshold": "0.5"}, "invalid_type", "p.threshold"),
            ({"threshold": True}, "invalid_type", "p.threshold"),
            ({"prefix_padding_ms": -1}, "invalid_value", "p.prefix_padding_ms"),
            ({"prefix_padding_ms": 1.5}, "invalid_type", "p.prefix_padding_ms"),
            ({"silence_duration_ms": None}, "invalid_type", "p.silence_duration_ms"),
            ({"idle_timeout_ms": -5}, "invalid_value", "p.idle_timeout_ms"),
            ({"create_response": "yes"}, "invalid_type", "p.create_response"),
            ({"interrupt_response": 1}, "invalid_type", "p.interrupt_response"),
            ({"loudness": 3}, "unknown_parameter", "p.loudness"),
            ({"type": "semantic_vad", "threshold": 0.5}, "unknown_parameter", "p.threshold"),
            ({"type": "semantic_vad", "eagerness": "eager"}, "invalid_value", "p.eagerness"),
            ({"type": "server_vad", "eagerness": "low"}, "unknown_parameter", "p.eagerness"),
        ],
    )
    def test_what_openai_refuses_is_refused(self, value: object, code: str, param: str) -> None:
        error = parse_turn_detection(value, "p")
        assert isinstance(error, TurnDetectionError)
        assert (error.code, error.param) == (code, param)

    def test_ga_and_beta_places(self) -> None:
        current = DEFAULT_TURN_DETECTION
        ga = {"audio": {"input": {"turn_detection": None, "format": {"type": "audio/pcm"}}}}
        assert turn_detection_from_session(ga, current) == TURN_DETECTION_OFF
        beta = {"turn_detection": {"type": "semantic_vad"}, "voice": "alloy"}
        beta_config = turn_detection_from_session(beta, current)
        assert isinstance(beta_config, TurnDetection)
        assert beta_config.mode is TurnMode.SEMANTIC_VAD
        # Neither: what was in effect stays.
        assert turn_detection_from_session({"instructions": "hi"}, TURN_DETECTION_OFF) == (
            TURN_DETECTION_OFF
        )
        assert turn_detection_from_session({"audio": {"output": {}}}, current) is current
        error = turn_detection_from_session({"turn_detection": {"threshold": 2}}, current)
        assert isinstance(error, TurnDetectionError)
        assert error.param == "session.turn_detection.threshold"
        error = turn_detection_from_session(
            {"audio": {"input": {"turn_detection": {"threshold": 2}}}}, current
        )
        assert isinstance(error, TurnDetectionError)
        assert error.param == "session.audio.input.turn_detection.threshold"
