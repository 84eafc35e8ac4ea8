"""Per-session settings of a simulated duplex session and ``session.update`` parsing.

docs/engine-protocol.md, Client events: ``session.update`` carries many optional keys, in both the
flat
0.28/beta spelling (``input_audio_format``, ``turn_detection``) and the GA
nesting (``audio.input.format``, ``audio.input.turn_detection``). Real clients
also send keys the simulator has no use for (``ref_audio``, ``temperature``…):
they are accepted and, where small, echoed back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Final

from engine_launcher.simulator.audio import input_bytes_per_sample
from engine_launcher.simulator.playback_history import COMMIT_ALL_ON_DONE, normalize_policy

__all__ = [
    "DEFAULT_INPUT_RATE",
    "SettingsError",
    "SimulatedSettings",
    "apply_update",
    "truthy",
]

# docs/engine-protocol.md, Client events: input audio defaults to PCM16 at 16 kHz.
DEFAULT_INPUT_RATE: Final = 16000
DEFAULT_INPUT_FORMAT: Final = "pcm16"

# OpenAI GA spells formats as MIME-like types; map them to the engine's names.
_GA_FORMATS: Final = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}

# Keys echoed back in session.updated as given (small scalars or objects).
_ECHO_KEYS: Final = (
    "instructions",
    "voice",
    "temperature",
    "idle_timeout_s",
    "overlap_policy",
    "max_response_output_tokens",
    "tools",
    "tool_choice",
)


class SettingsError(ValueError):
    """A ``session.update`` the engine would reject.

    Attributes:
        code: the wire error code (docs/engine-protocol.md, Terminal events and errors).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True, kw_only=True)
class SimulatedSettings:
    """Effective configuration of one session."""

    model: str
    modalities: list[str] = field(default_factory=lambda: ["audio", "text"])
    turn_detection: dict[str, Any] | None = None
    input_format: str = DEFAULT_INPUT_FORMAT
    input_rate: int = DEFAULT_INPUT_RATE
    extra_body: dict[str, Any] = field(default_factory=dict)
    echo: dict[str, Any] = field(default_factory=dict)
    ref_audio_present: bool = False
    #: ``commit_all_on_done`` or ``ack_only`` (docs/design.md, Simulator); any
    #: other spelling falls back to ``commit_all_on_done``, as in the engine.
    playback_commit_policy: str = COMMIT_ALL_ON_DONE

    @property
    def server_vad(self) -> bool:
        """True when server VAD (and with it barge-in on speech) is on."""
        return self.turn_detection is not None and self.turn_detection.get("type") == "server_vad"

    @property
    def auto_response(self) -> bool:
        """``extra_body.auto_response``: a commit starts a response by itself."""
        return truthy(self.extra_body.get("auto_response"))


def truthy(value: object) -> bool:
    """Interpret a JSON flag that clients send as bool, number or string."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value is True or (isinstance(value, int) and value == 1)


def _format_name(value: object) -> tuple[str | None, int | None]:
    """Return (format, rate) from a flat string or a GA ``{type, rate}`` object."""
    if isinstance(value, str):
        return _GA_FORMATS.get(value, value), None
    if isinstance(value, dict):
        fmt = value.get("type") or value.get("format")
        rate = value.get("rate") or value.get("sample_rate_hz")
        name = _GA_FORMATS.get(fmt, fmt) if isinstance(fmt, str) else None
        return name, rate if isinstance(rate, int) else None
    return None, None


def apply_update(current: SimulatedSettings, session: dict[str, Any]) -> SimulatedSettings:
    """Return ``current`` updated by a ``session.update``'s ``session`` object.

    Validation happens before anything changes, so a rejected update leaves
    the session as it was.

    Raises:
        SettingsError: unsupported turn detection or audio format.
    """
    new = dataclasses.replace(
        current,
        modalities=list(current.modalities),
        extra_body=dict(current.extra_body),
        echo=dict(current.echo),
    )
    audio = session.get("audio")
    audio_in = audio.get("input") if isinstance(audio, dict) else None
    audio_in = audio_in if isinstance(audio_in, dict) else {}

    model = session.get("model")
    if isinstance(model, str) and model:
        new.model = model
    modalities = session.get("modalities") or session.get("output_modalities")
    if isinstance(modalities, list) and all(isinstance(m, str) for m in modalities):
        new.modalities = list(modalities)

    missing = object()
    td = session.get("turn_detection", audio_in.get("turn_detection", missing))
    if td is not missing:
        if td is None:
            new.turn_detection = None
        elif isinstance(td, dict):
            kind = td.get("type")
            if kind in ("none", None):
                new.turn_detection = None
            elif kind == "server_vad":
                # docs/engine-protocol.md, Cancellation in the engine: interrupt_response false is
                # unsupported.
                if td.get("interrupt_response") is False or td.get("create_response") is True:
                    raise SettingsError(
                        "unsupported_turn_detection",
                        "server_vad supports neither interrupt_response=false nor create_response",
                    )
                new.turn_detection = dict(td)
            else:
                raise SettingsError(
                    "unsupported_turn_detection", f"turn_detection type {kind!r} is not supported"
                )
        else:
            raise SettingsError("unsupported_turn_detection", "turn_detection must be an object")

    fmt, rate = _format_name(session.get("input_audio_format", audio_in.get("format")))
    if fmt is not None:
        if input_bytes_per_sample(fmt) is None:
            raise SettingsError("unsupported_audio_format", f"input audio format {fmt!r}")
        new.input_format = fmt
        if fmt.startswith("g711"):
            new.input_rate = 8000
    for candidate in (rate, session.get("sample_rate_hz"), audio_in.get("sample_rate_hz")):
        if isinstance(candidate, int) and not isinstance(candidate, bool):
            if not 8000 <= candidate <= 192000:
                raise SettingsError("unsupported_audio_format", f"sample rate {candidate}")
            new.input_rate = candidate

    extra = session.get("extra_body")
    if isinstance(extra, dict):
        new.extra_body.update(extra)
    for source in (session, extra if isinstance(extra, dict) else {}):
        # The engine reads it at the top level and, failing that, from extra_body.
        if isinstance(source.get("playback_commit_policy"), str):
            new.playback_commit_policy = normalize_policy(source["playback_commit_policy"])
            break
    for key in _ECHO_KEYS:
        if key in session:
            new.echo[key] = session[key]
    if "ref_audio" in session:
        # Often megabytes of base64: remember only that it came.
        new.ref_audio_present = bool(session["ref_audio"])
    return new
