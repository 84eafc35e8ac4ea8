"""The container tier's background image build (``CacheWarmup``): one per run, stopped
with everything it started.

It runs on every machine, podman or not: the build is replaced by small Python
children, since what is checked is the harness's promise to the suite (one
build per pytest-xdist run, a stop that leaves nothing of its process group and
signals no one else), not the image.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from tests.children import is_alive
from tests.conftest import DEADLINE, RUN_FIRST, RUN_LAST, wait_until, xdist_queues
from tests.integration.container_image import REPO_ROOT, WARMUP_ENV, CacheWarmup, warm_during

#: Says its pid and idles; SIGTERM ends it (Python's default).
_IDLE = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
#: Ignores SIGTERM: only the SIGKILL to its group after the timeout ends it.
_STUBBORN = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print(os.getpid(), flush=True); time.sleep(60)"
)
#: Starts a stubborn child in its own process group, says the child's pid, then idles.
_LEAVES_A_CHILD = (
    "import subprocess, sys, time;"
    f"c = subprocess.Popen([sys.executable, '-c', {_STUBBORN!r}], stdout=subprocess.PIPE);"
    "print(c.stdout.readline().decode().strip(), flush=True); time.sleep(60)"
)


async def _first_line(log: Path) -> int:
    await wait_until(lambda: log.exists() and log.read_text().endswith("\n"), what="a pid")
    return int(log.read_text().splitlines()[0])


async def test_one_warmup_per_run_and_its_stop_ends_it(tmp_path: Path) -> None:
    """The second worker of a run starts none; stop is SIGTERM, reaped, marker removed."""
    command = [sys.executable, "-c", _IDLE]
    first = CacheWarmup.start("run-1", command, cache=tmp_path)
    assert first is not None
    try:
        assert CacheWarmup.start("run-1", command, cache=tmp_path) is None
        await _first_line(tmp_path / "warmup.log")
    finally:
        status = first.stop(timeout=DEADLINE)
    assert status == -signal.SIGTERM
    assert list(tmp_path.glob("warmup-*.started")) == []
    other = CacheWarmup.start("run-2", [sys.executable, "-c", "pass"], cache=tmp_path)
    assert other is not None, "another run starts its own"
    await wait_until(lambda: other.proc.poll() is not None, what="a warm-up done by itself")
    assert other.stop(timeout=DEADLINE) == 0


async def test_stop_kills_what_the_warmup_left_in_its_group(tmp_path: Path) -> None:
    """A child of the build that ignores SIGTERM is killed with the group, nothing else is."""
    bystander = CacheWarmup.start(None, [sys.executable, "-c", _IDLE], cache=tmp_path / "b")
    warmup = CacheWarmup.start(None, [sys.executable, "-c", _LEAVES_A_CHILD], cache=tmp_path)
    assert bystander is not None and warmup is not None
    try:
        child = await _first_line(tmp_path / "warmup.log")
        assert os.getpgid(child) == warmup.proc.pid
        assert warmup.stop(timeout=DEADLINE) == -signal.SIGTERM
        await wait_until(lambda: not is_alive(child), what="the warm-up's child gone")
        assert bystander.proc.poll() is None, "a process outside the group was signalled"
    finally:
        warmup.stop(timeout=0)
        bystander.stop(timeout=DEADLINE)


@pytest.mark.timeout(DEADLINE * 3)
async def test_a_warmup_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    warmup = CacheWarmup.start(None, [sys.executable, "-c", _STUBBORN], cache=tmp_path)
    assert warmup is not None
    await _first_line(tmp_path / "warmup.log")
    assert warmup.stop(timeout=0.2) == -signal.SIGKILL


def test_the_build_context_leaves_out_what_a_test_run_writes_beside_the_sources() -> None:
    """Bytecode and compiled modules in the checkout would change the COPY layers' keys,
    and every run of the suite (which writes bytecode) would rebuild the install layer."""
    ignore = REPO_ROOT / ".dockerignore"
    patterns = {
        line.strip()
        for line in ignore.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    missing = {"**/__pycache__", "**/*.so", ".venv*", ".cache"} - patterns
    assert not missing, f"{ignore.name} lets the build see {sorted(missing)}"


async def test_wait_is_true_once_the_warmup_ended_by_itself(tmp_path: Path) -> None:
    running = CacheWarmup.start(None, [sys.executable, "-c", _IDLE], cache=tmp_path / "r")
    done = CacheWarmup.start(None, [sys.executable, "-c", "pass"], cache=tmp_path / "d")
    assert running is not None and done is not None
    try:
        assert done.wait(DEADLINE)
        assert not running.wait(0.1)
    finally:
        assert done.stop() == 0
        running.stop(timeout=DEADLINE)


@pytest.mark.parametrize(("workers", "others"), [(1, 7), (2, 7), (2, 40), (3, 11)])
def test_each_workers_first_queue_starts_long_and_ends_with_the_container_tier(
    workers: int, others: int
) -> None:
    """xdist gives worker k the k-th slice (``len // workers`` of what is left): every
    slice begins with its share of RUN_FIRST and ends with its share of RUN_LAST."""
    first = [f"{RUN_FIRST[n % len(RUN_FIRST)]}::test_{n}" for n in range(2)]
    last = [f"{RUN_LAST[0]}::test_{n}" for n in range(5)]
    rest = [f"tests/proxy/test_unit.py::test_{n}" for n in range(others)]
    items = [SimpleNamespace(nodeid=name) for name in [*rest[:3], *last, *first, *rest[3:]]]
    ordered = [item.nodeid for item in xdist_queues(cast(list[pytest.Item], items), workers)]
    assert sorted(ordered) == sorted(item.nodeid for item in items)
    # xdist's first split, worked out here rather than taken from conftest: an oracle.
    slices, left, start = [], len(ordered), 0
    for k in range(workers):
        size = left // (workers - k)
        slices.append(ordered[start : start + size])
        start, left = start + size, left - size
    for queue in slices:
        kinds = ["first" if n in first else "last" if n in last else "rest" for n in queue]
        assert kinds == sorted(kinds, key=["first", "rest", "last"].index), queue
    if workers <= len(first):  # every worker starts on a long one
        assert all(queue[0] in first for queue in slices), slices
    assert all(any(n in last for n in queue) for queue in slices), slices


async def test_make_test_runs_its_steps_beside_the_build_and_stops_it_after(
    tmp_path: Path,
) -> None:
    """warm-during (``make test``): the steps' exit status, the suite told that a build
    runs, and a build still running when the steps end is stopped."""
    log = tmp_path / "warmup.log"
    # The steps first wait for the build to have said its pid, so the check below
    # means something, then exit 3 if they were told that a build runs (4 if not).
    steps = (
        "import os, pathlib, sys, time\n"
        f"while not pathlib.Path({str(log)!r}).read_text():\n"
        "    time.sleep(0.01)\n"
        f"sys.exit(3 if os.environ.get({WARMUP_ENV!r}) == '1' else 4)\n"
    )
    status = await asyncio.to_thread(
        warm_during,
        [sys.executable, "-c", steps],
        [sys.executable, "-c", _IDLE],
        tmp_path,
    )
    assert status == 3
    pid = int(log.read_text().split()[0])
    assert not is_alive(pid), "the build outlived make test's steps"
