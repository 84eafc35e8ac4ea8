"""``bench/results/summary.md``: every figure of the issue against its target."""

from __future__ import annotations

import math
from typing import Any

from bench.common import RESULTS_DIR
from bench.report import fmt

__all__ = ["write_summary"]


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _ok(value: Any, test: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return "met" if test(value) else "**not met**"


def write_summary(results: dict[str, Any], elapsed: float, command: str) -> str:
    rows: list[list[Any]] = []
    rt = results.get("realtime-latency")
    tp = results.get("throughput")
    st = results.get("stale-audio")
    sl = results.get("slow-client")
    cap = results.get("capacity")
    if st:
        v = _get(st, "sidecar", "late_max")
        rows.append(
            [
                "stale-audio: late audio frames per cancel, sidecar (max)",
                v,
                "0 (≤ 1 in flight)",
                _ok(v, lambda x: x <= 1),
            ]
        )
        for cfg in ("direct", "nginx"):
            rows.append(
                [
                    f"stale-audio: late audio s per cancel, {cfg}",
                    _get(st, cfg, "late_s_per_cancel"),
                    "(shows the engine's late chunks)",
                    "–",
                ]
            )
        rows.append(
            [
                "stale-audio: cancel→silence p50 / p99 ms, sidecar",
                f"{fmt(_get(st, 'sidecar', 'c2s_p50'))} / {fmt(_get(st, 'sidecar', 'c2s_p99'))}",
                "–",
                "–",
            ]
        )
    if rt:
        counts = sorted({int(k.split("/")[1]) for k in rt if k.count("/") == 2})
        lo = counts[0] if counts else 100
        for prof in ("minicpmo", "nemotron"):
            v = _get(rt, f"{prof}/{lo}/sidecar", "added_p99")
            rows.append(
                [
                    f"realtime: added p99 at {lo} sessions, {prof} (down)",
                    v,
                    "< 1 ms",
                    _ok(v, lambda x: x < 1.0),
                ]
            )
            v = _get(rt, f"{prof}/{lo}/sidecar", "added_up_p99")
            rows.append(
                [
                    f"realtime: added p99 at {lo} sessions, {prof} (up)",
                    v,
                    "< 1 ms",
                    _ok(v, lambda x: x < 1.0),
                ]
            )
        for prof in ("minicpmo", "nemotron"):
            for c in counts:
                v = rt.get(f"{prof}/{c}/ratio_bare")
                rows.append(
                    [
                        f"CPU per relayed event, sidecar ÷ bare aiohttp relay ({prof}, {c} sessions)",
                        v,
                        "≤ 1.0×",
                        _ok(v, lambda x: x <= 1.0),
                    ]
                )
                v = rt.get(f"{prof}/{c}/ratio_nginx")
                rows.append(
                    [
                        f"CPU per relayed event, sidecar ÷ nginx ({prof}, {c} sessions)",
                        v,
                        "≤ 1.5×",
                        _ok(v, lambda x: x <= 1.5),
                    ]
                )
                us = {k: _get(rt, f"{prof}/{c}/{k}", "us") for k in ("sidecar", "bare", "nginx")}
                rows.append(
                    [
                        f"  µs CPU per event ({prof}, {c}): sidecar / bare / nginx",
                        f"{fmt(us['sidecar'])} / {fmt(us['bare'])} / {fmt(us['nginx'])}",
                        "–",
                        "–",
                    ]
                )
    if tp:
        for chunk, target in ((40, 0.8), (500, 0.6)):
            counts = sorted({int(k.split("/")[1]) for k in tp if k.startswith(f"{chunk}/")})
            for c in counts:
                v = _get(tp, f"{chunk}/{c}/sidecar", "ratio")
                size = "2.8 KB" if chunk == 40 else "32 KB"
                rows.append(
                    [
                        f"burst throughput sidecar ÷ nginx, {size}, {c} sessions (ev/s)",
                        v,
                        f"≥ {target:.0%}",
                        _ok(v, lambda x, t=target: x >= t),
                    ]
                )
                v2 = _get(tp, f"{chunk}/{c}/sidecar", "ratio_cpu")
                rows.append(["  same, events per proxy CPU-second", v2, "–", "–"])
    if sl:
        rows.append(
            [
                "slow-client: sidecar RSS growth with 20 stalled (MB)",
                sl.get("rss_growth_mb_max"),
                f"≤ {fmt(sl.get('rss_bound_mb'))} MB",
                _ok(sl.get("rss_growth_mb_max"), lambda x: x <= sl["rss_bound_mb"]),
            ]
        )
        rows.append(
            [
                "slow-client: stalled sessions end with the overflow sequence",
                sl.get("overflow_sequence"),
                "20/20",
                "met" if sl.get("overflow_all") else "**not met**",
            ]
        )
        rows.append(
            [
                "slow-client: reading sessions p99 stalled ÷ not stalled",
                sl.get("p99_ratio_median"),
                "≤ 1.10",
                _ok(sl.get("p99_ratio_median"), lambda x: x <= 1.10),
            ]
        )
    if cap:
        for prof, target in (("minicpmo", 2000), ("nemotron", 500)):
            v = _get(cap, prof, "capacity")
            fail = _get(cap, prof, "first_failure")
            rows.append(
                [
                    f"capacity per sidecar core, {prof}-like (added p99 ≤ 5 ms)",
                    f"{v}" + (f" (failed at {fail})" if fail else " (no failure found)"),
                    f"≥ {target}",
                    _ok(v, lambda x, t=target: x >= t),
                ]
            )
            est = _get(cap, prof, "cpu_model_sessions_per_core")
            label = (
                f"  CPU model: sessions per fully busy core ({prof}, "
                f"{fmt(_get(cap, prof, 'us_per_event'))} µs/event)"
            )
            rows.append([label, est, f"≥ {target}", _ok(est, lambda x, t=target: x >= t)])
    lines = [
        "# Benchmark summary: figures against targets",
        "",
        f"`{command}` took {elapsed / 60:.1f} min. Details, per-run tables and plots: the other files here.",
        "",
        "| figure | measured | target | verdict |",
        "|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "summary.md").write_text(text)
    return text
