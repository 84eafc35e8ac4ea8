"""Markdown tables, PNG plots and the raw JSON of each scenario, in bench/results/."""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common
from bench.common import RESULTS_DIR

__all__ = ["Report", "fmt"]


def fmt(value: Any, digits: int = 2) -> str:
    """Numbers for tables: '–' for missing, fixed digits, thousands as 12.3k."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if abs(value) >= 10_000:
            return f"{value / 1000:.1f}k"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}f}"
    return str(value)


class Report:
    """Collects sections of one scenario and writes ``NAME.md``, ``NAME.png``, ``NAME.json``."""

    def __init__(self, name: str, title: str) -> None:
        self.name = name
        self.title = title
        self.lines: list[str] = []
        self.raw: dict[str, Any] = {"scenario": name, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.t0 = time.monotonic()

    def para(self, text: str) -> None:
        self.lines += [text, ""]

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.lines.append("| " + " | ".join(header) + " |")
        self.lines.append("|" + "---|" * len(header))
        for row in rows:
            self.lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
        self.lines.append("")

    def write(self, command: str, fig: Any = None) -> Path:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        elapsed = time.monotonic() - self.t0
        self.raw["elapsed_s"] = elapsed
        nice = f"; every benchmark process at nice {common.NICE}" if common.NICE else ""
        intro = (
            f"Run {self.raw['started']} on {platform.node() or 'host'} "
            f"(Python {platform.python_version()}), {elapsed:.0f} s. Command: `{command}`. "
            f"Pinning: proxy under test alone on cpu1, engine + load client + orchestrator on cpu0"
            f"{nice}."
        )
        head = [f"# {self.title}", "", intro, ""]
        if fig is not None:
            png = RESULTS_DIR / f"{self.name}.png"
            fig.savefig(png, dpi=90, bbox_inches="tight")
            import matplotlib.pyplot as plt

            plt.close(fig)
            head += [f"![{self.name}]({png.name})", ""]
        path = RESULTS_DIR / f"{self.name}.md"
        path.write_text("\n".join(head + self.lines))
        (RESULTS_DIR / f"{self.name}.json").write_text(json.dumps(self.raw, indent=1, default=str))
        return path


def figure(ncols: int = 1, nrows: int = 1, width: float = 6.0, height: float = 3.6) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes


def bars(
    ax: Any,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    ylabel: str,
    title: str,
    log: bool = False,
    hline: float | None = None,
) -> None:
    """Grouped bar chart: one group per x label, one bar per series."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [0.0 if v is None or math.isnan(v) else v for v in values], width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    if hline is not None:
        ax.axhline(hline, color="red", linestyle="--", linewidth=1)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
