"""Starting, probing and stopping the engine child process.

The child always runs in its own process group (``start_new_session``) so that
a stop reaches every process it spawned (vLLM-Omni forks one process per
stage). On Linux it also gets a parent-death signal, so that it never outlives
a sidecar that was killed with SIGKILL.

Readiness (DESIGN.md §8, reference §4.3): the HTTP port accepts TCP, then
``GET /health`` answers 200. vLLM-Omni binds its port only after every stage
is loaded, which can take 8–20 minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import aiohttp

from engine_launcher.config import EngineConfig
from engine_launcher.errors import EngineStartError

__all__ = [
    "EngineProcess",
    "HealthProbe",
    "ProbeResult",
    "build_argv",
    "free_port",
    "probe_health",
]

log = logging.getLogger("engine_launcher")
engine_log = logging.getLogger("engine_launcher.child")

_PR_SET_PDEATHSIG: Final = 1
#: Longest engine output line passed to our log (the rest is cut).
_MAX_LINE_BYTES: Final = 64 * 1024


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def build_argv(config: EngineConfig, port: int) -> list[str]:
    """The exact command line for the engine child.

    ``vllm-omni``: ``PYTHON -m vllm_omni.entrypoints.cli.main serve MODEL --omni
    --host H --port P [--deploy-config Y] [extra_args]`` (the form vLLM-Omni's
    own test harness uses; without ``--omni`` the CLI silently falls back to
    plain vLLM). ``command``: the argv as configured, with ``{host}`` and
    ``{port}`` substituted. ``simulator``: our simulator, launched the same way.
    """
    host = config.host
    if config.kind == "vllm-omni":
        assert config.model is not None
        argv = [
            config.effective_python(),
            "-m",
            "vllm_omni.entrypoints.cli.main",
            "serve",
            config.model,
            "--omni",
            "--host",
            host,
            "--port",
            str(port),
        ]
        if config.deploy_config:
            argv += ["--deploy-config", config.deploy_config]
        return argv + list(config.extra_args)
    if config.kind == "simulator":
        return [
            config.effective_python(),
            "-m",
            "engine_launcher.simulator",
            "--host",
            host,
            "--port",
            str(port),
            *config.simulator_args,
        ]
    if config.kind == "command":
        return [
            part.replace("{host}", host).replace("{port}", str(port)) for part in config.command
        ]
    raise EngineStartError(f"engine kind {config.kind!r} has no process to start")


def _set_parent_death_signal() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One readiness probe: ``stage`` is "tcp" or "health"; ``detail`` says why not."""

    ok: bool
    stage: str
    detail: str


async def probe_health(
    session: aiohttp.ClientSession, host: str, port: int, path: str, timeout: float
) -> ProbeResult:
    """TCP connect, then ``GET path`` must answer 200."""
    try:
        async with asyncio.timeout(timeout):
            _reader, writer = await asyncio.open_connection(host, port)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    except (OSError, TimeoutError) as exc:
        return ProbeResult(False, "tcp", f"connect {host}:{port}: {exc or type(exc).__name__}")
    url = f"http://{_url_host(host)}:{port}{path}"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status == 200:
                return ProbeResult(True, "health", "200")
            return ProbeResult(False, "health", f"GET {path} -> {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return ProbeResult(False, "health", f"GET {path}: {exc or type(exc).__name__}")


class HealthProbe:
    """Probes one engine endpoint with a shared HTTP session."""

    def __init__(self, host: str, port: int, *, path: str = "/health", timeout: float = 5.0):
        self.host = host
        self.port = port
        self.path = path
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self) -> ProbeResult:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return await probe_health(self._session, self.host, self.port, self.path, self.timeout)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class EngineProcess:
    """One run of the engine child.

    Args:
        argv: the command line.
        env: extra environment variables (merged over ours).
        name: for log lines.
    """

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self._env = env or {}
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self.started_at: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    async def start(self) -> None:
        """Spawn the child in its own process group; its output goes to our log."""
        # The engine needs none of our settings, and some are secrets (API keys).
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_SIDECAR_")}
        env.update(self._env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        log.info("starting engine: %s", " ".join(self.argv))
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal,
                limit=_MAX_LINE_BYTES,
            )
        except OSError as exc:
            raise EngineStartError(f"cannot start engine {self.argv[0]!r}: {exc}") from exc
        self.started_at = time.monotonic()
        self._pump = asyncio.create_task(self._pump_output(), name="engine-output")

    async def _pump_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        stream = self._proc.stdout
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the limit: take what is there
                line = await stream.read(_MAX_LINE_BYTES)
            if not line:
                return
            engine_log.info("engine: %s", line.decode("utf-8", "replace").rstrip())

    async def wait(self) -> int:
        """Wait for the child to exit; return its exit status."""
        assert self._proc is not None
        return await self._proc.wait()

    async def wait_ready(
        self,
        probe: Callable[[], object],
        *,
        timeout: float,
        interval: float = 0.5,
        progress_interval: float = 15.0,
        on_progress: Callable[[float, ProbeResult | None], None] | None = None,
    ) -> float:
        """Probe until ready; return seconds it took.

        Raises:
            EngineStartError: the child exited or ``timeout`` passed first.
        """
        started = time.monotonic()
        next_progress = started + progress_interval
        last: ProbeResult | None = None
        while True:
            if self.returncode is not None:
                raise EngineStartError(
                    f"engine exited with status {self.returncode} before it was ready",
                    returncode=self.returncode,
                )
            result = await probe()  # type: ignore[misc]
            assert isinstance(result, ProbeResult)
            last = result
            now = time.monotonic()
            if result.ok:
                return now - started
            if now - started >= timeout:
                raise EngineStartError(
                    f"engine not ready after {timeout:.0f} s (last probe: {result.detail})"
                )
            if now >= next_progress:
                next_progress = now + progress_interval
                if on_progress is not None:
                    on_progress(now - started, last)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.wait()

    async def stop(self, grace: float) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                async with asyncio.timeout(grace):
                    await proc.wait()
            except TimeoutError:
                log.warning("engine ignored SIGTERM for %.1f s; sending SIGKILL", grace)
        # Always sweep the group: stage processes may outlive their parent.
        self._signal_group(signal.SIGKILL)
        if proc.returncode is None:
            await proc.wait()
        if self._pump is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                async with asyncio.timeout(2.0):
                    await self._pump
            if not self._pump.done():
                self._pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._pump
        return proc.returncode

    def _signal_group(self, signum: int) -> None:
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)
