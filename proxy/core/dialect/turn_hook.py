"""Where the sidecar's own turn detection plugs into the OpenAI dialect (sans-I/O).

An engine that does not commit turns and create responses by itself, as
OpenAI's server VAD does, gets them from the sidecar: a :class:`TurnSource`
per session scores the client's input audio and gives out :class:`TurnSignal`
values, which the dialect turns into OpenAI's events and the engine's frames
(docs/design.md, OpenAI dialect). The turn-detection library's
``TurnDetector`` is one behind a small adapter; tests use a scripted one.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["TurnAction", "TurnSignal", "TurnSource", "TurnSourceFactory"]


class TurnAction(enum.Enum):
    """What a turn detector says, in OpenAI's order: started [cancel] ... stopped, commit [create]."""

    SPEECH_STARTED = "speech_started"
    CANCEL_RESPONSE = "cancel_response"
    SPEECH_STOPPED = "speech_stopped"
    COMMIT = "commit"
    CREATE_RESPONSE = "create_response"


@dataclass(frozen=True, slots=True)
class TurnSignal:
    """One turn event; ``audio_ms`` is ms of input audio since the detector was made
    (``audio_start_ms`` / ``audio_end_ms`` of OpenAI's speech events)."""

    action: TurnAction
    audio_ms: int = 0


class TurnSource(Protocol):
    """One session's turn detection over the client's input audio."""

    @property
    def rate(self) -> int:
        """The rate of the PCM16 mono audio :meth:`audio` takes."""
        ...

    def configure(self, turn_detection: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The client's ``turn_detection`` (GA or beta object, or None: off); returns
        what is in effect as OpenAI shows it (None: off)."""
        ...

    def audio(self, pcm16: bytes) -> Sequence[TurnSignal]:
        """Input audio at :attr:`rate`; the signals it completes."""
        ...

    def response_active(self, active: bool) -> None:
        """A response runs (speech now barges in), or no longer does."""
        ...

    def clear(self) -> None:
        """The client committed or cleared the input itself: the turn ends silently."""
        ...


#: Builds a session's :class:`TurnSource` (None where the sidecar has none).
TurnSourceFactory = Callable[[], TurnSource]
