"""Per-session converters and the phone framer (proxy/core/audio_convert.py).

Resampling through one stream per direction is continuous: a signal cut into
random chunks comes out as the one-shot resample of the whole, with no jump at
a chunk join; sample counts add up (N in, N x out/in out after a flush); the
output keeps time, so positions map between the timebases by the rate ratio;
a reset drops what the resampler holds. The framer cuts exact frames
(docs/design.md, Audio formats).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import soxr
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.audio_convert import (
    DEFAULT_RESAMPLE_QUALITY,
    TWILIO_FRAME_BYTES,
    AudioConverter,
    FrameCutter,
    ResampleQuality,
    silence,
)
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
    decode_samples,
    encode_samples,
)

#: The pairs the front doors convert: (source, target).
PAIRS = [
    (NEMOTRON_OUTPUT, OPENAI_PCM16),  # engine -> OpenAI client
    (OPENAI_PCM16, NEMOTRON_INPUT),  # OpenAI client -> engine
    (OPENAI_PCM16, MINICPMO_INPUT),
    (G711_ULAW, MINICPMO_INPUT),  # phone -> engine
    (NEMOTRON_OUTPUT, G711_ULAW),  # engine -> phone
    (MINICPMO_OUTPUT, G711_ALAW),
]


def _ids(pairs: list[tuple[AudioFormat, AudioFormat]]) -> list[str]:
    return [f"{a.encoding.value}@{a.rate}->{b.encoding.value}@{b.rate}" for a, b in pairs]


def _sine(fmt: AudioFormat, seconds: float, hz: float = 440.0, level: float = 0.5) -> bytes:
    t = np.arange(round(fmt.rate * seconds)) / fmt.rate
    return encode_samples(fmt.encoding, (level * np.sin(2 * np.pi * hz * t)).astype(np.float32))


def _floats(fmt: AudioFormat, data: bytes) -> np.ndarray:
    samples = decode_samples(fmt.encoding, data)
    assert not isinstance(samples, AudioError)
    return samples.astype(np.float64)


def _run(converter: AudioConverter, data: bytes, cuts: list[int]) -> bytes:
    """``data`` through ``converter`` cut at the sample offsets ``cuts``, then flushed."""
    width = converter.source.bytes_per_sample
    out = []
    start = 0
    for cut in [*sorted(cuts), len(data) // width]:
        piece = converter.convert(data[start * width : cut * width])
        assert isinstance(piece, bytes)
        out.append(piece)
        start = cut
    out.append(converter.flush())
    return b"".join(out)


def _cuts(data: bytes, fmt: AudioFormat, seed: int, count: int = 60) -> list[int]:
    n = len(data) // fmt.bytes_per_sample
    return sorted(np.random.default_rng(seed).integers(0, n, count).tolist())


# -- continuity ---------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=_ids(PAIRS))
def test_random_chunks_give_the_one_shot_resample(source: AudioFormat, target: AudioFormat) -> None:
    data = _sine(source, 1.5)
    streamed = _floats(target, _run(AudioConverter(source, target), data, _cuts(data, source, 1)))
    whole = soxr.resample(
        _floats(source, data).astype(np.float32),
        source.rate,
        target.rate,
        quality=DEFAULT_RESAMPLE_QUALITY.value,
    )
    reference = _floats(target, encode_samples(target.encoding, whole))
    assert len(streamed) == len(reference)
    # Within the target format's own quantisation (G.711: a step near the peak).
    step = 1 / 32768 if target.encoding in (Encoding.PCM16, Encoding.F32LE) else 1024 / 32768
    assert np.max(np.abs(streamed - reference)) <= step


@pytest.mark.parametrize(("source", "target"), PAIRS[:3], ids=_ids(PAIRS[:3]))
def test_no_jump_at_chunk_joins(source: AudioFormat, target: AudioFormat) -> None:
    # A 440 Hz sine at 0.5 moves at most 0.5 * 2 * pi * 440 / rate per sample; a
    # join that restarts the filter (a click) jumps far more than that.
    data = _sine(source, 1.0)
    out = _floats(target, _run(AudioConverter(source, target), data, _cuts(data, source, 2)))
    bound = 0.5 * 2 * np.pi * 440 / target.rate
    inner = out[target.rate // 50 : -target.rate // 50]  # the filter's edges aside
    assert np.max(np.abs(np.diff(inner))) <= bound * 1.01 + 2 / 32768


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=_ids(PAIRS))
def test_the_output_is_the_same_sine_at_the_target_rate(
    source: AudioFormat, target: AudioFormat
) -> None:
    data = _sine(source, 1.0)
    out = _floats(target, _run(AudioConverter(source, target), data, _cuts(data, source, 3)))
    t = np.arange(len(out)) / target.rate
    expected = 0.5 * np.sin(2 * np.pi * 440 * t)
    inner = slice(target.rate // 50, -target.rate // 50)  # the filter's edges aside
    g711 = {source.encoding, target.encoding} & {Encoding.MULAW, Encoding.ALAW}
    tolerance = 0.02 if g711 else 3e-4  # G.711's step near the peak is 1/32 of it
    assert np.max(np.abs(out[inner] - expected[inner])) <= tolerance


def test_a_tone_above_the_target_band_is_filtered_out() -> None:
    # 10 kHz is above 16 kHz's Nyquist: the default preset filters it; cubic
    # interpolation (QUICK) folds it down to 6 kHz.
    data = _sine(OPENAI_PCM16, 1.0, hz=10_000.0)
    quiet = _floats(NEMOTRON_INPUT, _run(AudioConverter(OPENAI_PCM16, NEMOTRON_INPUT), data, []))
    assert np.sqrt(np.mean(quiet[1000:-1000] ** 2)) < 0.5 / 100  # -40 dB
    quick = AudioConverter(OPENAI_PCM16, NEMOTRON_INPUT, quality=ResampleQuality.QUICK)
    folded = _floats(NEMOTRON_INPUT, _run(quick, data, []))
    assert np.sqrt(np.mean(folded[1000:-1000] ** 2)) > 0.5 / 10


# -- sample accounting -------------------------------------------------------------------


@given(
    st.integers(1, 30_000),
    st.lists(st.integers(0, 30_000), max_size=20),
    st.sampled_from(PAIRS),
)
@settings(max_examples=60, deadline=None)
def test_a_flushed_segment_lasts_as_long_as_its_input(
    n: int, cuts: list[int], pair: tuple[AudioFormat, AudioFormat]
) -> None:
    source, target = pair
    converter = AudioConverter(source, target)
    data = encode_samples(source.encoding, np.full(n, 0.1, dtype=np.float32))
    out = _run(converter, data, [c for c in cuts if c <= n])
    produced = len(out) // target.bytes_per_sample
    assert abs(produced - n * target.rate / source.rate) <= 1
    stats = converter.statistics()
    assert (stats.source_samples, stats.target_samples, stats.held_samples) == (0, 0, 0)
    assert stats.total_source_samples == n
    assert stats.total_target_samples == produced
    assert stats.dropped_samples == 0


def test_22050_to_24000_counts_while_streaming() -> None:
    converter = AudioConverter(NEMOTRON_OUTPUT, OPENAI_PCM16)
    chunk = _sine(NEMOTRON_OUTPUT, 0.04)  # 882 samples: 40 ms
    given_out = 0
    for _ in range(25):
        piece = converter.convert(chunk)
        assert isinstance(piece, bytes)
        given_out += len(piece) // 2
        stats = converter.statistics()
        assert stats.target_samples == given_out
        # What is not out yet is held, and the held audio stays under 2 ms.
        assert stats.held_samples == stats.source_samples - converter.source_samples_for(given_out)
        assert 0 <= stats.held_samples <= NEMOTRON_OUTPUT.rate // 500
    assert converter.statistics().source_samples == 25 * 882
    given_out += len(converter.flush()) // 2
    assert given_out == 24_000


def test_flushing_twice_or_with_nothing_taken_gives_nothing() -> None:
    converter = AudioConverter(NEMOTRON_OUTPUT, OPENAI_PCM16)
    assert converter.flush() == b""
    assert isinstance(converter.convert(_sine(NEMOTRON_OUTPUT, 0.04)), bytes)
    assert converter.flush() != b""
    assert converter.flush() == b""
    # The next segment starts on a fresh resampler.
    assert converter.convert(_sine(NEMOTRON_OUTPUT, 0.04)) != b""
    assert converter.flush() != b""
    assert converter.statistics().total_target_samples == 2 * 960


def test_a_reset_drops_the_held_audio() -> None:
    # Loud audio, a barge-in, then silence: nothing loud may come out after it.
    converter = AudioConverter(OPENAI_PCM16, G711_ULAW, quality=ResampleQuality.HIGH)
    before = converter.convert(_sine(OPENAI_PCM16, 0.02, level=0.9))
    assert isinstance(before, bytes)
    held = converter.statistics().held_samples
    assert held > 0  # HIGH holds a whole 20 ms chunk at 3:1
    assert converter.reset() == held
    after = converter.convert(bytes(960))
    assert isinstance(after, bytes)
    tail = after + converter.flush()
    assert len(tail) == 160
    assert np.max(np.abs(_floats(G711_ULAW, tail))) == 0.0
    stats = converter.statistics()
    assert stats.dropped_samples == held
    assert stats.total_source_samples == 960


def test_same_rate_conversion_is_sample_for_sample() -> None:
    converter = AudioConverter(G711_ULAW, AudioFormat(Encoding.PCM16, 8000))
    assert not converter.resamples
    out = converter.convert(bytes([0x00, 0x80, 0xFF]))
    assert np.frombuffer(out, "<i2").tolist() == [-32124, 32124, 0]  # type: ignore[arg-type]
    assert converter.statistics().held_samples == 0
    assert converter.flush() == b""
    assert converter.reset() == 0


def test_identical_formats_pass_through() -> None:
    converter = AudioConverter(G711_ULAW, G711_ULAW)
    data = bytes(range(160))
    assert converter.convert(data) is data
    assert converter.statistics().target_samples == 160
    pcm = AudioConverter(OPENAI_PCM16, OPENAI_PCM16)
    refused = pcm.convert(b"\x00\x01\x02")
    assert isinstance(refused, AudioError)
    assert refused.kind is AudioErrorKind.INVALID_AUDIO


# -- timebases ---------------------------------------------------------------------------


def test_the_resampler_keeps_time() -> None:
    # A click at engine sample k comes out at client sample k * 24000 / 22050.
    converter = AudioConverter(NEMOTRON_OUTPUT, OPENAI_PCM16)
    samples = np.zeros(22050, dtype=np.float32)
    samples[11025] = 0.9
    out = _floats(
        OPENAI_PCM16, _run(converter, encode_samples(Encoding.PCM16, samples), [3000, 11000])
    )
    assert abs(int(np.argmax(out)) - converter.target_samples_for(11025)) <= 1
    assert converter.target_samples_for(11025) == 12000


def test_positions_map_between_the_timebases() -> None:
    converter = AudioConverter(NEMOTRON_OUTPUT, OPENAI_PCM16)
    # The client played 1.5 s (36,000 of its samples): the engine's 33,075.
    assert converter.source_samples_for(36_000) == 33_075
    assert converter.target_samples_for(33_075) == 36_000
    # A truncation's audio_end_ms is the same instant in the engine's ms.
    assert converter.source_ms_for(1500) == 1500.0
    assert converter.source_ms_for(0) == 0.0
    assert converter.source_ms_for(1000 / 24000) == pytest.approx(1000 / 22050)
    phone_in = AudioConverter(G711_ULAW, NEMOTRON_INPUT)
    assert phone_in.target_samples_for(160) == 320


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=_ids(PAIRS))
def test_bad_chunks_are_an_error_value_and_take_nothing_in(
    source: AudioFormat, target: AudioFormat
) -> None:
    converter = AudioConverter(source, target)
    if source.bytes_per_sample > 1:
        odd = converter.convert(bytes(source.bytes_per_sample + 1))
        assert isinstance(odd, AudioError)
        assert odd.kind is AudioErrorKind.INVALID_AUDIO
    bad = converter.convert_base64("not base64!")
    assert isinstance(bad, AudioError)
    assert bad.kind is AudioErrorKind.INVALID_BASE64
    assert converter.statistics().total_source_samples == 0


def test_base64_chunks_convert() -> None:
    converter = AudioConverter(G711_ULAW, G711_ULAW)
    frame = base64.b64encode(bytes(160)).decode()
    assert converter.convert_base64(frame) == frame
    odd = AudioConverter(OPENAI_PCM16, G711_ULAW).convert_base64(base64.b64encode(b"abc").decode())
    assert isinstance(odd, AudioError)
    assert odd.kind is AudioErrorKind.INVALID_AUDIO


# -- framing -----------------------------------------------------------------------------


@given(st.lists(st.binary(max_size=500), max_size=30))
def test_frames_are_exact_and_lose_nothing(chunks: list[bytes]) -> None:
    cutter = FrameCutter()
    frames: list[bytes] = []
    for chunk in chunks:
        frames.extend(cutter.receive(chunk))
        assert 0 <= cutter.held_bytes < TWILIO_FRAME_BYTES
    assert all(len(f) == TWILIO_FRAME_BYTES for f in frames)
    assert b"".join(frames) + cutter.flush(pad=False) == b"".join(chunks)
    assert cutter.held_bytes == 0


def test_the_last_frame_is_padded_with_silence() -> None:
    cutter = FrameCutter()
    assert cutter.receive(bytes(200)) == [bytes(160)]
    last = cutter.flush()
    assert last == bytes(40) + b"\xff" * 120
    assert cutter.flush() == b""
    cutter.receive(b"\x01" * 10)
    assert cutter.reset() == 10
    assert cutter.flush() == b""


def test_frames_for_a_format() -> None:
    assert FrameCutter.for_format(G711_ULAW).frame_bytes == 160
    alaw = FrameCutter.for_format(G711_ALAW)
    alaw.receive(b"\x00")
    assert alaw.flush() == b"\x00" + silence(Encoding.ALAW) * 159
    pcm = FrameCutter.for_format(OPENAI_PCM16, 40)
    assert pcm.frame_bytes == 1920
    pcm.receive(b"\x01\x02\x03")  # a partial sample is padded to the frame all the same
    assert len(pcm.flush()) == 1920
    assert silence(Encoding.MULAW) == b"\xff"
    assert silence(Encoding.F32LE) == bytes(4)


@pytest.mark.parametrize(("size", "fill"), [(0, b"\xff"), (160, b""), (161, b"\x00\x00")])
def test_a_frame_cutter_needs_whole_fills(size: int, fill: bytes) -> None:
    with pytest.raises(ValueError, match="multiple"):
        FrameCutter(size, fill)


def test_engine_audio_reaches_a_phone_as_twilio_frames() -> None:
    # Nemotron-like 80 ms packets of 22.05 kHz PCM16 -> 20 ms mu-law frames, base64.
    converter = AudioConverter(NEMOTRON_OUTPUT, G711_ULAW)
    cutter = FrameCutter()
    packets = _sine(NEMOTRON_OUTPUT, 2.0)
    payloads: list[str] = []
    for start in range(0, len(packets), 1764 * 2):
        piece = converter.convert_base64(base64.b64encode(packets[start : start + 3528]).decode())
        assert isinstance(piece, str)
        for frame in cutter.receive(base64.b64decode(piece)):
            payloads.append(base64.b64encode(frame).decode())
    payloads.extend(base64.b64encode(f).decode() for f in cutter.receive(converter.flush()))
    assert cutter.flush() == b""  # 2 s is 100 whole frames
    assert all(len(base64.b64decode(p)) == 160 for p in payloads)
    assert len(payloads) == 100  # 2 s of 20 ms frames


@given(
    st.sampled_from(PAIRS),
    st.lists(st.one_of(st.integers(0, 4000), st.sampled_from(["flush", "reset"])), max_size=25),
)
@settings(max_examples=60, deadline=None)
def test_every_sample_is_given_out_or_counted_dropped(
    pair: tuple[AudioFormat, AudioFormat], steps: list[int | str]
) -> None:
    # Any interleaving of chunks, flushes (end of a response) and resets (cancels):
    # what came out is what went in, less what resets dropped, at the target rate.
    source, target = pair
    converter = AudioConverter(source, target)
    given_out = segments = 0
    for step in [*steps, "flush"]:
        if step == "flush":
            given_out += len(converter.flush()) // target.bytes_per_sample
            segments += 1
        elif step == "reset":
            converter.reset()
            segments += 1
        else:
            assert isinstance(step, int)
            chunk = encode_samples(source.encoding, np.full(step, 0.25, dtype=np.float32))
            out = converter.convert(chunk)
            assert isinstance(out, bytes)
            given_out += len(out) // target.bytes_per_sample
    stats = converter.statistics()
    assert stats.total_target_samples == given_out
    kept = stats.total_source_samples - stats.dropped_samples
    assert abs(given_out - kept * target.rate / source.rate) <= 2 * segments
