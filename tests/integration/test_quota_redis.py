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

import contextlib
import itertools
import shutil
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
