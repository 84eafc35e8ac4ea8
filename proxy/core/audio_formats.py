"""Audio formats of clients and engines, PCM and G.711 codecs, timebases (sans-I/O).

A library for the front doors that speak another dialect than the engine's: the
OpenAI Realtime front door (issue 39, item 3: PCM16 24 kHz, G.711 mu-law and
A-law 8 kHz) and the phone front door (issue 42: Twilio's 20 ms mu-law frames).
They read the client's format with :func:`parse_openai_format`, the engine's
with :func:`parse_engine_format`, and convert with
``proxy.core.audio_convert.AudioConverter`` (docs/design.md, Audio formats).
Nothing here raises on bad input: a parser or decoder returns an
:class:`AudioError`. Interpreted in both builds: numpy does the per-sample work.
"""

from __future__ import annotations

import binascii
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "G711_ALAW",
    "G711_ULAW",
    "MAX_RATE",
    "MINICPMO_INPUT",
    "MINICPMO_OUTPUT",
    "MIN_RATE",
    "NEMOTRON_INPUT",
    "NEMOTRON_OUTPUT",
    "OPENAI_PCM16",
    "AudioError",
    "AudioErrorKind",
    "AudioFormat",
    "Encoding",
    "Samples",
    "decode_base64",
    "decode_samples",
    "encode_base64",
    "encode_samples",
    "ms_to_samples",
    "parse_engine_audio",
    "parse_engine_format",
    "parse_openai_format",
    "partial_samples",
    "rescale_samples",
    "samples_to_ms",
]

#: Mono samples as the converters carry them: float32, full scale +-1.0.
Samples = npt.NDArray[np.float32]

#: Sample rates the engine accepts (docs/engine-protocol.md, Client events).
MIN_RATE: Final = 8_000
MAX_RATE: Final = 192_000
#: OpenAI Realtime's only PCM rate; G.711's own rate.
_OPENAI_PCM_RATE: Final = 24_000
_G711_RATE: Final = 8_000


class Encoding(enum.Enum):
    """How one sample is stored (always mono, little-endian); values are the engine's names."""

    PCM16 = "pcm16"
    F32LE = "pcm_f32le"
    MULAW = "g711_ulaw"
    ALAW = "g711_alaw"


_WIDTH: Final = {Encoding.PCM16: 2, Encoding.F32LE: 4, Encoding.MULAW: 1, Encoding.ALAW: 1}
#: OpenAI's GA type and beta name of each encoding it has (it has no float32).
_GA_TYPE: Final = {
    Encoding.PCM16: "audio/pcm",
    Encoding.MULAW: "audio/pcmu",
    Encoding.ALAW: "audio/pcma",
}
_BETA_NAME: Final = {
    Encoding.PCM16: "pcm16",
    Encoding.MULAW: "g711_ulaw",
    Encoding.ALAW: "g711_alaw",
}


class AudioErrorKind(enum.Enum):
    """Why audio or a format was refused; values are error codes a front door can send."""

    UNSUPPORTED_FORMAT = "unsupported_audio_format"
    INVALID_AUDIO = "invalid_audio"
    INVALID_BASE64 = "invalid_base64"


@dataclass(frozen=True, slots=True)
class AudioError:
    """A refused format or chunk: returned, never raised (the caller answers the client)."""

    kind: AudioErrorKind
    message: str


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """An encoding at a sample rate (Hz), mono.

    Durations here are in the format's own timebase: ``rate`` samples are one second.
    """

    encoding: Encoding
    rate: int

    def __post_init__(self) -> None:
        if self.rate <= 0:  # a programming error: the parsers check what comes from the wire
            raise ValueError(f"sample rate {self.rate} is not positive")

    @property
    def bytes_per_sample(self) -> int:
        return _WIDTH[self.encoding]

    def samples_in(self, nbytes: int) -> int:
        """Whole samples in ``nbytes`` bytes (a partial sample is not counted)."""
        return nbytes // _WIDTH[self.encoding]

    def duration_ms(self, nbytes: int) -> float:
        """Milliseconds of audio in ``nbytes`` bytes of this format."""
        return samples_to_ms(self.samples_in(nbytes), self.rate)

    def bytes_for_ms(self, ms: float) -> int:
        """Bytes of ``ms`` milliseconds, whole samples (nearest)."""
        return ms_to_samples(ms, self.rate) * _WIDTH[self.encoding]

    def engine_fields(self) -> dict[str, object]:
        """``format`` and ``sample_rate_hz`` as the engine's events spell them."""
        return {"format": self.encoding.value, "sample_rate_hz": self.rate}

    def openai_ga(self) -> dict[str, object] | None:
        """The OpenAI GA format object, or None when OpenAI has no such format."""
        if self.encoding is Encoding.PCM16 and self.rate == _OPENAI_PCM_RATE:
            return {"type": "audio/pcm", "rate": _OPENAI_PCM_RATE}
        if self.encoding in (Encoding.MULAW, Encoding.ALAW) and self.rate == _G711_RATE:
            return {"type": _GA_TYPE[self.encoding]}
        return None

    def openai_beta(self) -> str | None:
        """The OpenAI beta format name, or None when OpenAI has no such format."""
        return _BETA_NAME[self.encoding] if self.openai_ga() is not None else None


#: The formats OpenAI Realtime clients speak (GA and beta name the same three).
OPENAI_PCM16: Final = AudioFormat(Encoding.PCM16, _OPENAI_PCM_RATE)
G711_ULAW: Final = AudioFormat(Encoding.MULAW, _G711_RATE)
G711_ALAW: Final = AudioFormat(Encoding.ALAW, _G711_RATE)
#: What the engines of docs/engine-protocol.md declare (Deployment profiles).
MINICPMO_INPUT: Final = AudioFormat(Encoding.PCM16, 16_000)
MINICPMO_OUTPUT: Final = AudioFormat(Encoding.PCM16, 24_000)
NEMOTRON_INPUT: Final = AudioFormat(Encoding.F32LE, 16_000)
NEMOTRON_OUTPUT: Final = AudioFormat(Encoding.PCM16, 22_050)


def _unsupported(message: str) -> AudioError:
    return AudioError(AudioErrorKind.UNSUPPORTED_FORMAT, message)


_OPENAI_NAMES: Final = {
    "audio/pcm": Encoding.PCM16,
    "audio/pcmu": Encoding.MULAW,
    "audio/pcma": Encoding.ALAW,
    "pcm16": Encoding.PCM16,
    "g711_ulaw": Encoding.MULAW,
    "g711_alaw": Encoding.ALAW,
}


def parse_openai_format(value: object) -> AudioFormat | AudioError:
    """A client's format: a GA object (``{"type": "audio/pcm", "rate": 24000}``,
    ``{"type": "audio/pcmu"}``, ``{"type": "audio/pcma"}``) or a beta name
    (``"pcm16"``, ``"g711_ulaw"``, ``"g711_alaw"``).

    As OpenAI defines them: PCM is 24 kHz (the beta ``pcm16`` too, whatever the
    engine takes), G.711 is 8 kHz; a GA ``rate`` other than those is refused.

    Returns:
        The format, or an :class:`AudioError` (``UNSUPPORTED_FORMAT``) naming what is accepted.
    """
    rate: object = None
    if isinstance(value, Mapping):
        name = value.get("type")
        rate = value.get("rate")
    else:
        name = value
    encoding = _OPENAI_NAMES.get(name) if isinstance(name, str) else None
    if encoding is None:
        return _unsupported(
            f"audio format {name!r} is not supported: use audio/pcm (24 kHz), "
            "audio/pcmu or audio/pcma (or pcm16, g711_ulaw, g711_alaw)"
        )
    own = _OPENAI_PCM_RATE if encoding is Encoding.PCM16 else _G711_RATE
    if rate is not None and (isinstance(rate, bool) or rate != own):
        return _unsupported(f"{name} audio is {own} Hz; rate {rate!r} is not supported")
    return AudioFormat(encoding, own)


#: Every spelling the engine accepts, lower case (docs/engine-protocol.md, Client events).
_ENGINE_NAMES: Final = {
    "pcm16": Encoding.PCM16,
    "pcm_s16le": Encoding.PCM16,
    "s16le": Encoding.PCM16,
    "audio/pcm": Encoding.PCM16,
    "pcm_f32le": Encoding.F32LE,
    "g711_ulaw": Encoding.MULAW,
    "audio/pcmu": Encoding.MULAW,
    "audio/g711_ulaw": Encoding.MULAW,
    "g711_alaw": Encoding.ALAW,
    "audio/pcma": Encoding.ALAW,
    "audio/g711_alaw": Encoding.ALAW,
}


def parse_engine_format(name: object, rate: object) -> AudioFormat | AudioError:
    """The engine's ``format`` and ``sample_rate_hz`` (G.711 may omit the rate: 8 kHz).

    Returns:
        The format, or an :class:`AudioError`: an unknown name, a missing PCM
        rate, a rate outside 8-192 kHz, or G.711 at another rate than 8 kHz.
    """
    encoding = _ENGINE_NAMES.get(name.lower()) if isinstance(name, str) else None
    if encoding is None:
        return _unsupported(f"engine audio format {name!r} is not supported")
    g711 = encoding in (Encoding.MULAW, Encoding.ALAW)
    if rate is None and g711:
        return AudioFormat(encoding, _G711_RATE)
    if isinstance(rate, bool) or not isinstance(rate, int):
        return _unsupported(f"engine {name} audio needs an integer sample_rate_hz, got {rate!r}")
    if not MIN_RATE <= rate <= MAX_RATE or (g711 and rate != _G711_RATE):
        return _unsupported(f"engine {name} audio at {rate} Hz is not supported")
    return AudioFormat(encoding, rate)


def parse_engine_audio(side: object) -> AudioFormat | AudioError:
    """One side of the engine's ``session.audio`` (``{"format": ..., "sample_rate_hz": ...}``)."""
    if not isinstance(side, Mapping):
        return _unsupported(f"engine audio description {side!r} is not an object")
    return parse_engine_format(side.get("format"), side.get("sample_rate_hz"))


# -- timebases ---------------------------------------------------------------------------


def samples_to_ms(samples: int, rate: int) -> float:
    """Milliseconds that ``samples`` last at ``rate``."""
    return samples * 1000.0 / rate


def ms_to_samples(ms: float, rate: int) -> int:
    """Samples in ``ms`` milliseconds at ``rate`` (nearest; halves round up)."""
    return int(ms * rate / 1000.0 + 0.5) if ms > 0 else 0


def rescale_samples(samples: int, from_rate: int, to_rate: int) -> int:
    """The position ``samples`` at ``from_rate`` as samples at ``to_rate`` (the same
    instant), nearest, in exact integer arithmetic (halves round up)."""
    return (samples * to_rate * 2 + from_rate) // (from_rate * 2)


# -- base64 ------------------------------------------------------------------------------


def decode_base64(text: object) -> bytes | AudioError:
    """Strict RFC 4648 base64 (what OpenAI and Twilio send), or ``INVALID_BASE64``."""
    if not isinstance(text, str):
        return AudioError(AudioErrorKind.INVALID_BASE64, "audio must be a base64 string")
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except ValueError as exc:  # binascii.Error, or a non-ASCII str
        return AudioError(AudioErrorKind.INVALID_BASE64, f"audio is not valid base64: {exc}")


def encode_base64(data: bytes) -> str:
    """Standard base64 without a newline."""
    return binascii.b2a_base64(data, newline=False).decode("ascii")


# -- codecs ------------------------------------------------------------------------------
#
# G.711 follows the classic Sun reference implementation (g711.c), which is also
# what CPython's audioop did: mu-law on the top 14 bits of a 16-bit sample, A-law
# on the top 13, decoded to the 16-bit scale (ITU-T G.711 Tables 1 and 2 times 4
# and 8). The tests check every code and every 16-bit input against audioop.

_SEG_SHIFT: Final = 4
_QUANT_MASK: Final = 0x0F
_ULAW_BIAS: Final = 0x84


def _ulaw_decode_table() -> npt.NDArray[np.int16]:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((code & _QUANT_MASK) << 3) + _ULAW_BIAS) << ((code & 0x70) >> _SEG_SHIFT)
    return np.where(code & 0x80, _ULAW_BIAS - t, t - _ULAW_BIAS).astype(np.int16)


def _alaw_decode_table() -> npt.NDArray[np.int16]:
    code = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (code & 0x70) >> _SEG_SHIFT
    t = (code & _QUANT_MASK) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(code & 0x80, t, -t).astype(np.int16)


def _segment(magnitude: npt.NDArray[np.int32], ends: tuple[int, ...]) -> npt.NDArray[np.int32]:
    """The first segment whose end is >= the magnitude (len(ends) when none)."""
    return np.searchsorted(np.array(ends, dtype=np.int32), magnitude, side="left").astype(np.int32)


def _ulaw_encode_table() -> npt.NDArray[np.uint8]:
    pcm = np.arange(-32768, 32768, dtype=np.int32) >> 2  # 14-bit
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.abs(pcm), 32635) + (_ULAW_BIAS >> 2)
    seg = _segment(magnitude, (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF))
    code = (np.minimum(seg, 7) << 4) | ((magnitude >> (np.minimum(seg, 7) + 1)) & _QUANT_MASK)
    return _by_uint16(np.bitwise_xor(np.where(seg >= 8, 0x7F, code), mask))


def _alaw_encode_table() -> npt.NDArray[np.uint8]:
    pcm = np.arange(-32768, 32768, dtype=np.int32) >> 3  # 13-bit
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    magnitude = np.where(pcm >= 0, pcm, -pcm - 1)
    seg = _segment(magnitude, (0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF))
    shift = np.where(seg < 2, 1, np.minimum(seg, 7))
    code = (np.minimum(seg, 7) << _SEG_SHIFT) | ((magnitude >> shift) & _QUANT_MASK)
    return _by_uint16(np.bitwise_xor(np.where(seg >= 8, 0x7F, code), mask))


def _by_uint16(code_by_int16: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.uint8]:
    """Reorder a table indexed from -32768 up so that an int16 viewed as uint16 indexes it."""
    return np.roll(code_by_int16.astype(np.uint8), -32768)


#: 16-bit sample (as uint16) -> code, and code -> 16-bit sample.
_ENCODE: Final = {Encoding.MULAW: _ulaw_encode_table(), Encoding.ALAW: _alaw_encode_table()}
_DECODE: Final = {Encoding.MULAW: _ulaw_decode_table(), Encoding.ALAW: _alaw_decode_table()}
#: G.711 decoded to float32 directly (one lookup per sample).
_DECODE_FLOAT: Final = {k: (v.astype(np.float32) / np.float32(32768.0)) for k, v in _DECODE.items()}
_PCM16_SCALE: Final = np.float32(1.0 / 32768.0)


def partial_samples(encoding: Encoding, nbytes: int) -> AudioError:
    """The refusal of ``nbytes`` bytes that are not whole samples of ``encoding``."""
    width = _WIDTH[encoding]
    return AudioError(
        AudioErrorKind.INVALID_AUDIO,
        f"{nbytes} bytes of {encoding.value} audio is not a whole number of {width}-byte samples",
    )


def decode_samples(encoding: Encoding, data: bytes) -> Samples | AudioError:
    """Bytes of ``encoding`` as float32 samples (full scale +-1.0).

    Returns:
        The samples, or ``INVALID_AUDIO`` when ``data`` is not whole samples.
    """
    if len(data) % _WIDTH[encoding]:
        return partial_samples(encoding, len(data))
    if encoding is Encoding.PCM16:
        samples = np.frombuffer(data, dtype="<i2").astype(np.float32)
        samples *= _PCM16_SCALE
        return samples
    if encoding is Encoding.F32LE:
        raw = np.frombuffer(data, dtype="<f4").astype(np.float32)
        # A NaN or an infinity would spread through the resampler's filter.
        return np.nan_to_num(raw, nan=0.0, posinf=1.0, neginf=-1.0)
    return _DECODE_FLOAT[encoding][np.frombuffer(data, dtype=np.uint8)]


def _to_int16(samples: Samples) -> npt.NDArray[np.int16]:
    """Nearest 16-bit values (halves to even), clipped; one scratch array, little-endian."""
    scaled: Samples = samples * np.float32(32768.0)
    np.rint(scaled, out=scaled)
    np.clip(scaled, -32768.0, 32767.0, out=scaled)
    return scaled.astype("<i2")


def encode_samples(encoding: Encoding, samples: Samples) -> bytes:
    """Float32 samples as bytes of ``encoding``; out-of-range values are clipped."""
    if encoding is Encoding.PCM16:
        return _to_int16(samples).tobytes()
    if encoding is Encoding.F32LE:
        return np.clip(samples, -1.0, 1.0).astype("<f4").tobytes()
    return _ENCODE[encoding][_to_int16(samples).view(np.uint16)].tobytes()
