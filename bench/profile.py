"""``python -m bench profile``: where the sidecar spends its CPU at real-time pace.

Starts the bench engine and the sidecar (pinned as in the scenarios), drives
``--profile-sessions`` Nemotron-like sessions (80 ms both ways), and samples
the sidecar with ``py-spy record --nonblocking`` (py-spy itself on cpu0) for
``--profile-seconds``. Writes bench/results/profile.md with the top functions
by own time and by inclusive time, grouped by file, and the raw collapsed
stacks as profile.txt (for flamegraph tools).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import LOAD_CPU, RESULTS_DIR, python, start
from bench.report import Report
from bench.runner import log
from bench.stack import Stack

__all__ = ["profile", "summarize"]

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::(?P<line>\d+))?\)$")


def _short(path: str) -> str:
    for marker in ("site-packages/", "python3.11/"):
        i = path.find(marker)
        if i >= 0:
            return path[i + len(marker) :]
    for package in ("/proxy/", "/metrics/", "/engine_launcher/"):  # this tree or a baseline's
        i = path.rfind(package)
        if i >= 0:
            return path[i + 1 :]
    return path


def summarize(raw: str, top: int = 25) -> dict[str, Any]:
    """Own (leaf) and inclusive sample counts per function and per file from collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        total += count
        frames = []
        for f in stack.split(";"):
            m = _FRAME.match(f.strip())
            frames.append(f"{m['func']} ({_short(m['file'])})" if m else f.strip())
        if frames:
            own[frames[-1]] += count
            leaf = _FRAME.match(stack.split(";")[-1].strip())
            files[_short(leaf["file"]) if leaf else "?"] += count
        for f in set(frames):
            incl[f] += count
    return {
        "total": total,
        "own": own.most_common(top),
        "incl": incl.most_common(top),
        "files": files.most_common(15),
    }


def profile(ns: argparse.Namespace) -> None:
    pyspy = shutil.which("py-spy") or str(Path(python()).with_name("py-spy"))
    # --baseline-tree: profile that checkout's sidecar instead (a before/after pair).
    config = "sidecar" if ns.baseline_tree is None else "baseline"
    name = ns.profile_name
    report = Report(name, f"{name}: the sidecar's hot path at real-time pace (py-spy)")
    from bench.scen_realtime import PROFILES

    kind = PROFILES[ns.profile_kind]
    with Stack(configs=(config,), baseline_tree=ns.baseline_tree) as st:
        sessions = ns.profile_sessions
        warmup = 4.0
        argv = [
            python(),
            "-m",
            "bench.loadclient",
            "--url",
            st.url(config, kind["query"]),
            "-c",
            str(sessions),
            "--warmup",
            str(warmup),
            "--window",
            str(ns.profile_seconds + 2),
            "--up-ms",
            str(kind["up_ms"]),
            "--stats-url",
            st.stats_url(),
            *st.watch_args(config),
            "--max-seconds",
            str(int(ns.profile_seconds + 60)),
        ]
        if kind["ack"]:
            argv.append("--ack")
        client = start("client", argv, cpu=LOAD_CPU)
        time.sleep(warmup + 1)
        out = RESULTS_DIR / f"{name}.txt"
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        log(f"py-spy on {config} pid {st.procs[config].pid} for {ns.profile_seconds:g} s")
        prefix = ["nice", "-n", str(common.NICE)] if common.NICE else []
        subprocess.run(
            [
                *prefix,
                "taskset",
                "-c",
                str(LOAD_CPU),
                pyspy,
                "record",
                "--pid",
                str(st.procs[config].pid),
                "--duration",
                str(int(ns.profile_seconds)),
                "--rate",
                "200",
                # --native (C frames: uvloop) needs the process paused per sample.
                *(["--native"] if ns.profile_native else ["--nonblocking"]),
                "--format",
                "raw",
                "--output",
                str(out),
            ],
            check=True,
            timeout=ns.profile_seconds + 60,
            capture_output=True,
        )
        client.wait_exit(timeout=ns.profile_seconds + 90)
        result_line = client.log_path.read_text().strip().splitlines()[-1]
    result = __import__("json").loads(result_line)
    if ns.baseline_tree is None:
        from proxy.native import CORE_BUILD

        build = f"this checkout, {CORE_BUILD}"
    else:
        build = f"the checkout at {ns.baseline_tree} (run as Python)"
    mode = "--native" if ns.profile_native else "--nonblocking"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    summary = summarize(out.read_text())
    report.raw["summary"] = summary
    report.raw["load"] = result
    total = max(1, summary["total"])
    us = result["cpu_s"].get("proxy", 0) * 1e6 / max(1, result["relayed_events"])
    report.para(
        f"{sessions} sessions through the sidecar, {kind['label']}: "
        f"{result['relayed_events'] / result['window_s']:.0f} relayed events/s, sidecar "
        f"{result['cpu_pct'].get('proxy', 0):.0f} % CPU, {us:.1f} µs per relayed event), "
        f"`py-spy record --rate 200 {mode}` for {ns.profile_seconds:g} s: "
        f"{summary['total']} samples (idle time is not sampled, so shares are of busy time). "
        f"Raw collapsed stacks: {name}.txt. Build: {build}. Load average before: {load}."
    )
    report.para("## Own time (the function itself was running)")
    report.table(
        ["function (file)", "samples", "share %"],
        [[f, n, 100 * n / total] for f, n in summary["own"]],
    )
    report.para("## Own time by file")
    report.table(
        ["file", "samples", "share %"], [[f, n, 100 * n / total] for f, n in summary["files"]]
    )
    report.para("## Inclusive time (on the stack)")
    report.table(
        ["function (file)", "samples", "share %"],
        [[f, n, 100 * n / total] for f, n in summary["incl"]],
    )
    path = report.write(
        f"python -m bench profile --profile-sessions {sessions} --profile-kind {ns.profile_kind}"
        + (" --profile-native" if ns.profile_native else "")
        + (f" --profile-name {name}" if name != "profile" else "")
        + (f" --baseline-tree {ns.baseline_tree}" if ns.baseline_tree is not None else "")
    )
    log(f"wrote {path}")
