"""``omni-sidecar serve --upstream URL`` as a real child process, for the attack suites.

The child gets its own log file, free loopback ports, a clean environment and
its own process group (so :meth:`Served.kill` reaches only what it started).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import DEADLINE, free_port, wait_until
from tests.integration.helpers import SimChild, clean_env, cli_argv
from tests.integration.leakcheck import rss_bytes

__all__ = ["Served", "ready", "serve"]


@dataclass
class Served:
    """A running ``serve`` child (and the simulator behind it, when the test made one)."""

    proc: subprocess.Popen[bytes]
    port: int
    admin_port: int
    log_path: Path
    sim: SimChild | None = None

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def metrics(self, base: str | None = None) -> dict[str, float]:
        """Every sample of ``base``/metrics (the sidecar's admin listener by default)."""
        url = f"{base or f'http://127.0.0.1:{self.admin_port}'}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            text = await resp.text()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    async def metric(self, name: str) -> float:
        return (await self.metrics()).get(name, 0.0)

    async def gauge(self, name: str) -> float:
        return (await self.metrics())[name]

    async def rejected(self, reason: str) -> float:
        return await self.gauge(f'omni_sidecar_rejected_connections_total{{reason="{reason}"}}')

    async def engine_sessions(self) -> float:
        """Sessions the engine accepted: the simulator's own count."""
        assert self.sim is not None, "no simulator behind this sidecar"
        return (await self.metrics(self.sim.http_url))["vllm_omni_sim_sessions_total"]

    async def live_sessions(self) -> int:
        """Sessions the operator sees live on ``/debug/sessions``."""
        url = f"http://127.0.0.1:{self.admin_port}/debug/sessions"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return int((await resp.json())["live"])

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=DEADLINE)


@contextlib.contextmanager
def serve(
    tmp_path: Path,
    upstream: str,
    *flags: str,
    sim: SimChild | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Served]:
    """Start ``serve --upstream upstream *flags`` (keepalive off); kill it on exit.

    ``env`` is added to the clean environment (e.g. ``OTEL_*`` variables).
    """
    port, admin_port = free_port(), free_port()
    log_path = tmp_path / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cli_argv(
                "serve", "--listen", f"127.0.0.1:{port}",
                "--admin-listen", f"127.0.0.1:{admin_port}",
                "--upstream", upstream, "--heartbeat-interval", "0", *flags,
            ),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=clean_env(**(env or {})), start_new_session=True,
        )  # fmt: skip
    server = Served(proc, port, admin_port, log_path, sim)
    try:
        yield server
    finally:
        server.kill()


async def ready(server: Served) -> None:
    """Wait for ``/readyz`` 200; fail at once if the child exited."""

    async def check() -> bool:
        if server.proc.poll() is not None:
            pytest.fail(f"serve exited early:\n{server.log()}")
        try:
            url = f"http://127.0.0.1:{server.port}/readyz"
            async with aiohttp.ClientSession() as http, http.get(url) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError):
            return False

    await wait_until(check, timeout=3 * DEADLINE, what="serve /readyz 200")
