"""The child-process harness itself (tests/children.py): readiness, failures, stopping.

Each case starts its own small child (the simulator, or a Python one-liner)
and checks what the harness promises its callers: a failure names what it
waited on and quotes the child's log; stop is SIGTERM, then SIGKILL after the
grace, and the child is reaped.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from tests.children import ChildNotReady, ChildProcess, SimulatorChild, free_port
from tests.conftest import DEADLINE, wait_until

#: A child that ignores SIGTERM, says so, and idles (SIGKILL is the only way out).
_STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ignoring SIGTERM', flush=True); time.sleep(60)"
)


def test_a_child_that_exits_fails_with_its_status_and_log(tmp_path: Path) -> None:
    sim = SimulatorChild("--no-such-flag", log_path=tmp_path / "sim.log", ready_timeout=DEADLINE)
    with pytest.raises(ChildNotReady) as failed, sim:
        pass
    text = str(failed.value)
    assert "simulator exited with 2" in text, text
    assert "/health 200" in text and "--no-such-flag" in text, text
    assert sim.returncode == 2


async def test_a_child_never_ready_fails_at_the_deadline_and_is_stopped(tmp_path: Path) -> None:
    child = ChildProcess(
        "stubborn", [sys.executable, "-c", _STUBBORN], ready_port=free_port(), ready_path=None,
        log_path=tmp_path / "stubborn.log", ready_timeout=2.0, stop_grace=0.3,
    )  # fmt: skip
    with pytest.raises(ChildNotReady) as failed:
        async with child:
            pass
    text = str(failed.value)
    assert "stubborn not ready after 2.0 s" in text and "to accept TCP" in text, text
    assert "ignoring SIGTERM" in text, text
    # It ignored SIGTERM for the grace, then SIGKILL: reaped, not left behind.
    assert child.returncode == -signal.SIGKILL


def test_stop_is_sigterm_first_and_reaps(tmp_path: Path) -> None:
    with SimulatorChild(log_path=tmp_path / "sim.log", ready_timeout=DEADLINE) as sim:
        assert sim.running()
    assert sim.returncode == 0  # the simulator exits 0 on SIGTERM: no SIGKILL was needed


async def test_async_stop_of_a_stubborn_child_kills_after_the_grace(tmp_path: Path) -> None:
    child = ChildProcess(
        "stubborn", [sys.executable, "-c", _STUBBORN], ready_port=0, ready_path=None,
        log_path=tmp_path / "stubborn.log", stop_grace=0.3,
    )  # fmt: skip
    child.start()
    await wait_until(lambda: "ignoring SIGTERM" in child.log(), what="the handler installed")
    assert await child.astop() == -signal.SIGKILL
    assert not child.running()
