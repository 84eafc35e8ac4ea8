"""``omni-sidecar serve`` on listening sockets systemd passes (docs/design.md, Socket activation).

Real processes on loopback. Under ``systemd-socket-activate`` (Debian package
``systemd``), which binds the sockets, names them and starts the sidecar at the
first connection: both listeners serve on the passed sockets, the configured
addresses stay unbound, and the engine child inherits neither a descriptor nor
a ``LISTEN_*`` variable. Behind a socket the test holds (passed as systemd
passes it, by tests/fakes/listen_fds.py): sidecar A serves, is stopped, B
starts on the same socket, and no connection made meanwhile is refused; those
made while neither accepted waited in the backlog and B served them. A socket
that cannot be served on stops the start with exit 4 and one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest

from engine_launcher.exit_statuses import EXIT_LISTEN
from tests.children import SidecarChild, child_pids, clean_env, cli_argv, free_port
from tests.conftest import DEADLINE, wait_until
from tests.integration.helpers import connect, request_response

pytestmark = pytest.mark.timeout(120)

LAUNCHER = Path(__file__).resolve().parents[1] / "fakes" / "listen_fds.py"
O_CLOEXEC = 0o2000000  # the "flags:" field of /proc/PID/fdinfo/FD is octal
#: A quick built-in simulator: 3 chunks of 200 ms, unpaced.
FAST_SIMULATOR = "--realtime-factor 0 --chunk-ms 200 --response-seconds 0.6"
#: The client's first event; the engine answers ``session.created``.
OPEN = '{"type":"session.update","session":{"modalities":["audio","text"]}}'


class Activated(SidecarChild):
    """``serve`` whose ``--listen``/``--admin-listen`` name free ports it must leave unbound.

    ``prefix`` passes it the sockets (systemd-socket-activate, or the launcher with
    ``pass_fds``); readiness is ``/readyz`` on the passed client socket's ``port``.
    """

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        *,
        port: int,
        admin_port: int | None,
        prefix: Sequence[str],
        pass_fds: Sequence[int] = (),
        base_env: dict[str, str] | None = None,
    ) -> None:
        self.configured = (free_port(), free_port())
        super().__init__(
            "--log-level", "info", "--engine-simulator-args", FAST_SIMULATOR,
            port=self.configured[0], admin_port=self.configured[1], prefix=prefix,
            pass_fds=pass_fds, base_env=base_env, log_path=tmp_path / f"{name}.log",
            ready_timeout=3 * DEADLINE, stop_grace=DEADLINE, name=f"serve {name}",
        )  # fmt: skip
        self.port = self.ready_port = port
        self.admin_port = self.configured[1] if admin_port is None else admin_port


def socket_inode(pid: int, fd: int) -> str:
    return os.readlink(f"/proc/{pid}/fd/{fd}")


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE):
            return False
    except ConnectionRefusedError:
        return True


# -- under systemd-socket-activate --------------------------------------------------------------


@pytest.fixture
def socket_activate() -> str:
    found = shutil.which("systemd-socket-activate")
    if found is None:
        pytest.skip("systemd-socket-activate not found (Debian package: systemd)")
    return found


async def test_serves_on_the_sockets_systemd_passes_and_binds_nothing_else(
    tmp_path: Path, socket_activate: str
) -> None:
    port, admin_port = free_port(), free_port()
    # systemd-socket-activate hands its child TERM, PATH, USER, HOME and what -E names.
    passed_on = [f"-E{key}" for key in ("PYTHONPATH", "VIRTUAL_ENV") if key in os.environ]
    prefix = [
        socket_activate, f"--listen=127.0.0.1:{port}", f"--listen=127.0.0.1:{admin_port}",
        "--fdname=client:admin", *passed_on,
    ]  # fmt: skip
    sidecar = Activated(tmp_path, "activated", port=port, admin_port=admin_port, prefix=prefix)
    # It starts the sidecar at the first connection: the readiness poll's, which
    # waits in the backlog until the sidecar accepts (once its engine is ready).
    async with sidecar:
        pid = sidecar.pid
        async with connect(sidecar.ws_url) as client:
            await request_response(client, open_session=True)
            await client.recv_until("response.done")
        assert refused(sidecar.configured[0]), "listen was bound although a socket was passed"
        assert refused(sidecar.configured[1]), "admin_listen was bound"

        summary = f"{sidecar.admin_url}/debug/summary"
        async with aiohttp.ClientSession() as http, http.get(summary) as resp:
            assert resp.status == 200
            listeners = (await resp.json())["listeners"]
        assert listeners == {
            "listen": {"url": f"http://127.0.0.1:{port}", "source": "systemd"},
            "admin": {"url": f"http://127.0.0.1:{admin_port}", "source": "systemd"},
        }
        log = sidecar.log()
        assert (
            f"listen listener on http://127.0.0.1:{port}: socket from systemd (fd 3 'client')"
            in log
        )
        assert (
            f"admin listener on http://127.0.0.1:{admin_port}: socket from systemd (fd 4 'admin')"
            in log
        )
        assert f"clients ws://127.0.0.1:{port}/v1/realtime (socket from systemd)" in log

        passed = {socket_inode(pid, 3), socket_inode(pid, 4)}
        engines = child_pids(pid)
        assert len(engines) == 1, engines
        engine = engines[0]
        inherited = {
            link
            for entry in Path(f"/proc/{engine}/fd").iterdir()
            if (link := os.readlink(entry)).startswith("socket:")
        }
        assert not passed & inherited, "the engine child holds a listening socket of ours"
        environ = Path(f"/proc/{engine}/environ").read_bytes().split(b"\0")
        assert [v for v in environ if v.startswith(b"LISTEN_")] == []
        for fd in (3, 4):  # nor would any later child (close-on-exec)
            flags = Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0]
            assert int(flags, 8) & O_CLOEXEC, f"fd {fd} would be inherited by a child"

        sidecar.proc.send_signal(signal.SIGTERM)
        assert await sidecar.exited(DEADLINE) == 0, sidecar.log_tail()


# -- a restart behind a socket the test holds ----------------------------------------------------


@pytest.fixture
def held() -> Iterator[socket.socket]:
    """The client listener's socket, held here across the sidecars, as systemd holds it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", free_port()))
    sock.listen(128)
    try:
        yield sock
    finally:
        sock.close()


def on_held(tmp_path: Path, name: str, held: socket.socket) -> Activated:
    """A sidecar passed ``held`` unnamed at fd 3: the first fd is the client listener."""
    prefix = [sys.executable, str(LAUNCHER), str(held.fileno()), "--"]
    port = held.getsockname()[1]
    return Activated(
        tmp_path, name, port=port, admin_port=None, prefix=prefix, pass_fds=[held.fileno()]
    )


@dataclass
class Attempt:
    started: float
    ended: float
    outcome: str


async def attempt(url: str) -> Attempt:
    """One call: connect, upgrade, open the session (``session.created``), close."""
    started = time.monotonic()
    outcome = "session"
    try:
        timeout = aiohttp.ClientTimeout(total=4 * DEADLINE)
        async with aiohttp.ClientSession(timeout=timeout) as http, http.ws_connect(url) as ws:
            await ws.send_str(OPEN)
            msg = await ws.receive(timeout=4 * DEADLINE)
            if msg.type is not aiohttp.WSMsgType.TEXT:
                outcome = f"no event: {msg!r}"
            elif (kind := orjson.loads(msg.data).get("type")) != "session.created":
                outcome = f"first event {kind}"
    except aiohttp.WSServerHandshakeError as exc:
        outcome = f"http {exc.status}"
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        outcome = repr(exc)
    return Attempt(started, time.monotonic(), outcome)


async def calls(url: str, attempts: list[Attempt], stop: asyncio.Event) -> None:
    while not stop.is_set():
        attempts.append(await attempt(url))


@contextlib.asynccontextmanager
async def running(*tasks: asyncio.Task[None]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_restart_behind_a_held_socket_refuses_no_connection(
    tmp_path: Path, held: socket.socket
) -> None:
    port = held.getsockname()[1]
    url = f"ws://127.0.0.1:{port}/v1/realtime"
    first = on_held(tmp_path, "first", held)
    second = on_held(tmp_path, "second", held)
    attempts: list[Attempt] = []
    stop = asyncio.Event()
    try:
        await first.astart_ready()
        async with connect(url) as kept:  # a live session: the first sidecar drains on SIGTERM
            await kept.send(OPEN)
            await kept.recv_until("session.created")
            loops = [asyncio.create_task(calls(url, attempts, stop)) for _ in range(2)]
            async with running(*loops):
                await wait_until(
                    lambda: sum(a.outcome == "session" for a in attempts) >= 4,
                    what="calls served by the first sidecar",
                )
                first.proc.send_signal(signal.SIGTERM)
                await wait_until(
                    lambda: "shutting down: draining" in first.log(), what="the first to drain"
                )
                draining_at = time.monotonic()
                # Nobody accepts from here on until the second is ready: this call waits.
                gap = asyncio.create_task(attempt(url))
                await kept.ws.close()  # the drain ends, the first sidecar exits
                assert await first.exited(DEADLINE) == 0, first.log_tail()
                first_gone_at = time.monotonic()
                assert not gap.done(), f"answered while no sidecar accepted: {gap.result()}"
                await second.astart_ready()
                ready_at = time.monotonic()
                waited_call = await gap
                attempts.append(waited_call)
                assert waited_call.outcome == "session", (
                    f"{waited_call.outcome}; the second's log ends:\n{second.log_tail(1500)}"
                )
                await wait_until(
                    lambda: (
                        sum(a.outcome == "session" and a.started > ready_at for a in attempts) >= 4
                    ),
                    what="calls served by the second sidecar",
                )
                stop.set()
                await asyncio.wait_for(asyncio.gather(*loops), 4 * DEADLINE)
                summary = f"{second.admin_url}/debug/summary"
                async with aiohttp.ClientSession() as http, http.get(summary) as resp:
                    listeners = (await resp.json())["listeners"]
                assert listeners == {
                    "listen": {"url": f"http://127.0.0.1:{port}", "source": "systemd"},
                    "admin": {"url": second.admin_url, "source": "bound"},
                }
    finally:
        await first.astop()
        await second.astop()
    failed = [a for a in attempts if a.outcome not in ("session", "http 503")]
    assert failed == [], f"calls refused or broken during the restart: {failed}"
    # A 503 only from the first sidecar's drain, for a connection it took before it stopped.
    late = [a for a in attempts if a.started >= draining_at and a.outcome != "session"]
    assert late == [], f"calls made after the first stopped accepting, not served: {late}"
    waited = [a for a in attempts if a.started < first_gone_at and a.ended > first_gone_at]
    assert waited, "no call was open while no sidecar ran"
    assert "socket from systemd (fd 3 'unknown')" in second.log()


# -- a socket that cannot be served on ----------------------------------------------------------


def test_a_datagram_socket_stops_the_start_with_exit_4() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        port = free_port()
        argv = [
            sys.executable, str(LAUNCHER), f"{udp.fileno()}=client", "--",
            *cli_argv("serve", "--listen", f"127.0.0.1:{port}"),
        ]  # fmt: skip
        done = subprocess.run(
            argv,
            pass_fds=[udp.fileno()],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=3 * DEADLINE,
            check=False,
        )
    assert done.returncode == EXIT_LISTEN, done.stderr
    assert done.stderr == (
        "omni-sidecar: systemd socket activation: fd 3 (name 'client'): type SOCK_DGRAM, "
        "not a stream socket (ListenStream=)\n"
    )
