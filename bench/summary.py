"""``bench/results/summary.md``: every figure of the issue against its target."""

from __future__ import annotations

import math
from typing import Any

from bench.common import RESULTS_DIR
from bench.report import fmt

__all__ = ["PREVIOUS", "write_summary"]

#: The previous round's figures (bench/results/summary.md before the
#: performance work: aiohttp engine link, pure-Python core), by row.
PREVIOUS: dict[str, str] = {
    "stale-audio: late audio frames per cancel, sidecar (max)": "0",
    "realtime: added p99 at 100 sessions, minicpmo (down)": "0.59",
    "realtime: added p99 at 100 sessions, minicpmo (up)": "0.63",
    "realtime: added p99 at 100 sessions, nemotron (down)": "0.79",
    "realtime: added p99 at 100 sessions, nemotron (up)": "0.72",
    "CPU per relayed event, sidecar ÷ bare aiohttp relay (minicpmo, 100 sessions)": "1.35",
    "CPU per relayed event, sidecar ÷ bare aiohttp relay (minicpmo, 500 sessions)": "1.29",
    "CPU per relayed event, sidecar ÷ bare aiohttp relay (nemotron, 100 sessions)": "1.70",
    "CPU per relayed event, sidecar ÷ bare aiohttp relay (nemotron, 500 sessions)": "1.67",
    "CPU per relayed event, sidecar ÷ nginx (minicpmo, 100 sessions)": "2.08",
    "CPU per relayed event, sidecar ÷ nginx (minicpmo, 500 sessions)": "1.74",
    "CPU per relayed event, sidecar ÷ nginx (nemotron, 100 sessions)": "3.52",
    "CPU per relayed event, sidecar ÷ nginx (nemotron, 500 sessions)": "3.00",
    "  µs CPU per event (minicpmo, 100): sidecar / bare / bare-picows / nginx": "152 / 112 / – / 73",
    "  µs CPU per event (minicpmo, 500): sidecar / bare / bare-picows / nginx": "88 / 68 / – / 50",
    "  µs CPU per event (nemotron, 100): sidecar / bare / bare-picows / nginx": "98 / 58 / – / 28",
    "  µs CPU per event (nemotron, 500): sidecar / bare / bare-picows / nginx": "68 / 41 / – / 23",
    "burst throughput sidecar ÷ nginx, 2.8 KB, 1 sessions (ev/s)": "0.70",
    "burst throughput sidecar ÷ nginx, 2.8 KB, 10 sessions (ev/s)": "0.61",
    "burst throughput sidecar ÷ nginx, 2.8 KB, 100 sessions (ev/s)": "0.86",
    "burst throughput sidecar ÷ nginx, 32 KB, 1 sessions (ev/s)": "1.10",
    "burst throughput sidecar ÷ nginx, 32 KB, 10 sessions (ev/s)": "0.98",
    "burst throughput sidecar ÷ nginx, 32 KB, 100 sessions (ev/s)": "1.29",
    "slow-client: sidecar RSS growth with 20 stalled (MB)": "11.47 (same process, drift included)",
    "slow-client: stalled sessions end with the overflow sequence": "20/20",
    "slow-client: reading sessions p99 stalled ÷ not stalled": "0.89",
    "capacity per sidecar core, minicpmo-like (added p99 ≤ 5 ms)": "1500 (failed at 1750)",
    "capacity per sidecar core, nemotron-like (added p99 ≤ 5 ms)": "400 (failed at 500)",
}


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
                v = rt.get(f"{prof}/{c}/ratio_bare_picows")
                rows.append(
                    [
                        (
                            f"  sidecar ÷ bare relay with a picows engine link, the ceiling "
                            f"({prof}, {c} sessions)"
                        ),
                        v,
                        "–",
                        "–",
                    ]
                )
                us = {
                    k: _get(rt, f"{prof}/{c}/{k}", "us")
                    for k in ("sidecar", "bare", "bare-picows", "nginx")
                }
                rows.append(
                    [
                        f"  µs CPU per event ({prof}, {c}): sidecar / bare / bare-picows / nginx",
                        (
                            f"{fmt(us['sidecar'])} / {fmt(us['bare'])} / {fmt(us['bare-picows'])} / "
                            f"{fmt(us['nginx'])}"
                        ),
                        "–",
                        "–",
                    ]
                )
    if tp:
        for chunk, target in ((40, 0.9), (500, 1.0)):
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
        for prof, target in (("minicpmo", 2000), ("nemotron", 600)):
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
    from proxy.native import CORE_BUILD

    lines = [
        "# Benchmark summary: figures against targets",
        "",
        (
            f"`{command}` took {elapsed / 60:.1f} min, with the sidecar's core built as "
            f"`{CORE_BUILD}` (the install compiles it) and its default engine link (picows). "
            "*Previous round*: the same figure before this round's performance work (aiohttp "
            "engine link, Python core). Details, per-run tables and plots: the other files here."
        ),
        "",
        "| figure | measured | target | verdict | previous round |",
        "|---|---|---|---|---|",
    ]
    lines += [
        "| " + " | ".join(fmt(x) for x in row) + f" | {PREVIOUS.get(str(row[0]), '–')} |"
        for row in rows
    ]
    text = "\n".join(lines) + "\n"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "summary.md").write_text(text)
    return text
