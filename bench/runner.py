"""Run one load-client measurement against one path of a :class:`~bench.stack.Stack`."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.common import LOAD_CPU, median, python, run_json
from bench.stack import Stack

__all__ = ["load", "log", "paired", "rotated"]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rotated(configs: Sequence[str], rep: int) -> list[str]:
    """The configs in a fixed cyclic order that starts one later each repetition."""
    k = rep % len(configs)
    return list(configs[k:]) + list(configs[:k])


def load(
    st: Stack,
    config: str,
    query: str,
    sessions: int,
    *,
    warmup: float,
    window: float,
    up_ms: int = 0,
    ack: bool = False,
    ack_every: int = 0,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """One bounded load-client run; adds ``config`` and the proxy's µs of CPU per relayed event."""
    st.check_alive()
    argv = [
        python(),
        "-m",
        "bench.loadclient",
        "--url",
        st.url(config, query),
        "-c",
        str(sessions),
        "--warmup",
        str(warmup),
        "--window",
        str(window),
        "--stats-url",
        st.stats_url(),
        "--connect-concurrency",
        "100",
        "--max-seconds",
        str(int(warmup + window + 60 + sessions / 50)),
        *st.watch_args(config),
        *extra,
    ]
    if up_ms:
        argv += ["--up-ms", str(up_ms)]
    if ack:
        argv.append("--ack")
    if ack_every:
        argv += ["--ack-every", str(ack_every)]
    result = run_json(argv, cpu=LOAD_CPU, timeout=warmup + window + 120 + sessions / 20)
    result["config"] = config
    proxy_cpu = result["cpu_s"].get("proxy")
    relayed = result.get("relayed_events") or 0
    result["us_per_event"] = (
        proxy_cpu * 1e6 / relayed if proxy_cpu is not None and relayed else None
    )
    result["proxy_cpu_pct"] = result["cpu_pct"].get("proxy")
    result["proxy_rss_mb"] = (
        result["rss_max"].get("proxy", 0) / 2**20 if proxy_cpu is not None else None
    )
    log(
        f"  {config:8s} c={sessions:<5d} {query:32s} down {result['down_ev_s']:9.0f} ev/s "
        f"p50 {result.get('down_p50_ms') or 0:7.2f} p99 {result.get('down_p99_ms') or 0:8.2f} ms  "
        f"up p99 {result.get('up_p99_ms') or 0:7.2f}  proxy {result['proxy_cpu_pct'] or 0:5.1f}% "
        f"{result['us_per_event'] or 0:5.1f} us/ev  foreign {result['foreign_cpu_pct']:4.0f}%"
        + (f"  FAILED {result['failed']}" if result["failed"] else "")
    )
    return result


def paired(
    runs: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]], key: str, op: str = "sub"
) -> float:
    """Median over repetitions of (run[key] − base[key]) or of the ratio, paired by repetition."""
    values = []
    for a, b in zip(runs, base, strict=False):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            continue
        if op == "sub":
            values.append(x - y)
        elif y:
            values.append(x / y)
    return median(values)


def med(runs: Sequence[dict[str, Any]], key: str) -> float:
    return median([r[key] for r in runs if r.get(key) is not None])
