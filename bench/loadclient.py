"""Load client: C realtime sessions against one URL, measured inside a window (picows + uvloop).

Each session asks for one endless response (``response.create``); the bench
engine then streams audio deltas stamped with their send time. Optionally each
session also sends stamped ``input_audio_buffer.append`` frames every
``--up-ms`` (up direction) and a stamped ``session.event_ack`` for every server
event (``--ack``), like a MiniCPM-o client.

Inside the window (after ``--warmup``) it counts events and bytes, computes the
one-way latency of every audio delta (receive time minus the engine's stamp;
both are CLOCK_MONOTONIC on this host), asks the engine (``--stats-url``) for
the up-direction figures, and reads the CPU time and RSS of the watched
processes (``--watch name=pid``) and each core's busy time from /proc. The CPU
that none of the benchmark's processes account for is reported as
``foreign_cpu_pct`` (other tenants of the machine).

``--stall N`` makes the first N sessions stop reading (their receive buffer
shrunk to ``--stall-rcvbuf``) from the start until ``--stall-for`` seconds
later; then they read again, and the client records how each ended (the last
event types and the close code).

Prints one JSON object on stdout. Bounded: every wait has a deadline and the
process exits by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import socket
import time
from collections import deque
from typing import Any

import uvloop
from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_connect

from bench.common import CLK_TCK, cpu_times, percentile, proc_cpu_seconds, proc_rss_bytes

_AUDIO = b'{"type":"response.output_audio.delta"'
_IN_RATE = 16_000


def _stamp(head: bytes) -> int:
    i = head.find(b'"event_id":"b')
    if i < 0:
        return 0
    j = head.find(b'"', i + 13)
    try:
        return int(head[i + 13 : j])
    except ValueError:
        return 0


class Run:
    """Shared state of all sessions of one client process."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.recording = False
        self.down_events = 0
        self.down_bytes = 0
        self.lat_ns: list[int] = []
        self.total_down = 0
        self.sessions: list[Session] = []
        self.loop = asyncio.get_running_loop()
        up_ms = ns.up_ms or 0
        if up_ms:
            raw = bytes(
                random.Random(1).getrandbits(8) for _ in range(_IN_RATE * up_ms // 1000 * 2)
            )
            self.append_tail = b'","audio":"' + base64.b64encode(raw) + b'"}'
        else:
            self.append_tail = b""


class Session(WSListener):  # type: ignore[misc]
    def __init__(self, run: Run, index: int, stalled: bool) -> None:
        self.run = run
        self.index = index
        self.stalled = stalled
        self.transport: WSTransport | None = None
        self.connected = asyncio.get_running_loop().create_future()
        self.closed = asyncio.get_running_loop().create_future()
        self.up_timer: asyncio.TimerHandle | None = None
        self.t0 = 0.0
        self.ticks = 0
        self.close_code: int | None = None
        self.tail: deque[str] = deque(maxlen=6)
        self.events = 0

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport
        if not self.connected.done():
            self.connected.set_result(True)

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self.transport = None
        if self.up_timer is not None:
            self.up_timer.cancel()
        if not self.closed.done():
            self.closed.set_result(True)

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        kind = frame.msg_type
        if kind is WSMsgType.TEXT:
            run = self.run
            self.events += 1
            size = frame.payload_size
            mv = frame.get_payload_as_memoryview()
            head = bytes(mv[:200])
            if head.startswith(_AUDIO):
                run.total_down += 1
                if run.recording and not self.stalled:
                    run.down_events += 1
                    run.down_bytes += size
                    stamp = _stamp(head)
                    if stamp:
                        run.lat_ns.append(time.monotonic_ns() - stamp)
                if self.stalled:
                    self.tail.append("audio")
            else:
                self._control(bytes(mv))
            ack_every = run.ns.ack_every
            if run.ns.ack or (
                ack_every and head.startswith(_AUDIO) and self.events % ack_every == 0
            ):
                seq = 0
                i = head.find(b'"server_event_seq":')
                if i >= 0:
                    j = i + 19
                    k = j
                    while k < len(head) and 48 <= head[k] <= 57:
                        k += 1
                    seq = int(head[j:k] or b"0")
                transport.send(
                    WSMsgType.TEXT,
                    b'{"type":"session.event_ack","event_id":"c%d","server_event_seq":%d}'
                    % (time.monotonic_ns(), seq),
                )
        elif kind is WSMsgType.CLOSE:
            self.close_code = int(frame.get_close_code())
            transport.send_close(frame.get_close_code())
            transport.disconnect()

    def _control(self, payload: bytes) -> None:
        try:
            event = json.loads(payload)
        except ValueError:
            return
        kind = event.get("type", "?")
        if not self.stalled:
            return
        if kind == "error":
            kind += ":" + str((event.get("error") or {}).get("code"))
        elif kind == "response.done":
            kind += ":" + str((event.get("response") or {}).get("status"))
        elif kind == "session.closed":
            kind += ":" + str(event.get("reason"))
        self.tail.append(kind)

    def send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.send(WSMsgType.TEXT, data)

    def start_up(self, up_ms: int) -> None:
        self.t0 = self.run.loop.time() + random.random() * up_ms / 1000
        self.up_timer = self.run.loop.call_at(self.t0, self._append)

    def _append(self) -> None:
        if self.transport is None:
            return
        self.ticks += 1
        self.send(
            b'{"type":"input_audio_buffer.append","event_id":"c%d' % time.monotonic_ns()
            + self.run.append_tail
        )
        self.up_timer = self.run.loop.call_at(
            self.t0 + self.ticks * self.run.ns.up_ms / 1000, self._append
        )


def _small_rcvbuf_factory(size: int) -> Any:
    def factory(parsed_url: Any) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        sock.setblocking(False)
        return sock

    return factory


async def _connect(run: Run, index: int, stalled: bool, sem: asyncio.Semaphore) -> Session | None:
    ns = run.ns
    async with sem:
        try:
            _, session = await ws_connect(
                lambda: Session(run, index, stalled),
                ns.url,
                websocket_handshake_timeout=30,
                max_frame_size=64 * 1024 * 1024,
                socket_factory=_small_rcvbuf_factory(ns.stall_rcvbuf) if stalled else None,
            )
        except Exception:  # noqa: BLE001 - counted as a failed session
            return None
        return session  # type: ignore[no-any-return]


class Control(WSListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.replies: asyncio.Queue[bytes] = asyncio.Queue()

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        if frame.msg_type is WSMsgType.TEXT:
            self.replies.put_nowait(frame.get_payload_as_bytes())


async def _ask(control: tuple[WSTransport, Control] | None, command: bytes) -> dict[str, Any]:
    if control is None:
        return {}
    control[0].send(WSMsgType.TEXT, command)
    reply = await asyncio.wait_for(control[1].replies.get(), 10)
    result: dict[str, Any] = json.loads(reply)
    return result


def _tcp_mem() -> int:
    """Kernel memory held by TCP sockets (all of them), bytes, from /proc/net/sockstat."""
    try:
        with open("/proc/net/sockstat") as f:
            for line in f:
                if line.startswith("TCP:"):
                    parts = line.split()
                    return int(parts[parts.index("mem") + 1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    return 0


def _watch(spec: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for item in spec:
        name, _, pids = item.partition("=")
        out[name] = [int(p) for p in pids.split(",") if p]
    return out


def _cpu(pids: list[int]) -> float:
    return sum(proc_cpu_seconds(p) for p in pids)


async def main_async(ns: argparse.Namespace) -> dict[str, Any]:
    run = Run(ns)
    deadline = time.monotonic() + ns.max_seconds
    watch = _watch(ns.watch)
    watch["client"] = [os.getpid()]
    control = None
    if ns.stats_url:
        control = await ws_connect(Control, ns.stats_url)
    sem = asyncio.Semaphore(ns.connect_concurrency)
    t_connect = time.monotonic()
    results = await asyncio.gather(
        *(_connect(run, i, i < ns.stall, sem) for i in range(ns.sessions))
    )
    sessions = [s for s in results if s is not None]
    connect_s = time.monotonic() - t_connect
    run.sessions = sessions
    for s in sessions:
        if s.stalled and s.transport is not None:
            s.transport.underlying_transport.pause_reading()
    start_msg = b'{"type":"response.create","event_id":"c0"}'
    for s in sessions:
        s.send(start_msg)
        if ns.up_ms:
            s.start_up(ns.up_ms)
    t_traffic = time.monotonic()
    await asyncio.sleep(ns.warmup)
    # -- window ---------------------------------------------------------------------
    await _ask(control, b"reset")
    cpu0 = {name: _cpu(pids) for name, pids in watch.items()}
    cores0 = cpu_times()
    rss_max = {name: sum(proc_rss_bytes(p) for p in pids) for name, pids in watch.items()}
    rss_start = dict(rss_max)
    tcp_start = tcp_max = _tcp_mem()
    run.recording = True
    t0 = time.monotonic()
    end = t0 + ns.window
    while True:
        now = time.monotonic()
        if now >= end:
            break
        await asyncio.sleep(min(0.25, end - now))
        for name, pids in watch.items():
            rss_max[name] = max(rss_max[name], sum(proc_rss_bytes(p) for p in pids))
        tcp_max = max(tcp_max, _tcp_mem())
    run.recording = False
    elapsed = time.monotonic() - t0
    cpu1 = {name: _cpu(pids) for name, pids in watch.items()}
    cores1 = cpu_times()
    engine = await _ask(control, b"get")
    # -- stalled sessions: read again and see how they end -----------------------------------
    stalled = [s for s in sessions if s.stalled]
    if stalled:
        resume_at = t_traffic + ns.stall_for
        while time.monotonic() < resume_at:
            await asyncio.sleep(0.25)
            for name, pids in watch.items():
                rss_max[name] = max(rss_max[name], sum(proc_rss_bytes(p) for p in pids))
            tcp_max = max(tcp_max, _tcp_mem())
        for s in stalled:
            if s.transport is not None:
                s.transport.underlying_transport.resume_reading()
        with_timeout = max(1.0, min(ns.stall_drain, deadline - time.monotonic()))
        await asyncio.wait([s.closed for s in stalled], timeout=with_timeout)
    # -- close everything --------------------------------------------------------------------
    for s in sessions:
        if s.transport is not None and not s.stalled:
            s.transport.send_close()
    await asyncio.wait(
        [s.closed for s in sessions], timeout=max(1.0, min(5.0, deadline - time.monotonic()))
    )
    for s in sessions:
        if s.transport is not None:
            s.transport.disconnect(graceful=False)
    if control is not None:
        control[0].disconnect()

    busy = sum(cores1[c][0] - cores0[c][0] for c in cores1)
    total = sum(cores1[c][1] - cores0[c][1] for c in cores1)
    ours = sum(cpu1[n] - cpu0[n] for n in cpu1)
    ncores = len(cores1)
    wall_cores = total / CLK_TCK if total else elapsed * ncores  # jiffies → core-seconds
    lat = run.lat_ns
    down = run.down_events
    up = int(engine.get("up_events", 0))
    out: dict[str, Any] = {
        "sessions": len(sessions),
        "failed": ns.sessions - len(sessions),
        "connect_s": round(connect_s, 3),
        "window_s": round(elapsed, 3),
        "down_events": down,
        "down_ev_s": down / elapsed,
        "down_mb_s": run.down_bytes / elapsed / 1e6,
        "down_samples": len(lat),
        "down_p50_ms": percentile(lat, 50) / 1e6 if lat else None,
        "down_p99_ms": percentile(lat, 99) / 1e6 if lat else None,
        "down_max_ms": max(lat) / 1e6 if lat else None,
        "up_events": up,
        "up_p50_ms": engine.get("up_p50_ms"),
        "up_p99_ms": engine.get("up_p99_ms"),
        "relayed_events": down + up,
        "cpu_s": {n: cpu1[n] - cpu0[n] for n in cpu1},
        "cpu_pct": {n: 100 * (cpu1[n] - cpu0[n]) / elapsed for n in cpu1},
        "rss_max": rss_max,
        "rss_start": rss_start,
        "tcp_mem_start": tcp_start,
        "tcp_mem_max": tcp_max,
        "core_busy_pct": {
            c: 100 * (cores1[c][0] - cores0[c][0]) / max(1.0, cores1[c][1] - cores0[c][1])
            for c in sorted(cores1)
        },
        "foreign_cpu_pct": max(0.0, 100 * (busy / CLK_TCK - ours) / max(1e-9, wall_cores)),
        "ncores": ncores,
    }
    if stalled:
        out["stalled"] = [
            {"close_code": s.close_code, "tail": list(s.tail), "events": s.events} for s in stalled
        ]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--sessions", "-c", type=int, default=10)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--up-ms", type=int, default=0, help="append period; 0 = no appends")
    p.add_argument("--ack", action="store_true", help="ack every server event")
    p.add_argument("--ack-every", type=int, default=0, help="ack every Nth audio delta (credits)")
    p.add_argument("--stats-url", default="")
    p.add_argument("--watch", action="append", default=[], metavar="NAME=PID[,PID]")
    p.add_argument("--connect-concurrency", type=int, default=64)
    p.add_argument("--stall", type=int, default=0, help="sessions that stop reading")
    p.add_argument("--stall-for", type=float, default=10.0)
    p.add_argument("--stall-rcvbuf", type=int, default=16 * 1024)
    p.add_argument("--stall-drain", type=float, default=10.0)
    p.add_argument("--max-seconds", type=float, default=120.0, help="hard bound on the run")
    return p


def main() -> None:
    ns = build_parser().parse_args()
    result = uvloop.run(asyncio.wait_for(main_async(ns), ns.max_seconds + 15))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
