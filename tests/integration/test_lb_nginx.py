"""deploy/nginx/omni-sidecar-lb.conf as written, in front of two real sidecars.

Two ``omni-sidecar serve`` child processes (each with its own simulator, at
most 3 sessions) behind our own nginx on free loopback ports; only the ports
of the example are replaced. What a client sees through nginx is asserted:
6 sessions succeed (3 on each sidecar: ``least_conn``), the 7th gets 503 with
``Retry-After``; after SIGTERM on one sidecar (which drains: its handshakes
get 503 before the upgrade, ``proxy_next_upstream http_503``) every new
session lands on the other with no failed handshake, and the drained sidecar
exits 0 once its last session ends. docs/design.md, Engine pool.

The figures (handshake times through nginx, SIGTERM to exit) are printed.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.children import SidecarChild
from tests.conftest import DEADLINE, free_port, wait_until
from tests.integration.helpers import REPO_ROOT
from tests.integration.nginx_child import main_config, nginx

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed"),
]

LB_EXAMPLE = REPO_ROOT / "deploy" / "nginx" / "omni-sidecar-lb.conf"
PACED = "--chunk-ms 200 --realtime-factor 1 --response-seconds 30 --sample-rate 8000"


class Serve(SidecarChild):
    """One of the two sidecars: 3 sessions at most, a 30 s drain, paced simulator engine."""

    def __init__(self, tmp_path: Path) -> None:
        port = free_port()
        super().__init__(
            "--max-sessions", "3", "--drain-timeout", "30", "--playback-ack", "off",
            "--engine-simulator-args", PACED,
            port=port, log_path=tmp_path / f"serve-{port}.log",
            ready_timeout=3 * DEADLINE, stop_grace=DEADLINE,
        )  # fmt: skip

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self.http_url}/readyz") as resp,
        ):
            return resp.status, await resp.json()

    async def sessions(self) -> int:
        return int((await self.readyz())[1]["sessions"])


@contextlib.asynccontextmanager
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    """Started, not yet ready (``await srv.ready()``); stopped on exit."""
    srv = Serve(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        await srv.astop()


def lb_config(prefix: Path, listen: int, sidecars: list[int]) -> Path:
    """Our own nginx: the example as written, with only the ports replaced."""
    text = LB_EXAMPLE.read_text()
    replaced = (
        text.replace("server 127.0.0.1:8001 ", f"server 127.0.0.1:{sidecars[0]} ")
        .replace("server 127.0.0.1:8002 ", f"server 127.0.0.1:{sidecars[1]} ")
        .replace("listen 8000;", f"listen 127.0.0.1:{listen};")
    )
    assert all(f"127.0.0.1:{p}" in replaced for p in (*sidecars, listen)), "ports not replaced"
    site = prefix / "omni-sidecar-lb.conf"
    site.write_text(replaced)
    return main_config(prefix, site)


class Clients:
    """WebSocket sessions through nginx; handshake times and refusals are recorded."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url
        self.open: list[aiohttp.ClientWebSocketResponse] = []
        self.handshake_ms: list[float] = []
        self.refused: list[tuple[int, str | None]] = []

    async def connect(self) -> aiohttp.ClientWebSocketResponse | None:
        started = time.monotonic()
        try:
            ws = await self.http.ws_connect(self.url, autoclose=False)
        except aiohttp.WSServerHandshakeError as exc:
            self.refused.append((exc.status, (exc.headers or {}).get("Retry-After")))
            return None
        self.handshake_ms.append((time.monotonic() - started) * 1000)
        # The session works end to end through nginx: the engine answers.
        await ws.send_str('{"type":"session.update","session":{"modalities":["audio","text"]}}')
        msg = await ws.receive(timeout=DEADLINE)
        assert msg.type is aiohttp.WSMsgType.TEXT and '"session.' in msg.data, msg
        self.open.append(ws)
        return ws

    async def close_all(self) -> None:
        for ws in self.open:
            await ws.close()
        self.open.clear()


async def test_least_conn_spreads_refuses_the_7th_and_a_draining_sidecar_is_skipped(
    tmp_path: Path,
) -> None:
    async with serve(tmp_path) as a, serve(tmp_path) as b:
        for sidecar in (a, b):
            await sidecar.ready()
        listen = free_port()
        config = lb_config(tmp_path, listen, [a.port, b.port])
        async with (
            nginx(tmp_path, config, port=listen, ready_path="/readyz"),
            aiohttp.ClientSession() as http,
        ):
            clients = Clients(http, f"ws://127.0.0.1:{listen}/v1/realtime")
            on_a: list[aiohttp.ClientWebSocketResponse] = []
            for _ in range(4):
                before = await a.sessions()
                ws = await clients.connect()
                assert ws is not None, clients.refused
                if await a.sessions() > before:
                    on_a.append(ws)
            assert (len(on_a), await b.sessions()) == (2, 2)
            # least_conn: with a emptied, the next two both go to a (round robin
            # would split them).
            for ws in on_a:
                clients.open.remove(ws)
                await ws.close()
            await wait_until(lambda: _count(a, 0), what="a's sessions closed")
            for _ in range(2):
                assert await clients.connect() is not None, clients.refused
            assert (await a.sessions(), await b.sessions()) == (2, 2)
            for _ in range(2):
                assert await clients.connect() is not None, clients.refused
            assert (await a.sessions(), await b.sessions()) == (3, 3)
            assert await clients.connect() is None
            assert clients.refused == [(503, "1")]
            full_ms = list(clients.handshake_ms)

            # Two sessions, one each; then SIGTERM on a: it drains its one session.
            await clients.close_all()
            await wait_until(
                lambda: _sum_sessions(a, b, 0), what="all sessions closed on both sidecars"
            )
            for _ in range(2):
                assert await clients.connect() is not None
            assert (await a.sessions(), await b.sessions()) == (1, 1)
            terminated = time.monotonic()
            a.proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: _status(a, 503), what="a's /readyz says 503 while it drains")
            # Every new session goes to b, none fails, until b is full.
            clients.handshake_ms.clear()
            for _ in range(2):
                assert await clients.connect() is not None, clients.refused
            assert clients.refused == [(503, "1")]
            assert await b.sessions() == 3
            assert await a.sessions() == 1
            assert a.proc.poll() is None  # its session is still live
            after_ms = list(clients.handshake_ms)
            # Both sidecars say 503 now (a draining, b full): the client gets one.
            assert await clients.connect() is None
            assert len(clients.refused) == 2
            # The drained sidecar exits 0 when its last session ends.
            await clients.close_all()
            code = await a.exited(DEADLINE)
            exit_ms = (time.monotonic() - terminated) * 1000
            assert code == 0, a.log_tail(2000)
            # a is gone: nginx's connect is refused and it moves on, no failed handshake.
            assert await clients.connect() is not None
            assert await b.sessions() == 1
            await clients.close_all()
    print(
        f"\nnginx LB: {len(full_ms)} handshakes (6 live at once, 3 per sidecar) "
        f"p50 {statistics.median(full_ms):.1f} ms "
        f"max {max(full_ms):.1f} ms; 7th: 503 Retry-After 1; after SIGTERM on one sidecar "
        f"{len(after_ms)} new sessions all on the other (p50 {statistics.median(after_ms):.1f} ms), "
        f"0 failed handshakes; drained sidecar exited 0 {exit_ms:.0f} ms after SIGTERM "
        "(when its last session ended)"
    )


async def _status(sidecar: Serve, expected: int) -> bool:
    return (await sidecar.readyz())[0] == expected


async def _count(sidecar: Serve, expected: int) -> bool:
    return await sidecar.sessions() == expected


async def _sum_sessions(a: Serve, b: Serve, expected: int) -> bool:
    return await a.sessions() + await b.sessions() == expected


def _servers(config: str, upstream: str) -> list[str]:
    block = config.split(f"upstream {upstream} {{", 1)[1].split("}", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip().startswith("server ")]


def test_both_upstream_blocks_list_the_same_sidecars() -> None:
    # A sidecar missing from the affinity block would get no resumable calls, one
    # missing from the other no calls without affinity: the two lists are one list.
    text = LB_EXAMPLE.read_text()
    assert _servers(text, "omni_sidecars") == _servers(text, "omni_sidecars_by_affinity") != []
    # The rule itself, broken on purpose: one server line dropped from one block.
    broken = text.replace(
        "    server 127.0.0.1:8002 max_fails=0;\n    keepalive 16;\n    keepalive_timeout 5s;\n}",
        "    keepalive 16;\n    keepalive_timeout 5s;\n}",
        1,
    )
    assert _servers(broken, "omni_sidecars") != _servers(broken, "omni_sidecars_by_affinity")
