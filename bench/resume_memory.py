"""What the resume journal costs in RSS: ``python -m bench.resume_memory`` (~20 s).

N real ``Relay`` objects (core, frame writer, observer; bench/micro.py's null
client transport and engine link) whose engine offers resume stream audio to
clients that read everything and never send ``session.event_ack``: every
session's journal fills to ``resume_journal_bytes``. Each configuration runs
in a fresh child process: the same sessions with ``client_resume_grace`` 0
(no journal) and 30 s; the figure is the child's RSS after the stream less
its RSS before it, and the difference per session is what the journal costs
(docs/design.md, Memory). It must stay within ``resume_journal_bytes``.

``--tree PATH`` measures another checkout (e.g. the commit before the journal
kept frame text only: ``git worktree add ../before COMMIT``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _child(sessions: int, grace: float, journal: int, ticks: int, audio_chars: int) -> None:
    import base64

    from bench.micro import _relay
    from proxy.settings import Settings

    settings = Settings(
        playback_ack="off",
        client_resume_grace=grace,
        resume_journal_bytes=journal,
        max_client_frame_rate=0.0,
        max_input_audio_rate=0.0,
    )
    created = {
        "type": "session.created",
        "event_id": "b0",
        "server_event_seq": 1,
        "resume_token": "bench-token",
        "session": {"id": "s1", "capabilities": {"supports_session_resume": True}},
    }
    relays = []
    for _ in range(sessions):
        relay, _client = _relay(settings)
        relay.upstream_text(json.dumps(created, separators=(",", ":")))
        relays.append(relay)
    payload = base64.b64encode(bytes(range(256)) * (audio_chars // 340 + 1)).decode()
    payload = payload[: audio_chars - audio_chars % 4]
    gc.collect()
    before = _rss()
    seq = 1
    for tick in range(ticks):
        rid = f"resp_{tick // 25}"  # a 2 s response every 25 deltas of 80 ms
        for relay in relays:
            relay_seq = seq
            # Fresh strings per session, as frames read from each engine link are.
            relay.upstream_text(
                f'{{"type":"response.output_audio.delta","event_id":"e{tick}",'
                f'"response_id":"{rid}","item_id":"item_{rid}","output_index":0,'
                f'"content_index":0,"server_event_seq":{relay_seq + 1},'
                f'"delta":"{payload[:-6]}{tick:06d}"}}'
            )
            relay.upstream_text(
                f'{{"type":"response.output_audio_transcript.delta","event_id":"t{tick}",'
                f'"response_id":"{rid}","item_id":"item_{rid}","output_index":0,'
                f'"content_index":0,"server_event_seq":{relay_seq + 2},"delta":"word {tick} "}}'
            )
        seq += 2
    gc.collect()
    after = _rss()
    counted = sum(getattr(r.view, "journal_bytes", 0) for r in relays)
    pending = sum(r.view.pending_bytes for r in relays)
    for relay in relays:
        relay.timers.cancel()
    print(
        json.dumps(
            {
                "grace": grace,
                "sessions": sessions,
                "rss_growth": after - before,
                "journal_counted": counted,
                "pending": pending,
            }
        )
    )


def _run(tree: Path, grace: float, ns: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if tree.resolve() != ROOT:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # write nothing into another checkout
    args = [sys.executable, str(Path(__file__).resolve()), "--child", str(grace)]
    args += ["--sessions", str(ns.sessions), "--journal-bytes", str(ns.journal_bytes)]
    args += ["--ticks", str(ns.ticks), "--audio-chars", str(ns.audio_chars)]
    out = subprocess.run(args, env=env, cwd=tree, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--journal-bytes", type=int, default=2 * MIB)
    parser.add_argument("--ticks", type=int, default=1000, help="80 ms audio deltas per session")
    parser.add_argument(
        "--audio-chars", type=int, default=5120, help="base64 per delta (80 ms of 24 kHz PCM16)"
    )
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to measure")
    parser.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child is not None:
        sys.path.insert(0, os.getcwd())
        asyncio.run(_child(ns.sessions, ns.child, ns.journal_bytes, ns.ticks, ns.audio_chars))
        return
    off = _run(ns.tree, 0.0, ns)
    on = _run(ns.tree, 30.0, ns)
    extra = on["rss_growth"] - off["rss_growth"]
    bound = ns.sessions * ns.journal_bytes
    print(f"tree {ns.tree}: {ns.sessions} sessions never acking, {ns.ticks} deltas each")
    print(f"  without resume: RSS +{off['rss_growth'] / MIB:.1f} MiB")
    print(
        f"  with resume:    RSS +{on['rss_growth'] / MIB:.1f} MiB "
        f"(journals count {on['journal_counted'] / MIB:.1f} MiB)"
    )
    print(
        f"  the journals:   +{extra / MIB:.1f} MiB, {extra / ns.sessions / MIB:.2f} MiB per session; "
        f"bound {ns.sessions} x resume_journal_bytes = {bound / MIB:.0f} MiB: "
        + ("within" if extra <= bound else "OVER")
    )


if __name__ == "__main__":
    main()
