"""``omni-sidecar serve --upstream URL`` as a real child process, for the attack suites.

The child is a :class:`tests.children.SidecarChild`: its own log file, free
loopback ports, a clean environment and its own process group (so
:meth:`Served.kill` reaches only what it started).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from tests.children import SidecarChild, SimulatorChild, free_port
from tests.conftest import DEADLINE
from tests.integration.leakcheck import rss_bytes

__all__ = ["Served", "ready", "serve"]

#: Seconds a stopped child gets after SIGTERM before SIGKILL: the suites leave no
#: session worth draining, and a frozen attacker's would hold the drain for its whole timeout.
STOP_GRACE = 2.0


class Served(SidecarChild):
    """A running ``serve`` child (and the simulator behind it, when the test made one)."""

    def __init__(
        self,
        log_dir: Path,
        *flags: str,
        sim: SimulatorChild | None,
        env: dict[str, str],
        prefix: tuple[str, ...] = (),
    ) -> None:
        port = free_port()
        super().__init__(
            *flags,
            port=port,
            env=env,
            log_path=log_dir / f"serve-{port}.log",
            stop_grace=STOP_GRACE,
            ready_timeout=3 * DEADLINE,
            prefix=prefix,
        )
        self.sim = sim

    @property
    def ws(self) -> str:
        return self.ws_url

    async def metrics(self, base: str | None = None) -> dict[str, float]:
        """Every sample of ``base``/metrics (the sidecar's admin listener by default)."""
        url = f"{base or self.admin_url}/metrics"
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
        url = f"{self.admin_url}/debug/sessions"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return int((await resp.json())["live"])

    def rss(self) -> int:
        return rss_bytes(self.pid)


@contextlib.contextmanager
def serve(
    tmp_path: Path,
    upstream: str,
    *flags: str,
    sim: SimulatorChild | None = None,
    env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
) -> Iterator[Served]:
    """Start ``serve --upstream upstream *flags`` (keepalive off); stop it on exit.

    ``env`` is added to the clean environment (e.g. ``OTEL_*`` variables);
    ``prefix`` goes in front of the command (e.g. ``prlimit --nofile=64:64 --``).
    Readiness is the caller's: ``await ready(server)``.
    """
    server = Served(
        tmp_path, "--upstream", upstream, "--heartbeat-interval", "0", *flags,
        sim=sim, env=env or {}, prefix=prefix,
    )  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def ready(server: Served) -> None:
    """Wait for ``/readyz`` 200; fail at once (with the log) if the child exited."""
    await server.ready()
