"""A real Prometheus scrapes the sidecar's admin listener and sees the session counts.

Needs the ``prometheus`` binary (Debian package ``prometheus``); skipped
without it. Prometheus is a :class:`tests.children.PrometheusChild`: it
listens on 127.0.0.1 only, keeps its TSDB in tmp_path, and is stopped in a
finalizer.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from metrics import DROP_REASONS
from tests.children import PrometheusChild
from tests.conftest import MS
from tests.integration.test_metrics import SIMULATOR_ARGS, cancelled_session, wait_metric

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not on PATH (Debian package: prometheus)"
)
#: Scrape interval 1 s; startup, first scrape and the query together stay well under this.
SCRAPE_DEADLINE = 30_000 * MS


class Prometheus(PrometheusChild):
    """A Prometheus server on loopback and its HTTP query API."""

    async def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query"
        async with aiohttp.ClientSession() as http, http.get(url, params={"query": promql}) as resp:
            body = await resp.json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def value(self, promql: str) -> float | None:
        """The single instant value of ``promql``, or None while there is none."""
        result = await self.query(promql)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])


@pytest.fixture
async def prometheus(
    tmp_path: Path,
) -> AsyncIterator[Callable[[str], Awaitable[Prometheus]]]:
    """Factory: ``await prometheus("127.0.0.1:PORT")`` scrapes that target every second."""
    started: list[Prometheus] = []

    async def start(target: str) -> Prometheus:
        assert PROMETHEUS is not None
        config = tmp_path / "prometheus.yml"
        # JSON is YAML: no YAML library needed.
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "omni-sidecar",
                            "scrape_interval": "1s",
                            "scrape_timeout": "1s",
                            "static_configs": [{"targets": [target]}],
                        }
                    ],
                }
            )
        )
        server = Prometheus(
            config, tmp_path / "tsdb", "--storage.tsdb.retention.time=1h", "--log.level=warn",
            executable=PROMETHEUS, log_path=tmp_path / "prometheus.log",
            ready_timeout=SCRAPE_DEADLINE, stop_grace=10.0,
        )  # fmt: skip
        started.append(server.start())
        await server.ready()
        return server

    yield start
    for server in started:
        await server.astop()


async def _poll(what: str, probe: Callable[[], Awaitable[bool]], server: Prometheus) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SCRAPE_DEADLINE
    while not await probe():
        if loop.time() >= deadline:
            log = server.log_tail(4000)
            pytest.fail(f"timed out waiting for Prometheus to see {what}; log:\n{log}")
        await asyncio.sleep(200 * MS)


async def test_prometheus_scrapes_session_counts(
    simulator: Any, sidecar: Any, prometheus: Any
) -> None:
    sim = await simulator(*SIMULATOR_ARGS)
    proxy = await sidecar(upstream=sim.ws_url)
    host, port = proxy.sidecar.bound["admin"]
    server = await prometheus(f"{host}:{port}")

    async def scraped() -> bool:
        return await server.value('up{job="omni-sidecar"}') == 1.0

    await _poll("the sidecar target up", scraped, server)

    record = await cancelled_session(proxy.url)
    assert record.close_code == 1000
    await wait_metric(proxy, "omni_sidecar_sessions_total", {"outcome": "client_closed"}, 1)
    late = proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"})
    assert late > 0

    async def counted() -> bool:
        return await server.value('omni_sidecar_sessions_total{outcome="client_closed"}') == 1.0

    await _poll("sessions_total{outcome=client_closed} == 1", counted, server)
    # The session is over, so this scrape and the registry agree exactly.
    assert await server.value('omni_sidecar_dropped_events_total{reason="late_audio"}') == late
    assert await server.value("omni_sidecar_sessions_started_total") == 1.0
    assert await server.value('omni_sidecar_build_info{version!=""}') == 1.0
    # Every known series is there from the first scrape (initialised to 0).
    reasons = await server.query("omni_sidecar_dropped_events_total")
    assert len(reasons) == len(DROP_REASONS)
