"""Child processes the tests and the benchmarks start, all through one harness.

``ChildProcess`` runs one command as a child; its subclasses know how to run
the ones the project needs:

* ``SidecarChild``: ``omni-sidecar serve``; ``SimulatorChild``: ``python -m
  engine_launcher.simulator`` (loopback ports, free ones unless given);
* ``NginxChild``: nginx in the foreground with a prefix and config of the
  caller's (tests of the shipped nginx examples; the benchmarks' nginx path);
* ``PrometheusChild``: a Prometheus server scraping what its config names;
* ``RedisChild``: a ``redis-server`` without persistence (shared quotas);
* ``ChromiumChild``: a headless Chromium with its DevTools endpoint open.

All of them follow the same rules:

* readiness is a condition polled under a deadline (an HTTP path answering,
  a port accepting TCP, or a predicate such as "redis answers PING" or "the
  DevTools port file is written"); a child that exits or does not get there
  fails at once with what was waited on, the exit status and the tail of its
  log (and of any other log file it writes, such as nginx's error log);
* stopping sends the child it started its stop signal (SIGTERM, or nginx's
  graceful SIGQUIT), then SIGKILL to its process group after a grace, and
  reaps it. A child started in its own process group (the default) leaves
  nothing of that group behind: once the child has exited, and before it is
  reaped (so the group id cannot have been reused), whatever it left in its
  group (nginx's workers, Chromium's helpers) is killed too. A sidecar stops
  its own engine on SIGTERM; when it had to be killed, the engine children it
  had at that moment (found by parent pid just before the kill, each the
  leader of its own process group) are killed too. Nothing else is ever
  signalled.

All work as sync and as async context managers (entering starts and waits
for readiness unless told not to; leaving stops), or by hand with
``start()``, ``wait_ready()`` / ``await ready()`` (or ``start_ready()``) and
``stop()`` / ``await astop()``.

This module lives in ``tests/`` and the benchmarks import it (``python -m
bench`` runs from the repository root, where ``tests`` is a package): the
benchmarks measure the same processes the tests check, so they share the
tests' way of starting them (``bench.common.start`` adds CPU pinning and
niceness on top). It imports only the standard library and aiohttp (never
pytest or ``tests.conftest``), so a benchmark run needs no test extras.
Timeouts are parameters: the tests pass their ``DEADLINE``-based values, the
benchmarks their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, Self

import aiohttp

__all__ = [
    "ChildNotReady",
    "ChildProcess",
    "ChromiumChild",
    "NginxChild",
    "PrometheusChild",
    "RedisChild",
    "SidecarChild",
    "SimulatorChild",
    "child_pids",
    "clean_env",
    "cli_argv",
    "free_port",
    "group_members",
    "is_alive",
]

REPO_ROOT: Final = Path(__file__).resolve().parents[1]
#: How often a readiness condition is polled.
POLL_SECONDS: Final = 0.02
#: How much of a child's log a failure message quotes.
LOG_TAIL_CHARS: Final = 3000
#: How long a stop waits for a SIGKILLed process group to be gone (it takes milliseconds).
GROUP_GONE_SECONDS: Final = 5.0

_CLI_SCRIPT: Final = Path(sys.executable).with_name("omni-sidecar")


class ChildNotReady(AssertionError):
    """A child exited or missed its readiness deadline (an assertion: the test fails)."""


#: How many ports below the kernel's ephemeral range :func:`free_port` hands out.
PORT_POOL_SIZE: Final = 12000
_EPHEMERAL_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Where in its pool this process's next :func:`free_port` looks (its own start).
_cursor: Final = itertools.count(os.getpid())


def port_pool(
    worker: str | None = None, workers: str | None = None, ephemeral: str | None = None
) -> range:
    """The ports this process's :func:`free_port` hands out (empty: ask the kernel).

    A port the kernel picks (``bind(0)``) comes from its ephemeral range, the
    range every outgoing connection takes its source port from: between the
    test's pick and the child's bind, any client's connect may take it, and the
    child then exits with "Address already in use". So ports come from the
    ``PORT_POOL_SIZE`` ports below that range instead, which no connect takes,
    and each pytest-xdist worker has its own slice, so two workers never pick
    the same one. Arguments default to ``PYTEST_XDIST_WORKER`` ("gw1"),
    ``PYTEST_XDIST_WORKER_COUNT`` and the kernel's range.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0") if worker is None else worker
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") if workers is None else workers
    try:
        text = _EPHEMERAL_RANGE.read_text() if ephemeral is None else ephemeral
        low = int(text.split()[0])
        index, total = int(worker.removeprefix("gw")), int(count)
    except (OSError, ValueError, IndexError):
        return range(0)
    start = max(1024, low - PORT_POOL_SIZE)
    width = (low - start) // max(1, total)
    if width < 50 or not 0 <= index < total:
        return range(0)
    return range(start + index * width, start + (index + 1) * width)


@functools.cache
def _this_process_pool() -> range:
    """:func:`port_pool` read once: the worker and the kernel's range do not change."""
    return port_pool()


def free_port() -> int:
    """A loopback port free right now that no outgoing connection will take.

    The next port of :func:`port_pool` (starting at a place of this process's
    own) that binds, so a port is not handed out again until the pool wraps;
    the kernel's pick where there is no pool. The child binds it a moment later.
    """
    pool = _this_process_pool()
    for _ in range(len(pool)):
        port = pool[next(_cursor) % len(pool)]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or TIME_WAIT of an earlier test's listener
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cli_argv(*args: str) -> list[str]:
    """The installed console script, else the module (same entry point)."""
    if _CLI_SCRIPT.exists():
        return [str(_CLI_SCRIPT), *args]
    return [sys.executable, "-m", "proxy.cli", *args]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any OMNI_SIDECAR_* setting or systemd socket, plus ``extra``.

    ``OMNI_SIDECAR_TESTS_*`` (the tests' own knobs) are kept.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OMNI_SIDECAR_") or k.startswith("OMNI_SIDECAR_TESTS_")
    }
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(key, None)
    env.update(extra)
    return env


def _live_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields after its command name) of every live (non-zombie) process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[0] != "Z":
            yield int(entry.name), fields


def is_alive(pid: int) -> bool:
    """``pid`` is a live process (not a zombie): read from ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def child_pids(pid: int) -> list[int]:
    """Live (non-zombie) child pids of ``pid``, read from ``/proc``."""
    return [child for child, fields in _live_stats() if fields[1] == str(pid)]


def group_members(pgid: int, *, besides: int | None = None) -> list[int]:
    """Live (non-zombie) pids in process group ``pgid`` other than ``besides``."""
    return [pid for pid, fields in _live_stats() if fields[2] == str(pgid) and pid != besides]


def _wait_group_gone(pgid: int, *, besides: int) -> None:
    """After a SIGKILL to the group: wait (briefly; death is asynchronous) until it is empty."""
    deadline = time.monotonic() + GROUP_GONE_SECONDS
    while group_members(pgid, besides=besides) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS / 4)


class ChildProcess:
    """One command as a child process with a log, a readiness condition and a clean stop.

    Args:
        name: what failure messages call it.
        argv: the command (``prefix`` is put in front, e.g. ``taskset -c 3``).
        ready_port: the loopback port of the readiness condition (below).
        ready_path: the HTTP path on ``ready_port`` that answers ``ready_status``
            once it is ready; None: ready when ``ready_port`` accepts a TCP connection.
        ready_status: the status that means ready; None: any HTTP answer.
        ready: a predicate instead (quick, blocking; the async wait runs it in a
            thread), described by ``ready_what``. With neither ``ready`` nor
            ``ready_port`` the child is ready once spawned (a load client).
        env: its whole environment (None: this process's).
        log_path: where stdout and stderr go; None: a temporary file, removed on stop.
        side_logs: other log files the child writes (nginx's error log); failure
            messages quote their tails too.
        new_session: start it in its own session and process group (so that
            SIGKILL reaches what it forked, and a terminal's signals do not).
        stop_signal: what asks it to stop (SIGTERM; nginx's graceful SIGQUIT).
        stop_grace: seconds between the stop signal and SIGKILL on stop.
        pass_fds: descriptors it inherits (a listening socket the test holds).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready_port: int | None = None,
        ready_path: str | None = None,
        ready: Callable[[], bool] | None = None,
        ready_what: str | None = None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        side_logs: Sequence[Path] = (),
        cwd: Path | None = None,
        prefix: Sequence[str] = (),
        new_session: bool = True,
        stop_signal: signal.Signals = signal.SIGTERM,
        stop_grace: float = 10.0,
        ready_timeout: float = 20.0,
        ready_status: int | None = 200,
        pass_fds: Sequence[int] = (),
    ) -> None:
        assert ready is None or ready_what, "a readiness predicate needs ready_what"
        self.pass_fds = tuple(pass_fds)
        self.name = name
        self.argv = [*prefix, *argv]
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.new_session = new_session
        self.stop_signal = stop_signal
        self.stop_grace = stop_grace
        self.ready_timeout = ready_timeout
        self.ready_port = ready_port
        self.ready_path = ready_path
        self.ready_status = ready_status
        self.ready_check = ready
        self._ready_what = ready_what
        self._own_log = log_path is None
        self.log_path = log_path if log_path is not None else _temporary_log(name)
        self.side_logs = list(side_logs)
        self._proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    # -- starting and looking ------------------------------------------------------------

    def start(self) -> Self:
        """Spawn it (returns at once; readiness is waited for separately)."""
        assert self._proc is None, f"{self.name} already started"
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=self.new_session,
                pass_fds=self.pass_fds,
            )
        self.started_at = time.monotonic()
        return self

    def start_ready(self, timeout: float | None = None) -> Self:
        """:meth:`start`, then :meth:`wait_ready`; stopped again if it does not get ready."""
        self.start()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    async def astart_ready(self, timeout: float | None = None) -> Self:
        """:meth:`start_ready` without blocking the loop."""
        self.start()
        try:
            await self.ready(timeout)
        except BaseException:
            await self.astop()
            raise
        return self

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None, f"{self.name} not started"
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (reaped), else None."""
        return self.proc.poll()

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pids(self) -> list[int]:
        """The process and its live direct children (nginx: master + workers; serve: engines)."""
        return [self.pid, *child_pids(self.pid)]

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The end of its log, then (headed by their paths) of its side logs."""
        tail = self.log()[-chars:]
        for path in self.side_logs:
            try:
                side = path.read_text(errors="replace")[-chars:]
            except OSError:
                side = "(not written)"
            tail += f"\n-- {path} ends:\n{side}"
        return tail

    def _not_ready(self, what: str, timeout: float) -> ChildNotReady:
        code = self.proc.poll()
        state = f"exited with {code}" if code is not None else f"not ready after {timeout:.1f} s"
        return ChildNotReady(
            f"{self.name} {state} (waited for {what}); {self.log_path} ends:\n{self.log_tail()}"
        )

    @property
    def ready_what(self) -> str:
        if self.ready_check is not None:
            assert self._ready_what is not None
            return self._ready_what
        if self.ready_port is None:
            return "the process to start"
        if self.ready_path is None:
            return f"127.0.0.1:{self.ready_port} to accept TCP"
        answer = "any answer" if self.ready_status is None else str(self.ready_status)
        return f"GET http://127.0.0.1:{self.ready_port}{self.ready_path} {answer}"

    # -- readiness -----------------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until ready; seconds since the spawn. Fails with the log if it exits first."""
        limit = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            if self.proc.poll() is not None:
                raise self._not_ready(self.ready_what, limit)
            if self._ready_now():
                return time.monotonic() - self.started_at
            if time.monotonic() >= deadline:
                raise self._not_ready(self.ready_what, limit)
            time.sleep(POLL_SECONDS)

    async def ready(self, timeout: float | None = None) -> float:
        """:meth:`wait_ready` without blocking the loop (the upstream may be in this process)."""
        limit = self.ready_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            if self.proc.poll() is not None:
                raise self._not_ready(self.ready_what, limit)
            if await self._ready_now_async():
                return time.monotonic() - self.started_at
            if loop.time() >= deadline:
                raise self._not_ready(self.ready_what, limit)
            await asyncio.sleep(POLL_SECONDS)

    def _ready_now(self) -> bool:
        if self.ready_check is not None:
            return self.ready_check()
        if self.ready_port is None:
            return True
        if self.ready_path is None:
            return _accepts(self.ready_port)
        url = f"http://127.0.0.1:{self.ready_port}{self.ready_path}"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return self._is_ready(int(resp.status))
        except urllib.error.HTTPError as exc:
            return self._is_ready(exc.code)
        except (OSError, urllib.error.URLError):
            return False

    def _is_ready(self, status: int) -> bool:
        return self.ready_status is None or status == self.ready_status

    async def _ready_now_async(self) -> bool:
        if self.ready_check is not None:
            return await asyncio.to_thread(self.ready_check)
        if self.ready_port is None:
            return True
        if self.ready_path is None:
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.ready_port), 1
                )
            except (OSError, TimeoutError):
                return False
            writer.close()
            return True
        url = f"http://127.0.0.1:{self.ready_port}{self.ready_path}"
        try:
            timeout = aiohttp.ClientTimeout(total=1)
            async with aiohttp.ClientSession() as http, http.get(url, timeout=timeout) as resp:
                return self._is_ready(resp.status)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    # -- exiting and stopping ----------------------------------------------------------------

    def wait_exit(self, timeout: float) -> int:
        """Block until it exits on its own (after a signal the test sent); its status."""
        return self.proc.wait(timeout=timeout)

    async def exited(self, timeout: float) -> int:
        """:meth:`wait_exit` without blocking the loop; TimeoutError after ``timeout``."""
        async with asyncio.timeout(timeout):
            while (code := self.proc.poll()) is None:
                await asyncio.sleep(POLL_SECONDS)
        return code

    def stop(self, grace: float | None = None) -> int | None:
        """Stop signal, then after ``grace`` SIGKILL; reap. Its exit status (None if never started)."""
        if self._proc is None:
            return None
        try:
            if self._proc.returncode is None:
                if not self._exited_unreaped():
                    self._signal(self.stop_signal)
                    deadline = time.monotonic() + (self.stop_grace if grace is None else grace)
                    while not self._exited_unreaped():
                        if time.monotonic() >= deadline:
                            self._kill()
                            break
                        time.sleep(POLL_SECONDS)
                self._reap()
            return self._proc.returncode
        finally:
            self._closed()

    async def astop(self, grace: float | None = None) -> int | None:
        """:meth:`stop` without blocking the loop (the child may be talking to it)."""
        if self._proc is None:
            return None
        try:
            if self._proc.returncode is None:
                if not self._exited_unreaped():
                    self._signal(self.stop_signal)
                    loop = asyncio.get_running_loop()
                    deadline = loop.time() + (self.stop_grace if grace is None else grace)
                    while not self._exited_unreaped():
                        if loop.time() >= deadline:
                            self._kill()
                            break
                        await asyncio.sleep(POLL_SECONDS)
                self._reap()
            return self._proc.returncode
        finally:
            self._closed()

    def kill(self) -> None:
        """SIGKILL at once (a test that wants no drain); reap."""
        if self._proc is not None and self._proc.returncode is None:
            self._kill()
        self._closed()

    def _exited_unreaped(self) -> bool:
        """It has exited; not reaped, so its pid (and process group id) stays reserved."""
        if self.proc.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped behind Popen's back: nothing of it is left to us
            return True
        return info is not None

    def _signal(self, signum: int) -> None:
        """Signal the child itself (alive or a zombie not yet reaped: still ours)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signum)

    def _reap(self) -> None:
        """Reap it; first kill what it left in its own process group (held by the zombie)."""
        proc = self.proc
        if proc.returncode is not None:
            return
        if self.new_session and group_members(proc.pid, besides=proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            _wait_group_gone(proc.pid, besides=proc.pid)
        proc.wait()

    def _kill(self) -> None:
        proc = self.proc
        # Its own children (a sidecar's engines, each in its own process group)
        # would outlive it: note them while they are still its children.
        leftovers = child_pids(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            if self.new_session:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        if self.new_session:
            _wait_group_gone(proc.pid, besides=proc.pid)
        proc.wait()
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)

    def _closed(self) -> None:
        if self._own_log and (self._proc is None or self._proc.poll() is not None):
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    # -- context managers ------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start_ready()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await self.astart_ready()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.astop()


class _RealtimeServer(ChildProcess):
    """A child that serves HTTP and ``/v1/realtime`` on ``port`` (loopback)."""

    port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"


class SidecarChild(_RealtimeServer):
    """``omni-sidecar serve --listen P --admin-listen A *flags`` as a child process.

    Args:
        flags: the rest of ``serve``'s command line (``--upstream``, ``--config``...).
        port, admin_port: the listeners (free loopback ports unless given).
        env: added to ``base_env``; ``base_env`` None is :func:`clean_env` (no
            OMNI_SIDECAR_* setting leaks in from the test's environment).
        ready_path: ``/readyz`` (the engine answers) by default; None waits
            only for the listener to accept TCP (the benchmarks' condition).
        command: the ``omni-sidecar`` command (another venv's, say); None:
            :func:`cli_argv` of this interpreter.
        pass_fds: descriptors it inherits (with ``prefix``, a socket-activation launcher).
    """

    def __init__(
        self,
        *flags: str,
        port: int | None = None,
        admin_port: int | None = None,
        env: Mapping[str, str] | None = None,
        base_env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        prefix: Sequence[str] = (),
        new_session: bool = True,
        stop_grace: float = 10.0,
        ready_timeout: float = 30.0,
        ready_path: str | None = "/readyz",
        command: Sequence[str] | None = None,
        name: str = "omni-sidecar serve",
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.port = free_port() if port is None else port
        self.admin_port = free_port() if admin_port is None else admin_port
        environ = dict(clean_env() if base_env is None else base_env)
        environ.update(env or {})
        argv = [
            *(cli_argv() if command is None else command),
            "serve", "--listen", f"127.0.0.1:{self.port}",
            "--admin-listen", f"127.0.0.1:{self.admin_port}", *flags,
        ]  # fmt: skip
        super().__init__(
            name, argv, ready_port=self.port, ready_path=ready_path, env=environ,
            log_path=log_path, cwd=cwd, prefix=prefix, new_session=new_session,
            stop_grace=stop_grace, ready_timeout=ready_timeout, pass_fds=pass_fds,
        )  # fmt: skip

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


class SimulatorChild(_RealtimeServer):
    """``python -m engine_launcher.simulator --host 127.0.0.1 --port P *args`` as a child.

    Ready when ``/health`` answers 200. ``env`` None is this process's
    environment (the simulator reads no OMNI_SIDECAR_* setting).
    """

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = REPO_ROOT,
        prefix: Sequence[str] = (),
        new_session: bool = True,
        stop_grace: float = 5.0,
        ready_timeout: float = 20.0,
        ready_status: int | None = 200,
        python: str = sys.executable,
        name: str = "simulator",
    ) -> None:
        self.port = free_port() if port is None else port
        self.args = args
        argv = [python, "-m", "engine_launcher.simulator", "--host", "127.0.0.1",
                "--port", str(self.port), *args]  # fmt: skip
        super().__init__(
            name, argv, ready_port=self.port, ready_path="/health", env=env,
            log_path=log_path, cwd=cwd, prefix=prefix, new_session=new_session,
            stop_grace=stop_grace, ready_timeout=ready_timeout, ready_status=ready_status,
        )  # fmt: skip


class NginxChild(ChildProcess):
    """``nginx -p DIRECTORY -c CONFIG -e DIRECTORY/error.log`` in the foreground, as a child.

    The config (or ``directives``, nginx's ``-g``) must say ``daemon off;``, and
    keep its pid file and temp paths under ``directory``. Ready when
    ``ready_port`` accepts TCP, or, with ``ready_path``, when it answers
    ``ready_status`` there (a site proxied through it is up). Stopped with
    SIGQUIT by default (graceful: the master lets its workers finish), then
    SIGKILL to its group; its workers go with it. Failures quote its error log.
    """

    def __init__(
        self,
        directory: Path,
        config: Path,
        *,
        ready_port: int,
        ready_path: str | None = None,
        ready_status: int | None = 200,
        directives: str | None = None,
        executable: str = "nginx",
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        prefix: Sequence[str] = (),
        stop_signal: signal.Signals = signal.SIGQUIT,
        stop_grace: float = 10.0,
        ready_timeout: float = 20.0,
        name: str = "nginx",
    ) -> None:
        self.directory = directory
        self.port = ready_port
        self.error_log = directory / "error.log"
        argv = [executable, "-p", str(directory), "-c", str(config), "-e", str(self.error_log)]
        if directives is not None:
            argv += ["-g", directives]
        super().__init__(
            name, argv, ready_port=ready_port, ready_path=ready_path, ready_status=ready_status,
            env=env, log_path=log_path, side_logs=[self.error_log], cwd=cwd, prefix=prefix,
            stop_signal=stop_signal, stop_grace=stop_grace, ready_timeout=ready_timeout,
        )  # fmt: skip


class PrometheusChild(ChildProcess):
    """A Prometheus server on ``127.0.0.1:port`` scraping what ``config`` names.

    Its TSDB lives in ``storage``; ``args`` are more flags (retention, log
    level). Ready when ``/-/ready`` answers 200.
    """

    def __init__(
        self,
        config: Path,
        storage: Path,
        *args: str,
        port: int | None = None,
        executable: str = "prometheus",
        log_path: Path | None = None,
        stop_grace: float = 10.0,
        ready_timeout: float = 30.0,
        name: str = "prometheus",
    ) -> None:
        self.port = free_port() if port is None else port
        argv = [
            executable, f"--config.file={config}", f"--storage.tsdb.path={storage}",
            f"--web.listen-address=127.0.0.1:{self.port}", *args,
        ]  # fmt: skip
        super().__init__(
            name, argv, ready_port=self.port, ready_path="/-/ready", log_path=log_path,
            stop_grace=stop_grace, ready_timeout=ready_timeout,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RedisChild(ChildProcess):
    """``redis-server`` on ``127.0.0.1:port`` without persistence, its files in ``directory``.

    Ready when it answers ``PING`` with ``+PONG`` (it loaded and listens).
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        executable: str = "redis-server",
        log_path: Path | None = None,
        stop_grace: float = 10.0,
        ready_timeout: float = 20.0,
        name: str = "redis-server",
    ) -> None:
        self.port = free_port() if port is None else port
        argv = [
            executable, "--save", "", "--appendonly", "no", "--port", str(self.port),
            "--bind", "127.0.0.1", "--dir", str(directory),
        ]  # fmt: skip
        super().__init__(
            name, argv, ready=self._pong, ready_what=f"PING on 127.0.0.1:{self.port} +PONG",
            log_path=log_path, stop_grace=stop_grace, ready_timeout=ready_timeout,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


class ChromiumChild(ChildProcess):
    """A headless Chromium with a fresh ``profile`` and its DevTools endpoint on loopback.

    ``--remote-debugging-port=0`` lets it pick the port; ready once it wrote
    the port and path to ``profile/DevToolsActivePort`` (:attr:`ws_url`).
    ``flags`` are the rest of its command line (headless mode, features off).
    """

    def __init__(
        self,
        executable: str,
        profile: Path,
        *,
        flags: Sequence[str] = ("--headless",),
        log_path: Path | None = None,
        stop_grace: float = 10.0,
        ready_timeout: float = 20.0,
        name: str = "chromium",
    ) -> None:
        self.port_file = profile / "DevToolsActivePort"
        argv = [
            executable, *flags, "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank",
        ]  # fmt: skip
        super().__init__(
            name, argv, ready=lambda: self._endpoint() is not None,
            ready_what=f"{self.port_file} to name the DevTools endpoint", log_path=log_path,
            stop_grace=stop_grace, ready_timeout=ready_timeout,
        )  # fmt: skip

    @property
    def ws_url(self) -> str:
        """The browser's DevTools WebSocket (known once ready)."""
        endpoint = self._endpoint()
        assert endpoint is not None, f"{self.name} not ready"
        return endpoint

    def _endpoint(self) -> str | None:
        try:
            lines = self.port_file.read_text().split()
        except OSError:
            return None
        if len(lines) < 2:
            return None
        return f"ws://127.0.0.1:{lines[0]}{lines[1]}"


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _temporary_log(name: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=f"{name.replace(' ', '-')}-", suffix=".log")
    os.close(fd)
    return Path(path)
