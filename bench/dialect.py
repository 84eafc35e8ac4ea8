"""CPU per event of the OpenAI dialect alone: ``python -m bench.dialect`` (~15 s).

Feeds one session's ``OpenAIDialect`` (proxy/core/dialect) the frames engines
and OpenAI clients send and prints CPU µs per event (``process_time``, median
of ``--rounds`` rounds of ``--events`` events): audio deltas engine -> client
with and without resampling, appends client -> engine, and the control events
it reshapes. What the relay adds around it (the pass-through cost) is
``python -m bench.micro``; both are in docs/performance.md, The OpenAI dialect.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from proxy.core.capabilities import EngineVersion
from proxy.core.dialect import Flavour, OpenAIDialect, engine_dialect

__all__ = ["main"]


def _pcm16(ms: int, rate: int) -> str:
    t = np.arange(rate * ms // 1000) / rate
    return base64.b64encode((9000 * np.sin(2 * np.pi * 220 * t)).astype("<i2").tobytes()).decode()


def _dialect(flavour: Flavour, engine_in: tuple[str, int], engine_out: int) -> OpenAIDialect:
    ids = iter(range(1 << 62))
    d = OpenAIDialect(flavour, engine_dialect(EngineVersion.V0_30), lambda: f"event_{next(ids)}")
    created = {
        "type": "session.created",
        "event_id": "e0",
        "session": {
            "id": "s",
            "model": "m",
            "audio": {
                "input": {"format": engine_in[0], "sample_rate_hz": engine_in[1]},
                "output": {"format": "pcm16", "sample_rate_hz": engine_out},
            },
        },
    }
    d.to_client(json.dumps(created))
    return d


def _delta(seq: int, b64: str) -> str:
    text = (
        '{"type":"response.output_audio.delta","event_id":"e","response_id":"r1",'
        '"item_id":"item_r1","output_index":0,"content_index":0,'
        f'"server_event_seq":{seq},"delta":"{b64}"}}'
    )
    return text


def _time(run: Callable[[int], object], events: int, rounds: int) -> float:
    results = []
    for _ in range(rounds):
        started = time.process_time()
        for i in range(events):
            run(i)
        results.append((time.process_time() - started) / events * 1e6)
    return statistics.median(results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    ns = parser.parse_args(argv)
    rows: list[tuple[str, Callable[[int], object]]] = []
    for label, ms, rate in (
        ("80 ms of 22.05 kHz PCM16 -> 24 kHz (Nemotron-like)", 80, 22050),
        ("80 ms of 24 kHz PCM16, as the engine wrote it", 80, 24000),
        ("1000 ms of 22.05 kHz PCM16 -> 24 kHz", 1000, 22050),
        ("1000 ms of 24 kHz PCM16, as the engine wrote it (MiniCPM-o-like)", 1000, 24000),
    ):
        for flavour in (Flavour.GA, Flavour.BETA):
            d = _dialect(flavour, ("pcm16", 16000), rate)
            chunk = _pcm16(ms, rate)
            entries = [_delta(i, chunk) for i in range(ns.events)]
            rows.append(
                (
                    f"engine -> {flavour.value} client: {label}",
                    lambda i, d=d, e=entries: d.to_client(e[i]),
                )
            )
    for label, engine_in in (
        ("40 ms of 24 kHz PCM16 -> PCM16 16 kHz (MiniCPM-o-like)", ("pcm16", 16000)),
        ("40 ms of 24 kHz PCM16 -> f32le 16 kHz (Nemotron-like)", ("pcm_f32le", 16000)),
        ("40 ms of 24 kHz PCM16, the engine's own format", ("pcm16", 24000)),
    ):
        d = _dialect(Flavour.GA, engine_in, 24000)
        text = json.dumps({"type": "input_audio_buffer.append", "audio": _pcm16(40, 24000)})
        rows.append((f"GA client -> engine: {label}", lambda i, d=d, t=text: d.from_client(t)))
    d = _dialect(Flavour.GA, ("pcm16", 16000), 24000)
    created = json.dumps(
        {
            "type": "response.created",
            "event_id": "e",
            "response_id": "r1",
            "response": {
                "id": "r1",
                "object": "realtime.response",
                "status": "in_progress",
                "status_details": None,
                "modalities": ["audio", "text"],
                "output": [],
                "metadata": {"duplex_event": {"epoch": 0}},
            },
        }
    )
    transcript = (
        '{"type":"response.output_audio_transcript.delta","event_id":"e","response_id":"r1",'
        '"item_id":"item_r1","output_index":0,"content_index":0,"delta":"Hello"}'
    )
    rows.append(
        ("engine -> GA client: response.created (reshaped)", lambda i: d.to_client(created))
    )
    rows.append(
        ("engine -> GA client: a transcript delta (as it is)", lambda i: d.to_client(transcript))
    )
    for label, run in rows:
        print(f"{label}: {_time(run, ns.events, ns.rounds):.1f} µs")


if __name__ == "__main__":
    main()
