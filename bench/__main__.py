"""``python -m bench SCENARIO``: run one benchmark scenario, or ``all`` of them.

Scenarios: stale-audio, realtime-latency, throughput, slow-client, capacity
(``all`` runs them in this order and writes bench/results/summary.md), plus
``profile`` (py-spy profile of the sidecar under real-time load) and
``soak`` (``bench/soak.py``, when present) and ``barge-in`` (old answer heard
after an interruption, history vs. heard; not part of ``all``) and ``memory``
(RSS per idle and per streaming session, sidecar vs. bare relay; not part of
``all``). See bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCENARIOS = ("stale-audio", "realtime-latency", "throughput", "slow-client", "capacity")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=(*SCENARIOS, "all", "profile", "soak", "barge-in", "memory"))
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions (medians)")
    p.add_argument(
        "--nice",
        type=int,
        default=-10,
        help="niceness of every benchmark process (the anchors used -10; 0 = leave)",
    )
    g = p.add_argument_group("scale")
    g.add_argument("--stale-sessions", type=int, default=100)
    g.add_argument("--latency-sessions", default="100,500")
    g.add_argument(
        "--latency-profiles",
        default="minicpmo,nemotron",
        help="realtime-latency: which traffic profiles (a quicker A/B: one of them)",
    )
    g.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="realtime-latency: also run the sidecar of this checkout (e.g. a git worktree "
        "of an earlier commit) as path 'baseline', side by side in the same run; profile: "
        "profile that checkout's sidecar instead of this one's",
    )
    g.add_argument("--rt-warmup", type=float, default=1.5)
    g.add_argument("--rt-window", type=float, default=4.0)
    g.add_argument("--throughput-sessions", default="1,10,100")
    g.add_argument("--tp-warmup", type=float, default=0.5)
    g.add_argument("--tp-window", type=float, default=2.0)
    g.add_argument("--slow-sessions", type=int, default=200)
    g.add_argument("--slow-stalled", type=int, default=20)
    g.add_argument("--slow-window", type=float, default=10.0)
    g.add_argument("--capacity-start-minicpmo", type=int, default=2000)
    g.add_argument("--capacity-start-nemotron", type=int, default=600)
    g.add_argument("--capacity-budget", type=float, default=75.0, help="seconds per profile")
    g.add_argument("--capacity-steps", type=int, default=4)
    g.add_argument("--cap-warmup", type=float, default=2.0)
    g.add_argument("--cap-window", type=float, default=4.0)
    g.add_argument("--profile-seconds", type=float, default=12.0)
    g.add_argument("--profile-sessions", type=int, default=500)
    g.add_argument("--profile-kind", choices=("nemotron", "minicpmo"), default="nemotron")
    g.add_argument(
        "--profile-native",
        action="store_true",
        help="py-spy --native: C frames too (uvloop, and the compiled build's functions)",
    )
    g.add_argument(
        "--profile-name",
        default="profile",
        help="profile: the results' file name (bench/results/NAME.md, .txt), e.g. profile-before",
    )
    g.add_argument("--bargein-sessions", type=int, default=100)
    g.add_argument(
        "--memory-sessions",
        default="1,100,1000",
        help="memory: session counts, each measured idle and then streaming",
    )
    g.add_argument(
        "--memory-hold",
        type=float,
        default=5.0,
        help="memory: seconds of RSS samples per phase (idle, streaming) and session count",
    )
    return p


def _check_deps() -> None:
    missing = []
    for mod in ("picows", "matplotlib", "uvloop"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        sys.exit(
            f"bench needs {', '.join(missing)}: .venv/bin/pip install picows matplotlib py-spy"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["soak"]:
        # Owned by bench/soak.py; hand over everything after the word.
        os.execv(sys.executable, [sys.executable, "-m", "bench.soak", *argv[1:]])
    ns = _parser().parse_args(argv)
    _check_deps()
    from bench import common
    from bench.scen_bargein import barge_in
    from bench.scen_burst import throughput
    from bench.scen_cancel import stale_audio
    from bench.scen_memory import memory
    from bench.scen_realtime import capacity, realtime_latency
    from bench.scen_slow import slow_client
    from bench.stack import ensure_nginx
    from bench.summary import write_summary

    common.set_nice(ns.nice)
    common.pin_self()
    ensure_nginx()
    table: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "stale-audio": stale_audio,
        "realtime-latency": realtime_latency,
        "throughput": throughput,
        "slow-client": slow_client,
        "capacity": capacity,
        "barge-in": barge_in,
        "memory": memory,
    }
    if ns.scenario == "profile":
        from bench.profile import profile

        profile(ns)
        return 0
    names = SCENARIOS if ns.scenario == "all" else (ns.scenario,)
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    for name in names:
        t = time.monotonic()
        results[name] = table[name](ns)
        print(f"[bench] {name} took {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - t0
    if ns.scenario == "all":
        command = "python -m bench all" + (f" --reps {ns.reps}" if ns.reps != 2 else "")
        print(write_summary(results, elapsed, command))
    print(f"[bench] total {elapsed:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
