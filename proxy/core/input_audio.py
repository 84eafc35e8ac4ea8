"""How long a client's input audio is, as the engine will hear it (docs/design.md, Usage).

Input audio is charged (usage, the day quota) and rate-limited in seconds. The
seconds come from the base64 length and the format and rate the *engine*
applies: the session's from the engine's own ``session.created`` /
``session.updated``, and an append's ``format`` / ``sample_rate_hz`` with the
engine's precedence. A rate the engine refuses (not an integer in 8-192 kHz)
or an unknown format refuses the frame. Where two readings are possible (a
``session.update`` the engine has not answered yet, G.711 without a rate) the
longer one is charged, so a client cannot make audio cheaper than the engine
counts it. Sans-I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from proxy.core.ratelimit import BYTES_PER_SAMPLE

__all__ = ["MAX_INPUT_RATE", "MIN_INPUT_RATE", "InputAudio", "InputAudioRefused"]

#: Input sample rates the engine accepts (Hz); others are refused.
MIN_INPUT_RATE: Final = 8_000
MAX_INPUT_RATE: Final = 192_000
#: The engine's default input rate, and G.711's own.
_DEFAULT_RATE: Final = 16_000
_G711_RATE: Final = 8_000
#: Bytes per sample of each input format the engine decodes (mono), by every spelling.
_WIDTHS: Final = BYTES_PER_SAMPLE


class InputAudioRefused(Exception):
    """The engine would refuse this audio: an error ``code`` and a message for the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _format(value: object) -> tuple[str | None, object]:
    """(format name in lower case, its rate if the format object names one)."""
    if isinstance(value, Mapping):
        name = value.get("type")
        rate = value.get("rate", value.get("sample_rate_hz"))
        return (name.lower() if isinstance(name, str) else None), rate
    return (value.lower() if isinstance(value, str) else None), None


def _rate(value: object) -> int | None:
    """A rate the engine accepts; None when absent; raises ``InputAudioRefused`` when not accepted."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputAudioRefused("bad_event", "sample_rate_hz must be an integer")
    if value != int(value) or not MIN_INPUT_RATE <= value <= MAX_INPUT_RATE:
        raise InputAudioRefused(
            "bad_event", f"sample_rate_hz must be between {MIN_INPUT_RATE} and {MAX_INPUT_RATE}"
        )
    return int(value)


class InputAudio:
    """One session's input audio format as the engine applies it."""

    __slots__ = ("_format", "_pending", "_rate", "bytes_per_second")

    def __init__(self) -> None:
        self._format = "pcm16"
        #: The session rate the engine reported (None: its default, or G.711's).
        self._rate: int | None = None
        #: A client ``session.update`` the engine has not answered: (format, rate).
        self._pending: tuple[str | None, int | None] | None = None
        #: Raw bytes per second of the reading charged for a frame that names
        #: no format or rate of its own (the common append): kept current.
        self.bytes_per_second = float(_bytes_per_second(self._readings(None, None)))

    def on_client_update(self, body: Mapping[str, Any] | None) -> None:
        """A client ``session.update``: charged at its reading too until the engine answers."""
        fmt, rate = _session_audio(body)
        if fmt is None and rate is None:
            return
        try:
            checked = _rate(rate)
        except InputAudioRefused:
            checked = None  # the engine refuses it: the current reading stands
        self._pending = (fmt if fmt in _WIDTHS else None, checked)
        self.bytes_per_second = float(_bytes_per_second(self._readings(None, None)))

    def on_engine_session(self, body: Mapping[str, Any] | None) -> None:
        """The engine's ``session.created`` / ``session.updated``: what it applies now."""
        self._pending = None
        fmt, rate = _session_audio(body)
        if fmt in _WIDTHS:
            self._format = fmt
        try:
            checked = _rate(rate)
        except InputAudioRefused:
            checked = None
        if checked is not None or fmt is not None:
            self._rate = checked
        self.bytes_per_second = float(_bytes_per_second(self._readings(None, None)))

    def seconds(self, chars: int, fields: Mapping[str, Any] | None = None) -> float:
        """Seconds of ``chars`` base64 characters of audio, read as the engine reads them.

        Args:
            fields: the frame's own ``format``/``input_audio_format`` and
                ``sample_rate_hz``/``sample_rate`` (an append or an audio part).

        Raises:
            InputAudioRefused: the engine refuses the audio (format or rate).
        """
        named: object = None
        rate: object = None
        if fields:  # dict lookups only: an ordinary append names neither
            named = fields.get("format") or fields.get("input_audio_format")
            rate = fields.get("sample_rate_hz") or fields.get("sample_rate")
        if named is None and rate is None:
            return chars * 0.75 / self.bytes_per_second
        own_fmt, format_rate = _format(named)
        if named is not None and own_fmt not in _WIDTHS:
            raise InputAudioRefused("unsupported_audio_format", f"input audio format {named!r}")
        own_rate = _rate(rate or format_rate)
        return chars * 0.75 / _bytes_per_second(self._readings(own_fmt, own_rate))

    def item_seconds(self, body: Mapping[str, Any] | None) -> float:
        """Seconds of the audio parts of a ``conversation.item.create``, as the engine reads them.

        A part in a format the engine does not decode is skipped (the engine
        skips it too); a refused rate refuses the item.
        """
        item = (body or {}).get("item")
        content = item.get("content") if isinstance(item, dict) else None
        if not isinstance(content, list):
            return 0.0
        total = 0.0
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_audio", "audio"):
                continue
            data = part.get("audio") or part.get("data")
            if not isinstance(data, str) or not data:
                continue
            try:
                total += self.seconds(len(data), part)
            except InputAudioRefused as refused:
                if refused.code != "unsupported_audio_format":
                    raise
        return total

    def _readings(self, fmt: str | None, rate: int | None) -> list[tuple[str, int | None]]:
        """Every (format, rate) the engine may apply to a frame naming ``fmt``/``rate``."""
        found = [(fmt or self._format, rate if rate is not None else self._rate)]
        pending = self._pending
        if pending is not None:
            p_fmt = fmt or pending[0] or self._format
            p_rate = (
                rate if rate is not None else pending[1] if pending[1] is not None else self._rate
            )
            found.append((p_fmt, p_rate))
        return found


def _bytes_per_second(readings: list[tuple[str, int | None]]) -> int:
    """The fewest raw bytes per second among ``readings``: the longest audio is charged."""
    return min(_WIDTHS[fmt] * _reading_rate(fmt, rate) for fmt, rate in readings)


def _reading_rate(fmt: str, rate: int | None) -> int:
    """The rate to charge at: the named one, else the lowest the engine may apply."""
    if _WIDTHS[fmt] == 1:  # G.711: 8 kHz unless named (some engines fall back to 16 kHz)
        return rate if rate is not None else _G711_RATE
    return rate if rate is not None else _DEFAULT_RATE


def _session_audio(body: Mapping[str, Any] | None) -> tuple[str | None, object]:
    """(input format, input rate) of a ``session`` object, in every spelling engines use."""
    session = (body or {}).get("session")
    if not isinstance(session, Mapping):
        return None, None
    fmt, rate = _format(session.get("input_audio_format"))
    audio = session.get("audio")
    audio_in = audio.get("input") if isinstance(audio, Mapping) else None
    if isinstance(audio_in, Mapping):
        in_fmt, in_rate = _format(audio_in.get("format"))
        fmt = fmt or in_fmt
        rate = rate or in_rate or audio_in.get("sample_rate_hz") or audio_in.get("sample_rate")
    formats = session.get("formats")
    if fmt is None and isinstance(formats, Mapping):
        fmt, _ = _format(formats.get("input"))
    rate = rate or session.get("sample_rate_hz") or session.get("sample_rate")
    return fmt, rate
