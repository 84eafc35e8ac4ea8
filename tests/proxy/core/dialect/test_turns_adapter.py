"""DetectorTurns: the library's TurnDetector as the dialect's TurnSource, on a scripted scorer."""

from __future__ import annotations

import numpy as np

from proxy.core.dialect.turn_hook import TurnAction
from proxy.core.dialect.turns_adapter import DetectorTurns


class LoudIsSpeech:
    """A voice-activity scorer that calls any loud window speech (16 kHz, 512 samples)."""

    rate = 16000
    window_samples = 512

    def probability(self, window: np.ndarray) -> float:  # type: ignore[type-arg]
        return 0.9 if float(np.abs(window).max()) > 0.1 else 0.0

    def reset(self) -> None:
        pass


def pcm(ms: int, loud: bool) -> bytes:
    n = 16 * ms
    x = 0.5 * np.sin(2 * np.pi * 200 * np.arange(n) / 16000) if loud else np.zeros(n)
    return (x * 32767).astype("<i2").tobytes()


def test_a_turn_comes_out_as_openai_signals() -> None:
    turns = DetectorTurns(LoudIsSpeech())
    shown = turns.configure({"type": "server_vad", "silence_duration_ms": 200})
    assert shown is not None and shown["type"] == "server_vad" and shown["create_response"]
    actions = [s.action for s in turns.audio(pcm(600, loud=True))]
    assert actions == [TurnAction.SPEECH_STARTED]
    actions = [s.action for s in turns.audio(pcm(500, loud=False))]
    assert actions == [TurnAction.SPEECH_STOPPED, TurnAction.COMMIT, TurnAction.CREATE_RESPONSE]


def test_speech_over_a_response_cancels_it_and_off_is_none() -> None:
    turns = DetectorTurns(LoudIsSpeech())
    turns.configure({"type": "semantic_vad"})
    turns.response_active(True)
    actions = [s.action for s in turns.audio(pcm(300, loud=True))]
    assert actions == [TurnAction.SPEECH_STARTED, TurnAction.CANCEL_RESPONSE]
    assert turns.configure(None) is None
    assert turns.audio(pcm(300, loud=True)) == ()


def test_an_invalid_object_leaves_what_is_in_effect() -> None:
    turns = DetectorTurns(LoudIsSpeech())
    before = turns.configure({"type": "server_vad", "silence_duration_ms": 300})
    assert turns.configure({"type": "server_vad", "silence_duration_ms": -1}) == before
    turns.clear()
    assert turns.rate == 16000
