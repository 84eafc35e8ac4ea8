"""Starting, probing and stopping the engine child process.

The child runs in its own process group with a parent-death signal; readiness
is a TCP connect, then ``GET /health`` answering 200 (docs/design.md, Engine
launcher). :class:`UpstreamProbe` probes an ``external`` engine and hands over
to a WebSocket handshake when the server has no health route (docs/design.md,
Engine supervision). The child's output is logged line by line, each line at
the level that keeps a failure visible (docs/design.md, Logs).
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
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import aiohttp

from engine_launcher.engine_config import EngineConfig, ProbeKind
from engine_launcher.launcher_errors import EngineStartError
from engine_launcher.policy import HealthVerdict, health_verdict

__all__ = [
    "MAX_PROBE_TIMEOUT",
    "REALTIME_PATH",
    "EngineProcess",
    "HealthCheck",
    "HealthProbe",
    "UpstreamProbe",
    "build_argv",
    "free_port",
    "probe_health",
    "probe_websocket_url",
    "stderr_level",
]

# The engine loggers keep the names operators filter on ("engine_launcher",
# "engine_launcher.child"): they are part of the log format, not module paths.
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
class HealthCheck:
    """One readiness probe: ``stage`` is "tcp", "health" or "websocket"; ``detail`` says why not."""

    ok: bool
    stage: str
    detail: str


async def probe_health(
    session: aiohttp.ClientSession, host: str, port: int, path: str, timeout: float
) -> HealthCheck:
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
        return HealthCheck(False, "tcp", f"connect {host}:{port}: {exc or type(exc).__name__}")
    url = f"http://{_url_host(host)}:{port}{path}"
    left = max(0.001, deadline - loop.time())
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=left)) as resp:
            if resp.status == 200:
                return HealthCheck(True, "health", f"GET {path} -> 200")
            return HealthCheck(False, "health", f"GET {path} -> {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return HealthCheck(False, "health", f"GET {path}: {exc or type(exc).__name__}")


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

    async def __call__(self) -> HealthCheck:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return await probe_health(self._session, self.host, self.port, self.path, self.timeout)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class UpstreamProbe:
    """Is the engine at a WebSocket URL there? By ``GET /health``, a handshake or a connect.

    ``kind`` (``engine.probe``) picks the check:

    - ``health``: ``GET /health`` on the URL's host and port (``ws`` → ``http``,
      ``wss`` → ``https``) must answer 200.
    - ``websocket``: a handshake on :attr:`websocket_url` must answer 101.
    - ``tcp``: the URL's host and port accept a TCP connection.
    - ``auto``: ``health``, except that an answer saying the server has no
      health route (:func:`~engine_launcher.policy.health_verdict`: 400, 404,
      405, 426 or not HTTP) hands over to ``websocket``, for this probe and
      every later one, so that a WebSocket-only engine logs one refused
      ``GET`` (its handshake failure) instead of one per poll. 5xx, a refused
      connection and a timeout are unhealthy without the hand-over.

    The handshake asks for no session: its query is the URL's own with
    ``autostart=0`` (any ``autostart`` given replaced), so an engine given
    ``model=`` does not open a default session on connect (docs/engine-protocol.md,
    Opening a session), and the socket is closed with 1000 right after the
    101, before any client message, which is what opens one. The engine sees
    a clean close, not an error.

    Args:
        upstream: the ``ws://``/``wss://`` URL sessions are relayed to; a URL
            without a realtime path (``ws://h:8091``) is handshaken on
            ``/v1/realtime``, the path clients use.
        kind: ``auto``, ``health``, ``websocket`` or ``tcp``.
        timeout: seconds one probe may take, hand-over included (the close
            after a good handshake gets up to :data:`_CLOSE_WAIT` more).
    """

    def __init__(
        self, upstream: str, *, kind: ProbeKind = "auto", timeout: float = MAX_PROBE_TIMEOUT
    ) -> None:
        parts = urlsplit(upstream)
        scheme = "https" if parts.scheme == "wss" else "http"
        self.upstream = upstream
        self.kind = kind
        self.health_url = f"{scheme}://{parts.netloc}/health"
        self.websocket_url = probe_websocket_url(upstream)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "wss" else 80)
        self.timeout = timeout
        #: Why ``auto`` handed over to the handshake ("GET /health -> 426"); None before.
        self.no_health_route: str | None = None
        self._stage = "health"  # what the probe in flight is doing, for its timeout's detail
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self) -> HealthCheck:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        self._stage = "tcp" if self.kind == "tcp" else "health"
        opened: list[aiohttp.ClientWebSocketResponse] = []
        try:
            async with asyncio.timeout(self.timeout):
                return await self._probe(self._session, opened)
        except TimeoutError:
            return HealthCheck(False, self._stage, f"no answer within {self.timeout:.1f} s")
        finally:
            # Outside the deadline, so that the engine gets a close frame, not a dropped socket.
            for ws in opened:
                await _close_quietly(ws)

    async def _probe(
        self, session: aiohttp.ClientSession, opened: list[aiohttp.ClientWebSocketResponse]
    ) -> HealthCheck:
        if self.kind == "tcp":
            return await self._connect()
        if self.kind == "websocket" or self.no_health_route is not None:
            return await self._handshake(session, opened)
        answer = await self._health(session)
        if isinstance(answer, HealthCheck):
            return answer
        log.info(
            "engine %s has no health route (%s): probing it with a WebSocket handshake on %s",
            self.upstream,
            answer,
            self.websocket_url,
        )
        self.no_health_route = answer
        return await self._handshake(session, opened)

    async def _connect(self) -> HealthCheck:
        try:
            _reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            return HealthCheck(False, "tcp", f"connect {self.host}:{self.port}: {exc}")
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return HealthCheck(True, "tcp", f"connect {self.host}:{self.port} ok")

    async def _health(self, session: aiohttp.ClientSession) -> HealthCheck | str:
        """A decided result, or (``auto`` only) why the endpoint has no health route."""
        status: int | None
        try:
            async with session.get(self.health_url, allow_redirects=False) as resp:
                status = resp.status
            heard = f"GET /health -> {status}"
        except aiohttp.ClientConnectorError as exc:
            return HealthCheck(False, "tcp", f"connect {self.health_url}: {exc}")
        except (aiohttp.ClientResponseError, aiohttp.ClientOSError) as exc:
            # A status line that does not parse, or a close (or reset) instead of one.
            status, heard = None, f"GET /health: not HTTP ({type(exc).__name__})"
        except aiohttp.ServerDisconnectedError:
            status, heard = None, "GET /health: not HTTP (closed without an answer)"
        verdict = health_verdict(status)
        if verdict is HealthVerdict.HEALTHY:
            return HealthCheck(True, "health", heard)
        if verdict is HealthVerdict.NO_HEALTH_ROUTE and self.kind == "auto":
            return heard
        return HealthCheck(False, "health", f"{heard} ({self.health_url})")

    async def _handshake(
        self, session: aiohttp.ClientSession, opened: list[aiohttp.ClientWebSocketResponse]
    ) -> HealthCheck:
        """101 is healthy; the caller closes the socket (``opened``) after the deadline."""
        self._stage = "websocket"
        why = f"{self.no_health_route}; " if self.no_health_route else ""
        try:
            ws = await session.ws_connect(self.websocket_url, autoping=False, autoclose=False)
        except aiohttp.WSServerHandshakeError as exc:
            return HealthCheck(
                False, "websocket", f"{why}handshake on {self.websocket_url} -> {exc.status}"
            )
        except (aiohttp.ClientError, OSError) as exc:
            return HealthCheck(False, "websocket", f"{why}handshake on {self.websocket_url}: {exc}")
        opened.append(ws)
        return HealthCheck(True, "websocket", f"{why}handshake ok, closed before any session")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


#: Longest wait for the engine's answer to the probe's close frame (seconds).
_CLOSE_WAIT: Final = 1.0
#: The path a handshake probe uses when the upstream URL names none.
REALTIME_PATH: Final = "/v1/realtime"
_REALTIME_PATHS: Final = ("/v1/realtime", "/v1/duplex")


async def _close_quietly(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Close 1000 and wait up to :data:`_CLOSE_WAIT` for the engine's close frame."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_CLOSE_WAIT):
            await ws.close(code=aiohttp.WSCloseCode.OK)
    if not ws.closed:  # the close was cut short: drop the connection
        with contextlib.suppress(Exception):
            await ws.close(code=aiohttp.WSCloseCode.OK)


def probe_websocket_url(upstream: str) -> str:
    """The URL a handshake probe connects to: ``upstream`` asking for no session.

    A URL whose path does not end in ``/v1/realtime`` or ``/v1/duplex`` gets
    ``/v1/realtime`` appended (the proxy relays clients to their own path under
    it). The query keeps the URL's parameters and sets ``autostart=0``.
    """
    parts = urlsplit(upstream)
    path = parts.path.rstrip("/")
    if not path.endswith(_REALTIME_PATHS):
        path += REALTIME_PATH
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "autostart"]
    query.append(("autostart", "0"))
    return urlunsplit((parts.scheme, parts.netloc, path, urlencode(query), ""))


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
