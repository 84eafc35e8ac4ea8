"""The turn-detection library's ``TurnDetector`` as the dialect's ``TurnSource`` (sans-I/O).

The OpenAI front door takes turns from a :class:`~proxy.core.dialect.turn_hook.TurnSource`;
this adapts the sidecar's own detector (``proxy.core.turns``, a voice-activity
model per session) to it: OpenAI's ``turn_detection`` objects parsed as the
library parses them, its events as turn signals (docs/design.md, OpenAI dialect).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from proxy.core.audio_formats import AudioError
from proxy.core.dialect.turn_hook import TurnAction, TurnSignal
from proxy.core.turns import (
    CancelResponse,
    CommitInput,
    CreateResponse,
    SpeechStarted,
    SpeechStopped,
    TurnDetection,
    TurnDetectionError,
    TurnDetector,
    TurnEvent,
    VoiceActivityStream,
    parse_turn_detection,
)

__all__ = ["DetectorTurns"]

_NONE: Final[tuple[TurnSignal, ...]] = ()


class DetectorTurns:
    """One session's :class:`TurnDetector` behind the ``TurnSource`` protocol.

    Args:
        stream: the session's voice-activity scorer (``SileroModel.new_stream()``).
    """

    __slots__ = ("_detector", "_stream")

    def __init__(self, stream: VoiceActivityStream) -> None:
        self._stream = stream
        self._detector = TurnDetector(stream)

    @property
    def rate(self) -> int:
        return self._stream.rate

    def configure(self, turn_detection: Mapping[str, Any] | None) -> dict[str, Any] | None:
        parsed = parse_turn_detection(turn_detection)
        if not isinstance(parsed, TurnDetectionError):
            self._detector.configure(parsed)
        # A value OpenAI would refuse leaves what is in effect, which session.updated shows.
        return _shown(self._detector.config)

    def audio(self, pcm16: bytes) -> Sequence[TurnSignal]:
        events = self._detector.receive_pcm16(pcm16)
        if isinstance(events, AudioError) or not events:
            return _NONE
        return [_signal(event) for event in events]

    def response_active(self, active: bool) -> None:
        self._detector.receive_response_active(active)

    def clear(self) -> None:
        self._detector.clear()


def _shown(config: TurnDetection) -> dict[str, Any] | None:
    shown = config.to_openai()
    return None if shown is None else dict(shown)


def _signal(event: TurnEvent) -> TurnSignal:
    if isinstance(event, SpeechStarted):
        return TurnSignal(TurnAction.SPEECH_STARTED, event.audio_start_ms)
    if isinstance(event, SpeechStopped):
        return TurnSignal(TurnAction.SPEECH_STOPPED, event.audio_end_ms)
    if isinstance(event, CommitInput):
        return TurnSignal(TurnAction.COMMIT, event.audio_end_ms)
    if isinstance(event, CancelResponse):
        return TurnSignal(TurnAction.CANCEL_RESPONSE)
    assert isinstance(event, CreateResponse)
    return TurnSignal(TurnAction.CREATE_RESPONSE)
