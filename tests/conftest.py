"""Shared fixtures: timing factor, simulator child processes, in-process sidecars.

The child processes themselves are :mod:`tests.children` (shared with the benchmarks).

Every wait has a deadline scaled by ``OMNI_SIDECAR_TESTS_TIMEOUT_FACTOR`` (set
it above 1 on slow machines); nothing sleeps and hopes. Servers bind to
127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.settings import EngineConfig, Settings
from tests.children import SimulatorChild, free_port
from tests.integration import container_image
from tests.integration.container_image import CacheWarmup

#: ``free_port`` is re-exported: the tests import it from here.
__all__ = [
    "DEADLINE",
    "MS",
    "TIMEOUT_FACTOR",
    "RunningSidecar",
    "build_backend_files",
    "free_port",
    "http_ok",
    "monotonic",
    "wait_until",
]

TIMEOUT_FACTOR = float(os.environ.get("OMNI_SIDECAR_TESTS_TIMEOUT_FACTOR", "1"))
MS = 0.001 * TIMEOUT_FACTOR
#: Default deadline for anything a test waits on.
DEADLINE = 10_000 * MS


def build_backend_files(pyproject: Path) -> list[str]:
    """The build backend's files, where ``pyproject`` says they are (``backend-path``):
    a copy of the checkout that is built or installed needs them."""
    build = tomllib.loads(pyproject.read_text(encoding="utf-8"))["build-system"]
    return [f"{where}/{build['build-backend']}.py" for where in build["backend-path"]]


#: Test modules that take the longest (a venv of another aiohttp, the other
#: build's run): started first, one on each pytest-xdist worker where there are
#: two, so that both workers end together instead of one waiting on the other's
#: last long test.
RUN_FIRST = (
    "tests/test_aiohttp_floor.py",
    "tests/test_native_core.py",
)
#: The container tier, run last on every worker: its image is built in the
#: background from the start of the run (``CacheWarmup``), so the later its tests
#: come, the more of a cold build the rest of the suite has overlapped.
RUN_LAST = ("tests/integration/test_container_image.py",)
_WARMUP = pytest.StashKey[CacheWarmup]()


def _module(item: pytest.Item) -> str:
    return item.nodeid.partition("::")[0]


def xdist_queues(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` ordered so that each worker's first queue starts with its share of
    ``RUN_FIRST`` and ends with its share of ``RUN_LAST``, the rest dealt round.

    pytest-xdist (``make pytest``: ``--dist worksteal``) hands worker k the k-th
    contiguous slice of the collection (``len // workers`` of what is left), and
    an idle worker later takes the second half of the longest queue. Sorted as
    collected, one slice was the integration tests and the other the unit tests:
    the worker with the unit tests reached the container tier within a minute and
    sat on the cold image build for four.
    """

    first = [i for i in items if _module(i) in RUN_FIRST]
    last = [i for i in items if _module(i) in RUN_LAST]
    rest = [i for i in items if _module(i) not in RUN_FIRST and _module(i) not in RUN_LAST]
    sizes, left = [], len(items)
    for k in range(workers):
        sizes.append(left // (workers - k))
        left -= sizes[-1]
    heads: list[list[pytest.Item]] = [[] for _ in sizes]
    tails: list[list[pytest.Item]] = [[] for _ in sizes]
    for n, item in enumerate(first):
        heads[n % workers].append(item)
    for n, item in enumerate(last):
        tails[n % workers].append(item)
    middles: list[list[pytest.Item]] = [[] for _ in sizes]
    k = 0
    for item in rest:  # round, skipping queues already full
        while len(heads[k]) + len(middles[k]) + len(tails[k]) >= sizes[k]:
            k = (k + 1) % workers
        middles[k].append(item)
        k = (k + 1) % workers
    return [item for k in range(workers) for item in heads[k] + middles[k] + tails[k]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``RUN_FIRST`` first and ``RUN_LAST`` last, in each worker's queue."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = xdist_queues(items, max(workers, 1))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the container image when the run has tests of its tier.

    Under pytest-xdist every worker collects; the first one to ask starts it.
    """
    if session.config.option.collectonly or container_image.missing_tools() is not None:
        return
    if os.environ.get(container_image.WARMUP_ENV):  # make test started it before the install
        return
    if any(_module(item) in RUN_LAST for item in session.items):
        warmup = CacheWarmup.start(os.environ.get("PYTEST_XDIST_TESTRUNUID"))
        if warmup is not None:
            session.config.stash[_WARMUP] = warmup


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Let the image build of ``pytest_collection_finish`` end, or stop it when the run
    was cut short. Under pytest-xdist a worker with nothing left to take finishes
    while the other may still run the container tier, which needs that build."""
    warmup = session.config.stash.get(_WARMUP, None)
    if warmup is None:
        return
    if exitstatus != pytest.ExitCode.INTERRUPTED and not session.shouldstop:
        warmup.wait(container_image.DEBOOTSTRAP_TIMEOUT + container_image.BUILD_TIMEOUT)
    warmup.stop()


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout: float = DEADLINE, what: str = ""
) -> None:
    """Poll a condition until true; fail the test with ``what`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() >= deadline:
            pytest.fail(f"timed out after {timeout:.1f} s waiting for {what or predicate}")
        await asyncio.sleep(5 * MS)


async def http_ok(url: str) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=1)
        async with aiohttp.ClientSession() as session, session.get(url, timeout=timeout) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


@pytest.fixture
async def simulator() -> AsyncIterator[Callable[..., Awaitable[SimulatorChild]]]:
    """Factory: ``await simulator("--realtime-factor", "0")`` starts a ready simulator."""
    started: list[SimulatorChild] = []

    async def start(*args: str, wait_ready: bool = True) -> SimulatorChild:
        sim = SimulatorChild(*args, cwd=None, ready_timeout=DEADLINE, stop_grace=DEADLINE)
        started.append(sim.start())
        if wait_ready:
            await sim.ready()
        return sim

    yield start
    for sim in started:
        await sim.astop()


@dataclass
class RunningSidecar:
    sidecar: Any  # proxy.server.Sidecar
    task: asyncio.Task[int]

    @property
    def url(self) -> str:
        host, port = self.sidecar.bound["listen"]
        return f"ws://{host}:{port}/v1/realtime"

    @property
    def http_url(self) -> str:
        host, port = self.sidecar.bound["listen"]
        return f"http://{host}:{port}"

    @property
    def admin_url(self) -> str:
        host, port = self.sidecar.bound["admin"]
        return f"http://{host}:{port}"

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        # Per-event counts reach the counters at scrape time, as for /metrics.
        self.sidecar.sessions.flush_metrics()
        value = self.sidecar.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else float(value)

    async def stop(self) -> int:
        self.sidecar.stop_requested.set()
        async with asyncio.timeout(DEADLINE * 3):
            return await self.task


@pytest.fixture
async def sidecar() -> AsyncIterator[Callable[..., Awaitable[RunningSidecar]]]:
    """Factory: ``await sidecar(upstream=sim.ws_url, max_pending_output_bytes=...)``.

    Runs a whole in-process ``Sidecar`` on ephemeral ports and waits until ready.
    """
    from proxy.server import Sidecar

    running: list[RunningSidecar] = []

    async def start(*, engine: EngineConfig | None = None, **overrides: Any) -> RunningSidecar:
        values: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "heartbeat_interval": 0.0,
        }
        values.update(overrides)
        if engine is not None:
            values["engine"] = engine
        settings = Settings(**values)
        instance = Sidecar(settings, environ={})
        task = asyncio.ensure_future(instance.run())
        item = RunningSidecar(instance, task)
        running.append(item)
        ready = asyncio.ensure_future(instance.ready.wait())
        async with asyncio.timeout(DEADLINE * 2):
            await asyncio.wait((ready, task), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            ready.cancel()
            pytest.fail(f"sidecar exited early with {task.result()}")
        return item

    yield start
    for item in running:
        if not item.task.done():
            with contextlib.suppress(Exception):
                await item.stop()


def monotonic() -> float:
    return time.monotonic()
