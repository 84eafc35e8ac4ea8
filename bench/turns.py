"""CPU and latency of turn detection, without sockets: ``python -m bench.turns``.

What a front door that detects turns itself (docs/design.md, Turn detection)
adds per input frame: one session's ``TurnDetector`` (proxy/core/turns.py) over
the packaged Silero model (proxy/core/voice_activity.py), fed 20 ms frames of
PCM16 16 kHz, and of G.711 mu-law 8 kHz scored at 8 kHz (Twilio's frames). A
second table gives the memory of the process's one model and of each session's
detector; a third, with espeak-ng installed, how soon after the onset of
synthesized speech ``speech_started`` comes out. Markdown tables on stdout;
docs/performance.md quotes them.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import subprocess
import sys
import time
import wave
from collections.abc import Callable

import numpy as np
import soxr

from proxy.core.audio_formats import Encoding, decode_samples, encode_samples
from proxy.core.turns import SpeechStarted, TurnDetector

__all__ = ["main"]

VOICES = ("en-us", "en-gb", "en-us+f3", "de", "fr")
TEXTS = (
    "Hello, I would like to book a table for two people tomorrow evening.",
    "Could you tell me the weather in Paris?",
    "No, stop, wait a second.",
)


def _say(text: str, voice: str) -> np.ndarray:
    wav = subprocess.run(
        ["espeak-ng", "-v", voice, "--stdout", text], capture_output=True, check=True, timeout=60
    ).stdout
    with wave.open(io.BytesIO(wav)) as reader:
        rate = reader.getframerate()
        pcm = reader.readframes(reader.getnframes())
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768
    y: np.ndarray = np.asarray(soxr.resample(x, rate, 16_000), dtype=np.float32)
    return y * np.float32(0.1 / np.sqrt(np.mean(y**2)))


def _speech(seconds: float) -> np.ndarray:
    """Voice-like audio: espeak-ng's when installed, else a pitch-gliding buzz."""
    if shutil.which("espeak-ng"):
        x = np.concatenate([_say(t, "en-us") for t in TEXTS])
    else:
        t = np.arange(int(seconds * 16_000)) / 16_000
        x = 0.1 * np.sign(np.sin(2 * np.pi * (120 + 30 * np.sin(3 * t)) * t))
    return np.asarray(np.resize(x, int(seconds * 16_000)), dtype=np.float32)


def _cpu_us(run: Callable[[], object], events: int, rounds: int) -> float:
    """Median over rounds of CPU µs per call (``process_time``)."""
    samples = []
    for _ in range(rounds):
        started = time.process_time_ns()
        for _ in range(events):
            run()
        samples.append((time.process_time_ns() - started) / events / 1000)
    return statistics.median(samples)


def _frames(data: bytes, frame: int) -> Callable[[], bytes]:
    """A call that gives the next ``frame`` bytes, cycling over ``data``."""
    position = [0]

    def feed() -> bytes:
        start = position[0]
        position[0] = (start + frame) % (len(data) - frame)
        return data[start : start + frame]

    return feed


def _cpu_table(seconds: float, rounds: int) -> None:
    from proxy.session.voice_model import load_voice_model

    model = load_voice_model()
    speech = _speech(seconds)
    quiet = np.zeros_like(speech)
    narrow = soxr.resample(speech, 16_000, 8_000).astype(np.float32)
    ulaw = encode_samples(Encoding.MULAW, narrow)
    print("| input (20 ms frames) | audio | µs CPU per frame | % of one core per session |")
    print("|---|---|---|---|")
    for label, audio in (("speech", speech), ("silence", quiet)):
        pcm = encode_samples(Encoding.PCM16, audio)
        detector = TurnDetector(model.new_stream())
        chunk = _frames(pcm, 640)

        def web(d: TurnDetector = detector, c: Callable[[], bytes] = chunk) -> object:
            return d.receive_pcm16(c())

        us = _cpu_us(web, len(pcm) // 640, rounds)
        print(f"| PCM16 16 kHz | {label} | {us:.1f} | {us / 200:.2f} |")
    for label, data in (("speech", ulaw), ("silence", b"\xff" * len(ulaw))):
        detector = TurnDetector(model.new_stream(8_000))
        chunk = _frames(data, 160)

        def phone(d: TurnDetector = detector, c: Callable[[], bytes] = chunk) -> object:
            samples = decode_samples(Encoding.MULAW, c())
            assert isinstance(samples, np.ndarray)
            return d.receive_samples(samples)

        us = _cpu_us(phone, len(data) // 160, rounds)
        print(f"| mu-law 8 kHz, scored at 8 kHz | {label} | {us:.1f} | {us / 200:.2f} |")
    stream = model.new_stream()
    window = speech[:512].copy()
    us = _cpu_us(lambda: stream.probability(window), 2000, rounds)
    print(f"| one model window (32 ms at 16 kHz) | speech | {us:.1f} | {us / 320:.2f} |")


def _rss_kib() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * 4


def _memory_child(sessions: int) -> None:
    # Before: the project's other audio libraries (numpy, soxr) are already in.
    before = _rss_kib()
    started = time.perf_counter()
    from proxy.session.voice_model import load_voice_model

    model = load_voice_model()
    loaded = time.perf_counter() - started
    after_model = _rss_kib()
    silence = np.zeros(320, dtype=np.float32)
    detectors = [TurnDetector(model.new_stream()) for _ in range(sessions)]
    for detector in detectors:
        for _ in range(4):
            detector.receive_samples(silence)
    per = (_rss_kib() - after_model) / sessions
    print(f"{loaded * 1000:.0f} {(after_model - before) / 1024:.1f} {per:.1f}")


def _memory_table(sessions: int) -> None:
    child = [sys.executable, "-m", "bench.turns", "--memory-of", str(sessions)]
    out = subprocess.run(child, capture_output=True, text=True, check=True, timeout=120)
    load_ms, model_mib, per_kib = out.stdout.split()
    print()
    print("| import and model load (once per process) | RSS (MiB) | KiB per session |")
    print("|---|---|---|")
    print(f"| {load_ms} ms | {model_mib} | {per_kib} ({sessions} sessions) |")


def _latency_table() -> None:
    if not shutil.which("espeak-ng"):
        print("\n(espeak-ng is not installed: no latency table)")
        return
    from proxy.session.voice_model import load_voice_model

    model = load_voice_model()
    cases: dict[str, list[float]] = {
        "16 kHz": [],
        "mu-law 8 kHz": [],
        "16 kHz, white noise 10 dB": [],
    }
    rng = np.random.default_rng(5)
    for voice in VOICES:
        for text in TEXTS:
            x = np.concatenate((np.zeros(9600, np.float32), _say(text, voice)))
            frames = x[: len(x) // 160 * 160].reshape(-1, 160)
            onset = int(np.argmax(10 * np.log10(np.mean(frames**2, axis=1) + 1e-12) > -45)) * 10
            noisy = x + rng.standard_normal(len(x)).astype(np.float32) * 0.1 * 10 ** (-10 / 20)
            narrow = decode_samples(
                Encoding.MULAW,
                encode_samples(Encoding.MULAW, soxr.resample(x, 16_000, 8_000).astype(np.float32)),
            )
            assert isinstance(narrow, np.ndarray)
            for label, audio, rate in (
                ("16 kHz", x, 16_000),
                ("mu-law 8 kHz", narrow, 8_000),
                ("16 kHz, white noise 10 dB", noisy.astype(np.float32), 16_000),
            ):
                detector = TurnDetector(model.new_stream(rate))
                step = rate // 50
                for start in range(0, len(audio), step):
                    events = detector.receive_samples(audio[start : start + step])
                    if any(isinstance(e, SpeechStarted) for e in events):
                        cases[label].append(detector.position_ms - onset)
                        break
    print()
    print(
        f"| speech_started after the onset ({len(VOICES) * len(TEXTS)} utterances, 5 voices) | median ms | max ms | missed |"
    )
    print("|---|---|---|---|")
    for label, delays in cases.items():
        missed = len(VOICES) * len(TEXTS) - len(delays)
        print(f"| {label} | {statistics.median(delays):.0f} | {max(delays):.0f} | {missed} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.turns", description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="audio per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=500, help="detectors for the memory table")
    parser.add_argument("--memory-of", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.memory_of:
        _memory_child(ns.memory_of)
        return
    _cpu_table(ns.seconds, ns.rounds)
    _memory_table(ns.sessions)
    _latency_table()


if __name__ == "__main__":
    main()
