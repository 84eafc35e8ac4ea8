"""Quotas shared through Redis by three sidecars behind nginx (docs/design.md, Quotas).

Three ``omni-sidecar serve`` children (one simulator behind them) name one
``redis-server`` child; deploy/nginx/omni-sidecar-lb.conf, with a third server
line, fronts them. Asserted as a client and an operator see it: a key's
``max_sessions`` holds across all three (the next session on ANY of them, and
through nginx, gets 429); a day audio quota used up on one refuses the key on
the others; killing Redis mid-run ends no session, each sidecar falls back to
its own counts (``quota_backend_down`` 1, ``/readyz`` 200 ``degraded``), and
a new Redis on the same port is used again, with the live sessions' slots
back in it; a sidecar killed with sessions open frees their slots after
``quota_slot_ttl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.children import RedisChild
from tests.conftest import DEADLINE, free_port, wait_until
from tests.integration.helpers import REPO_ROOT, SILENCE_100MS, connect
from tests.integration.nginx_child import main_config, nginx
from tests.integration.served import Served, ready, serve
from tests.integration.test_quota import _refused

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed"),
    pytest.mark.skipif(
        shutil.which("redis-server") is None, reason="redis-server is not installed"
    ),
]

LB_EXAMPLE = REPO_ROOT / "deploy" / "nginx" / "omni-sidecar-lb.conf"
ALPHA = "sk-shared-ALPHA-51c2"
BETA = "sk-shared-BETA-0e93"
DOWN = "omni_sidecar_quota_backend_down"
#: quota_slot_ttl of the sidecars (its minimum): a crashed sidecar's slots live this long.
SLOT_TTL = 2.0
#: Each redis-server run gets its own log (the test starts two on one port).
_RUNS = itertools.count(1)


@contextlib.contextmanager
def redis_server(port: int, tmp_path: Path) -> Iterator[RedisChild]:
    """Our own redis-server on loopback (no persistence); stopped on exit.

    Started, not yet ready: ``await child.ready()`` waits until it answers PING.
    """
    log = tmp_path / f"redis-{port}-{next(_RUNS)}.log"
    child = RedisChild(tmp_path, port=port, log_path=log, ready_timeout=DEADLINE)
    child.start()
    try:
        yield child
    finally:
        child.stop(grace=DEADLINE)


def _lb_config(prefix: Path, listen: int, sidecars: list[int]) -> Path:
    """The example with its ports replaced and a third server line."""
    text = LB_EXAMPLE.read_text()
    replaced = (
        text.replace("server 127.0.0.1:8001 ", f"server 127.0.0.1:{sidecars[0]} ")
        .replace(
            "server 127.0.0.1:8002 max_fails=0;",
            f"server 127.0.0.1:{sidecars[1]} max_fails=0;\n"
            f"    server 127.0.0.1:{sidecars[2]} max_fails=0;",
        )
        .replace("listen 8000;", f"listen 127.0.0.1:{listen};")
    )
    assert all(f"127.0.0.1:{p}" in replaced for p in (*sidecars, listen)), "ports not replaced"
    site = prefix / "omni-sidecar-lb.conf"
    site.write_text(replaced)
    return main_config(prefix, site)


def _ws(child: Served) -> str:
    return f"ws://127.0.0.1:{child.port}/v1/realtime"


async def _readyz(child: Served) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{child.port}/readyz"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.json()


async def _refused_as(url: str, key: str) -> tuple[int, str | None, dict[str, Any]]:
    import tests.integration.test_quota as local

    saved = local.KEY
    local.KEY = key
    try:
        return await _refused(url)
    finally:
        local.KEY = saved


async def _responds(client: Any) -> None:
    """The session still works end to end: one response with its done."""
    await client.send({"type": "input_audio_buffer.append", "audio": SILENCE_100MS})
    await client.send({"type": "input_audio_buffer.commit"})
    await client.send({"type": "response.create"})
    await client.recv_until("response.done")


async def test_three_sidecars_share_one_keys_quotas_and_survive_redis_going_away(
    simulator: Any, tmp_path: Path
) -> None:
    sim = await simulator("--realtime-factor", "0")
    keys = tmp_path / "keys"
    keys.write_text(
        f"{ALPHA} name=alpha max_sessions=2\n{BETA} name=beta audio_seconds_per_day=0.5\n"
    )
    redis_port = free_port()
    flags = (
        "--api-keys-file", str(keys), "--quota-redis-url", f"redis://127.0.0.1:{redis_port}/0",
        "--quota-check-interval", "0.1", "--quota-redis-timeout", "0.2",
        "--max-input-audio-rate", "0", "--quota-slot-ttl", str(SLOT_TTL),
    )  # fmt: skip
    alpha = {"headers": {"Authorization": f"Bearer {ALPHA}"}}
    with (
        redis_server(redis_port, tmp_path) as redis_proc,
        serve(tmp_path, sim.ws_url, *flags) as a,
        serve(tmp_path, sim.ws_url, *flags) as b,
        serve(tmp_path, sim.ws_url, *flags) as c,
    ):
        await redis_proc.ready()
        for child in (a, b, c):
            await ready(child)
        listen = free_port()
        config = _lb_config(tmp_path, listen, [a.port, b.port, c.port])
        async with nginx(tmp_path, config, port=listen, ready_path="/readyz"):
            through_lb = f"ws://127.0.0.1:{listen}/v1/realtime"

            # The day audio quota: used up on a, refused on b and c.
            beta = {"headers": {"Authorization": f"Bearer {BETA}"}}
            async with connect(_ws(a), **beta) as spender:
                await spender.send({"type": "session.update", "session": {"modalities": ["audio"]}})
                for _ in range(10):
                    await spender.send(
                        {"type": "input_audio_buffer.append", "audio": SILENCE_100MS}
                    )
                closed = await spender.recv_until_closed()
            assert closed[-1]["type"] == "session.closed"
            assert closed[-1]["reason"] == "quota_exceeded"
            for child in (b, c):
                status, _, body = await _refused_as(_ws(child), BETA)
                assert (status, body["quota"]) == (429, "audio_seconds_per_day")

            # max_sessions=2 across all three: both sessions on a, the third anywhere is 429.
            async with connect(_ws(a), **alpha) as one, connect(_ws(a), **alpha) as two:
                for client in (one, two):
                    await client.send(
                        {"type": "session.update", "session": {"modalities": ["audio"]}}
                    )
                    await client.recv_until("session.updated")
                for url in (_ws(a), _ws(b), _ws(c), through_lb):
                    status, retry, body = await _refused_as(url, ALPHA)
                    assert (status, retry, body["quota"]) == (429, "1", "max_sessions"), url

                # Redis dies mid-run: no session is lost.
                redis_proc.kill()
                for client in (one, two):
                    await _responds(client)
                # b holds no alpha session: its own count admits one now.
                async with connect(_ws(b), **alpha):
                    pass
                # a holds two: its own count still refuses.
                assert (await _refused_as(_ws(a), ALPHA))[0] == 429
                for child in (a, b, c):
                    await wait_until(
                        lambda ch=child: _is(ch, 1.0),
                        what="quota_backend_down 1",  # type: ignore[misc]
                    )
                    status, body = await _readyz(child)
                    assert status == 200
                    assert body["quota"]["state"] == "degraded"
                assert await b.metric("omni_sidecar_quota_backend_errors_total") >= 1

                # A new Redis on the same port: used again, with a's live slots back in it.
                with redis_server(redis_port, tmp_path) as new_redis:
                    await new_redis.ready()
                    for child in (a, b, c):
                        await wait_until(
                            lambda ch=child: _is(ch, 0.0),
                            what="quota_backend_down 0",  # type: ignore[misc]
                        )
                    status, body = await _readyz(c)
                    assert (status, body["quota"]["state"]) == (200, "ok")
                    status, _, body = await _refused_as(_ws(c), ALPHA)
                    assert (status, body["quota"]) == (429, "max_sessions")
                    for client in (one, two):
                        await _responds(client)

                    # a crashes holding both slots: they expire after quota_slot_ttl.
                    a.kill()

                    async def admitted_on_c() -> bool:
                        return (await _refused_as(_ws(c), ALPHA))[0] == 101

                    await wait_until(
                        admitted_on_c, timeout=SLOT_TTL + DEADLINE, what="a's slots expired"
                    )


async def _is(child: Served, value: float) -> bool:
    return await child.gauge(DOWN) == value


# -- Redis restarted, flushed, shared by live sessions, bounded ---------------------------------

GAMMA = "sk-shared-GAMMA-7a41"
DELTA = "sk-shared-DELTA-c3d9"
EPS = "sk-shared-EPS-5b08"
RESEEDS = "omni_sidecar_quota_backend_reseeds_total"


def _flags(keys: Path, redis_port: int, *more: str) -> tuple[str, ...]:
    return (
        "--api-keys-file", str(keys), "--quota-redis-url", f"redis://127.0.0.1:{redis_port}/0",
        "--quota-check-interval", "0.1", "--quota-redis-timeout", "0.2",
        "--max-input-audio-rate", "0", "--quota-slot-ttl", str(SLOT_TTL), *more,
    )  # fmt: skip


def _bearer(key: str) -> dict[str, Any]:
    return {"headers": {"Authorization": f"Bearer {key}"}}


async def _our_redis(port: int) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0, decode_responses=True)


async def _spend_audio(url: str, key: str, seconds: float) -> list[dict[str, Any]]:
    """Send ``seconds`` of input audio in one session; every event up to the close."""
    async with connect(url, **_bearer(key)) as client:
        await client.send({"type": "session.update", "session": {"modalities": ["audio"]}})
        for _ in range(round(seconds * 10)):
            await client.send({"type": "input_audio_buffer.append", "audio": SILENCE_100MS})
        return await client.recv_until_closed()


async def _room_in_this_minute(seconds: float) -> None:
    """Wait, if need be, until at least ``seconds`` remain in the current UTC minute
    (the minute counts are checked across a Redis restart within one minute)."""
    await wait_until(
        lambda: 60 - time.time() % 60 >= seconds,
        timeout=60 - seconds + DEADLINE,
        what=f"{seconds:g} s left in the minute",
    )


async def test_a_redis_that_lost_its_data_is_reseeded_so_an_exhausted_key_stays_refused(
    simulator: Any, tmp_path: Path
) -> None:
    """An empty Redis (flushed, or restarted without persistence) would give every key a
    fresh day and minute. Each sidecar notices its epoch gone and reseeds the counts
    from what it knows: beta's day audio, spent on a, and gamma's one session this
    minute, taken on a, stay refused on b, which itself holds none of either."""
    sim = await simulator("--realtime-factor", "0")
    keys = tmp_path / "keys"
    keys.write_text(
        f"{BETA} name=beta audio_seconds_per_day=0.5\n{GAMMA} name=gamma sessions_per_minute=1\n"
    )
    redis_port = free_port()
    flags = _flags(keys, redis_port)

    async def both_refused(child: Served) -> None:
        status, _, body = await _refused_as(_ws(child), BETA)
        assert (status, body.get("quota")) == (429, "audio_seconds_per_day"), child.port
        status, _, body = await _refused_as(_ws(child), GAMMA)
        assert (status, body.get("quota")) == (429, "sessions_per_minute"), child.port

    with (
        redis_server(redis_port, tmp_path) as redis_proc,
        serve(tmp_path, sim.ws_url, *flags) as a,
        serve(tmp_path, sim.ws_url, *flags) as b,
    ):
        await redis_proc.ready()
        for child in (a, b):
            await ready(child)
        await _room_in_this_minute(30)
        closed = await _spend_audio(_ws(a), BETA, 1.0)
        assert closed[-1]["reason"] == "quota_exceeded"
        async with connect(_ws(a), **_bearer(GAMMA)):
            pass
        for child in (a, b):
            await both_refused(child)

        # Flushed: every sidecar reseeds (counted once each), and the keys stay refused.
        ours = await _our_redis(redis_port)
        try:
            await ours.flushall()
        finally:
            await ours.aclose()
        for child in (a, b):
            await wait_until(
                lambda ch=child: _is_count(ch, RESEEDS, 1),  # type: ignore[misc]
                what="reseeded after the flush",
            )
        for child in (a, b):
            await both_refused(child)

        # Restarted empty on the same port: the same once it answers again.
        redis_proc.kill()
        redis_proc.wait_exit(timeout=DEADLINE)
        with redis_server(redis_port, tmp_path) as new_redis:
            await new_redis.ready()
            for child in (a, b):
                await wait_until(
                    lambda ch=child: _is_count(ch, RESEEDS, 2),  # type: ignore[misc]
                    what="reseeded after the restart",
                )
                assert await child.gauge(DOWN) == 0.0
            for child in (a, b):
                await both_refused(child)
        assert "redis lost the quota counts" in a.log()


async def _is_count(child: Served, name: str, value: float) -> bool:
    return await child.metric(name) == value


async def test_expired_slots_go_while_another_sidecar_keeps_the_key_alive(
    simulator: Any, tmp_path: Path
) -> None:
    """a and b each hold one of alpha's two slots; a is killed. b's live session
    refreshes alpha's slot set at every check, so the set never expires as a
    whole: a's dead slot must be dropped on its own once its expiry passed, and
    b admits alpha's second session again."""
    sim = await simulator("--realtime-factor", "0")
    keys = tmp_path / "keys"
    keys.write_text(f"{ALPHA} name=alpha max_sessions=2\n")
    redis_port = free_port()
    flags = _flags(keys, redis_port)
    slots = "omni_sidecar:quota:slots:alpha"
    with (
        redis_server(redis_port, tmp_path) as redis_proc,
        serve(tmp_path, sim.ws_url, *flags) as a,
        serve(tmp_path, sim.ws_url, *flags) as b,
    ):
        await redis_proc.ready()
        for child in (a, b):
            await ready(child)
        ours = await _our_redis(redis_port)
        try:
            async with connect(_ws(a), **_bearer(ALPHA)), connect(_ws(b), **_bearer(ALPHA)) as kept:
                await kept.send({"type": "session.update", "session": {"modalities": ["audio"]}})
                await kept.recv_until("session.updated")
                assert await ours.zcard(slots) == 2
                assert (await _refused_as(_ws(b), ALPHA))[0] == 429
                a.kill()  # its slot stays in the set until its expiry passes

                async def one_slot_left() -> bool:
                    return int(await ours.zcard(slots)) == 1

                # No handshake meanwhile: b's checks alone must drop it.
                await wait_until(
                    one_slot_left, timeout=SLOT_TTL + DEADLINE, what="a's expired slot dropped"
                )
                assert await ours.pttl(slots) > 0, "the set itself is kept alive by b"
                async with connect(_ws(b), **_bearer(ALPHA)) as second:
                    await second.send(
                        {"type": "session.update", "session": {"modalities": ["audio"]}}
                    )
                    await second.recv_until("session.updated")
                    assert await ours.zcard(slots) == 2
        finally:
            await ours.aclose()


async def test_running_sessions_end_by_the_shared_day_count(simulator: Any, tmp_path: Path) -> None:
    """delta's session on b sends no audio (b's own day count stays 0); its session on
    a spends the day. b's session is ended by the shared count as well."""
    sim = await simulator("--realtime-factor", "0")
    keys = tmp_path / "keys"
    keys.write_text(f"{DELTA} name=delta audio_seconds_per_day=1.0\n")
    redis_port = free_port()
    flags = _flags(keys, redis_port)
    with (
        redis_server(redis_port, tmp_path) as redis_proc,
        serve(tmp_path, sim.ws_url, *flags) as a,
        serve(tmp_path, sim.ws_url, *flags) as b,
    ):
        await redis_proc.ready()
        for child in (a, b):
            await ready(child)
        async with connect(_ws(b), **_bearer(DELTA)) as quiet:
            await quiet.send({"type": "session.update", "session": {"modalities": ["audio"]}})
            await quiet.recv_until("session.updated")
            spent = await _spend_audio(_ws(a), DELTA, 1.5)
            assert spent[-1]["reason"] == "quota_exceeded"
            events = await quiet.recv_until_closed()
        errors = [e["error"]["code"] for e in events if e["type"] == "error"]
        assert errors == ["quota_exceeded"], events
        assert events[-1]["type"] == "session.closed"
        assert events[-1]["reason"] == "quota_exceeded"
        assert quiet.close_code == 1008
        ended = 'omni_sidecar_quota_sessions_ended_total{key="delta"}'
        assert await b.metric(ended) == 1


async def test_the_redis_pool_stays_within_quota_redis_max_connections(
    simulator: Any, tmp_path: Path
) -> None:
    """30 handshakes of a quota'd key at once through a sidecar allowed 2 Redis
    connections: every one is admitted, and Redis sees at most 2 connections named
    omni-sidecar. (A call that waits for a connection longer than
    quota_redis_timeout is decided locally, as a late call is: counted in
    quota_backend_errors_total, which a loaded machine may show here.)"""
    sim = await simulator("--realtime-factor", "0")
    keys = tmp_path / "keys"
    keys.write_text(f"{EPS} name=eps sessions_per_minute=100000\n")
    redis_port = free_port()
    cap = 2
    flags = _flags(keys, redis_port, "--quota-redis-max-connections", str(cap))
    with (
        redis_server(redis_port, tmp_path) as redis_proc,
        serve(tmp_path, sim.ws_url, *flags) as a,
    ):
        await redis_proc.ready()
        await ready(a)
        statuses = await asyncio.gather(*(_refused_as(_ws(a), EPS) for _ in range(30)))
        assert [s for s, _, _ in statuses] == [101] * 30
        ours = await _our_redis(redis_port)
        try:
            clients = [c for c in await ours.client_list() if c.get("name") == "omni-sidecar"]
        finally:
            await ours.aclose()
        errors = await a.metric("omni_sidecar_quota_backend_errors_total")
        print(f"\n30 handshakes at once: {len(clients)} redis connections (cap {cap}), "
              f"{errors:.0f} calls decided locally")  # fmt: skip
        assert 1 <= len(clients) <= cap, clients
