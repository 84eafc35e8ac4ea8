"""Scenario ``barge-in``: old answer heard after an interruption, and history vs. what was heard.

Engine: the project's simulator generating 4x faster than real time
(``--generation-speed 4``, 200 ms chunks, 4 s replies, its default 3 late
chunks after a cancel), once per playback commit policy (``commit_all_on_done``
and ``ack_only``). Paths, all against the same simulator process:

* ``direct``: the client talks to the simulator;
* ``unpaced``: ``omni-sidecar serve --no-playback-pacing`` (acks and truncation
  on the client's behalf still on: ``playback_ack`` auto);
* ``paced``: ``omni-sidecar serve --playback-pacing --max-audio-lead 0.5``.

:mod:`bench.bargeinclient` runs N sessions per path; each plays its reply
through the probe's 1x playout model (no buffer clear on a cancel) and barges
in at a seeded random playout time, the same draw on every path. It measures
old answer heard after the barge-in and, from the simulator's
``GET /debug/history`` read before the sessions close, how far the engine's
history of the reply is from what the listener had heard at the cancel.
"""

from __future__ import annotations

import argparse
import re
import urllib.request
from typing import Any, Final

from bench.common import (
    LOAD_CPU,
    percentile,
    python,
    run_json,
)
from bench.report import Report, figure
from bench.runner import log, rotated
from bench.stack import Stack, start_sidecar

__all__ = ["barge_in"]

PATHS: Final = ("direct", "unpaced", "paced")
POLICIES: Final = ("commit_all_on_done", "ack_only")
SIM_ARGS: Final = ["--generation-speed", "4", "--chunk-ms", "200", "--response-seconds", "4"]
UNPACED_ARGS: Final = ["--no-playback-pacing"]
PACED_ARGS: Final = ["--playback-pacing", "--max-audio-lead", "0.5"]
#: The bounds the issue states: a paced client holds at most max_audio_lead plus the
#: delta in flight, and history ends within one chunk of the heard position.
LEAD_MS: Final = 500.0
CHUNK_MS: Final = 200.0
#: The sidecar counters reported after each policy's runs (admin /metrics).
_METRICS: Final = re.compile(
    r"^(omni_sidecar_(?:playback_acks_total|truncations_total\{source=\"\w+\"\}"
    r"|paced_bound_releases_total|audio_lead_at_cancel_seconds_(?:sum|count)"
    r"|dropped_events_total\{reason=\"(?:late_audio|cancelled_audio)\"\})) (\S+)$",
    re.MULTILINE,
)


def _counters(admin_port: int) -> dict[str, float]:
    try:
        url = f"http://127.0.0.1:{admin_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    return {
        m.group(1).removeprefix("omni_sidecar_"): float(m.group(2)) for m in _METRICS.finditer(text)
    }


def _pooled(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [s[key] for r in runs for s in r["sessions_raw"] if s.get(key) is not None]


def _columnar(run: dict[str, Any]) -> dict[str, Any]:
    """A run for the JSON file with its sessions as one field list and one row per session."""
    sessions = run["sessions_raw"]
    fields = list(dict.fromkeys(key for session in sessions for key in session))
    rows = [[s.get(f) for f in fields] for s in sessions]
    return {**run, "sessions_raw": {"fields": fields, "rows": rows}}


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def barge_in(ns: argparse.Namespace) -> dict[str, Any]:
    report = Report(
        "barge-in", "barge-in: old answer heard after an interruption, and the engine's history"
    )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {p: {c: [] for c in PATHS} for p in POLICIES}
    counters: dict[str, dict[str, dict[str, float]]] = {}
    for policy in POLICIES:
        sim = [*SIM_ARGS, "--playback-commit-policy", policy]
        with Stack(
            engine="simulator",
            simulator_args=sim,
            configs=("direct", "sidecar"),
            sidecar_args=UNPACED_ARGS,
        ) as st:
            # One more sidecar in front of the stack's engine, as Stack starts its own.
            paced = start_sidecar(
                "sidecar-paced", f"ws://127.0.0.1:{st.ports['direct']}", *PACED_ARGS
            )
            paced_port, paced_admin = paced.port, paced.admin_port
            try:
                urls = {
                    "direct": st.url("direct"),
                    "unpaced": st.url("sidecar"),
                    "paced": f"ws://127.0.0.1:{paced_port}/v1/realtime",
                }
                history = f"http://127.0.0.1:{st.ports['direct']}/debug/history"
                for rep in range(ns.reps):
                    log(
                        f"barge-in {policy} rep {rep + 1}/{ns.reps}, {ns.bargein_sessions} sessions"
                    )
                    for path in rotated(PATHS, rep):
                        st.check_alive()
                        if not paced.running():
                            raise RuntimeError(f"paced sidecar exited:\n{paced.log_tail()}")
                        r = run_json(
                            [
                                python(),
                                "-m",
                                "bench.bargeinclient",
                                "--url",
                                urls[path],
                                "--history-url",
                                history,
                                "-c",
                                str(ns.bargein_sessions),
                                "--seed",
                                str(rep + 1),
                            ],
                            cpu=LOAD_CPU,
                            timeout=120,
                        )
                        r["path"], r["policy"], r["rep"] = path, policy, rep + 1
                        runs[policy][path].append(r)
                        log(
                            f"  {path:8s} cancelled {r['cancelled']}/{r['sessions']} "
                            f"(reply complete before the cancel: {r['done_before_cancel']}) heard after "
                            f"p50 {r['heard_after_p50_ms']:.0f} p99 {r['heard_after_p99_ms']:.0f} ms; "
                            f"history error p50 {r['history_error_p50_ms'] or 0:.0f} "
                            f"p99 {r['history_error_p99_ms'] or 0:.0f} ms"
                            + (f"; errors {r['errors']}" if r["errors"] else "")
                        )
                counters[policy] = {
                    "unpaced": _counters(st.ports["sidecar_admin"]),
                    "paced": _counters(paced_admin),
                }
            finally:
                paced.stop()
    return _write(ns, report, runs, counters)


def _write(
    ns: argparse.Namespace,
    report: Report,
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    counters: dict[str, dict[str, dict[str, float]]],
) -> dict[str, Any]:
    summary: dict[str, Any] = {"counters": counters}
    heard_rows, history_rows = [], []
    for path in PATHS:
        both = [r for policy in POLICIES for r in runs[policy][path]]
        heard = _pooled(both, "heard_after_ms")
        summary[path] = {
            "heard_after_p50_ms": _p(heard, 50),
            "heard_after_p99_ms": _p(heard, 99),
            "heard_after_max_ms": max(heard, default=None),
            "cancels": len(heard),
        }
        late = _pooled(both, "late_ms")
        delivery = [
            s["first_audio_to_done_s"]
            for r in both
            for s in r["sessions_raw"]
            if s.get("done_before_cancel") and s.get("first_audio_to_done_s")
        ]
        summary[path]["whole_reply_delivery_p50_s"] = _p(delivery, 50)
        complete = sum(r["done_before_cancel"] for r in both)
        heard_rows.append(
            [
                path,
                len(heard),
                complete,
                _p(heard, 50),
                _p(heard, 99),
                max(heard, default=None),
                sum(late) / max(1, len(late)),
                _p(delivery, 50),
            ]
        )
    for policy in POLICIES:
        summary[policy] = {}
        for path in PATHS:
            rs = runs[policy][path]
            error = _pooled(rs, "history_error_ms")
            heard_at = _pooled(rs, "heard_at_cancel_ms")
            history = _pooled(rs, "history_ms")
            share = _pooled(rs, "text_share_error_pct")
            found = sum(r["history_found"] for r in rs)
            held = sum(r["in_history"] for r in rs)
            summary[policy][path] = {
                "history_error_p50_ms": _p(error, 50),
                "history_error_p99_ms": _p(error, 99),
                "heard_at_cancel_p50_ms": _p(heard_at, 50),
                "history_p50_ms": _p(history, 50),
                "text_share_error_p50_pct": _p(share, 50),
                "text_share_error_p99_pct": _p(share, 99),
                "found": found,
                "in_history": held,
                "cancels": sum(r["cancelled"] for r in rs),
            }
            history_rows.append(
                [
                    policy,
                    path,
                    sum(r["cancelled"] for r in rs),
                    found,
                    held,
                    _p(heard_at, 50),
                    _p(history, 50),
                    _p(error, 50),
                    _p(error, 99),
                    max(error, default=None),
                    _p(share, 50),
                    _p(share, 99),
                ]
            )
    report.raw["runs"] = {
        policy: {path: [_columnar(r) for r in by_path[path]] for path in PATHS}
        for policy, by_path in runs.items()
    }
    report.raw["summary"] = summary
    n, reps = ns.bargein_sessions, ns.reps
    report.para(
        f"{reps} repetition(s) × {n} concurrent sessions per path and per commit policy (paths "
        f"interleaved, order rotated each repetition). Engine: `python -m engine_launcher.simulator "
        f"{' '.join(SIM_ARGS)} --playback-commit-policy POLICY` (4 s replies of 200 ms chunks "
        "generated at 4× real time, 3 late chunks after a cancel). Paths: *direct*; *unpaced* = "
        f"`omni-sidecar serve {' '.join(UNPACED_ARGS)}`; *paced* = `omni-sidecar serve "
        f"{' '.join(PACED_ARGS)}` (both with the default `playback_ack` auto). Each session plays "
        "its reply through the probe's 1x playout model (`proxy.probe.PlayoutBuffer`: playback "
        "starts at the first audio delta, and the buffer is **not** cleared on a cancel, like a "
        "telephony bridge) and sends `response.cancel` at a random playout time 0.2–3.8 s after "
        "its first delta (seeded; the same draw on every path)."
    )
    report.para(
        "**Old answer heard after the barge-in** = audio of the interrupted reply played after the "
        "cancel = what was buffered and unplayed at the cancel + that reply's audio that still "
        "arrived afterwards. Both policies' runs pooled (the policy does not change delivery). "
        "*reply complete* = the whole reply had arrived before the cancel (the engine was done; "
        "only the client's buffer was still talking); the last column is first delta → "
        "`response.done` of those replies: direct is the 4× generation under this load, paced is "
        "real time minus the lead."
    )
    report.table(
        [
            "path",
            "barge-ins",
            "reply complete before the cancel",
            "heard after p50 ms",
            "heard after p99 ms",
            "max ms",
            "late audio ms / barge-in",
            "whole 4 s reply delivered in s (p50)",
        ],
        heard_rows,
    )
    report.para(
        "**History vs. heard**: `GET /debug/history` of the simulator, read after every session's "
        "`response.done` plus 0.6 s and before the sockets close. *history ms* = the reply's "
        "`audio_ms` (where the text history holds ends), 0 when the reply is not in history. "
        "*heard ms* = the listener's position in the reply at the cancel (playout model). "
        "Error = |history ms − heard ms|. *Text share error* = |share of the generated text in "
        "history − share of the generated audio heard|, in percentage points (history is cut at "
        "word ends, so a few points are the text's granularity). Stock clients never ack, so "
        "directly the engine keeps a reply that completed before the barge-in whole "
        "(`commit_all_on_done`) or not at all (`ack_only`), and one cancelled while generating "
        "not at all (a cancel keeps only acknowledged audio); through the sidecar its acks and "
        "its truncation at the cancel put history where the listener was."
    )
    report.table(
        [
            "policy",
            "path",
            "barge-ins",
            "reply found",
            "reply in history",
            "heard ms p50",
            "history ms p50",
            "error p50 ms",
            "error p99 ms",
            "error max ms",
            "text share error p50 pp",
            "text share error p99 pp",
        ],
        history_rows,
    )
    if counters:
        parts = []
        for policy, by_path in counters.items():
            for path, values in by_path.items():
                text = ", ".join(f"`{k}` = {v:g}" for k, v in sorted(values.items()))
                parts.append(f"{policy} / {path}: {text}")
        report.para(
            "Sidecar counters after each policy's runs (admin /metrics):\n\n* " + "\n* ".join(parts)
        )
    checks = _checks(summary)
    summary["checks"] = checks
    report.para("Against the bounds of the playback ledger (docs/design.md, Playback):")
    report.table(["figure", "measured", "bound", "verdict"], checks)
    fig = _plot(runs, summary)
    written = report.write(f"python -m bench barge-in --reps {reps} --bargein-sessions {n}", fig)
    log(f"wrote {written}")
    return summary


def _checks(summary: dict[str, Any]) -> list[list[Any]]:
    """Rows of (figure, measured, bound, verdict) for the paced lead and the history error."""
    rows: list[list[Any]] = []
    paced = summary["paced"]["heard_after_p99_ms"]
    bound = LEAD_MS + CHUNK_MS
    rows.append(
        [
            "paced: old answer heard after barge-in p99 (ms)",
            paced,
            f"≤ {bound:g} (max_audio_lead + one chunk)",
            "met" if paced is not None and paced <= bound else "**not met**",
        ]
    )
    for policy in POLICIES:
        for path in ("unpaced", "paced"):
            error = summary[policy][path]["history_error_p99_ms"]
            rows.append(
                [
                    f"{policy}, {path}: history vs heard p99 (ms)",
                    error,
                    f"≤ {CHUNK_MS:g} (one chunk)",
                    "met" if error is not None and error <= CHUNK_MS else "**not met**",
                ]
            )
    return rows


def _plot(runs: dict[str, dict[str, list[dict[str, Any]]]], summary: dict[str, Any]) -> Any:
    fig, axes = figure(ncols=3, width=5.0)
    ax = axes[0][0]
    for path in PATHS:
        values = sorted(_pooled([r for p in POLICIES for r in runs[p][path]], "heard_after_ms"))
        if values:
            ax.step(
                values,
                [(i + 1) / len(values) for i in range(len(values))],
                where="post",
                label=path,
            )
    ax.axvline(500, color="red", linestyle="--", linewidth=1, label="max_audio_lead")
    ax.set_xlabel("old answer heard after barge-in (ms)")
    ax.set_ylabel("fraction of barge-ins")
    ax.set_title("heard after barge-in (CDF)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    for ax, policy in zip((axes[0][1], axes[0][2]), POLICIES, strict=True):
        for path in PATHS:
            xs = _pooled(runs[policy][path], "heard_at_cancel_ms")
            ys = [
                s.get("history_ms") or 0.0
                for r in runs[policy][path]
                for s in r["sessions_raw"]
                if s.get("heard_at_cancel_ms") is not None
            ]
            ax.scatter(xs, ys, s=6, alpha=0.5, label=path)
        ax.plot([0, 4000], [0, 4000], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("heard at the cancel (ms)")
        ax.set_ylabel("engine history audio_ms")
        ax.set_title(f"history vs heard, {policy}", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return fig
