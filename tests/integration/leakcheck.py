"""Resource snapshots for leak checks: tasks, open fds, child processes, RSS.

Everything is read from ``/proc`` (Linux), for this process or another one.
A test takes a :class:`Snapshot` once the sidecar is warm (after a first
session, so lazily created pools are already there), runs the scenario, then
calls :func:`wait_settled`, which polls until every quantity is back within
its slack or fails the test with the numbers.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import DEADLINE, MS

__all__ = [
    "MIB",
    "Slack",
    "Snapshot",
    "child_pids",
    "open_fds",
    "rss_bytes",
    "task_count",
    "wait_settled",
]

MIB = 1024 * 1024


def task_count() -> int:
    """Tasks alive in the running event loop (the caller's own task included)."""
    return len(asyncio.all_tasks())


def open_fds(pid: int | str = "self") -> int:
    """Open file descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of ``pid`` (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def child_pids(pid: int | str = "self") -> list[int]:
    """Live (non-zombie) children of ``pid``."""
    parent = str(os.getpid() if pid == "self" else pid)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2 and fields[1] == parent and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


@dataclass(frozen=True)
class Slack:
    """How much growth still counts as "no leak"."""

    tasks: int = 2
    fds: int = 4
    rss_bytes: int = 32 * MIB
    children: int = 0


@dataclass(frozen=True)
class Snapshot:
    """Resources of one process; ``tasks`` only for the calling process."""

    pid: int | str = "self"
    tasks: int | None = None
    fds: int = 0
    rss: int = 0
    children: tuple[int, ...] = field(default=())

    @classmethod
    def take(cls, pid: int | str = "self") -> Snapshot:
        return cls(
            pid=pid,
            tasks=task_count() if pid == "self" else None,
            fds=open_fds(pid),
            rss=rss_bytes(pid),
            children=tuple(child_pids(pid)),
        )

    def growth(self, later: Snapshot) -> dict[str, int]:
        """``later`` minus ``self`` per quantity."""
        out = {
            "fds": later.fds - self.fds,
            "rss_bytes": later.rss - self.rss,
            "children": len(later.children) - len(self.children),
        }
        if self.tasks is not None and later.tasks is not None:
            out["tasks"] = later.tasks - self.tasks
        return out

    def within(self, later: Snapshot, slack: Slack) -> bool:
        grown = self.growth(later)
        return (
            grown.get("tasks", 0) <= slack.tasks
            and grown["fds"] <= slack.fds
            and grown["rss_bytes"] <= slack.rss_bytes
            and grown["children"] <= slack.children
        )

    def describe(self, later: Snapshot) -> str:
        grown = self.growth(later)
        parts = [
            f"fds {self.fds}->{later.fds}",
            f"rss {self.rss / MIB:.1f}->{later.rss / MIB:.1f} MiB",
            f"children {len(self.children)}->{len(later.children)}",
        ]
        if "tasks" in grown:
            parts.insert(0, f"tasks {self.tasks}->{later.tasks}")
        return ", ".join(parts)


async def wait_settled(
    before: Snapshot, slack: Slack = Slack(), *, timeout: float = DEADLINE, what: str = ""
) -> Snapshot:
    """Poll until resources are back within ``slack`` of ``before``; return the last snapshot.

    Prints the before/after numbers (the issue asks for them to be quoted).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        now = Snapshot.take(before.pid)
        if before.within(now, slack):
            print(f"leakcheck {what}: {before.describe(now)}")
            return now
        if loop.time() >= deadline:
            pytest.fail(f"leak after {what or 'scenario'}: {before.describe(now)} (slack {slack})")
        await asyncio.sleep(20 * MS)
