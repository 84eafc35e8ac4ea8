"""Shared plumbing of the benchmarks: processes, /proc readings, statistics.

Everything runs on 127.0.0.1. Processes are pinned with ``taskset``: the
proxy under test gets its own core (``PROXY_CPU``) and everything else (engine,
load client, this orchestrator) shares ``LOAD_CPU``. Every long-lived child is
a :class:`tests.children.ChildProcess` (the tests' harness): started in its own
process group, ready on a condition under a deadline (a failure quotes its
log), stopped with SIGTERM, then SIGKILL to its group only. :func:`start` and
:func:`started` add the pinning and the niceness.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from tests.children import ChildProcess, free_port

__all__ = [
    "BENCH_DIR",
    "LOAD_CPU",
    "PROXY_CPU",
    "RESULTS_DIR",
    "ROOT",
    "Proc",
    "child_env",
    "cpu_prefix",
    "cpu_times",
    "free_port",
    "log_path_for",
    "percentile",
    "pin_self",
    "proc_cpu_seconds",
    "proc_rss_bytes",
    "python",
    "renice_autogroup",
    "run_json",
    "start",
    "started",
]

BENCH_DIR: Final = Path(__file__).resolve().parent
ROOT: Final = BENCH_DIR.parent
RESULTS_DIR: Final = BENCH_DIR / "results"

_NCPU: Final = os.cpu_count() or 1
#: The proxy under test runs alone on the last core; everything else on core 0.
PROXY_CPU: Final = _NCPU - 1 if _NCPU > 1 else 0
LOAD_CPU: Final = 0
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
PAGE: Final = os.sysconf("SC_PAGE_SIZE")


#: Niceness of every benchmark process (the anchors ran at -10); set by ``--nice``.
NICE = 0


def set_nice(value: int) -> None:
    global NICE
    NICE = value


def cpu_prefix(cpu: int) -> list[str]:
    """``nice``/``taskset`` in front of a command: pinned to ``cpu`` at ``NICE``."""
    out: list[str] = []
    if NICE:
        out += ["nice", "-n", str(NICE)]
    taskset = shutil.which("taskset")
    if taskset:
        out += [taskset, "-c", str(cpu)]
    return out


def renice_autogroup(pid: int) -> None:
    """Apply ``NICE`` to the process's scheduler autogroup as well.

    With ``kernel.sched_autogroup_enabled`` each session (``setsid``) is its own
    CFS group and a process's nice value only ranks it inside that group;
    ``/proc/PID/autogroup`` sets the group's weight against other sessions.
    """
    if not NICE:
        return
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(NICE))


def python() -> str:
    """The interpreter of the project's venv (the one running us)."""
    return sys.executable


def pin_self() -> None:
    """Put the orchestrator itself on the load core (it mostly sleeps)."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {LOAD_CPU})
    if NICE:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, NICE)


class Proc(ChildProcess):
    """A benchmark child started by :func:`start`: the tests' harness, pinned and niced."""

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its log."""
        return "\n".join(self.log().splitlines()[-lines:])


_Child = TypeVar("_Child", bound=ChildProcess)


_LOG_DIR: Path | None = None


def log_dir() -> Path:
    global _LOG_DIR
    if _LOG_DIR is None:
        _LOG_DIR = Path(tempfile.mkdtemp(prefix="omni-bench-"))
    return _LOG_DIR


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A benchmark child's environment: ours, unbuffered output, plus ``env``."""
    merged = dict(os.environ)
    merged.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        merged.update(env)
    return merged


def log_path_for(name: str) -> Path:
    """A fresh log file name for child ``name`` in this run's log directory."""
    return log_dir() / f"{name}-{int(time.time() * 1000)}.log"


def start(
    name: str,
    argv: Sequence[str],
    *,
    cpu: int,
    env: dict[str, str] | None = None,
    ready_port: int | None = None,
    ready_timeout: float = 20.0,
    stop_grace: float = 5.0,
) -> Proc:
    """Start ``argv`` pinned to ``cpu`` in its own process group, output to a log.

    Returns once ``ready_port`` accepts TCP (None: once spawned, e.g. a load
    client); a child that exits first or misses ``ready_timeout`` fails with
    its log tail and is stopped.
    """
    child = Proc(
        name, argv, ready_port=ready_port, env=child_env(env), log_path=log_path_for(name),
        cwd=ROOT, prefix=cpu_prefix(cpu), stop_grace=stop_grace, ready_timeout=ready_timeout,
    )  # fmt: skip
    return started(child)


def started(child: _Child) -> _Child:
    """Start ``child`` (its argv already pinned), give its autogroup ``NICE``, wait till ready.

    Stopped again when it does not get ready.
    """
    child.start()
    renice_autogroup(child.pid)
    try:
        child.wait_ready()
    except BaseException:
        child.stop()
        raise
    return child


def run_json(argv: Sequence[str], *, cpu: int, timeout: float) -> dict[str, Any]:
    """Run a pinned child that prints one JSON object on its last stdout line."""
    full = [*cpu_prefix(cpu), *argv]
    proc = subprocess.Popen(
        full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    renice_autogroup(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    out = stdout.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not out:
        raise RuntimeError(
            f"{argv[1:3]} failed ({proc.returncode}): {stderr.decode(errors='replace')[-2000:]}"
        )
    result: dict[str, Any] = json.loads(out[-1])
    return result


# -- /proc ------------------------------------------------------------------------------


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (0 when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw[raw.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def cpu_times() -> dict[str, tuple[float, float]]:
    """Per-core (busy, total) jiffies from /proc/stat, keyed 'cpu0', 'cpu1', ..."""
    out: dict[str, tuple[float, float]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *vals = line.split()
            nums = [float(v) for v in vals[:8]]
            idle = nums[3] + nums[4]
            total = sum(nums)
            out[name] = (total - idle, total)
    return out


# -- statistics ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return float(ordered[k])


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return float("nan")
    ordered = sorted(clean)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@contextlib.contextmanager
def stopping(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.stop()
