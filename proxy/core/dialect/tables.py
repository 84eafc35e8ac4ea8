"""The dialect's tables: what each OpenAI flavour names and knows, what each engine release does.

Every rewrite of the OpenAI front door is driven from here, never from a
condition in the translator (docs/design.md, OpenAI dialect): a
:class:`Vocabulary` per flavour (the event names a stock parser knows, renames,
content types) and an :class:`EngineDialect` per engine release (turn
detection, truncation, default formats, the errors answered by the sidecar).
Sans-I/O, interpreted in both builds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from proxy.core.audio_formats import MINICPMO_INPUT, MINICPMO_OUTPUT, AudioFormat
from proxy.core.engine_releases import EngineRelease, EngineVersion, release_of

__all__ = [
    "BETA",
    "CANCEL",
    "CLIENT_INTERRUPTS",
    "COMMIT",
    "COMMIT_AND_CREATE",
    "CREATE",
    "EMPTY_TURN_MS",
    "ENGINE_DIALECTS",
    "ENGINE_INTERRUPTS",
    "GA",
    "EngineDialect",
    "Flavour",
    "Vocabulary",
    "engine_dialect",
    "vocabulary",
]


class Flavour(enum.Enum):
    """Which OpenAI Realtime protocol a client speaks."""

    GA = "ga"
    BETA = "beta"


#: Types of both flavours' server-event unions (openai 3.x ``RealtimeServerEvent``).
_COMMON: Final = frozenset(
    {
        "conversation.created",
        "conversation.item.created",
        "conversation.item.deleted",
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.failed",
        "conversation.item.retrieved",
        "conversation.item.truncated",
        "error",
        "input_audio_buffer.cleared",
        "input_audio_buffer.committed",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "output_audio_buffer.cleared",
        "output_audio_buffer.started",
        "output_audio_buffer.stopped",
        "rate_limits.updated",
        "response.content_part.added",
        "response.content_part.done",
        "response.created",
        "response.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.added",
        "response.output_item.done",
        "session.created",
        "session.updated",
    }
)

#: The engine's audio and text names (0.30+ GA names, 0.28 beta names) -> GA.
_TO_GA: Final = {
    "response.audio.delta": "response.output_audio.delta",
    "response.audio.done": "response.output_audio.done",
    "response.audio_transcript.delta": "response.output_audio_transcript.delta",
    "response.audio_transcript.done": "response.output_audio_transcript.done",
    "response.text.delta": "response.output_text.delta",
    "response.text.done": "response.output_text.done",
    # The first announcement of an item wins, in the flavour's name (see the translator).
    "conversation.item.created": "conversation.item.added",
}
_TO_BETA: Final = {ga: beta for beta, ga in _TO_GA.items()}


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """One OpenAI flavour's server events.

    Attributes:
        flavour: GA or beta.
        types: the event types its stock parsers know; any other is not sent.
        renames: engine type -> this flavour's type (both engine spellings).
        assistant_audio: the content type of an assistant item's audio.
        audio_delta: this flavour's audio delta type (what audio is rewritten as).
    """

    flavour: Flavour
    types: frozenset[str]
    renames: Mapping[str, str]
    assistant_audio: str
    audio_delta: str


GA: Final = Vocabulary(
    flavour=Flavour.GA,
    types=_COMMON
    | {
        "conversation.item.added",
        "conversation.item.done",
        "conversation.item.input_audio_transcription.segment",
        "input_audio_buffer.timeout_triggered",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.delta",
        "response.output_audio_transcript.done",
        "response.output_text.delta",
        "response.output_text.done",
    },
    renames=_TO_GA,
    assistant_audio="output_audio",
    audio_delta="response.output_audio.delta",
)

BETA: Final = Vocabulary(
    flavour=Flavour.BETA,
    types=_COMMON
    | {
        "response.audio.delta",
        "response.audio.done",
        "response.audio_transcript.delta",
        "response.audio_transcript.done",
        "response.text.delta",
        "response.text.done",
        "transcription_session.updated",
    },
    renames={**_TO_BETA, "conversation.item.added": "conversation.item.created"},
    assistant_audio="audio",
    audio_delta="response.audio.delta",
)


def vocabulary(flavour: Flavour) -> Vocabulary:
    return GA if flavour is Flavour.GA else BETA


@dataclass(frozen=True, slots=True)
class EngineDialect:
    """What one engine release takes and answers, for the OpenAI front door.

    Attributes:
        version: the release.
        turn_detection: the client's ``turn_detection.type`` -> what the engine
            is asked for (None: the engine is asked for none; the sidecar's own
            turn detection would take it).
        turn_detection_fields: the keys of a ``server_vad`` object the engine
            accepts (it refuses ``create_response`` and ``interrupt_response:
            false``).
        engine_turns: the engine ends turns itself as OpenAI's server VAD does
            (speech stopped, commit, response created). Where it does not, the
            sidecar's own turn detection takes the client's ``turn_detection``
            when the session has one (``turn_hook``); else the engine's
            ``turn_detection`` (barge-in only) is asked for, as shown in effect.
        truncates: the engine applies ``conversation.item.truncate``, unless
            its ``session.created`` says otherwise
            (``capabilities.supports_audio_truncate``).
        input_format / output_format: the engine's formats until its
            ``session.created`` names them.
        hidden_errors: error codes that answer what a stock client does by
            default; the sidecar has answered it in OpenAI's way instead.
        status_reasons: the engine's ``status_details.reason`` -> OpenAI's.
        error_codes: the engine's error codes -> OpenAI's, where a stock client
            tells them apart (Pipecat treats any other error as fatal).
    """

    version: EngineVersion
    turn_detection: Mapping[str, str | None]
    turn_detection_fields: frozenset[str]
    engine_turns: bool
    truncates: bool
    input_format: AudioFormat
    output_format: AudioFormat
    hidden_errors: frozenset[str]
    status_reasons: Mapping[str, str]
    error_codes: Mapping[str, str]


_VAD_FIELDS: Final = frozenset({"type", "threshold", "prefix_padding_ms", "silence_duration_ms"})
#: docs/engine-protocol.md, Terminal events and errors: the engine's cancel reasons.
_REASONS: Final = {
    "client_cancelled": "client_cancelled",
    "barge_in": "turn_detected",
    "turn_detected": "turn_detected",
    "output_audio_buffer_clear": "client_cancelled",
    "max_output_tokens": "max_output_tokens",
    "content_filter": "content_filter",
}
#: A cancel when nothing runs (LiveKit's and the Agents SDK's interrupt), and a
#: truncation the sidecar answered from its ledger.
_ERROR_CODES: Final = {
    "response_already_active": "conversation_already_has_active_response",
    "response_not_active": "response_cancel_not_active",
}
_HIDDEN: Final = frozenset({"response_not_active", "unsupported_audio_truncate"})

#: What a release's ``semantic_vad`` capability adds: the engine's refusal where the
#: deployment lacks the model. Server VAD is still asked for, as on every release, so
#: a stock ``session.update`` is never refused.
_SEMANTIC_VAD_HIDDEN: Final = frozenset({"semantic_vad_unavailable"})


def _dialect_of(release: EngineRelease) -> EngineDialect:
    """One release's dialect: the same on every release but what its capabilities change."""
    return EngineDialect(
        version=release.version,
        # The engine's server VAD barges in; semantic_vad, where known, is not asked for.
        turn_detection={"server_vad": "server_vad", "semantic_vad": "server_vad"},
        turn_detection_fields=_VAD_FIELDS,
        # Its server VAD (in duplex mode) barges in; it commits no turn and creates no response.
        engine_turns=False,
        truncates=False,
        input_format=MINICPMO_INPUT,
        output_format=MINICPMO_OUTPUT,
        hidden_errors=(_HIDDEN | _SEMANTIC_VAD_HIDDEN) if release.semantic_vad else _HIDDEN,
        status_reasons=_REASONS,
        error_codes=_ERROR_CODES,
    )


#: A dialect per release of proxy/core/engine_releases.py, built from its row
#: (``UNKNOWN``: the oldest's); a new release needs no edit here.
ENGINE_DIALECTS: Final[Mapping[EngineVersion, EngineDialect]] = {
    version: _dialect_of(release_of(version)) for version in EngineVersion
}


def engine_dialect(version: EngineVersion) -> EngineDialect:
    return ENGINE_DIALECTS[version]


#: What interrupts the answer being played, from the client and from the engine (its
#: server VAD's barge-in); docs/engine-protocol.md, Cancellation in the engine.
CLIENT_INTERRUPTS: Final = frozenset(
    {"response.cancel", "output_audio_buffer.clear", "conversation.item.truncate",
     "barge_in", "turn.signal", "input.cancel"}
)  # fmt: skip
ENGINE_INTERRUPTS: Final = frozenset(
    {"input_audio_buffer.speech_started", "overlap.decision", "output_audio_buffer.cleared"}
)
#: The silence a response.create with no input at all is answered on (one engine turn).
EMPTY_TURN_MS: Final = 100
#: The engine frames the dialect sends of its own (a turn's commit, a create's, a cancel).
COMMIT: Final = '{"type":"input_audio_buffer.commit"}'
COMMIT_AND_CREATE: Final = '{"type":"input_audio_buffer.commit","response_create":true}'
CREATE: Final = '{"type":"response.create"}'
CANCEL: Final = '{"type":"response.cancel"}'
