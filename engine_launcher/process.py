"""Starting, probing and stopping the engine child process.

The child always runs in its own process group (``start_new_session``) so that
a stop reaches every process it spawned (vLLM-Omni forks one process per
stage). On Linux it also gets a parent-death signal, so that it never outlives
a sidecar that was killed with SIGKILL.

Readiness (docs/design.md, Engine launcher): the HTTP port accepts TCP, then
``GET /health`` answers 200. vLLM-Omni binds its port only after every stage
is loaded, which can take 8–20 minutes.

An ``external`` engine has no child; :class:`UpstreamProbe` checks it the same
way on the upstream URL's host and port, and falls back to a WebSocket
handshake on the upstream URL when ``/health`` is 404 or the port does not
speak HTTP (an engine behind a WebSocket-only front end).

Engine output reaches our log line by line with an ``engine:`` prefix (logger
``engine_launcher.child``): stdout at INFO, stderr at WARNING, and at ERROR a
Python traceback and every line that names the ERROR or CRITICAL level, so
that the reason an engine died (a ``ModuleNotFoundError``, a CUDA error) is
never buried among INFO lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import aiohttp

from engine_launcher.config import EngineConfig
from engine_launcher.errors import EngineStartError

__all__ = [
    "MAX_PROBE_TIMEOUT",
    "EngineProcess",
    "HealthProbe",
    "ProbeResult",
    "UpstreamProbe",
    "build_argv",
    "free_port",
    "probe_health",
    "stderr_level",
]

log = logging.getLogger("engine_launcher")
engine_log = logging.getLogger("engine_launcher.child")

_PR_SET_PDEATHSIG: Final = 1
#: Longest engine output line passed to our log (the rest is cut).
_MAX_LINE_BYTES: Final = 64 * 1024
#: Upper bound of one health probe (seconds); the supervisor uses the smaller of
#: this and ``health_interval`` so that a hung engine cannot stretch the interval.
MAX_PROBE_TIMEOUT: Final = 5.0
#: How long ``stop`` waits for the output pumps to reach EOF after the group died.
_PUMP_DRAIN_SECONDS: Final = 2.0
_ERROR_WORDS: Final = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b")
_TRACEBACK_START: Final = "Traceback (most recent call last):"


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
    """One readiness probe: ``stage`` is "tcp", "health" or "websocket"; ``detail`` says why not."""

    ok: bool
    stage: str
    detail: str


async def probe_health(
    session: aiohttp.ClientSession, host: str, port: int, path: str, timeout: float
) -> ProbeResult:
    """TCP connect, then ``GET path`` must answer 200; the whole probe within ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        async with asyncio.timeout(timeout):
            _reader, writer = await asyncio.open_connection(host, port)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    except (OSError, TimeoutError) as exc:
        return ProbeResult(False, "tcp", f"connect {host}:{port}: {exc or type(exc).__name__}")
    url = f"http://{_url_host(host)}:{port}{path}"
    left = max(0.001, deadline - loop.time())
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=left)) as resp:
            if resp.status == 200:
                return ProbeResult(True, "health", "200")
            return ProbeResult(False, "health", f"GET {path} -> {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return ProbeResult(False, "health", f"GET {path}: {exc or type(exc).__name__}")


class HealthProbe:
    """Probes one engine endpoint with a shared HTTP session.

    Args:
        host: the engine's address.
        port: its HTTP port.
        path: the health path.
        timeout: seconds one probe may take, TCP connect and GET together.
    """

    def __init__(
        self, host: str, port: int, *, path: str = "/health", timeout: float = MAX_PROBE_TIMEOUT
    ) -> None:
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


class UpstreamProbe:
    """Is an ``external`` engine there? ``GET /health`` first, a WebSocket handshake second.

    ``GET /health`` goes to the upstream URL's host and port (``ws`` → ``http``,
    ``wss`` → ``https``). A 200 is healthy; any other status but 404 is not.
    A 404, or an answer that is not HTTP, means the endpoint has no health
    route: then a WebSocket handshake on the upstream URL itself decides, and
    the socket is closed at once. A refused or timed-out connection is
    unhealthy without the fallback (the handshake would fail the same way).

    Args:
        upstream: the ``ws://``/``wss://`` URL sessions are relayed to.
        timeout: seconds one probe may take, fallback included.
    """

    def __init__(self, upstream: str, *, timeout: float = MAX_PROBE_TIMEOUT) -> None:
        parts = urlsplit(upstream)
        scheme = "https" if parts.scheme == "wss" else "http"
        self.upstream = upstream
        self.health_url = f"{scheme}://{parts.netloc}/health"
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self) -> ProbeResult:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        session = self._session
        try:
            async with asyncio.timeout(self.timeout):
                try:
                    async with session.get(self.health_url, allow_redirects=False) as resp:
                        if resp.status == 200:
                            return ProbeResult(True, "health", "200")
                        if resp.status != 404:
                            return ProbeResult(
                                False, "health", f"GET {self.health_url} -> {resp.status}"
                            )
                        why = "404"
                except aiohttp.ClientConnectorError as exc:
                    return ProbeResult(False, "tcp", f"connect {self.health_url}: {exc}")
                except (aiohttp.ClientResponseError, aiohttp.ServerDisconnectedError) as exc:
                    why = f"not HTTP ({type(exc).__name__})"
                try:
                    async with session.ws_connect(self.upstream, autoping=False):
                        return ProbeResult(True, "websocket", f"/health {why}; handshake ok")
                except (aiohttp.ClientError, OSError) as exc:
                    return ProbeResult(
                        False, "websocket", f"/health {why}; handshake to {self.upstream}: {exc}"
                    )
        except TimeoutError:
            return ProbeResult(False, "health", f"no answer within {self.timeout:.1f} s")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def stderr_level(line: str, in_traceback: bool) -> tuple[int, bool]:
    """The log level of one engine stderr line, and whether a traceback continues.

    stderr is where a Python engine writes its warnings and its last words, so
    nothing on it is below WARNING. A traceback (from its first line to the
    exception line, which is the first line without indentation) and lines
    naming ERROR/CRITICAL/FATAL are ERROR.
    """
    if line.startswith(_TRACEBACK_START):
        return logging.ERROR, True
    if in_traceback:
        # Frames and source lines are indented; the exception line is not and ends it.
        return logging.ERROR, line.startswith((" ", "\t")) or not line.strip()
    if _ERROR_WORDS.search(line):
        return logging.ERROR, False
    return logging.WARNING, False


class EngineProcess:
    """One run of the engine child.

    Args:
        argv: the command line.
        env: extra environment variables (merged over ours).
    """

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self._env = env or {}
        self._proc: asyncio.subprocess.Process | None = None
        self._pumps: list[asyncio.Task[None]] = []
        #: Resolved when the pidfd says the child exited: its status, or None when
        #: asyncio reaped it first (then ``proc.wait()`` has the status).
        self._exit: asyncio.Future[int | None] | None = None
        self._pidfd: int | None = None
        self.started_at: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status as soon as the child has exited (before it is reaped)."""
        seen = self._exit
        if seen is not None and seen.done() and not seen.cancelled():
            status = seen.result()
            if status is not None:
                return status
        return None if self._proc is None else self._proc.returncode

    async def start(self) -> None:
        """Spawn the child in its own process group; its output goes to our log.

        Raises:
            EngineStartError: the executable cannot be run.
        """
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
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal,
                limit=_MAX_LINE_BYTES,
            )
        except OSError as exc:
            raise EngineStartError(f"cannot start engine {self.argv[0]!r}: {exc}") from exc
        self.started_at = time.monotonic()
        self._watch_exit(self._proc.pid)
        # Owned here and awaited in ``stop``: they end at EOF, when the group is gone.
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._pumps = [
            asyncio.create_task(self._pump(self._proc.stdout, stderr=False), name="engine-stdout"),
            asyncio.create_task(self._pump(self._proc.stderr, stderr=True), name="engine-stderr"),
        ]

    @staticmethod
    async def _pump(stream: asyncio.StreamReader, *, stderr: bool) -> None:
        in_traceback = False
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the limit: take what is there
                raw = await stream.read(_MAX_LINE_BYTES)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            level = logging.INFO
            if stderr:
                level, in_traceback = stderr_level(line, in_traceback)
            engine_log.log(level, "engine: %s", line)

    def _watch_exit(self, pid: int) -> None:
        """Learn of the exit from a pidfd in the event loop, not from a reaper thread.

        asyncio's default child watcher (3.11) reaps in a thread and hands the
        status over when that thread next gets the GIL, milliseconds later; a
        client admitted meanwhile would be sent to a dead port (502). The pidfd
        turns readable the moment the child exits; ``waitid(WNOWAIT)`` reads the
        status and leaves the reaping to asyncio. Without pidfds (old kernels,
        other systems) ``wait`` falls back to asyncio's own.
        """
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        self._pidfd = pidfd
        self._exit = loop.create_future()
        loop.add_reader(pidfd, self._on_exit)

    def _on_exit(self) -> None:
        status: int | None = None
        with contextlib.suppress(ChildProcessError, OSError):  # already reaped: asyncio has it
            info = os.waitid(os.P_PIDFD, self._pidfd or -1, os.WEXITED | os.WNOWAIT)
            if info is not None:
                exited = info.si_code == os.CLD_EXITED
                status = info.si_status if exited else -info.si_status
        self._close_pidfd()
        if status is None and self._proc is not None:
            status = self._proc.returncode
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(status)

    def _close_pidfd(self) -> None:
        pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)

    async def wait(self) -> int:
        """Wait for the child to exit; return its exit status."""
        assert self._proc is not None
        seen = self._exit
        if seen is not None and not seen.cancelled():
            # Awaited directly (no extra task): the caller hears of the exit on the
            # next loop turn after the pidfd fired.
            status = await seen
            if status is not None:
                return status
        return await self._proc.wait()

    async def stop(self, grace: float) -> int | None:
        """SIGTERM (and SIGCONT) the process group, SIGKILL it after ``grace`` seconds.

        SIGCONT goes with SIGTERM because a stopped (SIGSTOP) engine would
        otherwise hold the SIGTERM pending and always cost the full grace.
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)
            try:
                async with asyncio.timeout(grace):
                    await proc.wait()
            except TimeoutError:
                log.warning("engine ignored SIGTERM for %.1f s; sending SIGKILL", grace)
        # Always sweep the group: stage processes may outlive their parent.
        self._signal_group(signal.SIGKILL)
        if proc.returncode is None:
            await proc.wait()
        self._close_pidfd()
        pumps, self._pumps = self._pumps, []
        if pumps:
            # The last lines (a traceback) are still in the pipes: let them reach the log.
            await asyncio.wait(pumps, timeout=_PUMP_DRAIN_SECONDS)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        return proc.returncode

    def _signal_group(self, signum: int) -> None:
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)
