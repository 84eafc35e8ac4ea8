"""Speech for the tests of turn detection through the OpenAI front door.

espeak-ng (Debian's ``espeak-ng``; .ci/run installs it) says a sentence; it is
resampled to 24 kHz PCM16 (what OpenAI clients send) at about -20 dBFS, the
level tests/proxy/core/test_voice_activity.py measures the model at.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import wave
from functools import cache
from typing import Final

import numpy as np
import pytest
import soxr

__all__ = ["RATE", "chunks", "needs_espeak", "silence_24k", "speech_24k"]

RATE: Final = 24000

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None,
    reason="espeak-ng is not installed (Debian package espeak-ng; .ci/run installs it)",
)


@cache
def speech_24k(text: str) -> bytes:
    """``text`` spoken, as 24 kHz PCM16 mono bytes."""
    wav = subprocess.run(
        ["espeak-ng", "-v", "en-us", "--stdout", text], capture_output=True, check=True, timeout=60
    ).stdout
    with wave.open(io.BytesIO(wav)) as reader:
        rate = reader.getframerate()
        pcm = reader.readframes(reader.getnframes())
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768
    x = soxr.resample(x, rate, RATE).astype(np.float32)
    x = x * (0.1 / np.sqrt(np.mean(x**2)))
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def silence_24k(ms: int) -> bytes:
    return b"\x00\x00" * (RATE * ms // 1000)


def chunks(pcm: bytes, ms: int = 100) -> list[bytes]:
    """``pcm`` (24 kHz PCM16) in pieces of ``ms``."""
    size = RATE * ms // 1000 * 2
    return [pcm[i : i + size] for i in range(0, len(pcm), size)]
