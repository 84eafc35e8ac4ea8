"""Scenario ``stale-audio``: audio of a cancelled response that still reaches the client.

Engine: the project's simulator (``python -m engine_launcher.simulator``) with
its defaults for the flaw under test: 1000 ms chunks and ``--late-audio-chunks
3`` (audio already produced is still sent after a cancel, before the
cancelled ``response.done``, as the released engines do). N sessions cancel
their response at a uniformly random point; :mod:`bench.cancelclient` counts
what arrives after the cancel.
"""

from __future__ import annotations

import argparse
import re
import urllib.request
from typing import Any, Final

from bench.common import LOAD_CPU, median, python, run_json
from bench.report import Report, bars, figure
from bench.runner import log, rotated
from bench.stack import Stack

__all__ = ["stale_audio"]

CONFIGS: Final = ("direct", "nginx", "sidecar")
SIM_ARGS: Final = ["--chunk-ms", "1000", "--late-audio-chunks", "3", "--response-seconds", "8"]


def _sidecar_drops(st: Stack) -> dict[str, float]:
    """The sidecar's own dropped-event counters, from its admin /metrics."""
    url = f"http://127.0.0.1:{st.ports['sidecar_admin']}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    out = {}
    for m in re.finditer(
        r'^omni_sidecar_dropped_events_total\{reason="(\w+)"\} (\S+)$', text, re.MULTILINE
    ):
        out[m.group(1)] = float(m.group(2))
    for m in re.finditer(
        r"^omni_sidecar_cancel_to_silence_seconds_(sum|count) (\S+)$", text, re.MULTILINE
    ):
        out["cancel_to_silence_" + m.group(1)] = float(m.group(2))
    return out


def stale_audio(ns: argparse.Namespace) -> dict[str, Any]:
    report = Report(
        "stale-audio", "stale-audio: audio of a cancelled response delivered after the cancel"
    )
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    with Stack(engine="simulator", simulator_args=SIM_ARGS, configs=CONFIGS) as st:
        for rep in range(ns.reps):
            log(f"stale-audio rep {rep + 1}/{ns.reps}, {ns.stale_sessions} sessions")
            for config in rotated(CONFIGS, rep):
                st.check_alive()
                r = run_json(
                    [
                        python(),
                        "-m",
                        "bench.cancelclient",
                        "--url",
                        st.url(config),
                        "-c",
                        str(ns.stale_sessions),
                        "--seed",
                        str(rep + 1),
                    ],
                    cpu=LOAD_CPU,
                    timeout=90,
                )
                runs[config].append(r)
                log(
                    f"  {config:8s} cancelled {r['cancelled']} late frames {r['late_frames_total']} "
                    f"(max {r['late_frames_max']}/session) {r['late_seconds_total']:.1f} s audio, "
                    f"c2s p50 {r['cancel_to_silence_p50_ms']} p99 {r['cancel_to_silence_p99_ms']}"
                )
        drops = _sidecar_drops(st)
    summary: dict[str, Any] = {"sidecar_metrics": drops}
    rows = []
    for config in CONFIGS:
        rs = runs[config]

        def m(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return median([r[key] for r in rs if r.get(key) is not None])

        row = {
            "cancels": sum(r["cancelled"] for r in rs),
            "late_frames": sum(r["late_frames_total"] for r in rs),
            "late_max": max(r["late_frames_max"] for r in rs),
            "with_late": sum(r["sessions_with_late"] for r in rs),
            "late_s_per_cancel": sum(r["late_seconds_total"] for r in rs)
            / max(1, sum(r["cancelled"] for r in rs)),
            "c2s_p50": m("cancel_to_silence_p50_ms"),
            "c2s_p99": m("cancel_to_silence_p99_ms"),
            "done": sum(r["done_cancelled"] for r in rs),
        }
        summary[config] = row
        rows.append(
            [
                config,
                row["cancels"],
                row["late_frames"],
                row["with_late"],
                row["late_max"],
                row["late_s_per_cancel"],
                row["c2s_p50"],
                row["c2s_p99"],
                row["done"],
            ]
        )
    report.raw["runs"] = runs
    report.raw["summary"] = summary
    report.para(
        f"{ns.reps} repetitions × {ns.stale_sessions} sessions per path (interleaved). Engine: "
        f"`python -m engine_launcher.simulator {' '.join(SIM_ARGS)}` (1000 ms chunks, 3 late "
        "chunks after a cancel). Each session cancels its response 0.3–4 s after its first audio "
        "delta. *late frames* = audio deltas of the cancelled response received after the client "
        "sent `response.cancel`; *cancel→silence* = from sending the cancel to the last such delta "
        "(0 when none), measured at the client."
    )
    report.table(
        [
            "path",
            "cancels",
            "late frames (total)",
            "cancels with late audio",
            "max late frames / cancel",
            "late audio s / cancel",
            "cancel→silence p50 ms",
            "cancel→silence p99 ms",
            "cancelled response.done received",
        ],
        rows,
    )
    if drops:
        report.para(
            "Sidecar's own counters after the run (admin /metrics): "
            + ", ".join(f"`{k}` = {v:g}" for k, v in sorted(drops.items()))
        )
    fig, axes = figure(ncols=2, width=5.5)
    bars(
        axes[0][0],
        ["late audio s / cancel"],
        {c: [summary[c]["late_s_per_cancel"]] for c in CONFIGS},
        ylabel="seconds of audio",
        title="stale audio after a cancel",
    )
    bars(
        axes[0][1],
        ["p50", "p99"],
        {c: [summary[c]["c2s_p50"], summary[c]["c2s_p99"]] for c in CONFIGS},
        ylabel="ms",
        title="cancel → silence (client)",
    )
    path = report.write(
        f"python -m bench stale-audio --reps {ns.reps} --stale-sessions {ns.stale_sessions}", fig
    )
    log(f"wrote {path}")
    return summary
