"""Audio formats, codecs, base64 and timebases (proxy/core/audio_formats.py).

The OpenAI and engine format spellings, G.711 against the ITU-T G.711 table
points and, exhaustively, against CPython's audioop (3.11/3.12 only; it is the
oracle here, never in the product), PCM round trips, and bad input: every
refusal is an :class:`AudioError` value, never an exception (docs/design.md,
Audio formats).
"""

from __future__ import annotations

import base64
import math
import sys
import warnings
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.audio_formats import (
    G711_ALAW,
    G711_ULAW,
    MINICPMO_INPUT,
    MINICPMO_OUTPUT,
    NEMOTRON_INPUT,
    NEMOTRON_OUTPUT,
    OPENAI_PCM16,
    AudioError,
    AudioErrorKind,
    AudioFormat,
    Encoding,
    decode_base64,
    decode_samples,
    encode_base64,
    encode_samples,
    ms_to_samples,
    parse_engine_audio,
    parse_engine_format,
    parse_openai_format,
    rescale_samples,
    samples_to_ms,
)


def _audioop() -> ModuleType | None:
    if sys.version_info >= (3, 13):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop

        return audioop


AUDIOOP = _audioop()
needs_audioop = pytest.mark.skipif(AUDIOOP is None, reason="audioop is gone from Python 3.13")
ALL_PCM16 = np.arange(-32768, 32768, dtype="<i2").tobytes()
ALL_CODES = bytes(range(256))


def _pcm16(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i2").tolist()


# -- OpenAI formats ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"type": "audio/pcm", "rate": 24000}, OPENAI_PCM16),
        ({"type": "audio/pcm"}, OPENAI_PCM16),
        ({"type": "audio/pcmu"}, G711_ULAW),
        ({"type": "audio/pcma"}, G711_ALAW),
        ({"type": "audio/pcmu", "rate": 8000}, G711_ULAW),
        # Beta: "pcm16" is OpenAI's 24 kHz, whatever rate the engine takes.
        ("pcm16", OPENAI_PCM16),
        ("g711_ulaw", G711_ULAW),
        ("g711_alaw", G711_ALAW),
    ],
)
def test_openai_formats(value: object, expected: AudioFormat) -> None:
    assert parse_openai_format(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        {"type": "audio/pcm", "rate": 16000},
        {"type": "audio/pcm", "rate": True},
        {"type": "audio/pcm", "rate": "24000"},
        {"type": "audio/pcmu", "rate": 16000},
        {"type": "audio/opus"},
        {"rate": 24000},
        {"type": 3},
        "pcm_f32le",
        "PCM16",
        "",
        None,
        17,
        ["pcm16"],
    ],
)
def test_other_openai_formats_are_an_error_value(value: object) -> None:
    result = parse_openai_format(value)
    assert isinstance(result, AudioError)
    assert result.kind is AudioErrorKind.UNSUPPORTED_FORMAT
    assert result.message


@pytest.mark.parametrize("fmt", [OPENAI_PCM16, G711_ULAW, G711_ALAW])
def test_openai_spellings_round_trip(fmt: AudioFormat) -> None:
    assert parse_openai_format(fmt.openai_ga()) == fmt
    assert parse_openai_format(fmt.openai_beta()) == fmt


@pytest.mark.parametrize("fmt", [NEMOTRON_INPUT, NEMOTRON_OUTPUT, MINICPMO_INPUT])
def test_formats_openai_lacks_have_no_openai_spelling(fmt: AudioFormat) -> None:
    assert fmt.openai_ga() is None
    assert fmt.openai_beta() is None


# -- engine formats ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rate", "expected"),
    [
        ("pcm16", 16000, MINICPMO_INPUT),
        ("pcm16", 24000, MINICPMO_OUTPUT),
        ("pcm16", 22050, NEMOTRON_OUTPUT),
        ("pcm_f32le", 16000, NEMOTRON_INPUT),
        ("PCM_S16LE", 16000, MINICPMO_INPUT),
        ("s16le", 16000, MINICPMO_INPUT),
        ("audio/pcm", 24000, MINICPMO_OUTPUT),
        ("g711_ulaw", None, G711_ULAW),
        ("audio/pcmu", 8000, G711_ULAW),
        ("audio/g711_alaw", None, G711_ALAW),
        ("pcm16", 8000, AudioFormat(Encoding.PCM16, 8000)),
        ("pcm16", 192000, AudioFormat(Encoding.PCM16, 192000)),
    ],
)
def test_engine_formats(name: str, rate: int | None, expected: AudioFormat) -> None:
    assert parse_engine_format(name, rate) == expected


@pytest.mark.parametrize(
    ("name", "rate"),
    [
        ("pcm16", None),  # PCM without a rate: the caller must say which
        ("pcm16", 7999),
        ("pcm16", 192001),
        ("pcm16", 16000.0),
        ("pcm16", True),
        ("g711_ulaw", 16000),
        ("opus", 48000),
        (None, 16000),
        (b"pcm16", 16000),
    ],
)
def test_other_engine_formats_are_an_error_value(name: object, rate: object) -> None:
    result = parse_engine_format(name, rate)
    assert isinstance(result, AudioError)
    assert result.kind is AudioErrorKind.UNSUPPORTED_FORMAT


@pytest.mark.parametrize(
    "fmt", [MINICPMO_INPUT, MINICPMO_OUTPUT, NEMOTRON_INPUT, NEMOTRON_OUTPUT, G711_ULAW]
)
def test_engine_spelling_round_trips(fmt: AudioFormat) -> None:
    # What the engine's session.created says under audio.input / audio.output.
    assert parse_engine_audio(fmt.engine_fields()) == fmt


def test_an_engine_audio_side_that_is_not_an_object_is_an_error_value() -> None:
    assert isinstance(parse_engine_audio("pcm16"), AudioError)


@given(st.one_of(st.text(), st.integers(), st.none(), st.dictionaries(st.text(), st.text())))
@settings(max_examples=200)
def test_parsers_never_raise(value: Any) -> None:
    assert isinstance(parse_openai_format(value), AudioFormat | AudioError)
    assert isinstance(parse_engine_format(value, value), AudioFormat | AudioError)
    assert isinstance(parse_engine_audio(value), AudioFormat | AudioError)


# -- G.711 -------------------------------------------------------------------------------

#: ITU-T G.711 Table 2 (mu-law) and Table 1 (A-law) end points, in 16-bit scale
#: (the tables' 14-bit values x 4 and 13-bit values x 8): code -> decoded value.
ULAW_POINTS = {0x00: -32124, 0x80: 32124, 0x7F: 0, 0xFF: 0, 0x7E: -8, 0xFE: 8, 0xEF: 132}
ALAW_POINTS = {0xD5: 8, 0x55: -8, 0xAA: 32256, 0x2A: -32256, 0xD4: 24, 0xC5: 264}


@pytest.mark.parametrize(
    ("encoding", "points"), [(Encoding.MULAW, ULAW_POINTS), (Encoding.ALAW, ALAW_POINTS)]
)
def test_g711_decodes_the_itu_table_points(encoding: Encoding, points: dict[int, int]) -> None:
    codes = bytes(points)
    decoded = decode_samples(encoding, codes)
    assert not isinstance(decoded, AudioError)
    assert _pcm16(encode_samples(Encoding.PCM16, decoded)) == list(points.values())


def test_g711_silence_and_full_scale_encode_to_the_itu_codes() -> None:
    pcm = np.array([0.0, 1.0, -1.0], dtype=np.float32)
    assert encode_samples(Encoding.MULAW, pcm) == bytes([0xFF, 0x80, 0x00])
    assert encode_samples(Encoding.ALAW, pcm) == bytes([0xD5, 0xAA, 0x2A])


@needs_audioop
@pytest.mark.parametrize(
    ("encoding", "encode", "decode"),
    [(Encoding.MULAW, "lin2ulaw", "ulaw2lin"), (Encoding.ALAW, "lin2alaw", "alaw2lin")],
)
def test_g711_matches_audioop_on_every_input(encoding: Encoding, encode: str, decode: str) -> None:
    assert AUDIOOP is not None
    samples = decode_samples(Encoding.PCM16, ALL_PCM16)
    assert not isinstance(samples, AudioError)
    assert encode_samples(encoding, samples) == getattr(AUDIOOP, encode)(ALL_PCM16, 2)
    decoded = decode_samples(encoding, ALL_CODES)
    assert not isinstance(decoded, AudioError)
    assert encode_samples(Encoding.PCM16, decoded) == getattr(AUDIOOP, decode)(ALL_CODES, 2)


@pytest.mark.parametrize("encoding", [Encoding.MULAW, Encoding.ALAW])
def test_g711_re_encodes_every_decoded_value_to_the_same_value(encoding: Encoding) -> None:
    decoded = decode_samples(encoding, ALL_CODES)
    assert not isinstance(decoded, AudioError)
    again = decode_samples(encoding, encode_samples(encoding, decoded))
    assert not isinstance(again, AudioError)
    assert np.array_equal(again, decoded)


@pytest.mark.parametrize("encoding", [Encoding.MULAW, Encoding.ALAW])
def test_g711_error_is_within_its_quantisation_step(encoding: Encoding) -> None:
    # Every 16-bit value comes back within half a step of its segment, that is
    # within 1/32 of its magnitude (4 bits of mantissa) plus the smallest step.
    pcm = decode_samples(Encoding.PCM16, ALL_PCM16)
    assert not isinstance(pcm, AudioError)
    back = decode_samples(encoding, encode_samples(encoding, pcm))
    assert not isinstance(back, AudioError)
    error = np.abs(back.astype(np.float64) - pcm) * 32768
    assert np.all(error <= np.abs(pcm) * 32768 / 16 + 16)


# -- PCM ---------------------------------------------------------------------------------


@given(st.binary(max_size=400).map(lambda b: b[: len(b) - len(b) % 2]))
def test_pcm16_round_trips_exactly(data: bytes) -> None:
    samples = decode_samples(Encoding.PCM16, data)
    assert not isinstance(samples, AudioError)
    assert encode_samples(Encoding.PCM16, samples) == data


@given(st.lists(st.integers(-32768, 32767), max_size=100))
def test_pcm16_to_f32le_and_back_is_exact(values: list[int]) -> None:
    data = np.array(values, dtype="<i2").tobytes()
    samples = decode_samples(Encoding.PCM16, data)
    assert not isinstance(samples, AudioError)
    f32 = encode_samples(Encoding.F32LE, samples)
    assert len(f32) == 2 * len(data)
    assert np.array_equal(np.frombuffer(f32, "<f4"), np.array(values) / 32768)
    back = decode_samples(Encoding.F32LE, f32)
    assert not isinstance(back, AudioError)
    assert encode_samples(Encoding.PCM16, back) == data


def test_out_of_range_and_non_finite_samples_are_clipped() -> None:
    f32 = np.array([2.0, -2.0, np.nan, np.inf, -np.inf, 0.5], dtype="<f4").tobytes()
    samples = decode_samples(Encoding.F32LE, f32)
    assert not isinstance(samples, AudioError)
    assert _pcm16(encode_samples(Encoding.PCM16, samples)) == [
        32767,
        -32768,
        0,
        32767,
        -32768,
        16384,
    ]
    assert np.frombuffer(encode_samples(Encoding.F32LE, samples), "<f4").tolist() == [
        1.0, -1.0, 0.0, 1.0, -1.0, 0.5
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("encoding", "size"), [(Encoding.PCM16, 3), (Encoding.F32LE, 6), (Encoding.F32LE, 1)]
)
def test_partial_samples_are_an_error_value(encoding: Encoding, size: int) -> None:
    result = decode_samples(encoding, bytes(size))
    assert isinstance(result, AudioError)
    assert result.kind is AudioErrorKind.INVALID_AUDIO
    assert str(size) in result.message


@given(st.sampled_from(list(Encoding)), st.binary(max_size=64))
def test_decoding_any_bytes_never_raises(encoding: Encoding, data: bytes) -> None:
    result = decode_samples(encoding, data)
    if isinstance(result, AudioError):
        assert len(data) % {Encoding.PCM16: 2, Encoding.F32LE: 4}[encoding]
    else:
        assert np.all(np.isfinite(result))


# -- base64 ------------------------------------------------------------------------------


@given(st.binary(max_size=300))
def test_base64_round_trips(data: bytes) -> None:
    text = encode_base64(data)
    assert text == base64.b64encode(data).decode()
    assert decode_base64(text) == data


@pytest.mark.parametrize("text", ["abc", "!!!!", "AAA=A", "é", "AA==AA==", "A", 3, None, b"AAAA"])
def test_bad_base64_is_an_error_value(text: object) -> None:
    result = decode_base64(text)
    assert isinstance(result, AudioError)
    assert result.kind is AudioErrorKind.INVALID_BASE64


@given(st.text(max_size=40))
def test_decoding_any_text_never_raises(text: str) -> None:
    assert isinstance(decode_base64(text), bytes | AudioError)


# -- timebases ---------------------------------------------------------------------------


def test_the_engine_second_lasts_a_second_in_the_clients_timebase() -> None:
    # The bug: 22,050 samples labelled 24 kHz last 918.75 ms, 8 % short.
    assert samples_to_ms(22050, 24000) == pytest.approx(918.75)
    assert samples_to_ms(22050, NEMOTRON_OUTPUT.rate) == 1000.0
    assert rescale_samples(22050, 22050, 24000) == 24000
    assert NEMOTRON_OUTPUT.duration_ms(44100) == 1000.0
    assert OPENAI_PCM16.duration_ms(48000) == 1000.0
    assert G711_ULAW.duration_ms(160) == 20.0
    assert NEMOTRON_INPUT.bytes_for_ms(20) == 1280
    assert OPENAI_PCM16.samples_in(3) == 1


@pytest.mark.parametrize(("ms", "rate", "samples"), [(0, 24000, 0), (-5, 24000, 0), (1000, 22050, 22050), (40, 22050, 882), (0.02, 24000, 0), (0.03, 24000, 1)])  # fmt: skip
def test_ms_to_samples(ms: float, rate: int, samples: int) -> None:
    assert ms_to_samples(ms, rate) == samples


@given(
    st.integers(0, 10**9),
    st.sampled_from([8000, 16000, 22050, 24000, 44100, 48000]),
    st.sampled_from([8000, 16000, 22050, 24000, 44100, 48000]),
)
def test_rescaling_is_nearest_and_round_trips_within_a_sample(samples: int, a: int, b: int) -> None:
    there = rescale_samples(samples, a, b)
    assert abs(there - samples * b / a) <= 0.5
    back = rescale_samples(there, b, a)
    assert abs(back - samples) <= math.ceil(a / b / 2)


def test_a_format_needs_a_positive_rate() -> None:
    # A programming error, not wire input: the parsers never build one.
    with pytest.raises(ValueError, match="not positive"):
        AudioFormat(Encoding.PCM16, 0)
