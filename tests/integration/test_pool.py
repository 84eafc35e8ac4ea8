"""An engine pool of 3 simulator replicas behind one in-process Sidecar.

docs/design.md, Engine pool. Real children on loopback; what is asserted is
what a client or an operator sees: where sessions land (``/debug/sessions``
``engine``), 503 + Retry-After, ``/readyz``'s per-replica body, events and
close codes, ``engine``-labelled metrics. Sessions that check gapless
``server_event_seq`` run with ``playback_ack = "off"`` (the engine's answers
to the sidecar's own acks are hidden from clients by design).

The placement rules themselves, socket-free: tests/engine_launcher/test_pool_placement.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shlex
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.settings import EngineConfig
from tests.conftest import DEADLINE, MS, RunningSidecar, wait_until
from tests.integration.helpers import SILENCE_100MS, Client, run_cli

pytestmark = pytest.mark.timeout(60)

Event = dict[str, Any]
#: 200 ms chunks of 8 kHz PCM16 in real time: a response is always in flight.
PACED = tuple(
    shlex.split("--chunk-ms 200 --realtime-factor 1 --response-seconds 30 --sample-rate 8000")
)
SUPERVISION: dict[str, Any] = {
    "health_interval": 200 * MS,
    "health_failures": 2,
    "stop_grace": 2000 * MS,
    "startup_timeout": 3 * DEADLINE,
}
AUDIO_DELTA = "response.output_audio.delta"


def pool(replicas: int = 3, *simulator_args: str) -> EngineConfig:
    return EngineConfig(
        kind="simulator", replicas=replicas, simulator_args=simulator_args, **SUPERVISION
    )


async def all_ready(proxy: RunningSidecar) -> None:
    router = proxy.sidecar.router
    await wait_until(
        lambda: all(s == "ready" for s in router.states) and not any(router.draining),
        timeout=3 * DEADLINE,
        what="every replica ready",
    )


async def get_json(url: str) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def sessions_by_engine(proxy: RunningSidecar) -> dict[str, int | None]:
    """The engine's session id → the replica ``/debug/sessions`` says it runs on."""
    _status, _headers, body = await get_json(f"{proxy.admin_url}/debug/sessions")
    return {row["upstream_session_id"]: row["engine"] for row in body["sessions"]}


def engine_id(session: Session) -> str:
    created = next(e for e in session.client.events if e["type"] == "session.created")
    return str(created["session"]["id"])


class Session:
    """One client session that reads in the background and checks ``server_event_seq``."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.closed = asyncio.Event()
        self.closed_at: float | None = None

    async def start_response(self) -> None:
        for event in (
            {"type": "session.update", "session": {"modalities": ["audio", "text"]}},
            {"type": "input_audio_buffer.append", "audio": SILENCE_100MS},
            {"type": "input_audio_buffer.commit"},
            {"type": "response.create"},
        ):
            await self.client.send(event)

    def audio(self) -> int:
        return sum(1 for e in self.client.events if e.get("type") == AUDIO_DELTA)

    async def read(self) -> None:
        ws = self.client.ws
        try:
            while True:
                msg = await ws.receive()
                if msg.type is aiohttp.WSMsgType.TEXT:
                    self.client.frames.append(msg.data)
                    self.client.events.append(orjson.loads(msg.data))
                    continue
                if msg.type is aiohttp.WSMsgType.CLOSE:
                    self.client.close_frame_code = int(msg.data)
                    # Answer like a well-behaved client (autoclose is off).
                    with contextlib.suppress(Exception):
                        await ws.close()
                break
        finally:
            self.closed_at = time.monotonic()
            self.closed.set()

    def gaps(self) -> list[str]:
        """Engine events carry seq 1, 2, 3...; only the proxy's own tail has none."""
        found, last, tail = [], 0, False
        for event in self.client.events:
            seq = event.get("server_event_seq")
            if event["type"] == "session.created":
                continue
            if seq is None:
                tail = True
                continue
            if tail or seq != last + 1:
                found.append(f"{event['type']} seq {seq} after {last} (tail={tail})")
            last = seq
        return found


@contextlib.asynccontextmanager
async def sessions(url: str, count: int) -> AsyncIterator[list[Session]]:
    """``count`` open sessions, each streaming a response, read in one TaskGroup."""
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        opened: list[Session] = []
        for _ in range(count):
            ws = await http.ws_connect(url, autoclose=False, max_msg_size=0)
            stack.push_async_callback(ws.close)
            opened.append(Session(Client(ws)))
        async with asyncio.TaskGroup() as group:
            for session in opened:
                group.create_task(session.read())
                await session.start_response()
            try:
                yield opened
            finally:
                for session in opened:
                    await session.client.ws.close()


async def refused(url: str) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await http.ws_connect(url)
    return info.value.status, dict(info.value.headers or {})


async def test_six_sessions_spread_2_2_2_the_7th_is_refused_and_a_killed_replica_ends_only_its_own(
    sidecar: Any,
) -> None:
    # Each start takes 1.5 s (a model load): the killed replica then stays not ready
    # for its backoff plus that, long enough to observe on a loaded machine.
    # Health probes every 1 s: a kill is seen at once through the child's exit, and a
    # loaded box must not make a slow 200 ms probe restart a replica on its own.
    engine = dataclasses.replace(
        pool(3, *PACED, "--startup-delay", "1.5"), health_interval=1.0, health_failures=3
    )
    proxy: RunningSidecar = await sidecar(
        engine=engine,
        max_sessions_per_engine=2,
        playback_ack="off",
    )
    await all_ready(proxy)
    status, _headers, body = await get_json(f"{proxy.http_url}/readyz")
    assert status == 200
    assert [e["state"] for e in body["engines"]] == ["ready"] * 3

    async with sessions(proxy.url, 6) as live:
        await wait_until(lambda: all(s.audio() >= 1 for s in live), what="audio on all six")
        placed = await sessions_by_engine(proxy)
        assert sorted(Counter(placed.values()).items()) == [(0, 2), (1, 2), (2, 2)]

        assert (await refused(proxy.url))[0] == 503
        status, headers, body = await get_json(f"{proxy.http_url}/readyz")
        assert (status, body["reason"], headers.get("Retry-After")) == (503, "capacity", "1")
        assert proxy.metric("omni_sidecar_engine_replica_sessions", {"engine": "1"}) == 2

        # SIGKILL replica 1: exactly its two sessions end, engine_unavailable / 1011.
        victim = proxy.sidecar.pool.replicas[1].supervisor
        pid = victim.pid
        assert pid is not None
        mine = [s for s in live if placed[engine_id(s)] == 1]
        others = [s for s in live if s not in mine]
        assert len(mine) == 2
        # One survivor slot is freed first, so that a new session has somewhere to go.
        freed = others.pop()
        await freed.client.ws.close()
        await freed.closed.wait()
        await wait_until(
            lambda: sum(proxy.sidecar.router.sessions) == 5, what="the freed slot released"
        )
        audio_before = [s.audio() for s in others]
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(DEADLINE):
            for s in mine:
                await s.closed.wait()
        closed_ms = max((s.closed_at or 0) - killed_at for s in mine) * 1000
        for s in mine:
            assert s.client.close_code == 1011
            assert s.client.events[-1]["type"] == "session.closed"
            assert s.client.events[-1]["reason"] == "engine_unavailable"
            assert s.gaps() == []

        # While replica 1 restarts (backoff >= 0.9 s) a new session goes to a survivor,
        # although replica 1 now has the fewest sessions; /readyz says so. The sessions
        # can end (their engine socket dropped) a few ms before the supervisor has
        # reaped the child, so wait for the supervisor to notice, inside the backoff.
        await wait_until(
            lambda: proxy.sidecar.router.states[1] != "ready",
            what="the supervisor noticing the kill",
        )
        status, _headers, body = await get_json(f"{proxy.http_url}/readyz")
        assert status == 200
        assert body["engines"][1]["state"] in ("restarting", "starting"), (
            f"{(time.monotonic() - killed_at) * 1000:.0f} ms after the kill: {body['engines'][1]}"
        )
        assert not body["engines"][1]["admitting"]
        assert proxy.metric("omni_sidecar_engine_replica_up", {"engine": "1"}) == 0
        assert proxy.metric("omni_sidecar_engine_replica_up", {"engine": "0"}) == 1
        async with sessions(proxy.url, 1) as extra:
            assert proxy.sidecar.router.states[1] != "ready"
            await wait_until(lambda: extra[0].audio() >= 1, what="audio on the extra session")
            assert (await sessions_by_engine(proxy))[engine_id(extra[0])] != 1
            await wait_until(
                lambda: proxy.sidecar.router.states[1] == "ready",
                timeout=3 * DEADLINE,
                what="replica 1 ready again",
            )
            ready_ms = (time.monotonic() - killed_at) * 1000
            await wait_until(
                lambda: proxy.sidecar.router.sessions[1] == 0, what="replica 1's slots released"
            )
            assert proxy.sidecar.pool.replicas[1].supervisor.pid != pid
            # Its slots are back: the next session lands on it (fewest sessions).
            async with sessions(proxy.url, 1) as back:
                await wait_until(lambda: back[0].audio() >= 1, what="audio on replica 1 again")
                assert (await sessions_by_engine(proxy))[engine_id(back[0])] == 1

        # The survivors streamed on: more audio, nothing closed, no gap.
        await wait_until(
            lambda: all(s.audio() > n + 2 for s, n in zip(others, audio_before, strict=False)),
            what="survivors keep streaming",
        )
        assert not any(s.closed.is_set() for s in others)
        assert all(s.gaps() == [] for s in others)
    assert proxy.metric("omni_sidecar_engine_replica_restarts_total", {"engine": "1"}) == 1
    assert proxy.metric("omni_sidecar_engine_replica_restarts_total", {"engine": "0"}) == 0
    assert proxy.metric("omni_sidecar_sessions_total", {"outcome": "engine_unavailable"}) == 2
    print(f"\nkill-one-replica: sessions closed {closed_ms:.0f} ms, ready again {ready_ms:.0f} ms")


async def test_draining_a_replica_moves_new_sessions_elsewhere_and_lets_its_own_finish(
    sidecar: Any,
) -> None:
    proxy: RunningSidecar = await sidecar(engine=pool(3, *PACED), playback_ack="off")
    await all_ready(proxy)
    async with sessions(proxy.url, 3) as live:
        await wait_until(lambda: all(s.audio() >= 1 for s in live), what="audio on all three")
        placed = await sessions_by_engine(proxy)
        assert sorted(placed.values()) == [0, 1, 2]
        on_1 = next(s for s in live if placed[engine_id(s)] == 1)
        pid = proxy.sidecar.pool.replicas[1].supervisor.pid

        # The operator's command: a POST to the admin listener.
        code, out, err = await run_cli("drain", "--engine", "1", "--admin", proxy.admin_url)
        assert code == 0, err
        assert orjson.loads(out)["state"] == "draining"
        code, _out, err = await run_cli("drain", "--engine", "1", "--admin", proxy.admin_url)
        assert (code, "drain refused (409)" in err) == (1, True), err  # already draining
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{proxy.admin_url}/engines/7/drain") as resp,
        ):
            assert resp.status == 404
        status, _headers, body = await get_json(f"{proxy.http_url}/readyz")
        assert status == 200
        assert body["engines"][1]["state"] == "draining"
        assert proxy.metric("omni_sidecar_engine_replica_draining", {"engine": "1"}) == 1

        # New sessions avoid replica 1 although it has the fewest... after these two.
        async with sessions(proxy.url, 2) as extra:
            await wait_until(lambda: all(s.audio() >= 1 for s in extra), what="extra audio")
            now = await sessions_by_engine(proxy)
            assert Counter(now.values()) == {0: 2, 1: 1, 2: 2}
            # Its own session streams on while it drains.
            before = on_1.audio()
            await wait_until(lambda: on_1.audio() > before + 2, what="drained session streams")
            assert not on_1.closed.is_set()
            assert proxy.sidecar.pool.replicas[1].supervisor.pid == pid

            # The last session ends: the replica restarts and admits again.
            await on_1.client.ws.close()
            await on_1.closed.wait()
            assert on_1.client.close_code == 1000
            assert on_1.gaps() == []
            await wait_until(
                lambda: (
                    proxy.sidecar.router.states[1] == "ready"
                    and not proxy.sidecar.router.draining[1]
                ),
                timeout=3 * DEADLINE,
                what="replica 1 restarted",
            )
            assert proxy.sidecar.pool.replicas[1].supervisor.pid != pid
            async with sessions(proxy.url, 1) as back:
                await wait_until(lambda: back[0].audio() >= 1, what="audio after the drain")
                assert (await sessions_by_engine(proxy))[engine_id(back[0])] == 1
    assert proxy.metric("omni_sidecar_engine_replica_draining", {"engine": "1"}) == 0
    assert proxy.metric("omni_sidecar_engine_replica_restarts_total", {"engine": "1"}) == 1


async def test_sixty_sessions_spread_evenly_over_three_replicas(sidecar: Any) -> None:
    """The measured distribution for the closing note: fewest-sessions placement."""
    fast = ("--chunk-ms", "1000", "--realtime-factor", "0", "--sample-rate", "8000")
    proxy: RunningSidecar = await sidecar(engine=pool(3, *fast), max_sessions=64)
    await all_ready(proxy)
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def one() -> None:
            ws = await http.ws_connect(proxy.url, autoclose=False)
            stack.push_async_callback(ws.close)

        async with asyncio.TaskGroup() as group:
            for _ in range(60):
                group.create_task(one())
        _status, _headers, body = await get_json(f"{proxy.admin_url}/debug/sessions")
        spread = Counter(row["engine"] for row in body["sessions"])
    print(f"\n60 sessions over 3 replicas: {dict(sorted(spread.items()))}")
    assert spread == {0: 20, 1: 20, 2: 20}


async def test_external_upstreams_are_one_replica_each(simulator: Any, sidecar: Any) -> None:
    """``engine.upstreams``: no children; each URL is probed and placed on like a replica."""
    first, second = await simulator(*PACED), await simulator(*PACED)
    engine = EngineConfig(kind="external", upstreams=(first.ws_url, second.ws_url), **SUPERVISION)
    proxy: RunningSidecar = await sidecar(engine=engine, playback_ack="off")
    await wait_until(
        lambda: proxy.sidecar.router.states == ["ready", "ready"], what="both upstreams ready"
    )
    async with sessions(proxy.url, 4) as live:
        await wait_until(lambda: all(s.audio() >= 1 for s in live), what="audio on all four")
        placed = await sessions_by_engine(proxy)
        assert Counter(placed.values()) == {0: 2, 1: 2}
        # The second upstream goes away: it stops being served; the first streams on.
        second.kill()
        await wait_until(
            lambda: proxy.sidecar.router.targets[1] is None, what="upstream 1 not served"
        )
        async with sessions(proxy.url, 1) as extra:
            await wait_until(lambda: extra[0].audio() >= 1, what="audio on upstream 0")
            assert (await sessions_by_engine(proxy))[engine_id(extra[0])] == 0
        survivors = [s for s in live if placed[engine_id(s)] == 0]
        assert not any(s.closed.is_set() for s in survivors)
        assert all(s.gaps() == [] for s in survivors)
