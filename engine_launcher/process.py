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
import functools
import logging
import os
import re
import signal
import socket
import subprocess
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


def _popen(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """fork+exec (brief; the child is not waited for): own session, parent-death signal."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        # Only prctl(2) runs between fork and exec; nothing that takes a lock.
        preexec_fn=_set_parent_death_signal,  # noqa: PLW1509
    )


class EngineProcess:
    """One run of the engine child.

    The child is spawned with :class:`subprocess.Popen` and reaped here, in the
    event loop, when its pidfd turns readable: asyncio 3.11's default watcher
    would reap it in a thread and hand the status over when that thread next
    gets the GIL, milliseconds in which a client could be admitted to a dead
    engine port (502 instead of 503). Its stdout and stderr are read through
    the loop's pipe transports. Without pidfds (old kernels, other systems) a
    worker thread waits for the exit instead.

    Args:
        argv: the command line.
        env: extra environment variables (merged over ours).
    """

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self._env = env or {}
        self._popen: subprocess.Popen[bytes] | None = None
        self._returncode: int | None = None
        self._waiters: list[asyncio.Future[int]] = []
        self._pidfd: int | None = None
        self._reaper: asyncio.Future[int] | None = None  # the fallback's worker thread
        self._pumps: list[asyncio.Task[None]] = []
        self._pipes: list[asyncio.BaseTransport] = []
        self.started_at: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

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
        loop = asyncio.get_running_loop()
        try:
            popen = _popen(self.argv, env)
        except OSError as exc:
            raise EngineStartError(f"cannot start engine {self.argv[0]!r}: {exc}") from exc
        self._popen = popen
        self.started_at = time.monotonic()
        self._watch_exit(loop, popen)
        assert popen.stdout is not None and popen.stderr is not None
        for pipe, name in ((popen.stdout, "stdout"), (popen.stderr, "stderr")):
            reader = asyncio.StreamReader(limit=_MAX_LINE_BYTES)
            transport, _ = await loop.connect_read_pipe(
                functools.partial(asyncio.StreamReaderProtocol, reader), pipe
            )
            self._pipes.append(transport)
            # Owned here and awaited in ``stop``: they end at EOF, when the group is gone.
            self._pumps.append(
                asyncio.create_task(
                    self._pump(reader, stderr=name == "stderr"), name=f"engine-{name}"
                )
            )

    def _watch_exit(self, loop: asyncio.AbstractEventLoop, popen: subprocess.Popen[bytes]) -> None:
        try:
            pidfd = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            self._reaper = loop.run_in_executor(None, popen.wait)
            self._reaper.add_done_callback(
                lambda done: self._exited(done.result()) if not done.cancelled() else None
            )
            return
        self._pidfd = pidfd
        loop.add_reader(pidfd, self._on_pidfd)

    def _on_pidfd(self) -> None:
        """The child exited: reap it here, so the status is known on this loop turn."""
        assert self._popen is not None
        try:
            pid, status = os.waitpid(self._popen.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: no status to be had
            pid, status = self._popen.pid, 255 << 8
        if pid == 0:
            return  # not yet (spurious wake-up)
        self._close_pidfd()
        code = os.waitstatus_to_exitcode(status)
        self._popen.returncode = code  # so that Popen never waits for it again
        self._exited(code)

    def _exited(self, code: int) -> None:
        if self._returncode is not None:
            return
        self._returncode = code
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(code)

    def _close_pidfd(self) -> None:
        pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)

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

    async def wait(self) -> int:
        """Return once the child has exited, with its exit status (-N: killed by signal N).

        Each call waits on its own future, so cancelling one waiter leaves the
        others (and the exit itself) alone.
        """
        assert self._popen is not None
        if self._returncode is not None:
            return self._returncode
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def stop(self, grace: float) -> int | None:
        """SIGTERM (and SIGCONT) the process group, SIGKILL it after ``grace`` seconds.

        SIGCONT goes with SIGTERM because a stopped (SIGSTOP) engine would
        otherwise hold the SIGTERM pending and always cost the full grace.
        """
        if self._popen is None:
            return None
        if self._returncode is None:
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)
            try:
                async with asyncio.timeout(grace):
                    await self.wait()
            except TimeoutError:
                log.warning("engine ignored SIGTERM for %.1f s; sending SIGKILL", grace)
        # Always sweep the group: stage processes may outlive their parent.
        self._signal_group(signal.SIGKILL)
        if self._returncode is None:
            await self.wait()
        self._close_pidfd()
        pumps, self._pumps = self._pumps, []
        if pumps:
            # The last lines (a traceback) are still in the pipes: let them reach the log.
            await asyncio.wait(pumps, timeout=_PUMP_DRAIN_SECONDS)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        pipes, self._pipes = self._pipes, []
        for pipe in pipes:
            pipe.close()
        return self._returncode

    def _signal_group(self, signum: int) -> None:
        if self._popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signum)
