"""The dialect with a turn detector of the sidecar's own (turn_hook), scripted.

A loudness detector stands in for the turn-detection library: loud 20 ms
windows are speech, two quiet ones end the turn. What is checked is the
dialect's side: OpenAI's speech events to the client, the commit (with the
resampler's held audio ahead of it) and the response to the engine, a cancel
on barge-in, the engine asked for no turn detection of its own, and what
``session.updated`` shows.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from proxy.core.capabilities import EngineVersion
from proxy.core.dialect import Flavour, OpenAIDialect, engine_dialect
from proxy.core.dialect.turn_hook import TurnAction, TurnSignal
from tests.proxy.core.dialect.test_translator import engine_session, out


class LoudnessTurns:
    rate = 16000

    def __init__(self) -> None:
        self.config: dict[str, Any] | None = None
        self.active = False
        self.speaking = False
        self.quiet = 0
        self.position = 0  # samples
        self.cleared = 0

    def configure(self, turn_detection: Mapping[str, Any] | None) -> dict[str, Any] | None:
        self.config = (
            None if turn_detection is None else {**turn_detection, "create_response": True}
        )
        return self.config

    def audio(self, pcm16: bytes) -> Sequence[TurnSignal]:
        samples = np.frombuffer(pcm16, dtype="<i2")
        signals: list[TurnSignal] = []
        for start in range(0, len(samples) - 319, 320):
            loud = np.abs(samples[start : start + 320]).max() > 3000
            self.position += 320
            ms = self.position // 16
            if loud and not self.speaking:
                self.speaking, self.quiet = True, 0
                signals.append(TurnSignal(TurnAction.SPEECH_STARTED, ms - 20))
                if self.active:
                    signals.append(TurnSignal(TurnAction.CANCEL_RESPONSE))
            elif not loud and self.speaking:
                self.quiet += 1
                if self.quiet == 2:
                    self.speaking = False
                    signals += [
                        TurnSignal(TurnAction.SPEECH_STOPPED, ms),
                        TurnSignal(TurnAction.COMMIT, ms),
                        TurnSignal(TurnAction.CREATE_RESPONSE),
                    ]
        return signals

    def response_active(self, active: bool) -> None:
        self.active = active

    def clear(self) -> None:
        self.cleared += 1


def tone(ms: int, loud: bool) -> str:
    t = np.arange(24 * ms) / 24000
    amplitude = 0.5 * 32767 if loud else 0.0
    return base64.b64encode(
        (amplitude * np.sin(2 * np.pi * 300 * t)).astype("<i2").tobytes()
    ).decode()


def with_turns() -> tuple[OpenAIDialect, LoudnessTurns]:
    detector = LoudnessTurns()
    ids = iter(range(1000))
    d = OpenAIDialect(
        Flavour.GA,
        engine_dialect(EngineVersion.V0_30),
        lambda: f"event_{next(ids)}",
        turns=lambda: detector,
    )
    out(d, engine_session())
    d.from_client('{"type":"session.update","session":{}}')  # the client's first frame
    return d, detector


def update(d: OpenAIDialect, td: dict[str, Any] | None) -> dict[str, Any]:
    body = {"type": "session.update", "session": {"type": "realtime",
            "audio": {"input": {"turn_detection": td}}}}  # fmt: skip
    (text,) = d.from_client(json.dumps(body)).forward
    session = json.loads(text)["session"]
    assert isinstance(session, dict)
    return session


def append(
    d: OpenAIDialect, ms: int, loud: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    step = d.from_client(json.dumps({"type": "input_audio_buffer.append", "audio": tone(ms, loud)}))
    return [json.loads(t) for t in step.forward], [json.loads(t) for t in step.replies]


def test_semantic_vad_goes_to_the_sidecars_detector_and_the_engine_gets_none() -> None:
    d, detector = with_turns()
    engine = update(d, {"type": "semantic_vad", "create_response": True})
    assert engine["turn_detection"] is None
    assert detector.config is not None and detector.config["type"] == "semantic_vad"
    (updated,) = out(d, {**engine_session(), "type": "session.updated"})
    shown = updated["session"]["audio"]["input"]["turn_detection"]
    assert shown["type"] == "semantic_vad" and shown["create_response"] is True


def test_a_turn_is_started_stopped_committed_and_answered_as_openai_does() -> None:
    d, _ = with_turns()
    update(d, {"type": "server_vad"})
    forward, replies = append(d, 200, loud=True)
    assert [f["type"] for f in forward] == ["input_audio_buffer.append"]
    (started,) = replies
    assert started["type"] == "input_audio_buffer.speech_started"
    forward, replies = append(d, 100, loud=False)
    # The append, the audio the resampler held (24 -> 16 kHz), then the commit.
    types = [f["type"] for f in forward]
    assert types == ["input_audio_buffer.append"] * 2 + ["input_audio_buffer.commit"]
    assert forward[-1]["response_create"] is True
    (stopped,) = replies
    assert stopped["type"] == "input_audio_buffer.speech_stopped"
    assert stopped["item_id"] == started["item_id"]
    assert not d.uncommitted
    # The next turn is another item.
    _, replies = append(d, 100, loud=True)
    assert replies[0]["item_id"] != started["item_id"]


def test_speech_during_a_response_cancels_it() -> None:
    d, detector = with_turns()
    update(d, {"type": "server_vad"})
    out(d, {"type": "response.created", "event_id": "e", "response": {
        "id": "r1", "object": "realtime.response", "status": "in_progress", "output": []}})  # fmt: skip
    assert detector.active
    forward, replies = append(d, 100, loud=True)
    assert [f["type"] for f in forward] == ["input_audio_buffer.append", "response.cancel"]
    assert replies[0]["type"] == "input_audio_buffer.speech_started"


def test_turn_detection_off_and_the_clients_own_commit_reach_the_detector() -> None:
    d, detector = with_turns()
    update(d, {"type": "server_vad"})
    d.from_client('{"type":"input_audio_buffer.commit"}')
    assert detector.cleared == 1
    assert update(d, None)["turn_detection"] is None
    assert detector.config is None


def test_without_a_detector_the_engines_server_vad_is_asked_for() -> None:
    ids = iter(range(100))
    d = OpenAIDialect(Flavour.GA, engine_dialect(EngineVersion.V0_30), lambda: f"e_{next(ids)}")
    assert update(d, {"type": "semantic_vad"})["turn_detection"] == {"type": "server_vad"}
