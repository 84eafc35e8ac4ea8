"""Soak test: a real ``omni-sidecar serve`` under churn, watched for leaks.

    python -m bench.soak                                # quick: 0.5 min, 20 sessions
    python -m bench.soak --minutes 5 --sessions 200     # the release soak

Starts ``omni-sidecar serve`` with the simulator engine on loopback, then runs
``--sessions`` concurrent client loops until the time is up. Each loop
connects, runs a few responses and reconnects; on each response it may cancel
it after some audio, stall (stop reading for a while, like a slow client) or
vanish (reset the TCP connection mid-response). Every second the sidecar's RSS
and open fd count are sampled from ``/proc``. At the end the clients stop, the
sidecar is left idle for a few seconds and sampled again, then gets SIGTERM.

Checks on the way: the simulator stamps ``server_event_seq`` 1, 2, 3... so a
gap the proxy was not asked for (a cancel drops late audio on purpose) is
counted as an error, as is any session that ends without the documented close.

Writes ``bench/results/soak.md`` (parameters, counts, start/end/peak RSS and
fds) and ``bench/results/soak.png`` (RSS, fds and live sessions over time).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import orjson

from tests.aiohttp_private import transport_of
from tests.children import SidecarChild

__all__ = ["main"]

ROOT: Final = Path(__file__).resolve().parents[1]
RESULTS: Final = ROOT / "bench" / "results"
MIB: Final = 1024 * 1024
#: 100 ms of PCM16 silence at 16 kHz, base64.
SILENCE: Final = base64.b64encode(bytes(3200)).decode()
#: The engine: 200 ms chunks of 16 kHz audio in real time, 2 s responses.
SIMULATOR_ARGS: Final = (
    "--chunk-ms 200 --realtime-factor 1 --response-seconds 2 --sample-rate 16000"
)
AUDIO_DELTA: Final = "response.output_audio.delta"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat[stat.rfind(")") + 2 :].split()
                if fields[1] == str(pid) and fields[0] != "Z":
                    found.append(int(entry))
    return found


# -- the sidecar process ---------------------------------------------------------------------


class Sidecar(SidecarChild):
    """``omni-sidecar serve`` with the simulator engine, in its own process group."""

    def __init__(self, sessions: int, log_path: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_SIDECAR_")}
        env["OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS"] = SIMULATOR_ARGS
        super().__init__(
            "--max-sessions", str(max(64, sessions * 2)), "--heartbeat-interval", "5",
            "--drain-timeout", "2", "--log-level", "warning",
            base_env=env, log_path=log_path, cwd=ROOT, ready_timeout=60.0, stop_grace=30.0,
            name="omni-sidecar",
        )  # fmt: skip

    async def sessions_active(self, http: aiohttp.ClientSession) -> float:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with http.get(f"http://127.0.0.1:{self.admin_port}/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("omni_sidecar_sessions_active "):
                        return float(line.split()[1])
        return -1.0


# -- the clients -------------------------------------------------------------------------------


@dataclass
class Stats:
    connections: int = 0
    refused: int = 0
    responses: Counter[str] = field(default_factory=Counter)
    stalls: int = 0
    vanished: int = 0
    events: int = 0
    errors: list[str] = field(default_factory=list)

    def error(self, text: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(text)
        else:
            self.errors[-1] = f"... and more (last: {text})"


class Session:
    """One connection: sends responses, reads and checks their events."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, stats: Stats) -> None:
        self.ws = ws
        self.stats = stats
        self.last_seq = 0
        self.cancelled: set[str] = set()

    async def next_event(self, timeout: float = 30.0) -> dict[str, Any] | None:
        msg = await self.ws.receive(timeout=timeout)
        if msg.type is not aiohttp.WSMsgType.TEXT:
            return None
        event: dict[str, Any] = orjson.loads(msg.data)
        self.stats.events += 1
        seq = event.get("server_event_seq")
        if isinstance(seq, int):
            if seq != self.last_seq + 1 and not self.cancelled:
                self.stats.error(f"seq gap: {event['type']} {seq} after {self.last_seq}")
            self.last_seq = seq
        if event.get("type") == "error":
            self.stats.error(f"error event: {event.get('error')}")
        return event

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(orjson.dumps(event).decode())

    async def response(self, rng: random.Random) -> bool:
        """Run one response with a random twist. False when the connection is gone."""
        for request in (
            {"type": "input_audio_buffer.append", "audio": SILENCE},
            {"type": "input_audio_buffer.commit"},
            {"type": "response.create"},
        ):
            await self.send(request)
        roll = rng.random()
        cancel_after = rng.randint(1, 4) if roll < 0.25 else None
        stall_for = rng.uniform(0.5, 3.0) if 0.25 <= roll < 0.35 else None
        vanish_after = rng.randint(1, 5) if 0.35 <= roll < 0.40 else None
        audio = 0
        response_id: str | None = None
        while True:
            event = await self.next_event()
            if event is None:
                self.stats.error("connection closed mid-response")
                return False
            kind = event.get("type")
            response = event.get("response")
            response = response if isinstance(response, dict) else {}
            if kind == "response.created":
                created_id = response.get("id")
                response_id = created_id if isinstance(created_id, str) else None
            elif kind == AUDIO_DELTA:
                audio += 1
                if cancel_after is not None and audio == cancel_after and response_id:
                    self.cancelled.add(response_id)
                    await self.send({"type": "response.cancel", "response_id": response_id})
                if stall_for is not None and audio == 1:
                    self.stats.stalls += 1
                    await asyncio.sleep(stall_for)  # a slow client: stop reading for a while
                if vanish_after is not None and audio == vanish_after:
                    self.stats.vanished += 1
                    transport = transport_of(self.ws)
                    if transport is not None:
                        transport.abort()
                    return False
            elif kind == "response.done":
                status = str(response.get("status", "?"))
                self.stats.responses[status] += 1
                self.cancelled.discard(str(response_id))
                if cancel_after is not None and status not in ("cancelled", "completed"):
                    self.stats.error(f"cancelled response ended {status}")
                if cancel_after is None and status != "completed":
                    self.stats.error(f"response ended {status}")
                return True


async def client_loop(url: str, deadline: float, rng: random.Random, stats: Stats) -> None:
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                ws = await http.ws_connect(url, max_msg_size=0, heartbeat=None)
            except aiohttp.WSServerHandshakeError as exc:
                stats.refused += 1
                if exc.status not in (503, 429):
                    stats.error(f"handshake {exc.status}")
                await asyncio.sleep(rng.uniform(0.2, 1.0))
                continue
            except (aiohttp.ClientError, OSError) as exc:
                stats.error(f"connect: {exc!r}")
                await asyncio.sleep(1.0)
                continue
            stats.connections += 1
            session = Session(ws, stats)
            try:
                await session.send(
                    {"type": "session.update", "session": {"modalities": ["audio", "text"]}}
                )
                for _ in range(rng.randint(1, 5)):
                    if time.monotonic() >= deadline or not await session.response(rng):
                        break
                    await asyncio.sleep(rng.uniform(0.1, 1.5))  # think time
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                stats.error(f"session: {exc!r}")
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(5):
                        await ws.close()


# -- sampling and the report --------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    rss: int
    fds: int
    sessions: float


async def sampler(
    sidecar: Sidecar,
    http: aiohttp.ClientSession,
    t0: float,
    out: list[Sample],
    stop: asyncio.Event,
    interval: float,
) -> None:
    pid = sidecar.proc.pid
    while not stop.is_set():
        with contextlib.suppress(OSError):
            out.append(
                Sample(
                    time.monotonic() - t0,
                    rss_bytes(pid),
                    open_fds(pid),
                    await sidecar.sessions_active(http),
                )
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


def write_png(samples: list[Sample], load_end: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].plot(t, [s.rss / MIB for s in samples], color="tab:blue")
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(t, [s.fds for s in samples], color="tab:orange")
    axes[1].set_ylabel("open fds")
    axes[2].plot(t, [max(0.0, s.sessions) for s in samples], color="tab:green")
    axes[2].set_ylabel("live sessions")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.axvline(load_end, color="grey", linestyle="--", linewidth=1)
        ax.grid(True, alpha=0.3)
    axes[0].set_title("omni-sidecar soak (dashed: load stops)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_md(
    args: argparse.Namespace,
    stats: Stats,
    samples: list[Sample],
    load_end: float,
    exit_code: int | None,
    leftover: list[int],
    path: Path,
) -> str:
    under_load = [s for s in samples if s.t <= load_end]
    start, end = samples[0], samples[-1]
    peak_rss = max(samples, key=lambda s: s.rss)
    peak_fds = max(samples, key=lambda s: s.fds)
    responses = sum(stats.responses.values())
    lines = [
        "# Soak: omni-sidecar under churn",
        "",
        (
            f"`python -m bench.soak --minutes {args.minutes:g} --sessions {args.sessions}` "
            f"(seed {args.seed}); engine: simulator `{SIMULATOR_ARGS}`."
        ),
        "",
        (
            "Each client loop connects, runs 1-5 responses and reconnects; per response: 25 % "
            "cancel after 1-4 audio deltas, 10 % stall (stop reading 0.5-3 s), 5 % vanish "
            "(TCP reset mid-response). RSS and fds of the sidecar process (not its engine "
            "child) are sampled every second; *end* is after the load stopped and the "
            "sidecar sat idle."
        ),
        "",
        "| | RSS (MiB) | open fds |",
        "|---|---|---|",
        f"| start (idle, ready) | {start.rss / MIB:.1f} | {start.fds} |",
        (
            f"| peak | {peak_rss.rss / MIB:.1f} (at {peak_rss.t:.0f} s) | "
            f"{peak_fds.fds} (at {peak_fds.t:.0f} s) |"
        ),
        f"| end (idle again) | {end.rss / MIB:.1f} | {end.fds} |",
        "",
        (
            f"- load: {load_end:.0f} s, {args.sessions} concurrent client loops, "
            f"peak live sessions {max(s.sessions for s in under_load):.0f}"
        ),
        (
            f"- sessions run (connections accepted): {stats.connections}; refused "
            f"(503/429, retried): {stats.refused}"
        ),
        (
            f"- responses: {responses} ({dict(stats.responses)}); stalls: {stats.stalls}; "
            f"vanished clients: {stats.vanished}; events read: {stats.events}"
        ),
        f"- errors (unexpected gaps, error events, bad endings): {len(stats.errors)}",
        f"- sidecar exit status after SIGTERM: {exit_code}; processes left: {leftover or 'none'}",
    ]
    if stats.errors:
        lines += ["", "First errors:", ""] + [f"- `{e}`" for e in stats.errors[:20]]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


async def run(args: argparse.Namespace) -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    log_path = RESULTS / "soak-sidecar.log.tmp"
    sidecar = Sidecar(args.sessions, log_path)
    sidecar.start()
    stats = Stats()
    samples: list[Sample] = []
    stop_sampling = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as http:
            await sidecar.ready()
            await sidecar.sessions_active(http)  # the admin keep-alive socket exists from here
            t0 = time.monotonic()
            sampling = asyncio.ensure_future(
                sampler(sidecar, http, t0, samples, stop_sampling, args.sample_interval)
            )
            deadline = time.monotonic() + args.minutes * 60
            url = sidecar.ws_url
            loops = [
                asyncio.ensure_future(
                    client_loop(url, deadline, random.Random(rng.random()), stats)
                )
                for _ in range(args.sessions)
            ]
            await asyncio.gather(*loops)
            load_end = time.monotonic() - t0
            # Idle: every session gone, then a few more samples.
            idle_by = time.monotonic() + 30
            while await sidecar.sessions_active(http) != 0 and time.monotonic() < idle_by:
                await asyncio.sleep(0.5)
            await asyncio.sleep(args.settle)
            stop_sampling.set()
            await sampling
        engine_pids = children(sidecar.proc.pid)
        code = sidecar.stop()
        # None: it ignored SIGTERM for the whole grace and was killed.
        exit_code = None if code == -signal.SIGKILL else code
        leftover = [p for p in engine_pids if Path(f"/proc/{p}").exists()]
    finally:
        sidecar.kill()
    write_png(samples, load_end, RESULTS / "soak.png")
    text = write_md(args, stats, samples, load_end, exit_code, leftover, RESULTS / "soak.md")
    print(text)
    return 0 if exit_code == 0 and not leftover else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=0.5, help="load duration (default 0.5)")
    parser.add_argument("--sessions", type=int, default=20, help="concurrent clients (default 20)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sample-interval", type=float, default=1.0)
    parser.add_argument(
        "--settle", type=float, default=5.0, help="idle seconds before the end sample"
    )
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.sessions <= 0:
        parser.error("--minutes and --sessions must be positive")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
