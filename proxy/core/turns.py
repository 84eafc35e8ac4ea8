"""Turn detection on the client's input audio, as OpenAI's ``server_vad`` (sans-I/O).

For front doors whose engine has no turn detection of its own (docs/design.md,
Turn detection): one :class:`TurnDetector` per session scores its input audio
with a ``VoiceActivityStream`` and gives out OpenAI's turn events as values
(speech started/stopped, commit, create a response, barge-in). The client's
``turn_detection`` object (GA or beta) is read by :func:`turn_detection_from_session`;
:meth:`TurnDetection.to_openai` is what ``session.updated`` reports. Time is the
input audio itself: every ``*_ms`` is milliseconds of audio received since the
detector was made.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np

from .audio_formats import AudioError, Encoding, Samples, decode_samples

__all__ = [
    "DEFAULT_MIN_SPEECH_MS",
    "DEFAULT_TURN_DETECTION",
    "SEMANTIC_SILENCE_MS",
    "TURN_DETECTION_OFF",
    "CancelResponse",
    "CommitInput",
    "CreateResponse",
    "Eagerness",
    "SpeechStarted",
    "SpeechStopped",
    "TurnDetection",
    "TurnDetectionError",
    "TurnDetector",
    "TurnEvent",
    "TurnMode",
    "VoiceActivityStream",
    "parse_turn_detection",
    "turn_detection_from_session",
]


class TurnMode(enum.Enum):
    """``turn_detection.type``; ``OFF`` is ``null`` (the client commits itself)."""

    SERVER_VAD = "server_vad"
    SEMANTIC_VAD = "semantic_vad"
    OFF = "none"


class Eagerness(enum.Enum):
    """``semantic_vad``'s ``eagerness``; ``auto`` is ``medium`` (OpenAI's definition)."""

    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    AUTO = "auto"


#: semantic_vad, approximated: OpenAI scores whether the words so far end a turn
#: and waits up to 8/4/2 s (low/medium/high) when they do not. The sidecar has no
#: such model; each eagerness is a fixed silence (docs/design.md, Turn detection).
SEMANTIC_SILENCE_MS: Final[Mapping[Eagerness, int]] = {
    Eagerness.LOW: 1200,
    Eagerness.MEDIUM: 800,
    Eagerness.AUTO: 800,
    Eagerness.HIGH: 400,
}
#: Speech must last this long before ``speech_started`` (a click or a cough does
#: not barge in): two of the model's 32 ms windows.
DEFAULT_MIN_SPEECH_MS: Final = 64
#: Hysteresis: in speech, a window counts as silence only below ``threshold``
#: minus this (Silero's own ``VADIterator`` uses 0.15).
_HYSTERESIS: Final = 0.15


class VoiceActivityStream(Protocol):
    """One audio stream's scorer: what :class:`proxy.core.turns.TurnDetector` needs."""

    @property
    def rate(self) -> int:
        """Samples per second of the windows it scores."""
        ...

    @property
    def window_samples(self) -> int:
        """Samples in one window; :meth:`probability` takes exactly this many."""
        ...

    def probability(self, window: Samples) -> float:
        """The probability, 0 to 1, that ``window`` (float32, full scale 1.0) holds speech."""
        ...

    def reset(self) -> None:
        """Forget the audio so far (a new, unrelated stream follows)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnDetection:
    """The turn detection in effect; OpenAI's defaults unless the client set them."""

    mode: TurnMode = TurnMode.SERVER_VAD
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    eagerness: Eagerness = Eagerness.AUTO

    @property
    def silence_ms(self) -> int:
        """The silence that ends a turn (semantic_vad: by eagerness)."""
        if self.mode is TurnMode.SEMANTIC_VAD:
            return SEMANTIC_SILENCE_MS[self.eagerness]
        return self.silence_duration_ms

    def to_openai(self) -> dict[str, object] | None:
        """The ``turn_detection`` object ``session.updated`` reports (``None``: off).

        ``idle_timeout_ms`` is always ``None``: the sidecar does not prompt an idle caller.
        """
        if self.mode is TurnMode.OFF:
            return None
        if self.mode is TurnMode.SEMANTIC_VAD:
            return {
                "type": "semantic_vad",
                "eagerness": self.eagerness.value,
                "create_response": self.create_response,
                "interrupt_response": self.interrupt_response,
            }
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "idle_timeout_ms": None,
        }


#: What a session starts with (OpenAI's: server_vad, 0.5, 300 ms, 500 ms).
DEFAULT_TURN_DETECTION: Final = TurnDetection()
TURN_DETECTION_OFF: Final = TurnDetection(mode=TurnMode.OFF)


@dataclass(frozen=True, slots=True)
class TurnDetectionError:
    """A ``turn_detection`` object OpenAI would refuse: answer with an ``error`` event.

    ``code`` is OpenAI's (``invalid_value``, ``invalid_type``, ``unknown_parameter``);
    ``param`` the dotted path, e.g. ``session.turn_detection.threshold``.
    """

    code: str
    param: str
    message: str


_COMMON_KEYS: Final = frozenset({"type", "create_response", "interrupt_response"})
_KEYS: Final[Mapping[TurnMode, frozenset[str]]] = {
    TurnMode.SERVER_VAD: _COMMON_KEYS
    | {"threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"},
    TurnMode.SEMANTIC_VAD: _COMMON_KEYS | {"eagerness"},
}


def _int_ms(value: object, param: str) -> int | TurnDetectionError:
    if isinstance(value, bool) or not isinstance(value, int):
        return TurnDetectionError("invalid_type", param, f"{param} must be an integer")
    if value < 0:
        return TurnDetectionError("invalid_value", param, f"{param} must be at least 0")
    return value


def parse_turn_detection(
    value: object, param: str = "session.audio.input.turn_detection"
) -> TurnDetection | TurnDetectionError:
    """Read a ``turn_detection`` object (GA or beta: the same fields) as OpenAI does.

    ``None`` turns detection off. Fields left out take OpenAI's defaults (the
    object replaces the one in effect, as in OpenAI's ``session.update``).
    ``idle_timeout_ms`` is accepted and not honoured (reported as ``null``).
    """
    if value is None:
        return TURN_DETECTION_OFF
    if not isinstance(value, Mapping):
        return TurnDetectionError("invalid_type", param, f"{param} must be an object or null")
    kind = value.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        return TurnDetectionError(
            "invalid_value", f"{param}.type", "type must be 'server_vad' or 'semantic_vad'"
        )
    mode = TurnMode(kind)
    for key in value:
        if key not in _KEYS[mode]:
            return TurnDetectionError(
                "unknown_parameter", f"{param}.{key}", f"Unknown parameter: '{param}.{key}'."
            )
    flags: list[bool] = []
    for key in ("create_response", "interrupt_response"):
        flag = value.get(key, True)
        if not isinstance(flag, bool):
            return TurnDetectionError("invalid_type", f"{param}.{key}", f"{key} must be a boolean")
        flags.append(flag)
    create_response, interrupt_response = flags
    if mode is TurnMode.SEMANTIC_VAD:
        eagerness = value.get("eagerness", "auto")
        if eagerness not in {e.value for e in Eagerness}:
            return TurnDetectionError(
                "invalid_value",
                f"{param}.eagerness",
                "eagerness must be 'low', 'medium', 'high' or 'auto'",
            )
        return TurnDetection(
            mode=mode,
            eagerness=Eagerness(eagerness),
            create_response=create_response,
            interrupt_response=interrupt_response,
        )
    threshold = value.get("threshold", DEFAULT_TURN_DETECTION.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        return TurnDetectionError(
            "invalid_type", f"{param}.threshold", "threshold must be a number"
        )
    if not 0.0 <= threshold <= 1.0:
        return TurnDetectionError(
            "invalid_value", f"{param}.threshold", "threshold must be between 0.0 and 1.0"
        )
    prefix = _int_ms(
        value.get("prefix_padding_ms", DEFAULT_TURN_DETECTION.prefix_padding_ms),
        f"{param}.prefix_padding_ms",
    )
    if isinstance(prefix, TurnDetectionError):
        return prefix
    silence = _int_ms(
        value.get("silence_duration_ms", DEFAULT_TURN_DETECTION.silence_duration_ms),
        f"{param}.silence_duration_ms",
    )
    if isinstance(silence, TurnDetectionError):
        return silence
    idle = value.get("idle_timeout_ms")
    if idle is not None:
        checked = _int_ms(idle, f"{param}.idle_timeout_ms")
        if isinstance(checked, TurnDetectionError):
            return checked
    return TurnDetection(
        mode=mode,
        threshold=float(threshold),
        prefix_padding_ms=prefix,
        silence_duration_ms=silence,
        create_response=create_response,
        interrupt_response=interrupt_response,
    )


def turn_detection_from_session(
    session: Mapping[str, object], current: TurnDetection
) -> TurnDetection | TurnDetectionError:
    """The turn detection after a ``session.update``'s ``session`` object.

    GA puts it at ``session.audio.input.turn_detection``, beta at
    ``session.turn_detection``; a session object with neither keeps ``current``.
    """
    audio = session.get("audio")
    if isinstance(audio, Mapping):
        audio_input = audio.get("input")
        if isinstance(audio_input, Mapping) and "turn_detection" in audio_input:
            return parse_turn_detection(
                audio_input["turn_detection"], "session.audio.input.turn_detection"
            )
    if "turn_detection" in session:
        return parse_turn_detection(session["turn_detection"], "session.turn_detection")
    return current


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """``input_audio_buffer.speech_started``: the turn's audio starts at ``audio_start_ms``
    (the speech's onset less ``prefix_padding_ms``, not before the buffer's start)."""

    audio_start_ms: int


@dataclass(frozen=True, slots=True)
class CancelResponse:
    """Barge-in: cancel the response in progress now, and stop its audio (after
    :class:`SpeechStarted`, when ``interrupt_response`` is on and a response is active)."""


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    """``input_audio_buffer.speech_stopped``; ``audio_end_ms`` includes the silence."""

    audio_end_ms: int


@dataclass(frozen=True, slots=True)
class CommitInput:
    """Commit the input buffer up to ``audio_end_ms`` (``input_audio_buffer.committed``)."""

    audio_end_ms: int


@dataclass(frozen=True, slots=True)
class CreateResponse:
    """Create a response now (``create_response`` on and none active)."""


TurnEvent = SpeechStarted | CancelResponse | SpeechStopped | CommitInput | CreateResponse


class TurnDetector:
    """One session's turn detection over its input audio.

    Drive it with the session's events::

        detector = TurnDetector(model.new_stream(), config)
        for event in detector.receive_pcm16(pcm16):  # any chunking; at stream.rate
            ...  # SpeechStarted [CancelResponse] ... SpeechStopped CommitInput [CreateResponse]
        detector.receive_response_active(True)  # response.created; False on response.done
        detector.configure(new_config)  # session.update
        detector.clear()  # the client committed or cleared the buffer itself

    Args:
        stream: the session's voice-activity scorer; its ``rate`` is the rate of
            the audio this detector takes.
        config: the turn detection in effect (:meth:`configure` changes it).
        min_speech_ms: speech shorter than this starts no turn.
    """

    def __init__(
        self,
        stream: VoiceActivityStream,
        config: TurnDetection = DEFAULT_TURN_DETECTION,
        *,
        min_speech_ms: int = DEFAULT_MIN_SPEECH_MS,
    ) -> None:
        self._stream = stream
        self._rate = stream.rate
        self._window = stream.window_samples
        self._min_speech = min_speech_ms * self._rate // 1000
        self._config = config
        self._pending: Samples = np.zeros(0, dtype=np.float32)
        self._position = 0  # samples scored or pending since construction
        self._buffer_start = 0  # where the input buffer starts (after the last commit)
        self._speech_run = 0  # samples of speech in a row while idle
        self._onset: int | None = None  # where that run started
        self._in_speech = False
        self._silence_start: int | None = None  # in speech: where the silence started
        self._response_active = False

    @property
    def config(self) -> TurnDetection:
        return self._config

    @property
    def in_speech(self) -> bool:
        """Between a :class:`SpeechStarted` and its :class:`SpeechStopped`."""
        return self._in_speech

    @property
    def position_ms(self) -> int:
        """Milliseconds of audio received so far."""
        return self._ms(self._position + len(self._pending))

    def configure(self, config: TurnDetection) -> None:
        """Apply a new ``turn_detection`` (``session.update``); off drops the turn in progress."""
        if config.mode is TurnMode.OFF:
            self._position += len(self._pending)
            self._pending = np.zeros(0, dtype=np.float32)
            self._end_turn(self._position)
        elif self._config.mode is TurnMode.OFF:
            self._stream.reset()  # the audio it scored last is not the audio that follows
        self._config = config

    def receive_response_active(self, active: bool) -> None:
        """Whether a response is in progress: from ``response.created`` until its audio
        has finished playing at the client (the playback ledger knows), not merely
        until ``response.done``: speech over audio still playing is a barge-in too."""
        self._response_active = active

    def clear(self) -> None:
        """The client committed or cleared the buffer itself: the turn in progress ends
        without events, and the next turn's audio starts at the current position."""
        self._end_turn(self._position + len(self._pending))

    def receive_pcm16(self, data: bytes) -> list[TurnEvent] | AudioError:
        """Take PCM16 mono at ``stream.rate``; the events that audio completes.

        ``data`` that is not whole samples is refused whole (an ``AudioError``,
        ``invalid_audio``), as ``audio_formats`` refuses it.
        """
        samples = decode_samples(Encoding.PCM16, data)
        if isinstance(samples, AudioError):
            return samples
        return self.receive_samples(samples)

    def receive_samples(self, samples: Samples) -> list[TurnEvent]:
        """Take float32 samples (full scale 1.0) at ``stream.rate``; the events they complete.

        Only whole windows are scored; the rest waits for the next call, so any
        chunking of the same audio gives the same events at the same positions.
        """
        if self._config.mode is TurnMode.OFF:
            self._position += len(samples)
            return []
        audio = np.concatenate((self._pending, samples)) if len(self._pending) else samples
        events: list[TurnEvent] = []
        whole = len(audio) - len(audio) % self._window
        for start in range(0, whole, self._window):
            window = audio[start : start + self._window]
            self._position += self._window
            self._score(self._stream.probability(window), events)
        self._pending = audio[whole:].astype(np.float32, copy=True)
        return events

    def _score(self, probability: float, events: list[TurnEvent]) -> None:
        end = self._position
        config = self._config
        if not self._in_speech:
            if probability < config.threshold:
                self._speech_run, self._onset = 0, None
                return
            if self._onset is None:
                self._onset = end - self._window
            self._speech_run += self._window
            if self._speech_run < max(self._min_speech, 1):
                return
            self._in_speech, self._silence_start = True, None
            padding = config.prefix_padding_ms * self._rate // 1000
            start = max(self._buffer_start, self._onset - padding)
            events.append(SpeechStarted(self._ms(start)))
            if self._response_active and config.interrupt_response:
                self._response_active = False
                events.append(CancelResponse())
            return
        if probability >= config.threshold:
            self._silence_start = None
        elif probability < config.threshold - _HYSTERESIS and self._silence_start is None:
            self._silence_start = end - self._window
        silence = config.silence_ms * self._rate // 1000
        if self._silence_start is None or end - self._silence_start < silence:
            return
        self._end_turn(end)
        events.append(SpeechStopped(self._ms(end)))
        events.append(CommitInput(self._ms(end)))
        if config.create_response and not self._response_active:
            events.append(CreateResponse())

    def _end_turn(self, at: int) -> None:
        self._in_speech = False
        self._speech_run, self._onset, self._silence_start = 0, None, None
        self._buffer_start = at

    def _ms(self, samples: int) -> int:
        return samples * 1000 // self._rate
