"""Child processes the tests and the benchmarks start: the sidecar and the simulator.

``SidecarChild`` runs ``omni-sidecar serve``; ``SimulatorChild`` runs
``python -m engine_launcher.simulator``. Both are real processes on loopback
ports (free ones unless given), and both follow the same rules:

* readiness is a condition polled under a deadline (``/readyz`` or
  ``/health`` answering 200, or the port accepting TCP); a child that exits
  or does not get there fails at once with what was waited on, the exit
  status and the tail of its log;
* stopping sends SIGTERM to the child it started, then SIGKILL to its
  process group after a grace, and reaps it. A sidecar stops its own engine
  on SIGTERM; when it had to be killed, the engine children it had at that
  moment (found by parent pid just before the kill, each the leader of its
  own process group) are killed too, so nothing is left behind. Nothing
  else is ever signalled.

Both work as sync and as async context managers (entering starts and waits
for readiness unless told not to; leaving stops), or by hand with
``start()``, ``wait_ready()`` / ``await ready()`` and ``stop()`` /
``await astop()``.

This module lives in ``tests/`` and the benchmarks import it (``python -m
bench`` runs from the repository root, where ``tests`` is a package): the
benchmarks measure the same processes the tests check, so they share the
tests' way of starting them. It imports only the standard library and
aiohttp (never pytest or ``tests.conftest``), so a benchmark run needs no
test extras. Timeouts are parameters: the tests pass their ``DEADLINE``-based
values, the benchmarks their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, Self

import aiohttp

__all__ = [
    "ChildNotReady",
    "ChildProcess",
    "SidecarChild",
    "SimulatorChild",
    "child_pids",
    "clean_env",
    "cli_argv",
    "free_port",
]

REPO_ROOT: Final = Path(__file__).resolve().parents[1]
#: How often a readiness condition is polled.
POLL_SECONDS: Final = 0.02
#: How much of a child's log a failure message quotes.
LOG_TAIL_CHARS: Final = 3000

_CLI_SCRIPT: Final = Path(sys.executable).with_name("omni-sidecar")


class ChildNotReady(AssertionError):
    """A child exited or missed its readiness deadline (an assertion: the test fails)."""


def free_port() -> int:
    """A loopback port free right now (the child binds it a moment later)."""
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
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_USEC", None)
    env.update(extra)
    return env


def child_pids(pid: int) -> list[int]:
    """Live (non-zombie) child pids of ``pid``, read from ``/proc``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ..."; comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2 and fields[1] == str(pid) and fields[0] != "Z":
            out.append(int(entry.name))
    return out


class ChildProcess:
    """One command as a child process with a log, a readiness condition and a clean stop.

    Args:
        name: what failure messages call it.
        argv: the command (``prefix`` is put in front, e.g. ``taskset -c 3``).
        env: its whole environment (None: this process's).
        log_path: where stdout and stderr go; None: a temporary file, removed on stop.
        new_session: start it in its own session and process group (so that
            SIGKILL reaches what it forked, and a terminal's signals do not).
        stop_grace: seconds between SIGTERM and SIGKILL on stop.
        ready_path: the HTTP path that answers ``ready_status`` once it is
            ready; None: ready when ``ready_port`` accepts a TCP connection.
        ready_status: the status that means ready; None: any HTTP answer.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready_port: int,
        ready_path: str | None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        prefix: Sequence[str] = (),
        new_session: bool = True,
        stop_grace: float = 10.0,
        ready_timeout: float = 20.0,
        ready_status: int | None = 200,
    ) -> None:
        self.name = name
        self.argv = [*prefix, *argv]
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.new_session = new_session
        self.stop_grace = stop_grace
        self.ready_timeout = ready_timeout
        self.ready_port = ready_port
        self.ready_path = ready_path
        self.ready_status = ready_status
        self._own_log = log_path is None
        self.log_path = log_path if log_path is not None else _temporary_log(name)
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
            )
        self.started_at = time.monotonic()
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
        return self.log()[-chars:]

    def _not_ready(self, what: str, timeout: float) -> ChildNotReady:
        code = self.proc.poll()
        state = f"exited with {code}" if code is not None else f"not ready after {timeout:.1f} s"
        return ChildNotReady(
            f"{self.name} {state} (waited for {what}); {self.log_path} ends:\n{self.log_tail()}"
        )

    @property
    def ready_what(self) -> str:
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
        """SIGTERM, then after ``grace`` SIGKILL; reap. Its exit status (None if never started)."""
        if self._proc is None:
            return None
        try:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    self._proc.wait(timeout=self.stop_grace if grace is None else grace)
                except subprocess.TimeoutExpired:
                    self._kill()
            return self._proc.returncode
        finally:
            self._closed()

    async def astop(self, grace: float | None = None) -> int | None:
        """:meth:`stop` without blocking the loop (the child may be talking to it)."""
        if self._proc is None:
            return None
        try:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    await self.exited(self.stop_grace if grace is None else grace)
                except TimeoutError:
                    self._kill()
            return self._proc.returncode
        finally:
            self._closed()

    def kill(self) -> None:
        """SIGKILL at once (a test that wants no drain); reap."""
        if self._proc is not None and self._proc.poll() is None:
            self._kill()
        self._closed()

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
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        self.start()
        try:
            await self.ready()
        except BaseException:
            await self.astop()
            raise
        return self

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
            stop_grace=stop_grace, ready_timeout=ready_timeout,
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
