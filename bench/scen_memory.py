"""Scenario ``memory``: RSS per idle and per streaming session, sidecar against a bare relay.

For each path (``sidecar``: ``omni-sidecar serve`` with default settings;
``bare``: :mod:`bench.bare_relay`, aiohttp forwarding frames only), both in
front of the bench engine and kept up for the whole scenario, and for each
session count N of ``--memory-sessions`` (ascending, in the same process):

1. **baseline**: the proxy's RSS before its first session;
2. **idle**: N sessions connected, each has received ``session.created``
   through the proxy, the engine holds N sessions (the proxy's engine links are
   open), nothing is streaming; 0.5 s settle, then RSS is sampled every 0.25 s
   for ``--memory-hold`` seconds;
3. **streaming**: the same N sessions each send ``response.create`` and an
   80 ms ``input_audio_buffer.append`` every 80 ms, and the engine streams an
   80 ms delta every 80 ms (the Nemotron-like profile of ``realtime-latency``);
   once every session has received its first audio delta, RSS is sampled the
   same way for ``--memory-hold`` seconds;
4. the sessions close; the next N starts once the engine holds none.

The figure per phase is the **median** of its samples (the max is in the
JSON). Per session: (RSS − baseline) ÷ N, in KiB. RSS is the proxy process's
resident set (``/proc/PID/statm``): kernel socket buffers are not in it. The
sessions come from a small picows client (this module, run as
``python -m bench.scen_memory``) on the load core, driven phase by phase over
its stdin/stdout. A delivered % below 100 means the path did not keep up with
the streaming pace (its RSS then includes the backlog it holds).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO, Final

import aiohttp

from bench.common import (
    LOAD_CPU,
    ROOT,
    child_env,
    cpu_prefix,
    log_path_for,
    median,
    proc_rss_bytes,
    python,
    renice_autogroup,
)
from bench.report import Report, bars, figure
from bench.runner import log
from bench.scen_realtime import PROFILES
from bench.stack import Stack

__all__ = ["PATHS", "memory"]

#: The paths measured, by their :class:`~bench.stack.Stack` names.
PATHS: Final = ("sidecar", "bare")
LABELS: Final = {"sidecar": "sidecar", "bare": "bare aiohttp relay"}
STREAM: Final = PROFILES["nemotron"]
#: Audio per engine delta at that pace (its ``chunk_ms``): one delta due per session per period.
DELTA_MS: Final = int(STREAM["query"].partition("chunk_ms=")[2])
SAMPLE_EVERY: Final = 0.25
SETTLE: Final = 0.5
KIB: Final = 1024
MIB: Final = 1024 * 1024


# -- orchestrator ----------------------------------------------------------------------------


def _rss(st: Stack, path: str) -> int:
    return sum(proc_rss_bytes(p) for p in st.proxy_pids(path))


async def _samples(st: Stack, path: str, hold: float) -> dict[str, float]:
    """RSS every ``SAMPLE_EVERY`` s for ``hold`` s (at least 3 samples): median, max, count."""
    values: list[float] = []
    end = time.monotonic() + hold
    while True:
        values.append(float(_rss(st, path)))
        if len(values) >= 3 and time.monotonic() >= end:
            break
        await asyncio.sleep(SAMPLE_EVERY)
    return {"median": median(values), "max": max(values), "samples": len(values)}


class _Engine:
    """The bench engine's ``/stats`` socket: how many sessions it holds."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws

    async def sessions(self) -> int:
        await self.ws.send_str("get")
        reply = await self.ws.receive(timeout=10)
        return int(json.loads(reply.data)["sessions"])

    async def wait_sessions(self, count: int, timeout: float) -> int:
        """Until the engine holds ``count`` sessions (or ``timeout``); the last count."""
        end = time.monotonic() + timeout
        held = await self.sessions()
        while held != count and time.monotonic() < end:
            await asyncio.sleep(0.1)
            held = await self.sessions()
        return held


def _open_log(path: Path) -> BinaryIO:
    return path.open("wb")


class _Client:
    """The session client as a child process, one JSON line per phase."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    @classmethod
    async def start(cls, url: str, sessions: int) -> _Client:
        log_path = log_path_for("memclient")
        argv = [
            *cpu_prefix(LOAD_CPU), python(), "-m", "bench.scen_memory",
            "--url", url, "-c", str(sessions), "--up-ms", str(STREAM["up_ms"]),
            "--max-seconds", str(int(300 + sessions / 5)),
        ]  # fmt: skip
        with _open_log(log_path) as err:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                cwd=ROOT,
                env=child_env(),
                start_new_session=True,
            )
        renice_autogroup(proc.pid)
        return cls(proc, log_path)

    async def expect(self, phase: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            line = b""
        if not line:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"memory client: no '{phase}' line; its log ends:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("phase") != phase:
            raise RuntimeError(f"memory client: expected '{phase}', got {reply}")
        return reply

    async def say(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()

    async def finish(self) -> None:
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def _one(st: Stack, engine: _Engine, path: str, n: int, hold: float) -> dict[str, Any]:
    """Idle, then streaming, with ``n`` sessions through ``path``."""
    before = _rss(st, path)
    client = await _Client.start(st.url(path, STREAM["query"]), n)
    try:
        idle = await client.expect("idle", 60 + n / 10)
        held = await engine.wait_sessions(idle["created"], 30)
        await asyncio.sleep(SETTLE)
        idle_rss = await _samples(st, path, hold)
        await client.say("stream")
        streaming = await client.expect("streaming", 60)
        stream_rss = await _samples(st, path, hold)
        await client.say("close")
        stats = await client.expect("stats", 30)
        await client.finish()
    finally:
        if client.proc.returncode is None:
            client.proc.kill()
            await client.proc.wait()
    left = await engine.wait_sessions(0, 30)
    await asyncio.sleep(SETTLE)
    expected = stats["open"] * stats["window_s"] * 1000 / DELTA_MS
    return {
        "sessions": n,
        "rss_before": before,
        "idle": {**idle, "engine_sessions": held, "rss": idle_rss},
        "streaming": {**streaming, **stats, "phase": "streaming", "rss": stream_rss},
        "delivered_pct": 100 * stats["audio"] / expected if expected else None,
        "engine_sessions_after": left,
        "rss_after_close": _rss(st, path),
    }


async def _path(st: Stack, path: str, counts: list[int], hold: float) -> dict[str, Any]:
    # The engine's /stats socket does not answer a close frame: do not wait for one.
    quick_close = aiohttp.ClientWSTimeout(ws_close=0.5)
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(st.stats_url(), timeout=quick_close) as ws,
    ):
        engine = _Engine(ws)
        await engine.wait_sessions(0, 30)
        baseline = await _samples(st, path, min(hold, 2.0))
        log(f"memory {path}: baseline {baseline['median'] / MIB:.1f} MiB")
        runs = []
        for n in counts:
            st.check_alive()
            run = await _one(st, engine, path, n, hold)
            # Per session the path held: connected and created (idle), still open (streaming).
            held = {"idle": run["idle"]["created"], "streaming": run["streaming"]["open"]}
            for phase, count in held.items():
                rss = run[phase]["rss"]["median"]
                run[phase]["kib_per_session"] = (rss - baseline["median"]) / KIB / max(1, count)
            runs.append(run)
            log(
                f"  {path:8s} c={n:<5d} idle {run['idle']['rss']['median'] / MIB:6.1f} MiB "
                f"{run['idle']['kib_per_session']:7.1f} KiB/session, streaming "
                f"{run['streaming']['rss']['median'] / MIB:6.1f} MiB "
                f"{run['streaming']['kib_per_session']:7.1f} KiB/session, delivered "
                f"{run['delivered_pct'] or 0:5.1f} %"
                + (f"  FAILED {run['idle']['failed']}" if run["idle"]["failed"] else "")
            )
    return {"baseline": baseline, "runs": runs}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}×" if b > 0 else "–"


def memory(ns: argparse.Namespace) -> dict[str, Any]:
    from proxy.native import CORE_BUILD

    counts = sorted({int(c) for c in ns.memory_sessions.split(",")})
    hold = float(ns.memory_hold)
    report = Report("memory", "memory: RSS per idle and per streaming session")
    results: dict[str, Any] = {}
    with Stack(configs=PATHS) as st:
        for path in PATHS:
            results[path] = asyncio.run(_path(st, path, counts, hold))
    report.raw["args"] = {"sessions": counts, "hold_s": hold, "stream": STREAM}
    report.raw["core_build"] = CORE_BUILD
    report.raw["paths"] = results
    report.para(
        "Each path runs in one process for the whole scenario (no restart between session "
        "counts; counts ascending). *Baseline*: the proxy's RSS before its first session. "
        "*Idle*: N sessions connected, `session.created` received by every one and N engine "
        "sessions open, nothing streaming. *Streaming*: the same N sessions at the Nemotron-like "
        f"pace (`response.create`, then one {DELTA_MS} ms audio delta down and one "
        f"{STREAM['up_ms']} ms append up every {DELTA_MS} ms per session), from every session's "
        "first delta on. RSS (`/proc/PID/statm`, the proxy process; kernel socket buffers are "
        f"not in it) is sampled every {SAMPLE_EVERY:g} s for {hold:g} s once the phase's "
        f"condition holds ({SETTLE:g} s settle for idle); the table shows the **median** of "
        "those samples. KiB/session = (RSS − baseline) ÷ N, N = the sessions the path held "
        "(created; streaming: still open); at N = 1 it includes whatever the proxy sets up on "
        "its first session. *Delivered %*: audio deltas received ÷ deltas due at the pace during the "
        "streaming phase (below 100: the path fell behind and its RSS includes that backlog). "
        f"The sidecar ran this checkout's {CORE_BUILD} build."
    )
    report.para(
        "Baseline / after the last sessions closed: "
        + "; ".join(
            f"{LABELS[p]} {results[p]['baseline']['median'] / MIB:.1f} / "
            f"{results[p]['runs'][-1]['rss_after_close'] / MIB:.1f} MiB"
            for p in PATHS
        )
        + "."
    )
    rows = []
    for path in PATHS:
        for run in results[path]["runs"]:
            rows.append(
                [
                    LABELS[path],
                    run["sessions"],
                    run["idle"]["rss"]["median"] / MIB,
                    run["idle"]["kib_per_session"],
                    run["streaming"]["rss"]["median"] / MIB,
                    run["streaming"]["kib_per_session"],
                    run["delivered_pct"],
                ]
            )
    report.table(
        [
            "path",
            "sessions",
            "idle RSS MiB",
            "idle KiB/session",
            "streaming RSS MiB",
            "streaming KiB/session",
            "delivered %",
        ],
        rows,
    )
    failed = {p: sum(r["idle"]["failed"] for r in results[p]["runs"]) for p in PATHS}
    if any(failed.values()):
        report.para(
            "Sessions that failed to connect (not in N): "
            + ", ".join(f"{LABELS[p]} {f}" for p, f in failed.items())
            + "."
        )
    top = counts[-1]
    side = results["sidecar"]["runs"][-1]
    bare = results["bare"]["runs"][-1]
    summary = {
        p: {
            str(r["sessions"]): {
                "idle_mib": r["idle"]["rss"]["median"] / MIB,
                "idle_kib_per_session": r["idle"]["kib_per_session"],
                "streaming_mib": r["streaming"]["rss"]["median"] / MIB,
                "streaming_kib_per_session": r["streaming"]["kib_per_session"],
                "delivered_pct": r["delivered_pct"],
            }
            for r in results[p]["runs"]
        }
        for p in PATHS
    }
    report.raw["summary"] = summary
    si, ss = side["idle"]["kib_per_session"], side["streaming"]["kib_per_session"]
    bi, bs = bare["idle"]["kib_per_session"], bare["streaming"]["kib_per_session"]
    report.para(
        f"At {top} sessions the sidecar holds {si:.1f} KiB per idle session and {ss:.1f} KiB "
        f"per streaming session, the bare aiohttp relay {bi:.1f} and {bs:.1f} KiB "
        f"({_ratio(si, bi)} and {_ratio(ss, bs)} the bare relay's)."
    )
    fig, axes = figure(ncols=2, width=5.5)
    groups = [str(n) for n in counts]
    for ax, phase in zip(axes[0], ("idle", "streaming"), strict=True):
        bars(
            ax,
            groups,
            {LABELS[p]: [r[phase]["kib_per_session"] for r in results[p]["runs"]] for p in PATHS},
            ylabel="KiB per session (RSS − baseline) ÷ N",
            title=f"{phase} sessions",
            log=True,
        )
        ax.set_xlabel("sessions")
    command = "python -m bench memory"
    if ns.memory_sessions != "1,100,1000":
        command += f" --memory-sessions {ns.memory_sessions}"
    if hold != 5.0:
        command += f" --memory-hold {hold:g}"
    path = report.write(command, fig)
    log(f"wrote {path}")
    return summary


# -- the session client (``python -m bench.scen_memory``) ---------------------------------------

_AUDIO: Final = b'{"type":"response.output_audio.delta"'
_IN_RATE: Final = 16_000


def _client_main(ns: argparse.Namespace) -> None:
    """N sessions, phase by phase: connect (idle), ``stream``, ``close``; JSON lines on stdout."""
    import uvloop
    from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_connect

    raw = bytes(random.Random(1).getrandbits(8) for _ in range(_IN_RATE * ns.up_ms // 1000 * 2))
    append_tail = b'","audio":"' + base64.b64encode(raw) + b'"}'
    counts = {"audio": 0, "appends": 0}

    class Session(WSListener):  # type: ignore[misc]
        def __init__(self) -> None:
            loop = asyncio.get_running_loop()
            self.loop = loop
            self.transport: WSTransport | None = None
            self.created = loop.create_future()
            self.first_audio = loop.create_future()
            self.closed = loop.create_future()
            self.timer: asyncio.TimerHandle | None = None
            self.t0 = 0.0
            self.ticks = 0

        def on_ws_connected(self, transport: WSTransport) -> None:
            self.transport = transport

        def on_ws_disconnected(self, transport: WSTransport) -> None:
            self.transport = None
            if self.timer is not None:
                self.timer.cancel()
            if not self.closed.done():
                self.closed.set_result(True)

        def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
            if frame.msg_type is WSMsgType.TEXT:
                payload = frame.get_payload_as_memoryview()
                if bytes(payload[: len(_AUDIO)]) == _AUDIO:
                    counts["audio"] += 1
                    if not self.first_audio.done():
                        self.first_audio.set_result(True)
                elif not self.created.done():
                    try:
                        kind = json.loads(bytes(payload)).get("type")
                    except (ValueError, AttributeError):
                        kind = None
                    if kind == "session.created":
                        self.created.set_result(True)
            elif frame.msg_type is WSMsgType.CLOSE:
                transport.send_close(frame.get_close_code())
                transport.disconnect()

        def send(self, data: bytes) -> None:
            if self.transport is not None:
                self.transport.send(WSMsgType.TEXT, data)

        def start_up(self) -> None:
            self.t0 = self.loop.time() + random.random() * ns.up_ms / 1000
            self.timer = self.loop.call_at(self.t0, self._append)

        def _append(self) -> None:
            if self.transport is None:
                return
            self.ticks += 1
            counts["appends"] += 1
            self.send(
                b'{"type":"input_audio_buffer.append","event_id":"c%d' % time.monotonic_ns()
                + append_tail
            )
            self.timer = self.loop.call_at(self.t0 + self.ticks * ns.up_ms / 1000, self._append)

    def say(body: dict[str, Any]) -> None:
        print(json.dumps(body), flush=True)

    async def command() -> str:
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        return line.strip() or "close"  # EOF: the orchestrator is gone

    async def connect(sem: asyncio.Semaphore) -> Any:
        async with sem:
            try:
                _, session = await ws_connect(
                    Session, ns.url, websocket_handshake_timeout=30, max_frame_size=64 * MIB
                )
            except Exception:  # noqa: BLE001 - counted as a failed session
                return None
            return session

    async def run() -> None:
        sem = asyncio.Semaphore(ns.connect_concurrency)
        t = time.monotonic()
        found = await asyncio.gather(*(connect(sem) for _ in range(ns.sessions)))
        sessions = [s for s in found if s is not None]
        if sessions:
            await asyncio.wait([s.created for s in sessions], timeout=30)
        say(
            {
                "phase": "idle",
                "sessions": len(sessions),
                "failed": ns.sessions - len(sessions),
                "created": sum(1 for s in sessions if s.created.done()),
                "connect_s": round(time.monotonic() - t, 3),
            }
        )
        if await command() == "stream":
            t = time.monotonic()
            for s in sessions:
                s.send(b'{"type":"response.create","event_id":"c0"}')
                s.start_up()
            if sessions:
                await asyncio.wait([s.first_audio for s in sessions], timeout=30)
            say(
                {
                    "phase": "streaming",
                    "first_audio": sum(1 for s in sessions if s.first_audio.done()),
                    "first_audio_s": round(time.monotonic() - t, 3),
                }
            )
            counts["audio"] = counts["appends"] = 0
            t = time.monotonic()
            await command()
            say(
                {
                    "phase": "stats",
                    "window_s": round(time.monotonic() - t, 3),
                    "audio": counts["audio"],
                    "appends": counts["appends"],
                    "open": sum(1 for s in sessions if s.transport is not None),
                }
            )
        for s in sessions:
            if s.transport is not None:
                s.transport.send_close()
        if sessions:
            await asyncio.wait([s.closed for s in sessions], timeout=10)
        for s in sessions:
            if s.transport is not None:
                s.transport.disconnect(graceful=False)

    uvloop.run(asyncio.wait_for(run(), ns.max_seconds))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.scen_memory",
        description="the memory scenario's session client (run by `python -m bench memory`)",
    )
    p.add_argument("--url", required=True)
    p.add_argument("--sessions", "-c", type=int, default=1)
    p.add_argument("--up-ms", type=int, default=STREAM["up_ms"])
    p.add_argument("--connect-concurrency", type=int, default=100)
    p.add_argument("--max-seconds", type=float, default=300.0, help="hard bound on the run")
    _client_main(p.parse_args(argv))


if __name__ == "__main__":
    main()
