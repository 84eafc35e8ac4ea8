"""The quota store's counts across a Redis that fails or loses its data, against a real
``redis-server`` child (docs/design.md, Quotas: When Redis lost its data / fails).

``QuotaGate`` is driven directly (its periodic ``check`` called by the test, wall time
injected); another sidecar's charges are written into Redis by the test itself.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from metrics import SidecarMetrics
from proxy.core.quota_rules import KeyQuota, day_window
from proxy.edge.quota_store import QuotaGate
from tests.children import RedisChild
from tests.conftest import DEADLINE, wait_until

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed"
)

#: A fixed wall time (Unix seconds): one UTC day throughout.
WALL = 1_800_000_000.0
DAY_KEY = f"omni_sidecar:quota:day:k:{day_window(WALL)}"
#: How long Redis stops answering (ms): several of the gate's 0.2 s call timeouts.
PAUSE_MS = 1000


class Meter:
    """A running session's audio so far (what ``UsageMeter.quota_seconds`` answers)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def quota_seconds(self) -> float:
        return self.seconds


async def _redis_client(port: int) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0, decode_responses=True)


@pytest.fixture
async def gate_on(tmp_path: Path) -> AsyncIterator[Any]:
    gates: list[QuotaGate] = []

    def make(port: int) -> tuple[QuotaGate, Meter]:
        gate = QuotaGate(
            SidecarMetrics(CollectorRegistry(), process_metrics=False),
            redis_url=f"redis://127.0.0.1:{port}/0",
            timeout=0.2,
            wall=lambda: WALL,
        )
        gate.quotas = {"k": KeyQuota(audio_seconds_per_day=10_000.0)}
        gates.append(gate)
        return gate, Meter()

    yield make
    for gate in gates:
        await gate.close()


async def _day_total(port: int) -> float:
    ours = await _redis_client(port)
    try:
        return float(await ours.get(DAY_KEY) or 0.0)
    finally:
        await ours.aclose()


async def test_audio_counted_while_redis_was_down_is_in_the_reseeded_count(
    tmp_path: Path, gate_on: Any
) -> None:
    """Redis answered a shared total (others' audio included), then went away; this
    process counted more audio alone; Redis came back empty. The reseed raises the day
    to the last shared total *plus* what was counted while Redis was down."""
    with RedisChild(tmp_path, ready_timeout=DEADLINE, stop_grace=DEADLINE) as first:
        await first.ready()
        port = first.port
        gate, meter = gate_on(port)
        assert await gate.admit("k", "s1") is None
        gate.attach("s1", meter, lambda message: None)
        meter.seconds = 10.0
        await gate.check()
        ours = await _redis_client(port)
        try:
            await ours.incrbyfloat(DAY_KEY, 50.0)  # another sidecar's audio
        finally:
            await ours.aclose()
        meter.seconds = 15.0
        await gate.check()
        assert await _day_total(port) == pytest.approx(65.0)
    # Redis is gone: this process counts 20 s alone.
    meter.seconds = 35.0
    await gate.check()
    assert gate.readiness()["state"] == "degraded"
    with RedisChild(tmp_path, port=port, ready_timeout=DEADLINE, stop_grace=DEADLINE) as second:
        await second.ready()
        await gate.check()  # answers again, empty: reseeded
        assert gate.readiness()["state"] == "ok"
        assert await _day_total(port) == pytest.approx(85.0)
        meter.seconds = 36.0
        await gate.check()  # and charged on from there, the down time not twice
        assert await _day_total(port) == pytest.approx(86.0)


async def test_audio_counted_while_redis_did_not_answer_is_charged_when_it_answers(
    tmp_path: Path, gate_on: Any
) -> None:
    """Redis stops answering but keeps its data (paused, not restarted): what this
    process counted meanwhile is added to the shared day once it answers again."""
    with RedisChild(tmp_path, ready_timeout=DEADLINE, stop_grace=DEADLINE) as redis:
        await redis.ready()
        port = redis.port
        gate, meter = gate_on(port)
        assert await gate.admit("k", "s1") is None
        gate.attach("s1", meter, lambda message: None)
        meter.seconds = 10.0
        await gate.check()
        ours = await _redis_client(port)
        try:  # five quota_redis_timeouts: the next check's calls are late
            await ours.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
        finally:
            await ours.aclose()
        meter.seconds = 30.0
        await gate.check()
        assert gate.readiness()["state"] == "degraded"
        meter.seconds = 31.0

        async def answers_again() -> bool:
            await gate.check()
            return gate.readiness()["state"] == "ok"

        await wait_until(answers_again, what="redis answers after its pause")
        assert await _day_total(port) == pytest.approx(31.0)


async def test_audio_counted_before_redis_ever_answered_is_reseeded_once(
    tmp_path: Path, gate_on: Any
) -> None:
    """Redis was down from the start: everything this process counted goes to it once
    it answers, not twice (its own count and its unshared part are one audio)."""
    first = RedisChild(tmp_path, ready_timeout=DEADLINE, stop_grace=DEADLINE)
    gate, meter = gate_on(first.port)  # nothing listens there yet
    assert await gate.admit("k", "s1") is None
    gate.attach("s1", meter, lambda message: None)
    meter.seconds = 20.0
    await gate.check()
    assert gate.readiness()["state"] == "degraded"
    with first:
        await first.ready()
        await gate.check()
        assert gate.readiness()["state"] == "ok"
        assert await _day_total(first.port) == pytest.approx(20.0)
