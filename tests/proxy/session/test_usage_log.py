"""The usage file's writer (proxy/session/usage_log.py): bounded queue, rotation, failures counted.

docs/design.md, Usage: at most ``usage_file_max_pending`` records wait for the
writer thread; one more is dropped (``put`` says so), never queued.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson
import pytest

from proxy.session.usage_log import UsageFile

DEADLINE = 10.0


def test_a_writer_that_falls_behind_drops_beyond_max_pending(tmp_path: Path) -> None:
    # A FIFO with no reader: the writer thread blocks opening it, as on a stuck disk.
    path = tmp_path / "usage.fifo"
    os.mkfifo(path)
    writer = UsageFile(str(path), max_bytes=1 << 20, backups=0, max_pending=3)
    accepted = [writer.put({"n": n}) for n in range(10)]
    # The thread may have taken one record off the queue before it blocked.
    assert 3 <= sum(accepted) <= 4
    assert accepted[: sum(accepted)] == [True] * sum(accepted)
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(path.open("rb").read().splitlines()))
    reader.start()
    writer.close(DEADLINE)
    reader.join(DEADLINE)
    assert [orjson.loads(line)["n"] for line in lines] == list(range(sum(accepted)))


def test_rotation_keeps_backups_and_the_size_bound(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    writer = UsageFile(str(path), max_bytes=4096, backups=2, max_pending=1000)
    for n in range(200):
        assert writer.put({"n": n, "pad": "x" * 80})
    writer.close(DEADLINE)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["usage.jsonl", "usage.jsonl.1", "usage.jsonl.2"]
    kept: list[int] = []
    for name in ("usage.jsonl.2", "usage.jsonl.1", "usage.jsonl"):
        data = (tmp_path / name).read_bytes()
        assert 0 < len(data) <= 4096
        kept += [orjson.loads(line)["n"] for line in data.splitlines()]
    assert kept == list(range(200 - len(kept), 200))  # the newest, in order


def test_no_backups_truncates(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    writer = UsageFile(str(path), max_bytes=4096, backups=0, max_pending=1000)
    for n in range(100):
        writer.put({"n": n, "pad": "x" * 80})
    writer.close(DEADLINE)
    assert [p.name for p in tmp_path.iterdir()] == ["usage.jsonl"]
    assert 0 < path.stat().st_size <= 4096


def test_a_record_the_disk_refuses_is_counted(tmp_path: Path) -> None:
    failures: list[int] = []
    writer = UsageFile(
        str(tmp_path / "missing-dir" / "usage.jsonl"),
        max_bytes=4096,
        backups=1,
        max_pending=10,
        on_failure=lambda: failures.append(1),
    )
    assert writer.put({"n": 1}) and writer.put({"n": 2})
    writer.close(DEADLINE)
    assert len(failures) == 2


@pytest.mark.parametrize("backups", [1, 3])
def test_reopening_appends(tmp_path: Path, backups: int) -> None:
    path = tmp_path / "usage.jsonl"
    for n in range(2):
        writer = UsageFile(str(path), max_bytes=4096, backups=backups, max_pending=10)
        writer.put({"n": n})
        writer.close(DEADLINE)
    assert [orjson.loads(line)["n"] for line in path.read_bytes().splitlines()] == [0, 1]
