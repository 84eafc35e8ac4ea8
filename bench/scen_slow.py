"""Scenario ``slow-client``: 200 real-time sessions of which 20 stop reading.

Nemotron-like pace down (80 ms deltas, ≈ 66 KB/s per session). The 20 stalled
clients shrink their receive buffer to 16 KiB and stop reading from the start;
they read again after ``--stall-for`` seconds and the client records how each
session ended. The sidecar runs with a 256 KiB ``max_pending_output_bytes`` so
that a stalled session overflows within the run (≈ 7 s at this pace instead
of ≈ 35 s with the 2 MiB default), and ``close_timeout`` 20 s so that a
client that reads again within that time still receives the final events.

Checks: the sidecar's peak RSS stays ≤ base + 20 × per-session limit + 2 MB
(base = the peak RSS of a fresh sidecar process under the same load without
stalled clients; every run gets a fresh process; per-session limit =
max_pending_output_bytes + output_reserve_bytes + client_write_buffer_bytes);
every stalled session ends with ``error`` {output_backpressure} →
``response.done`` {failed} → ``session.closed`` {output_backpressure} and
close code 1008; the 180 others keep their latency (p99 within 10 % of the
run without stalled clients). Direct and nginx are run once with the same
stalled clients to show what happens without the sidecar: nothing ends, and
the engine's outbox grows.
"""

from __future__ import annotations

import argparse
from typing import Any, Final

from bench.report import Report, bars, figure
from bench.runner import load, log, med
from bench.stack import Stack

__all__ = ["slow_client"]

SESSIONS: Final = 200
STALLED: Final = 20
PENDING: Final = 256 * 1024
RESERVE: Final = 64 * 1024
WRITE_BUFFER: Final = 64 * 1024
PER_SESSION: Final = PENDING + RESERVE + WRITE_BUFFER
#: What the RSS bound allows on top of the stalled sessions' budgets.
SLACK_MB: Final = 2.0
SIDECAR_ARGS: Final = ["--max-pending-output-bytes", str(PENDING), "--close-timeout", "20"]
SEQUENCE: Final = [
    "error:output_backpressure",
    "response.done:failed",
    "session.closed:output_backpressure",
]
QUERY: Final = "mode=paced&chunk_ms=80"


def _ended_with_overflow(s: dict[str, Any]) -> bool:
    return s["tail"][-3:] == SEQUENCE and s["close_code"] == 1008


def slow_client(ns: argparse.Namespace) -> dict[str, Any]:
    report = Report("slow-client", "slow-client: 20 of 200 sessions stop reading")
    sessions, stalled = ns.slow_sessions, ns.slow_stalled
    warmup, window = 1.0, ns.slow_window
    stall_for = warmup + window + 1.0
    runs: dict[str, list[dict[str, Any]]] = {}

    def stall_args(drain: float) -> list[str]:
        return ["--stall", str(stalled), "--stall-for", str(stall_for), "--stall-drain", str(drain)]

    # Each sidecar run gets a fresh process: a heap grown by an earlier run
    # (glibc keeps freed memory) would otherwise be counted as growth, or hide it.
    for rep in range(ns.reps):
        log(f"slow-client rep {rep + 1}/{ns.reps}: sidecar without / with {stalled} stalled")
        order = [False, True] if rep % 2 == 0 else [True, False]
        for with_stall in order:
            with Stack(configs=("sidecar",), sidecar_args=SIDECAR_ARGS) as fresh:
                r = load(
                    fresh,
                    "sidecar",
                    QUERY,
                    sessions,
                    warmup=warmup,
                    window=window,
                    extra=stall_args(10.0) if with_stall else [],
                )
            runs.setdefault("sidecar/stall" if with_stall else "sidecar/base", []).append(r)
    with Stack(configs=("direct", "nginx")) as st:
        for config in ("direct", "nginx"):
            log(f"slow-client {config} with {stalled} stalled")
            r = load(
                st, config, QUERY, sessions, warmup=warmup, window=window, extra=stall_args(2.0)
            )
            runs[f"{config}/stall"] = [r]
    report.raw["runs"] = runs
    base, stall = runs["sidecar/base"], runs["sidecar/stall"]
    growth = [
        (s["rss_max"]["proxy"] - b["rss_max"]["proxy"]) / 2**20
        for s, b in zip(stall, base, strict=False)
    ]
    bound_mb = stalled * PER_SESSION / 2**20 + SLACK_MB
    ended = [sum(_ended_with_overflow(x) for x in r["stalled"]) for r in stall]
    p99_ratio = [s["down_p99_ms"] / b["down_p99_ms"] for s, b in zip(stall, base, strict=False)]
    summary = {
        "rss_growth_mb_max": max(growth),
        "rss_bound_mb": bound_mb,
        "overflow_sequence": f"{min(ended)}/{stalled}",
        "overflow_all": min(ended) == stalled,
        "p99_ratio_median": sorted(p99_ratio)[len(p99_ratio) // 2],
        "p99_ratio_max": max(p99_ratio),
        "base_p99": med(base, "down_p99_ms"),
        "stall_p99": med(stall, "down_p99_ms"),
    }
    report.raw["summary"] = summary
    report.para(
        f"{sessions} sessions, {stalled} of them stop reading (16 KiB receive buffer) from the "
        f"start and read again after {stall_for:g} s. Down-only, 80 ms deltas at real-time pace. "
        f"Sidecar flags: `{' '.join(SIDECAR_ARGS)}` (per-session limit {PER_SESSION // 1024} KiB "
        f"= pending {PENDING // 1024} + reserve {RESERVE // 1024} + client write buffer "
        f"{WRITE_BUFFER // 1024}). {ns.reps} interleaved pairs of sidecar runs (with / without "
        f"stalled clients), each in a fresh sidecar process; latency is of the {sessions - stalled} reading sessions; "
        f"{warmup:g} s warm-up, {window:g} s window."
    )
    rows = []
    for key, rs in runs.items():
        config, kind = key.split("/")
        engine_growth = [(r["rss_max"]["engine"] - r["rss_start"]["engine"]) / 2**20 for r in rs]
        seq = (
            f"{min(sum(_ended_with_overflow(x) for x in r['stalled']) for r in rs)}/{stalled}"
            if kind == "stall"
            else "–"
        )
        codes = sorted({str(x["close_code"]) for r in rs for x in r.get("stalled", [])})
        rows.append(
            [
                config,
                "yes" if kind == "stall" else "no",
                med(rs, "down_p50_ms"),
                med(rs, "down_p99_ms"),
                med(rs, "proxy_rss_mb"),
                max(engine_growth),
                max((r["tcp_mem_max"] - r["tcp_mem_start"]) / 2**20 for r in rs),
                seq,
                ",".join(codes) or "–",
                med(rs, "proxy_cpu_pct"),
                med(rs, "foreign_cpu_pct"),
            ]
        )
    report.table(
        [
            "path",
            "20 stalled",
            "reading sessions p50 ms",
            "p99 ms",
            "proxy peak RSS MB",
            "engine RSS growth MB",
            "kernel TCP memory growth MB",
            "stalled sessions ended with overflow sequence",
            "stalled close codes",
            "proxy CPU %",
            "foreign CPU %",
        ],
        rows,
    )
    report.table(
        ["check", "measured", "target", "met"],
        [
            [
                "sidecar RSS growth with 20 stalled (MB, worst pair)",
                summary["rss_growth_mb_max"],
                f"≤ {bound_mb:.1f} (20 × {PER_SESSION // 1024} KiB + {SLACK_MB:g} MB)",
                summary["rss_growth_mb_max"] <= bound_mb,
            ],
            [
                "stalled sessions ending error → failed done → session.closed, 1008",
                summary["overflow_sequence"],
                f"{stalled}/{stalled}",
                summary["overflow_all"],
            ],
            [
                "reading sessions p99, stalled ÷ not stalled (median of pairs)",
                summary["p99_ratio_median"],
                "≤ 1.10",
                summary["p99_ratio_median"] <= 1.10,
            ],
        ],
    )
    example = next((x for r in stall for x in r["stalled"]), None)
    if example:
        report.para(
            f"Last events of a stalled sidecar session: `{' → '.join(example['tail'])}`, "
            f"close code {example['close_code']}."
        )
    fig, axes = figure(ncols=2, width=5.5)
    labels = list(runs)
    bars(
        axes[0][0],
        ["peak RSS"],
        {k: [med(runs[k], "proxy_rss_mb") or 0] for k in labels},
        ylabel="MB",
        title="proxy peak RSS",
    )
    bars(
        axes[0][1],
        ["p50", "p99"],
        {k: [med(runs[k], "down_p50_ms"), med(runs[k], "down_p99_ms")] for k in labels},
        ylabel="ms",
        title="latency of the reading sessions",
    )
    path = report.write(f"python -m bench slow-client --reps {ns.reps}", fig)
    log(f"wrote {path}")
    return summary
