"""Scenario ``throughput``: the engine as fast as possible, 1/10/100 sessions.

The bench engine streams audio deltas in burst mode with credit flow control
(at most ``window`` deltas not yet acknowledged; the client acks every
``window/4``-th delta). Credits are needed because the sidecar reads the
engine at full speed by design and would otherwise end a session whose
client reads slower than the engine writes (its overflow policy); every path
gets the same credits so the comparison stays fair. The sidecar's frame-rate
limit is raised above the acks' rate (see ``SIDECAR_ARGS``).
"""

from __future__ import annotations

import argparse
from typing import Any, Final

from bench.report import Report, bars, figure
from bench.runner import load, log, med, paired, rotated
from bench.stack import Stack

__all__ = ["throughput"]

SIZES: Final = {40: "2.8 KB (40 ms)", 500: "32 KB (500 ms)"}
#: The client acks every window/4-th delta: at 60k deltas/s one session sends
#: ~1,000 acks/s, above the default max_client_frame_rate (200/s) that guards
#: against floods; a dropped ack is a lost credit and the stream stalls. The
#: limit stays on, above what this client legitimately sends.
SIDECAR_ARGS: Final = ["--max-client-frame-rate", "20000", "--client-frame-burst", "40000"]
CONFIGS: Final = ("direct", "nginx", "bare", "bare-picows", "sidecar")


def _window(chunk_ms: int) -> int:
    frame = 24_000 * chunk_ms // 1000 * 2 * 4 // 3 + 200
    return max(16, min(256, (1 << 20) // frame))


def throughput(ns: argparse.Namespace) -> dict[str, Any]:
    counts = [int(c) for c in ns.throughput_sessions.split(",")]
    report = Report("throughput", "throughput: burst events/s and MB/s through one proxy process")
    runs: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    with Stack(configs=CONFIGS, sidecar_args=SIDECAR_ARGS) as st:
        for rep in range(ns.reps):
            for chunk in SIZES:
                win = _window(chunk)
                for count in counts:
                    log(f"throughput rep {rep + 1}/{ns.reps} {chunk} ms c={count} window={win}")
                    for config in rotated(CONFIGS, rep):
                        r = load(
                            st,
                            config,
                            f"mode=burst&chunk_ms={chunk}&window={win}",
                            count,
                            warmup=ns.tp_warmup,
                            window=ns.tp_window,
                            ack_every=max(1, win // 4),
                        )
                        r["ev_per_cpu_s"] = (
                            r["down_events"] / r["cpu_s"]["proxy"]
                            if r["cpu_s"].get("proxy")
                            else None
                        )
                        runs.setdefault((chunk, count, config), []).append(r)
    report.raw["runs"] = {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in runs.items()}
    summary: dict[str, Any] = {}
    report.para(
        f"Medians of {ns.reps} interleaved repetitions; {ns.tp_warmup:g} s warm-up, "
        f"{ns.tp_window:g} s window. *ratio vs nginx* is sidecar (or bare) events/s ÷ nginx "
        "events/s, paired within a repetition. A proxy below ~95 % CPU was not the bottleneck "
        "(the engine and client share cpu0); then *k events per proxy CPU-s* is the fairer figure. "
        "nginx runs with its default 4k proxy_buffer_size."
    )
    fig, axes = figure(ncols=2, width=6.5)
    for i, (chunk, label) in enumerate(SIZES.items()):
        report.para(f"## {label} frames")
        rows = []
        series: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for count in counts:
            ng = runs[(chunk, count, "nginx")]
            for config in CONFIGS:
                rs = runs[(chunk, count, config)]
                row = {
                    "ev_s": med(rs, "down_ev_s"),
                    "mb_s": med(rs, "down_mb_s"),
                    "cpu": med(rs, "proxy_cpu_pct"),
                    "ev_cpu": med(rs, "ev_per_cpu_s"),
                    "rss": med(rs, "proxy_rss_mb"),
                    "ratio": None
                    if config in ("direct", "nginx")
                    else paired(rs, ng, "down_ev_s", "ratio"),
                    "ratio_cpu": None
                    if config in ("direct", "nginx")
                    else paired(rs, ng, "ev_per_cpu_s", "ratio"),
                    "us": med(rs, "us_per_event"),
                    "foreign": med(rs, "foreign_cpu_pct"),
                    "failed": max(r["failed"] for r in rs),
                }
                summary[f"{chunk}/{count}/{config}"] = row
                series[config].append(row["ev_s"] / 1000)
                rows.append(
                    [
                        count,
                        config,
                        row["ev_s"] / 1000,
                        row["mb_s"],
                        row["cpu"],
                        None if row["ev_cpu"] is None else row["ev_cpu"] / 1000,
                        row["us"],
                        row["rss"],
                        row["ratio"],
                        row["ratio_cpu"],
                        row["failed"],
                        row["foreign"],
                    ]
                )
        report.table(
            [
                "sessions",
                "path",
                "k events/s",
                "MB/s",
                "proxy CPU %",
                "k events per proxy CPU-s",
                "µs CPU / relayed event",
                "proxy RSS MB",
                "ratio vs nginx (ev/s)",
                "ratio vs nginx (ev per CPU-s)",
                "failed",
                "foreign CPU %",
            ],
            rows,
        )
        bars(
            axes[0][i],
            [f"c{c}" for c in counts],
            series,
            ylabel="k events/s",
            title=f"{label} frames",
        )
    report.raw["summary"] = summary
    path = report.write(f"python -m bench throughput --reps {ns.reps}", fig)
    log(f"wrote {path}")
    return summary
