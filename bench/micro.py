"""The sidecar's own Python per event, without sockets: ``python -m bench micro``.

A real ``Relay`` (its core, frame writer, timers and metrics observer) runs on
a null client transport and a null engine link, and is fed the frames the
benchmark engine and load client send: audio deltas down (Nemotron-like 80 ms,
MiniCPM-o-like 1000 ms), appends and acks up. What it measures is what the
sidecar adds on top of a bare relay's syscalls and frame parsing, with none of
the noise of a loaded 2-core box: a lever that moves this number moves the
real one, and this one can be measured in seconds.

It prints µs per engine event (``upstream_text`` through the client write) and
per client frame (the reader loop through the engine send), as the median of
``--rounds`` rounds. ``--dialect ga`` (or ``beta``) puts the OpenAI front door
in the relay (docs/design.md, OpenAI dialect), fed by a client at 24 kHz, with
the engine's output at ``--engine-output-rate`` (24000: no resampling of the
output; 22050: Nemotron's) and its input at ``--engine-input-rate`` (16000:
resampled; 24000: not). ``--calls`` prints instead how many Python function calls
each takes (``sys.setprofile``): a count that does not move with the machine's
load, for comparing two trees.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import statistics
import sys
import time
from collections.abc import Sized
from typing import Any, Self

import aiohttp
from prometheus_client import CollectorRegistry

from metrics.definitions import SidecarMetrics
from proxy.edge.state import session_settings
from proxy.session.client_side import ClientSide
from proxy.session.limits import RelayLimits
from proxy.session.registry import SessionRegistry
from proxy.session.relay import Relay
from proxy.session.upstream_link import UpstreamHandler
from proxy.settings import Settings

__all__ = ["main"]


class _NullTransport:
    def write(self, data: bytes) -> None:
        pass

    def writelines(self, parts: list[bytes]) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass


class _NullProtocol:
    def __init__(self) -> None:
        self.transport = _NullTransport()
        self.writing_paused = False


class _NullLink:
    backlog: Sized = ()
    write_paused = False
    on_drained: Any = None
    closed = False
    close_code: int | None = None

    def input_backlog(self) -> int:
        return 0

    async def run(self, handler: UpstreamHandler) -> bool:
        await asyncio.Event().wait()
        return True

    def send_nowait(self, text: str) -> None:
        pass

    async def wait_drained(self) -> None:
        pass

    async def ping(self) -> None:
        pass

    def abort(self) -> None:
        pass

    async def close(self) -> None:
        pass


class _ScriptedClient:
    """Client frames returned without suspending, like aiohttp's queue when it is full."""

    def __init__(self) -> None:
        self.frames: list[aiohttp.WSMessage] = []
        self.closed = False

    async def receive(self) -> aiohttp.WSMessage:
        if self.frames:
            return self.frames.pop()
        return aiohttp.WSMessage(aiohttp.WSMsgType.CLOSE, 1000, None)

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        return True


def _delta(rid: str, seq: int, b64: str) -> str:
    return (
        f'{{"type":"response.output_audio.delta","event_id":"b{time.monotonic_ns()}",'
        f'"response_id":"{rid}","item_id":"item_{rid}","output_index":0,"content_index":0,'
        f'"server_event_seq":{seq},"delta":"{b64}"}}'
    )


def _dialect(flavour: str) -> Any:
    if flavour == "none":
        return None
    from proxy.core.capabilities import EngineVersion
    from proxy.core.dialect import Flavour, OpenAIDialect, engine_dialect
    from proxy.session.openai_side import OpenAISide

    ids = iter(range(1 << 62))
    return OpenAISide(
        OpenAIDialect(
            Flavour(flavour), engine_dialect(EngineVersion.V0_30), lambda: f"event_{next(ids)}"
        )
    )


def _relay(settings: Settings, dialect: str = "none") -> tuple[Relay, _ScriptedClient]:
    metrics = SidecarMetrics(CollectorRegistry(), process_metrics=False)
    registry = SessionRegistry(metrics, max_total_pending_output_bytes=1 << 40)
    client = _ScriptedClient()
    link = _NullLink()
    side = ClientSide(
        client,
        _NullProtocol(),
        link,  # type: ignore[arg-type]
        write_buffer_bytes=settings.client_write_buffer_bytes,
        translator=_dialect(dialect),
    )
    relay = Relay(
        session_key="micro",
        side=side,
        upstream=link,  # type: ignore[arg-type]
        settings=session_settings(settings),
        observer=registry.observer("micro"),
        limits=RelayLimits(
            close_timeout=1.0,
            drain_timeout=1.0,
            upstream_close_timeout=1.0,
            write_buffer_bytes=settings.client_write_buffer_bytes,
            heartbeat_interval=settings.heartbeat_interval,
            client_idle_timeout=settings.client_idle_timeout,
        ),
    )
    registry.add(relay)
    return relay, client


class _CallCounter:
    """Counts Python function calls while on (``sys.setprofile``); C calls are not counted."""

    def __init__(self) -> None:
        self.calls = 0

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1

    def __enter__(self) -> Self:
        self.calls = 0
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


async def _round(
    chunk_ms: int,
    events: int,
    settings: Settings,
    *,
    count_calls: bool = False,
    dialect: str = "none",
    engine_rate: int = 24000,
    engine_input_rate: int = 16000,
) -> tuple[float, float]:
    relay, client = _relay(settings, dialect)
    b64 = base64.b64encode(b"\x01\x02" * (engine_rate * chunk_ms // 1000)).decode()
    client_rate = 16 if dialect == "none" else 24  # samples per ms: the engine's, or OpenAI's
    up_b64 = base64.b64encode(b"\x01\x02" * (client_rate * 80)).decode()
    relay.upstream_text(
        '{"type":"session.created","event_id":"b0","session":{"id":"s1","audio":'
        f'{{"input":{{"format":"pcm16","sample_rate_hz":{engine_input_rate}}},'
        f'"output":{{"format":"pcm16","sample_rate_hz":{engine_rate}}}}}}}}}'
    )
    rid = "resp_1"
    relay.upstream_text(
        f'{{"type":"response.created","event_id":"b0","response_id":"{rid}",'
        f'"response":{{"id":"{rid}","status":"in_progress"}}}}'
    )
    texts = [_delta(rid, i + 1, b64) for i in range(events)]
    counter = _CallCounter()
    started = time.perf_counter()
    if count_calls:
        with counter:
            for text in texts:
                relay.upstream_text(text)
        down = counter.calls / events
    else:
        for text in texts:
            relay.upstream_text(text)
        down = (time.perf_counter() - started) / events
    appends = [
        aiohttp.WSMessage(
            aiohttp.WSMsgType.TEXT,
            f'{{"type":"input_audio_buffer.append","event_id":"c{time.monotonic_ns()}",'
            f'"audio":"{up_b64}"}}',
            None,
        )
        for _ in range(events)
    ]
    client.frames = appends[::-1]
    reader = functools.partial(relay.side.reader.run, relay)
    started = time.perf_counter()
    if count_calls:
        with counter:
            await reader()
        up = counter.calls / events
    else:
        await reader()
        up = (time.perf_counter() - started) / events * 1e6
        down *= 1e6
    relay.timers.cancel()
    return down, up


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--playback-ack", default="auto", choices=("auto", "off", "always"))
    parser.add_argument("--dialect", default="none", choices=("none", "ga", "beta"))
    parser.add_argument("--engine-output-rate", type=int, default=24000)
    parser.add_argument("--engine-input-rate", type=int, default=16000)
    parser.add_argument(
        "--calls", action="store_true", help="count Python calls per event instead of timing"
    )
    ns = parser.parse_args(argv)
    # The frame and input-audio rate limits are per-second budgets; this run sends far faster.
    settings = Settings(
        playback_ack=ns.playback_ack, max_client_frame_rate=0.0, max_input_audio_rate=0.0
    )
    for label, chunk_ms in (("nemotron (80 ms deltas)", 80), ("minicpmo (1000 ms deltas)", 1000)):
        downs, ups = [], []
        for _ in range(ns.rounds):
            down, up = asyncio.run(
                _round(
                    chunk_ms,
                    ns.events,
                    settings,
                    count_calls=ns.calls,
                    dialect=ns.dialect,
                    engine_rate=ns.engine_output_rate,
                    engine_input_rate=ns.engine_input_rate,
                )
            )
            downs.append(down)
            ups.append(up)
        unit = "Python calls" if ns.calls else "µs"
        print(
            f"{label}: engine event {statistics.median(downs):.2f} {unit}, "
            f"client frame {statistics.median(ups):.2f} {unit} (median of {ns.rounds})"
        )


if __name__ == "__main__":
    main()
