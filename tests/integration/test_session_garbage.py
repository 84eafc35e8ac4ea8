"""Ended sessions leave nothing for the cyclic collector (docs/design.md, Memory).

Everything a session builds (relay, core, writer, reader, timers, observer,
upstream link, the edge's request handler) must be freed by reference
counting the moment the session ends: cyclic garbage waits for a collection
that, with the collector tuned for a relay (``tune_gc``), almost never comes,
and a sidecar that serves sessions for weeks grows by every one of them.
The test runs 100 whole sessions through an in-process sidecar with
``gc.DEBUG_SAVEALL`` on, so the collector keeps what it would have had to
free, and asserts that none of it is the product's.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import types
from collections.abc import Iterator
from typing import Any, Final

import pytest

from tests.conftest import wait_until
from tests.integration.helpers import SimulatorChild, connect, module_simulator, request_response

SESSIONS: Final = 100
PRODUCT: Final = ("proxy", "engine_launcher", "metrics")
PRODUCT_DIRS: Final = ("/proxy/", "/engine_launcher/", "/metrics/")


@pytest.fixture(scope="module")
def quick_sim() -> Iterator[SimulatorChild]:
    with module_simulator(
        "--chunk-ms", "100", "--realtime-factor", "0", "--response-seconds", "0.3"
    ) as sim:
        yield sim


def _theirs(obj: object) -> bool:
    """An object the product built: an instance of one of its classes, or its code running."""
    try:
        if (type(obj).__module__ or "").split(".")[0] in PRODUCT:
            return True
        if isinstance(obj, types.MethodType):
            return _theirs(obj.__self__)
        code = None
        if isinstance(obj, types.FunctionType):
            code = obj.__code__
        elif isinstance(obj, types.CoroutineType):
            code = obj.cr_code
        elif isinstance(obj, types.FrameType):
            code = obj.f_code
        return code is not None and any(d in code.co_filename for d in PRODUCT_DIRS)
    except ReferenceError:  # a dead weak proxy
        return False


async def _one_session(url: str) -> None:
    async with connect(url) as client:
        await request_response(client, open_session=True)
        await client.recv_until("response.done")
        await client.send({"type": "session.close"})
        await client.recv_until_closed()


@pytest.mark.parametrize("link", ["picows", "aiohttp"])
async def test_a_hundred_ended_sessions_leave_no_cyclic_garbage(
    quick_sim: SimulatorChild, sidecar: Any, link: str
) -> None:
    proxy = await sidecar(upstream=quick_sim.ws_url, upstream_client=link)
    registry = proxy.sidecar.state.registry
    for _ in range(3):  # warm up: imports, caches and lazily built singletons
        await _one_session(proxy.url)
    await wait_until(lambda: not registry.relays, what="the warm-up sessions ended")
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(SESSIONS):
            await _one_session(proxy.url)
        await wait_until(lambda: not registry.relays, what="every session ended")
        await asyncio.sleep(0)  # the relays' last callbacks
        gc.collect()
        theirs = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage if _theirs(o)
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not theirs, f"cyclic garbage of {SESSIONS} sessions: {theirs.most_common(12)}"
