"""Readiness of an ``external`` engine, through a real ``omni-sidecar serve`` child.

The sidecar probes the upstream itself (``GET /health`` on its host:port, a
WebSocket handshake when that is 404 or not HTTP): nothing listening means
``/readyz`` 503, ``omni_sidecar_engine_up 0`` and 503 for clients (never
"ready" with every client getting 502); an engine appearing on the port makes
it ready; the engine going away again makes it not ready within
``health_failures × health_interval + probe timeout`` (3 × 2 s + 2 s by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import DEADLINE, free_port, wait_until
from tests.integration.helpers import clean_env, cli_argv

pytestmark = pytest.mark.timeout(90)

#: Defaults of engine.health_failures, engine.health_interval and the probe timeout.
DETECTION_BOUND = 3 * 2.0 + 2.0


class Serve:
    def __init__(self, proc: asyncio.subprocess.Process, port: int, admin: int, log: Path):
        self.proc, self.port, self.admin, self.log = proc, port, admin, log

    async def readyz(self) -> tuple[int, dict[str, object]] | None:
        try:
            url = f"http://127.0.0.1:{self.port}/readyz"
            timeout = aiohttp.ClientTimeout(total=1)
            async with aiohttp.ClientSession() as http, http.get(url, timeout=timeout) as resp:
                return resp.status, await resp.json()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def engine_up(self) -> float | None:
        try:
            url = f"http://127.0.0.1:{self.admin}/metrics"
            async with aiohttp.ClientSession() as http, http.get(url) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, OSError):
            return None
        for line in text.splitlines():
            if line.startswith("omni_sidecar_engine_up "):
                return float(line.split()[1])
        return None

    async def handshake_status(self) -> int:
        async with aiohttp.ClientSession() as http:
            try:
                ws = await http.ws_connect(f"ws://127.0.0.1:{self.port}/v1/realtime")
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status
            await ws.close()
            return 101


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, *args: str) -> AsyncIterator[Serve]:
    port, admin = free_port(), free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *cli_argv(
                "serve", "--listen", f"127.0.0.1:{port}", "--admin-listen",
                f"127.0.0.1:{admin}", "--log-level", "info", *args,
            ),
            stdout=sink,
            stderr=sink,
            env=clean_env(),
        )  # fmt: skip
    try:
        yield Serve(proc, port, admin, log)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(DEADLINE):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        print(log.read_text(errors="replace")[-3000:])


@contextlib.contextmanager
def simulator_on(port: int) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "engine_launcher.simulator", "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        yield process
    finally:
        kill(process)


def kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


async def test_unreachable_upstream_is_not_ready_until_an_engine_answers(tmp_path: Path) -> None:
    engine_port = free_port()
    started = time.monotonic()
    async with serve(tmp_path, "--upstream", f"ws://127.0.0.1:{engine_port}/v1/realtime") as srv:

        async def answered_503() -> bool:
            answer = await srv.readyz()
            return answer is not None and answer[0] == 503

        async def probed_and_503() -> bool:
            # /readyz is 503 "engine is starting" from the first moment; the detail
            # names the upstream only once the first probe has failed, which on a
            # busy machine can come after the first 503 a poll sees.
            answer = await srv.readyz()
            return (
                answer is not None
                and answer[0] == 503
                and f"127.0.0.1:{engine_port}" in str(answer[1].get("detail"))
            )

        await wait_until(probed_and_503, timeout=DEADLINE, what="/readyz 503 naming the upstream")
        print(f"\nunreachable upstream -> /readyz 503 after {time.monotonic() - started:.2f} s")
        answer = await srv.readyz()
        assert answer is not None
        status, body = answer
        assert (status, body["reason"]) == (503, "not_ready")
        assert f"127.0.0.1:{engine_port}" in str(body["detail"])
        assert await srv.engine_up() == 0.0
        assert await srv.handshake_status() == 503  # not 502

        with simulator_on(engine_port) as sim:
            appeared = time.monotonic()

            async def ready() -> bool:
                answer = await srv.readyz()
                return answer is not None and answer[0] == 200

            await wait_until(ready, timeout=DEADLINE, what="/readyz 200")
            print(f"engine appeared -> /readyz 200 after {time.monotonic() - appeared:.2f} s")
            assert await srv.engine_up() == 1.0
            assert await srv.handshake_status() == 101

            kill(sim)
            gone_at = time.monotonic()
            await wait_until(answered_503, timeout=DETECTION_BOUND + 1.0, what="/readyz 503 again")
            took = time.monotonic() - gone_at
            print(f"engine gone -> /readyz 503 after {took:.2f} s (bound {DETECTION_BOUND} s)")
            assert took >= 2 * 2.0 * 0.9  # not at the first failed probe: 3 are needed
            assert await srv.engine_up() == 0.0
            assert await srv.handshake_status() == 503
        assert srv.proc.returncode is None


async def test_upstream_without_a_health_route_is_probed_with_a_handshake(
    tmp_path: Path,
) -> None:
    """``/health`` 404: a WebSocket handshake on the upstream URL decides."""
    handshakes = 0

    async def realtime(request: web.Request) -> web.WebSocketResponse:
        nonlocal handshakes
        handshakes += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/v1/realtime", realtime)
    runner = web.AppRunner(app)
    await runner.setup()
    engine_port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", engine_port)
    await site.start()
    try:
        async with serve(
            tmp_path, "--upstream", f"ws://127.0.0.1:{engine_port}/v1/realtime"
        ) as srv:

            async def ready() -> bool:
                answer = await srv.readyz()
                return answer is not None and answer[0] == 200

            await wait_until(ready, timeout=DEADLINE, what="/readyz 200 via a handshake")
            assert handshakes >= 1
            assert await srv.engine_up() == 1.0
    finally:
        await runner.cleanup()
