"""``run_session`` (proxy/session/lifetime.py): a session's TaskGroup, failure and cleanup.

A relay that fails is logged and ended as failed, never raising for the peer's
behaviour; the cleanup always runs and is bounded by ``close_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from proxy.session.lifetime import run_session
from proxy.session.limits import RelayLimits
from tests.conftest import MS


class Relay:
    """A relay that records what its lifetime did to it."""

    def __init__(self, *, fail: bool = False, hang_on_close: bool = False) -> None:
        self.key = "s1"
        self.limits = RelayLimits(
            close_timeout=50 * MS, drain_timeout=1.0, upstream_close_timeout=1.0
        )
        self.log: logging.LoggerAdapter[Any] = logging.LoggerAdapter(
            logging.getLogger("omni_sidecar.test_lifetime"), {}
        )
        self.calls: list[str] = []
        self.fail = fail
        self.hang_on_close = hang_on_close
        self.child_done = False

    async def serve(self, tg: asyncio.TaskGroup) -> None:
        self.calls.append("serve")

        async def child() -> None:
            await asyncio.sleep(0)
            self.child_done = True

        tg.create_task(child())
        if self.fail:
            raise RuntimeError("boom")

    def failed(self) -> None:
        self.calls.append("failed")

    def finish(self) -> None:
        self.calls.append("finish")

    async def close_connections(self) -> None:
        self.calls.append("close_connections")
        if self.hang_on_close:
            await asyncio.Event().wait()


async def test_a_session_runs_its_tasks_then_finishes_and_closes() -> None:
    relay = Relay()
    await run_session(relay)
    assert relay.calls == ["serve", "finish", "close_connections"]
    assert relay.child_done, "the TaskGroup waited for the session's own task"


async def test_a_failure_is_logged_and_ends_the_session_as_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    relay = Relay(fail=True)
    with caplog.at_level(logging.ERROR, logger="omni_sidecar.test_lifetime"):
        await run_session(relay)  # does not raise
    assert relay.calls == ["serve", "failed", "finish", "close_connections"]
    assert any("session s1 failed" in r.getMessage() for r in caplog.records)


async def test_the_cleanup_is_bounded_by_the_close_timeout() -> None:
    relay = Relay(hang_on_close=True)
    await asyncio.wait_for(run_session(relay), timeout=100_000 * MS)
    assert relay.calls[-1] == "close_connections"


async def test_a_cancelled_session_still_cleans_up() -> None:
    started = asyncio.Event()

    class Stuck(Relay):
        async def serve(self, tg: asyncio.TaskGroup) -> None:
            started.set()
            await asyncio.Event().wait()

    relay = Stuck()
    task = asyncio.create_task(run_session(relay))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert relay.calls == ["finish", "close_connections"]
