"""Churn soak: RSS of the sidecar and of a bare relay over thousands of short sessions.

    python -m bench.churn                                   # 10,000 sessions, rounds of 1,000
    python -m bench.churn --sessions 2000 --round 500       # a quicker look

A small engine (this module, ``--engine``) answers each session quickly and,
asked with ``x.big``, sends one very large audio delta. Both paths, the
sidecar (``omni-sidecar serve --upstream``) and the bare aiohttp relay
(``bench/bare_relay.py``), are run in turn in front of it: ``--sessions``
short sessions (update, one response, close), ``--concurrency`` at a time,
with the path's RSS sampled after every ``--round``; then one session asks
for ``--big-frames`` frames of ``--big-mb`` MB and the RSS is sampled after
them and once more after a settle. Writes ``bench/results/churn.md`` and
``churn.json`` (docs/performance.md, Memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

from tests.children import ChildProcess, SidecarChild, free_port

__all__ = ["main"]

ROOT: Final = Path(__file__).resolve().parents[1]
RESULTS: Final = ROOT / "bench" / "results"
MIB: Final = 1024 * 1024
_DELTA: Final = "A" * 3200  # 2,400 bytes of base64 audio per small delta


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# -- the engine ------------------------------------------------------------------------------


async def _engine_session(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(max_msg_size=0)
    await ws.prepare(request)
    seq = 0

    async def send(body: dict[str, Any]) -> None:
        nonlocal seq
        seq += 1
        await ws.send_str(orjson.dumps({**body, "server_event_seq": seq}).decode())

    await ws.send_str('{"type":"session.created","session":{"id":"churn"}}')
    async for msg in ws:
        if msg.type is not aiohttp.WSMsgType.TEXT:
            break
        event = orjson.loads(msg.data)
        kind = event.get("type")
        if kind == "session.update":
            await send({"type": "session.updated", "session": {"id": "churn"}})
        elif kind == "response.create":
            rid = f"resp_{seq}"
            await send({"type": "response.created", "response": {"id": rid}, "response_id": rid})
            for _ in range(3):
                await send(
                    {"type": "response.output_audio.delta", "response_id": rid, "delta": _DELTA}
                )
            done = {"id": rid, "status": "completed"}
            await send({"type": "response.done", "response_id": rid, "response": done})
        elif kind == "x.big":
            size = int(event.get("mb", 50)) * 1_000_000
            rid = f"resp_big_{seq}"
            head = '{"type":"response.output_audio.delta","response_id":"' + rid + '","delta":"'
            await ws.send_str(head + "A" * size + '"}')
        elif kind == "session.close":
            await send({"type": "session.closed", "reason": "client_close"})
            break
    await ws.close()
    return ws


def serve_engine(port: int) -> None:
    app = web.Application()
    app.router.add_get("/{tail:.*}", _engine_session)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- the client --------------------------------------------------------------------------------


async def _one_session(http: aiohttp.ClientSession, url: str) -> None:
    async with http.ws_connect(url, max_msg_size=0) as ws:
        await ws.send_str('{"type":"session.update","session":{"modalities":["audio"]}}')
        await ws.send_str('{"type":"response.create"}')
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT and '"response.done"' in msg.data:
                break
        await ws.send_str('{"type":"session.close"}')
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                break


async def _round(url: str, sessions: int, concurrency: int) -> int:
    failures = 0
    gate = asyncio.Semaphore(concurrency)

    async def guarded(http: aiohttp.ClientSession) -> None:
        nonlocal failures
        async with gate:
            try:
                async with asyncio.timeout(30):
                    await _one_session(http, url)
            except (aiohttp.ClientError, TimeoutError):
                failures += 1

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(guarded(http) for _ in range(sessions)))
    return failures


async def _big_frames(url: str, frames: int, mb: int) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        for _ in range(frames):
            await ws.send_str(orjson.dumps({"type": "x.big", "mb": mb}).decode())
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.TEXT and len(msg.data) > mb * 1_000_000:
                    break
        await ws.send_str('{"type":"session.close"}')


async def _measure(url: str, pid: int, ns: argparse.Namespace) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    start = rss_bytes(pid)
    done = failures = 0
    while done < ns.sessions:
        count = min(ns.round, ns.sessions - done)
        t = time.monotonic()
        failures += await _round(url, count, ns.concurrency)
        done += count
        await asyncio.sleep(ns.settle)
        samples.append(
            {"sessions": done, "rss": rss_bytes(pid), "seconds": round(time.monotonic() - t, 1)}
        )
        print(f"[churn] {done} sessions: {samples[-1]['rss'] / MIB:.1f} MiB", file=sys.stderr)
    before_big = rss_bytes(pid)
    await _big_frames(url, ns.big_frames, ns.big_mb)
    after_big = rss_bytes(pid)
    await asyncio.sleep(ns.settle)
    settled = rss_bytes(pid)
    return {
        "start": start,
        "rounds": samples,
        "failures": failures,
        "before_big": before_big,
        "after_big": after_big,
        "after_big_settled": settled,
    }


def _paths(engine_url: str, ns: argparse.Namespace) -> list[tuple[str, ChildProcess]]:
    relay_port = free_port()
    bare = ChildProcess(
        "bare relay",
        [
            sys.executable,
            "-m",
            "bench.bare_relay",
            "--port",
            str(relay_port),
            "--upstream",
            engine_url,
        ],
        ready_port=relay_port,
        cwd=ROOT,
    )
    bare.port = relay_port  # type: ignore[attr-defined]
    sidecar = SidecarChild(
        "--upstream",
        engine_url,
        "--max-sessions",
        "0",
        "--max-pending-output-bytes",
        str(64 * MIB),
        "--max-total-pending-output-bytes",
        str(1024 * MIB),
        cwd=ROOT,
    )
    return [("sidecar", sidecar), ("bare relay", bare)]


async def run(ns: argparse.Namespace) -> dict[str, Any]:
    engine_port = free_port()
    engine = ChildProcess(
        "churn engine",
        [sys.executable, "-m", "bench.churn", "--engine", str(engine_port)],
        ready_port=engine_port,
        cwd=ROOT,
    )
    results: dict[str, Any] = {"args": vars(ns)}
    async with engine:
        engine_url = f"ws://127.0.0.1:{engine_port}"
        for name, child in _paths(engine_url, ns):
            async with child:
                port = child.port
                pid = child.pid
                url = f"ws://127.0.0.1:{port}/v1/realtime"
                print(f"[churn] {name} (pid {pid})", file=sys.stderr)
                results[name] = await _measure(url, pid, ns)
    return results


def write_results(results: dict[str, Any]) -> str:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "churn.json").write_text(json.dumps(results, indent=2))
    names = [n for n in ("sidecar", "bare relay") if n in results]
    lines = [
        "# churn: RSS over short sessions and very large frames",
        "",
        "`python -m bench.churn " + " ".join(_argv_of(results["args"])) + "`",
        "",
        "| sessions | " + " | ".join(f"{n} RSS (MiB)" for n in names) + " |",
        "|---|" + "---|" * len(names),
        "| 0 (start) | " + " | ".join(f"{results[n]['start'] / MIB:.1f}" for n in names) + " |",
    ]
    for i, sample in enumerate(results[names[0]]["rounds"]):
        cells = [f"{results[n]['rounds'][i]['rss'] / MIB:.1f}" for n in names]
        lines.append(f"| {sample['sessions']} | " + " | ".join(cells) + " |")
    args = results["args"]
    for key, label in (
        ("before_big", "before the large frames"),
        ("after_big", f"after {args['big_frames']} x {args['big_mb']} MB frames"),
        ("after_big_settled", f"{args['settle']:g} s later"),
    ):
        lines.append(
            f"| {label} | " + " | ".join(f"{results[n][key] / MIB:.1f}" for n in names) + " |"
        )
    lines.append("")
    for n in names:
        rounds = results[n]["rounds"]
        first, last = rounds[0]["rss"], rounds[-1]["rss"]
        lines.append(
            f"- {n}: {rounds[-1]['sessions']} sessions, failures {results[n]['failures']}; "
            f"RSS after the last round minus after the first: {(last - first) / MIB:+.1f} MiB; "
            f"after the large frames minus the start: "
            f"{(results[n]['after_big_settled'] - results[n]['start']) / MIB:+.1f} MiB"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / "churn.md").write_text(text)
    return text


def _argv_of(args: dict[str, Any]) -> list[str]:
    flags = ("sessions", "round", "concurrency", "big_frames", "big_mb", "settle")
    return [f"--{k.replace('_', '-')} {args[k]}" for k in flags]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.churn", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--round", type=int, default=1_000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--big-frames", type=int, default=10)
    parser.add_argument("--big-mb", type=int, default=50)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before each sample")
    parser.add_argument("--engine", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.engine is not None:
        serve_engine(ns.engine)
        return 0
    print(write_results(asyncio.run(run(ns))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
