"""Which resume tokens are spent, across a fleet (proxy/edge/resume_spent.py;
docs/design.md, Resume), against a real ``redis-server`` child.

Two ``SpentTokens`` on one Redis stand for two sidecars of a fleet: a generation
one records spends every older one for the other. A check Redis does not answer
falls back to this process's record, and is counted.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from metrics import SidecarMetrics
from proxy.edge.resume_spent import SpentTokens
from tests.children import RedisChild
from tests.conftest import DEADLINE, free_port

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed"
)

FALLBACKS = "omni_sidecar_resume_spent_check_fallbacks_total"
CHECKS = "omni_sidecar_resume_spent_checks_total"


def _metrics() -> tuple[SidecarMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return SidecarMetrics(registry, process_metrics=False), registry


async def test_a_burst_past_the_pool_waits_for_a_connection_and_every_check_reaches_redis(
    tmp_path: Path,
) -> None:
    """32 calls of one key come back at once after a blip: each resumed where it is
    held records its next generation. With 4 pooled connections every record still
    reaches Redis (a call waits for a connection), so another sidecar refuses each
    older token."""
    with RedisChild(tmp_path, ready_timeout=DEADLINE, stop_grace=DEADLINE) as redis:
        await redis.ready()
        url = f"redis://127.0.0.1:{redis.port}/0"
        metrics, registry = _metrics()
        holder = SpentTokens(url, timeout=DEADLINE, max_connections=4, metrics=metrics)
        other = SpentTokens(url, timeout=DEADLINE, max_connections=4)
        try:
            await asyncio.gather(*(holder.issued(f"s{i}", f"e{i}", 1) for i in range(32)))
            spent = await asyncio.gather(*(other.spent(f"s{i}", f"e{i}", 0) for i in range(32)))
        finally:
            await holder.close()
            await other.close()
    assert spent.count(False) == 0, f"{spent.count(False)} of 32 spent tokens accepted"
    assert registry.get_sample_value(CHECKS) == 32
    assert registry.get_sample_value(FALLBACKS) == 0


async def test_a_check_redis_does_not_answer_falls_back_to_this_process_and_is_counted() -> None:
    metrics, registry = _metrics()
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    tokens = SpentTokens(nobody, timeout=0.2, max_connections=4, metrics=metrics)
    try:
        await tokens.issued("s", "e", 1)
        assert await tokens.spent("s", "e", 0), "this process still remembers"
    finally:
        await tokens.close()
    assert registry.get_sample_value(CHECKS) == 2
    assert registry.get_sample_value(FALLBACKS) == 2
