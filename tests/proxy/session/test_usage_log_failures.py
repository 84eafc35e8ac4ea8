"""A usage file the disk refuses (proxy/session/usage_log.py): counted per record, logged
rarely (docs/design.md, Usage).

A full disk used to log one WARNING per ended session. Now: one line at the
first lost record, then at most one a minute with the count lost since the
previous line, and one when writes work again or the writer stops. The
writer's clock is injected, so "a minute" passes without waiting for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from proxy.session.usage_log import FAILURE_LOG_INTERVAL, UsageFile

DEADLINE = 10.0
LOGGER = "proxy.session.usage_log"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Lost:
    """Counts the writer's failure callbacks (the dropped-records counter's feed)."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    def __call__(self) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait_for(self, count: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.count >= count, DEADLINE), self.count


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= 30]


def wait_for_lines(caplog: pytest.LogCaptureFixture, count: int) -> list[str]:
    """The writer thread counts a record before it logs it: wait for the line itself."""
    deadline = time.monotonic() + DEADLINE
    while len(warnings(caplog)) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    return warnings(caplog)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_disk_logs_once_then_once_a_minute_with_the_count_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock, lost = Clock(), Lost()
    writer = UsageFile(
        "/dev/full", max_bytes=1 << 20, backups=0, max_pending=1000, on_failure=lost, clock=clock
    )
    for n in range(50):
        assert writer.put({"n": n})
    lost.wait_for(50)
    assert len(wait_for_lines(caplog, 1)) == 1, warnings(caplog)
    assert "cannot write a record" in warnings(caplog)[0]
    clock.now = FAILURE_LOG_INTERVAL / 2
    for n in range(10):
        writer.put({"n": n})
    lost.wait_for(60)
    assert len(warnings(caplog)) == 1, "a second line within the minute"
    clock.now = FAILURE_LOG_INTERVAL + 1
    writer.put({"n": 60})
    lost.wait_for(61)
    lines = wait_for_lines(caplog, 2)
    assert len(lines) == 2, lines
    assert "60 records lost since the last warning, 61 in all" in lines[1]
    writer.put({"n": 61})
    writer.close(DEADLINE)
    lines = warnings(caplog)
    assert len(lines) == 3, lines
    assert "1 records lost since the last warning, 62 in all, when the writer stopped" in lines[2]
    assert lost.count == 62


def test_writes_that_work_again_say_how_many_records_were_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    lost = Lost()
    folder = tmp_path / "not-yet"
    writer = UsageFile(
        str(folder / "usage.jsonl"), max_bytes=1 << 20, backups=0, max_pending=100, on_failure=lost
    )
    for n in range(5):
        writer.put({"n": n})
    lost.wait_for(5)
    folder.mkdir()
    writer.put({"n": 5})
    writer.close(DEADLINE)
    lines = warnings(caplog)
    assert len(lines) == 2, lines
    assert "writing again; 5 records were lost (4 since the last warning)" in lines[1]
    assert (folder / "usage.jsonl").read_bytes() == b'{"n":5}\n'
