"""Scenarios at real-time pace: ``realtime-latency`` and ``capacity``.

Two traffic profiles, both 24 kHz PCM16 out and 16 kHz PCM16 in:

* MiniCPM-o-like: one 1000 ms audio delta per second down (≈ 64 KB), a 200 ms
  ``input_audio_buffer.append`` every 200 ms up (≈ 8.5 KB), and a
  ``session.event_ack`` for every server event: 7 relayed events per second.
* Nemotron-like: 80 ms deltas down (≈ 5.2 KB) and 80 ms appends up (≈ 3.5 KB):
  25 relayed events per second.

Every delta is stamped by the bench engine when it is written; the client
subtracts the stamp on receipt (down). Appends and acks are stamped by the
client and measured by the engine (up). "Added" latency is the path's figure
minus the direct connection's, paired within one repetition.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Final

from bench.report import Report, bars, figure
from bench.runner import load, log, med, paired, rotated
from bench.stack import Stack

__all__ = ["PROFILES", "capacity", "realtime_latency"]

PROFILES: Final[dict[str, dict[str, Any]]] = {
    "minicpmo": {
        "label": "MiniCPM-o-like (1000 ms deltas, 200 ms appends, ack per server event)",
        "query": "mode=paced&chunk_ms=1000",
        "up_ms": 200,
        "ack": True,
    },
    "nemotron": {
        "label": "Nemotron-like (80 ms deltas down, 80 ms appends up)",
        "query": "mode=paced&chunk_ms=80",
        "up_ms": 80,
        "ack": False,
    },
}
LAT_CONFIGS: Final = ("direct", "nginx", "bare", "bare-picows", "sidecar")


def _run(
    st: Stack, config: str, profile: str, sessions: int, warmup: float, window: float
) -> dict[str, Any]:
    p = PROFILES[profile]
    return load(
        st,
        config,
        p["query"],
        sessions,
        warmup=warmup,
        window=window,
        up_ms=p["up_ms"],
        ack=p["ack"],
    )


def realtime_latency(ns: argparse.Namespace) -> dict[str, Any]:
    counts = [int(c) for c in ns.latency_sessions.split(",")]
    rep_count = ns.reps
    report = Report(
        "realtime-latency", "realtime-latency: added latency per event at real-time pace"
    )
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    profiles = {k: PROFILES[k] for k in ns.latency_profiles.split(",")}
    baseline = getattr(ns, "baseline_tree", None)
    configs = (*LAT_CONFIGS, "baseline") if baseline is not None else LAT_CONFIGS
    with Stack(configs=configs, baseline_tree=baseline) as st:
        for rep in range(rep_count):
            for profile in profiles:
                for count in counts:
                    log(f"realtime-latency rep {rep + 1}/{rep_count} {profile} c={count}")
                    for config in rotated(configs, rep):
                        r = _run(st, config, profile, count, ns.rt_warmup, ns.rt_window)
                        runs.setdefault((profile, count, config), []).append(r)
    report.raw["runs"] = {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in runs.items()}
    summary: dict[str, Any] = {}
    report.para(
        f"Medians of {rep_count} interleaved repetitions (config order rotated each repetition); "
        f"{ns.rt_warmup:g} s warm-up, {ns.rt_window:g} s window per run. Latencies are one-way "
        "and in ms; *added* is the path minus direct, paired within a repetition. "
        "CPU per relayed event = proxy process CPU time (utime+stime from /proc/PID/stat, nginx: "
        "master+worker) ÷ events relayed in the window (deltas received by the clients + appends "
        "and acks received by the engine)."
    )
    fig, axes = figure(ncols=2, width=6.5)
    groups = []
    added99: dict[str, list[float]] = {c: [] for c in configs[1:]}
    us_ev: dict[str, list[float]] = {c: [] for c in configs[1:]}
    for profile, p in profiles.items():
        report.para(f"## {p['label']}")
        for count in counts:
            base = runs[(profile, count, "direct")]
            rows = []
            for config in configs:
                rs = runs[(profile, count, config)]
                row = {
                    "down_p50": med(rs, "down_p50_ms"),
                    "down_p99": med(rs, "down_p99_ms"),
                    "added_p50": paired(rs, base, "down_p50_ms"),
                    "added_p99": paired(rs, base, "down_p99_ms"),
                    "up_p99": med(rs, "up_p99_ms"),
                    "added_up_p99": paired(rs, base, "up_p99_ms"),
                    "cpu": med(rs, "proxy_cpu_pct"),
                    "us": med(rs, "us_per_event"),
                    "rss": med(rs, "proxy_rss_mb"),
                    "foreign": med(rs, "foreign_cpu_pct"),
                    "ev_s": med(rs, "down_ev_s") + med(rs, "up_events") / ns.rt_window,
                    "failed": max(r["failed"] for r in rs),
                }
                summary[f"{profile}/{count}/{config}"] = row
                rows.append(
                    [
                        config,
                        row["down_p50"],
                        row["down_p99"],
                        None if config == "direct" else row["added_p50"],
                        None if config == "direct" else row["added_p99"],
                        row["up_p99"],
                        None if config == "direct" else row["added_up_p99"],
                        row["cpu"],
                        row["us"],
                        row["rss"],
                        row["ev_s"],
                        row["failed"],
                        row["foreign"],
                    ]
                )
                if config != "direct":
                    added99[config].append(row["added_p99"])
                    us_ev[config].append(row["us"])
            groups.append(f"{profile}\n{count}")
            report.para(f"### {count} sessions")
            report.table(
                [
                    "path",
                    "down p50",
                    "down p99",
                    "added p50",
                    "added p99",
                    "up p99",
                    "added up p99",
                    "proxy CPU %",
                    "µs CPU / relayed event",
                    "proxy RSS MB",
                    "relayed ev/s",
                    "failed",
                    "foreign CPU %",
                ],
                rows,
            )
        # CPU per event ratios, paired per repetition (sidecar ÷ bare, sidecar ÷ nginx).
        for count in counts:
            sc = runs[(profile, count, "sidecar")]
            summary[f"{profile}/{count}/ratio_bare"] = paired(
                sc, runs[(profile, count, "bare")], "us_per_event", "ratio"
            )
            summary[f"{profile}/{count}/ratio_nginx"] = paired(
                sc, runs[(profile, count, "nginx")], "us_per_event", "ratio"
            )
            summary[f"{profile}/{count}/ratio_bare_picows"] = paired(
                sc, runs[(profile, count, "bare-picows")], "us_per_event", "ratio"
            )
            if baseline is not None:
                summary[f"{profile}/{count}/ratio_baseline"] = paired(
                    sc, runs[(profile, count, "baseline")], "us_per_event", "ratio"
                )
        header = [
            "sessions",
            "sidecar ÷ bare aiohttp relay (CPU/event)",
            "sidecar ÷ nginx (CPU/event)",
            "sidecar ÷ bare picows-upstream relay (CPU/event)",
        ]
        keys = ["ratio_bare", "ratio_nginx", "ratio_bare_picows"]
        if baseline is not None:
            header.append(f"sidecar ÷ baseline {baseline} (CPU/event)")
            keys.append("ratio_baseline")
        report.table(
            header, [[c, *(summary[f"{profile}/{c}/{key}"] for key in keys)] for c in counts]
        )
    bars(
        axes[0][0],
        groups,
        added99,
        ylabel="ms",
        title="added p99 latency vs direct (down)",
        hline=1.0,
    )
    axes[0][0].set_yscale("symlog", linthresh=1.0)
    bars(axes[0][1], groups, us_ev, ylabel="µs", title="proxy CPU per relayed event")
    report.raw["summary"] = summary
    path = report.write(f"python -m bench realtime-latency --reps {rep_count}", fig)
    log(f"wrote {path}")
    return summary


# -- capacity -----------------------------------------------------------------------------------


def _passes(sc: dict[str, Any], direct: dict[str, Any], limit_ms: float) -> tuple[bool, float]:
    added = max(
        (sc.get("down_p99_ms") or 1e9) - (direct.get("down_p99_ms") or 0),
        (sc.get("up_p99_ms") or 1e9) - (direct.get("up_p99_ms") or 0),
    )
    ok = sc["failed"] == 0 and added <= limit_ms and (sc["proxy_cpu_pct"] or 0) < 97
    return ok, added


def capacity(ns: argparse.Namespace) -> dict[str, Any]:
    report = Report(
        "capacity", "capacity: real-time sessions per sidecar core before added p99 > 5 ms"
    )
    targets = {"minicpmo": ns.capacity_start_minicpmo, "nemotron": ns.capacity_start_nemotron}
    limit = 5.0
    summary: dict[str, Any] = {}
    steps_all: dict[str, list[dict[str, Any]]] = {}
    with Stack(configs=("direct", "sidecar")) as st:
        for profile, start in targets.items():
            t_end = time.monotonic() + ns.capacity_budget
            lo, hi = 0, 0
            count = start
            steps: list[dict[str, Any]] = []
            while count > 0 and len(steps) < ns.capacity_steps:
                log(f"capacity {profile} c={count}")
                direct = _run(st, "direct", profile, count, ns.cap_warmup, ns.cap_window)
                sc = _run(st, "sidecar", profile, count, ns.cap_warmup, ns.cap_window)
                ok, added = _passes(sc, direct, limit)
                steps.append(
                    {
                        "sessions": count,
                        "pass": ok,
                        "added_p99_ms": added,
                        "direct": direct,
                        "sidecar": sc,
                    }
                )
                if ok:
                    lo = max(lo, count)
                else:
                    hi = count if hi == 0 else min(hi, count)
                step = 100 if profile == "nemotron" else 250
                if hi == 0:
                    nxt = int(count * 1.5 / step + 0.5) * step
                else:
                    nxt = int((lo + hi) / 2 / step + 0.5) * step
                    if hi - lo <= step or nxt in (lo, hi):
                        break
                if time.monotonic() > t_end:
                    break
                count = nxt
            steps_all[profile] = steps
            # CPU model, independent of how contested the box was: one core's
            # worth of the sidecar's measured µs per relayed event.
            us = [s["sidecar"]["us_per_event"] for s in steps if s["sidecar"]["us_per_event"]]
            ev = [
                s["sidecar"]["relayed_events"] / s["sidecar"]["window_s"] / max(1, s["sessions"])
                for s in steps
                if s["sidecar"]["relayed_events"]
            ]
            est = None
            if us and ev:
                us_m = sorted(us)[len(us) // 2]
                ev_m = sorted(ev)[len(ev) // 2]
                est = 1e6 / (us_m * ev_m)
            summary[profile] = {
                "capacity": lo,
                "first_failure": hi or None,
                "cpu_model_sessions_per_core": est,
                "us_per_event": sorted(us)[len(us) // 2] if us else None,
            }
    report.raw["steps"] = steps_all
    report.raw["summary"] = summary
    report.para(
        "Search per profile: start at the target count, grow ×1.5 while it passes, bisect after a "
        f"failure; at most {ns.capacity_steps} steps and {ns.capacity_budget:g} s per profile. "
        "A step passes when every session connected, the sidecar's added p99 (worse of down and "
        "up, sidecar minus a direct run at the same count, run just before it) is ≤ 5 ms, and the "
        f"sidecar core is below 97 % busy. {ns.cap_warmup:g} s warm-up, {ns.cap_window:g} s window."
    )
    fig, axes = figure(ncols=2, width=7.0)
    for i, (profile, steps) in enumerate(steps_all.items()):
        sm = summary[profile]
        report.para(
            f"## {PROFILES[profile]['label']}: capacity ≥ **{sm['capacity']}** sessions"
            + (f" (failed at {sm['first_failure']})" if sm["first_failure"] else "")
            + (
                f"; CPU model: {sm['us_per_event']:.0f} µs per relayed event → "
                f"{sm['cpu_model_sessions_per_core']:.0f} sessions per fully busy core, "
                f"{0.75 * sm['cpu_model_sessions_per_core']:.0f} at 75 %"
                if sm["cpu_model_sessions_per_core"]
                else ""
            )
        )
        rows = []
        for s in steps:
            d, c = s["direct"], s["sidecar"]
            rows.append(
                [
                    s["sessions"],
                    "pass" if s["pass"] else "FAIL",
                    s["added_p99_ms"],
                    d.get("down_p99_ms"),
                    c.get("down_p99_ms"),
                    d.get("up_p99_ms"),
                    c.get("up_p99_ms"),
                    c["proxy_cpu_pct"],
                    c["us_per_event"],
                    c["proxy_rss_mb"],
                    c["relayed_events"] / c["window_s"],
                    c["failed"],
                    c["foreign_cpu_pct"],
                ]
            )
        report.table(
            [
                "sessions",
                "result",
                "added p99 ms",
                "direct down p99",
                "sidecar down p99",
                "direct up p99",
                "sidecar up p99",
                "sidecar CPU %",
                "µs / event",
                "RSS MB",
                "relayed ev/s",
                "failed",
                "foreign CPU %",
            ],
            rows,
        )
        ordered = sorted(steps, key=lambda s: s["sessions"])
        ax = axes[0][i]
        ax.plot(
            [s["sessions"] for s in ordered],
            [s["added_p99_ms"] for s in ordered],
            "o-",
            label="added p99 ms",
        )
        ax.axhline(limit, color="red", linestyle="--", linewidth=1)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("sessions")
        ax.set_ylabel("added p99 (ms)")
        ax2 = ax.twinx()
        ax2.plot(
            [s["sessions"] for s in ordered],
            [s["sidecar"]["proxy_cpu_pct"] for s in ordered],
            "s--",
            color="gray",
            label="sidecar CPU %",
        )
        ax2.set_ylabel("sidecar CPU %")
        ax.set_title(profile, fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = report.write("python -m bench capacity", fig)
    log(f"wrote {path}")
    return summary
