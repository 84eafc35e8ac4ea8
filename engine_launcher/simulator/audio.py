"""Output voice and input-energy helpers for the simulator (stdlib only).

The output audio is real PCM16 so clients and benchmarks can play or measure
it. It is computed once at start-up and cut into base64 chunks, because a
session may send one delta every 80 ms and per-chunk work must stay tiny.
"""

from __future__ import annotations

import array
import base64
import math
import sys
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DEFAULT_LOOP_SECONDS",
    "TRANSCRIPT_WORDS",
    "AudioBank",
    "input_bytes_per_sample",
    "load_wav",
    "make_audio_bank",
    "pcm16_rms",
    "pcm_f32_rms",
    "synthesize_voice",
]

# Length of the generated voice before it repeats. Two seconds keeps start-up
# cheap (the synthesis loop is pure Python) while still sounding like speech.
DEFAULT_LOOP_SECONDS: Final = 2.0
PCM16_MAX: Final = 32767

# One transcript word per audio delta: the real engine sends exactly one
# transcript delta per audio delta (docs/engine-protocol.md, Server events), possibly empty.
TRANSCRIPT_WORDS: Final[tuple[str, ...]] = (
    "This", "is", "the", "simulated", "omni", "engine", "speaking", "in", "short",
    "chunks", "of", "synthetic", "audio", "so", "that", "the", "sidecar", "can", "be",
    "measured", "without", "a", "GPU.",
)  # fmt: skip

_LITTLE_ENDIAN: Final = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class AudioBank:
    """Precomputed base64 PCM16 chunks, played in a loop.

    Attributes:
        chunks: base64 text of each chunk, all of ``chunk_ms`` length.
        chunk_ms: audio duration of one chunk.
        sample_rate: samples per second of the PCM16 mono data.
    """

    chunks: tuple[str, ...]
    chunk_ms: int
    sample_rate: int

    def chunk(self, index: int) -> str:
        """Return the base64 audio of chunk ``index`` (wrapping around)."""
        return self.chunks[index % len(self.chunks)]

    @staticmethod
    def transcript(index: int) -> str:
        """Return the transcript text that goes with chunk ``index``."""
        word = TRANSCRIPT_WORDS[index % len(TRANSCRIPT_WORDS)]
        return word if index == 0 else " " + word


def synthesize_voice(sample_rate: int, seconds: float) -> array.array[int]:
    """Generate a voice-like PCM16 signal.

    A glottal-ish tone (fundamental plus decaying harmonics) whose pitch drifts
    per syllable, shaped by a syllable-rate envelope (~4 Hz) with short pauses
    between "words". Enough structure for VAD, codecs and level meters to
    behave as they do with speech.

    Args:
        sample_rate: output rate in Hz.
        seconds: length of the signal.

    Returns:
        Signed 16-bit samples.
    """
    n = max(1, round(sample_rate * seconds))
    harmonics = ((1, 0.55), (2, 0.25), (3, 0.12), (4, 0.06))
    syllable_rate = 4.0  # syllables per second, typical of conversational speech
    word_length = 6  # syllables per "word"; the last one is a pause
    base_pitches = (140.0, 165.0, 150.0, 180.0, 130.0, 155.0)
    two_pi = 2.0 * math.pi
    out = array.array("h", bytes(2 * n))
    phase = 0.0
    for i in range(n):
        t = i / sample_rate
        syllable_pos = t * syllable_rate
        syllable = int(syllable_pos)
        frac = syllable_pos - syllable
        if syllable % word_length == word_length - 1:
            continue  # pause between words: digital silence
        pitch = base_pitches[syllable % len(base_pitches)] * (1.0 + 0.06 * math.sin(two_pi * frac))
        phase += two_pi * pitch / sample_rate
        if phase > two_pi:
            phase -= two_pi
        envelope = math.sin(math.pi * frac) ** 2
        value = 0.0
        for k, amp in harmonics:
            value += amp * math.sin(k * phase)
        out[i] = int(PCM16_MAX * 0.6 * envelope * value)
    return out


def load_wav(path: str, sample_rate: int) -> array.array[int]:
    """Read a PCM16 WAV file as mono samples at ``sample_rate``.

    Multi-channel files keep their first channel; other rates are resampled
    linearly (good enough for a test voice).

    Raises:
        ValueError: the file is not 16-bit PCM.
    """
    with wave.open(path, "rb") as wav:
        if wav.getsampwidth() != 2 or wav.getcomptype() != "NONE":
            raise ValueError(f"{path}: expected 16-bit PCM WAV")
        channels = wav.getnchannels()
        rate = wav.getframerate()
        frames = wav.readframes(wav.getnframes())
    samples = array.array("h")
    samples.frombytes(frames[: len(frames) - len(frames) % 2])
    if not _LITTLE_ENDIAN:
        samples.byteswap()
    if channels > 1:
        samples = samples[::channels]
    if not samples:
        raise ValueError(f"{path}: no audio frames")
    if rate == sample_rate:
        return samples
    n_out = max(1, int(len(samples) * sample_rate / rate))
    out = array.array("h", bytes(2 * n_out))
    step = rate / sample_rate
    last = len(samples) - 1
    for i in range(n_out):
        pos = i * step
        j = int(pos)
        frac = pos - j
        a = samples[min(j, last)]
        b = samples[min(j + 1, last)]
        out[i] = int(a + (b - a) * frac)
    return out


def make_audio_bank(
    chunk_ms: int, sample_rate: int, samples: Sequence[int] | None = None
) -> AudioBank:
    """Cut ``samples`` (or a generated voice) into base64 chunks of ``chunk_ms``.

    The generated voice is made a whole number of chunks long so the loop has
    no seam; a WAV file is wrapped around at its end instead.
    """
    chunk_samples = max(1, sample_rate * chunk_ms // 1000)
    if samples is None:
        n_chunks = max(1, math.ceil(DEFAULT_LOOP_SECONDS * 1000 / chunk_ms))
        pcm = synthesize_voice(sample_rate, n_chunks * chunk_samples / sample_rate)
    else:
        pcm = array.array("h", samples)
        n_chunks = max(1, math.ceil(len(pcm) / chunk_samples))
        # Wrap the tail around to the start so every chunk has full length.
        while len(pcm) < n_chunks * chunk_samples:
            pcm.extend(pcm[: n_chunks * chunk_samples - len(pcm)])
    if not _LITTLE_ENDIAN:
        pcm.byteswap()
    raw = pcm.tobytes()
    size = 2 * chunk_samples
    chunks = tuple(
        base64.b64encode(raw[i * size : (i + 1) * size]).decode("ascii") for i in range(n_chunks)
    )
    return AudioBank(chunks=chunks, chunk_ms=chunk_ms, sample_rate=sample_rate)


def input_bytes_per_sample(fmt: str) -> int | None:
    """Bytes per sample of a client input format, ``None`` if unsupported."""
    return {
        "pcm16": 2,
        "pcm_s16le": 2,
        "s16le": 2,
        "pcm_f32le": 4,
        "g711_ulaw": 1,
        "g711_alaw": 1,
    }.get(fmt)


def _rms(data: bytes, typecode: str, full_scale: float) -> float:
    """Root-mean-square level of little-endian samples, in 0..1 of full scale.

    Every 4th sample is enough for a speech/silence decision and keeps the
    cost per append low.
    """
    samples = array.array(typecode)
    samples.frombytes(data[: len(data) - len(data) % samples.itemsize])
    if not _LITTLE_ENDIAN:
        samples.byteswap()
    picked = samples[::4]
    if not picked:
        return 0.0
    total = sum(s * s for s in picked)
    return math.sqrt(total / len(picked)) / full_scale


def pcm16_rms(data: bytes) -> float:
    """RMS level of little-endian PCM16, in 0..1 of full scale."""
    return _rms(data, "h", 32768.0)


def pcm_f32_rms(data: bytes) -> float:
    """RMS level of little-endian float32 samples."""
    return _rms(data, "f", 1.0)
