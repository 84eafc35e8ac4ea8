"""CPU per event of audio conversion, without sockets: ``python -m bench.audio``.

What a translating front door (the OpenAI dialect, the phone) adds per audio
event on top of relaying it: the event's base64 payload decoded, converted by
the session's ``AudioConverter`` (proxy/core/audio_convert.py) and encoded
again, for the chunk sizes the engines and clients send. Each case runs with
and without resampling, so the resampler's share is visible; a second table
gives, per resampler preset, the CPU per event and the audio the stream holds
back while it runs at a steady chunk rate (the latency it adds); a third, the
memory a session's two converters (engine -> client, client -> engine) take,
as RSS growth over 500 of them in a fresh process per preset. Results go to
stdout as Markdown tables; docs/performance.md quotes them.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from proxy.core.audio_convert import AudioConverter, FrameCutter, ResampleQuality
from proxy.core.audio_formats import (
    G711_ULAW,
    MINICPMO_INPUT,
    MINICPMO_OUTPUT,
    NEMOTRON_INPUT,
    NEMOTRON_OUTPUT,
    OPENAI_PCM16,
    AudioFormat,
    Encoding,
    encode_samples,
)

__all__ = ["main"]

#: (label, source, target, chunk ms, cut into Twilio frames).
CASES: tuple[tuple[str, AudioFormat, AudioFormat, int, bool], ...] = (
    ("engine -> OpenAI: 40 ms 22.05 kHz PCM16 -> 24 kHz", NEMOTRON_OUTPUT, OPENAI_PCM16, 40, False),
    ("engine -> OpenAI: 80 ms 22.05 kHz PCM16 -> 24 kHz", NEMOTRON_OUTPUT, OPENAI_PCM16, 80, False),
    (
        "  no resampling: 40 ms 24 kHz PCM16 passed through",
        MINICPMO_OUTPUT,
        OPENAI_PCM16,
        40,
        False,
    ),
    (
        "OpenAI -> engine: 40 ms 24 kHz PCM16 -> f32le 16 kHz",
        OPENAI_PCM16,
        NEMOTRON_INPUT,
        40,
        False,
    ),
    (
        "OpenAI -> engine: 40 ms 24 kHz PCM16 -> PCM16 16 kHz",
        OPENAI_PCM16,
        MINICPMO_INPUT,
        40,
        False,
    ),
    ("  no resampling: 40 ms PCM16 -> f32le, 16 kHz", MINICPMO_INPUT, NEMOTRON_INPUT, 40, False),
    ("phone -> engine: 20 ms mu-law 8 kHz -> PCM16 16 kHz", G711_ULAW, MINICPMO_INPUT, 20, False),
    ("phone -> engine: 20 ms mu-law 8 kHz -> f32le 16 kHz", G711_ULAW, NEMOTRON_INPUT, 20, False),
    (
        "  no resampling: 20 ms mu-law -> PCM16, 8 kHz",
        G711_ULAW,
        AudioFormat(Encoding.PCM16, 8000),
        20,
        False,
    ),
    (
        "engine -> phone: 80 ms 22.05 kHz PCM16 -> mu-law frames",
        NEMOTRON_OUTPUT,
        G711_ULAW,
        80,
        True,
    ),
    (
        "  no resampling: 80 ms 8 kHz PCM16 -> mu-law frames",
        AudioFormat(Encoding.PCM16, 8000),
        G711_ULAW,
        80,
        True,
    ),
)


def _payload(fmt: AudioFormat, ms: int) -> str:
    """Base64 of ``ms`` of a voice-band tone in ``fmt``."""
    n = fmt.rate * ms // 1000
    t = np.arange(n) / fmt.rate
    tone = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 1700 * t)).astype(
        np.float32
    )
    return base64.b64encode(encode_samples(fmt.encoding, tone)).decode()


def _event(
    converter: AudioConverter, payload: str, frames: FrameCutter | None
) -> Callable[[], object]:
    if frames is None:
        return lambda: converter.convert_base64(payload)

    def to_frames() -> object:
        raw = base64.b64decode(payload)
        out = converter.convert(raw)
        assert isinstance(out, bytes)
        return [base64.b64encode(f).decode() for f in frames.receive(out)]

    return to_frames


def _cpu_us(run: Callable[[], object], events: int, rounds: int) -> float:
    """Median over rounds of CPU µs per call (``process_time``)."""
    for _ in range(min(events, 200)):  # warm-up
        run()
    samples = []
    for _ in range(rounds):
        started = time.process_time_ns()
        for _ in range(events):
            run()
        samples.append((time.process_time_ns() - started) / events / 1000)
    return statistics.median(samples)


def _held_ms(converter: AudioConverter, payload: str, events: int) -> float:
    """The most audio held back at an event boundary, in ms, at a steady chunk rate."""
    most = 0
    for _ in range(events):
        converter.convert_base64(payload)
        most = max(most, converter.statistics().held_samples)
    return most * 1000 / converter.source.rate


def _rss_kib() -> float:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * 4096 / 1024


def _session_kib(quality: ResampleQuality, sessions: int = 500) -> float:
    """RSS growth per session of a Nemotron-like session's two converters, both used once."""
    AudioConverter(NEMOTRON_OUTPUT, OPENAI_PCM16, quality=quality).convert(bytes(1764))
    before = _rss_kib()
    kept = []
    for _ in range(sessions):
        down = AudioConverter(NEMOTRON_OUTPUT, OPENAI_PCM16, quality=quality)
        up = AudioConverter(OPENAI_PCM16, NEMOTRON_INPUT, quality=quality)
        down.convert(bytes(1764))
        up.convert(bytes(1920))
        kept.append((down, up))
    return (_rss_kib() - before) / sessions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000, help="events per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (the median is printed)")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # one preset, in a child
    ns = parser.parse_args(argv)
    if ns.memory_of:
        print(f"{_session_kib(ResampleQuality(ns.memory_of)):.0f}")
        return

    print("| event | µs CPU per event |")
    print("|---|---|")
    for label, source, target, ms, framed in CASES:
        converter = AudioConverter(source, target)
        frames = FrameCutter() if framed else None
        us = _cpu_us(_event(converter, _payload(source, ms), frames), ns.events, ns.rounds)
        print(f"| {label.strip()}{' (baseline)' if label.startswith(' ') else ''} | {us:.1f} |")

    print()
    pairs = [c for c in CASES if c[1].rate != c[2].rate and not c[4]]
    print("| resampling | preset | µs CPU per event | held back (max, ms) |")
    print("|---|---|---|---|")
    for label, source, target, ms, _ in pairs:
        name = label.split(": ", 1)[1]
        for quality in ResampleQuality:
            converter = AudioConverter(source, target, quality=quality)
            payload = _payload(source, ms)
            us = _cpu_us(_event(converter, payload, None), ns.events // 4, ns.rounds)
            held = _held_ms(AudioConverter(source, target, quality=quality), payload, 200)
            print(f"| {name} | {quality.value} | {us:.1f} | {held:.1f} |")

    print()
    print("| preset | KiB per session (both directions, 500 sessions) |")
    print("|---|---|")
    for quality in ResampleQuality:
        child = [sys.executable, "-m", "bench.audio", "--memory-of", quality.value]
        kib = subprocess.run(child, capture_output=True, text=True, check=True, timeout=120)
        print(f"| {quality.value} | {kib.stdout.strip()} |")


if __name__ == "__main__":
    main()
