"""The client listener's accept loop (proxy/edge/listener.py) on real loopback sockets.

Running out of file descriptors is tested end to end against a ``serve`` child
under ``prlimit`` (tests/integration/test_attacks_edge.py). Here, in process:
an ``accept()`` that fails for lack of memory pauses accepting for
``ACCEPT_RETRY_DELAY`` (instead of spinning on a socket that stays readable),
says so in one log line, and then takes the waiting client, which is served
as usual; and with the process's descriptors used up (a lowered soft
``RLIMIT_NOFILE``), every episode spends the spare descriptor and takes it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Iterator

import pytest

from proxy.edge.listener import ACCEPT_RETRY_DELAY, FD_LIMIT, Listener, bind
from tests.conftest import DEADLINE, MS, wait_until


class FailingOnce(socket.socket):
    """A listening socket whose first ``accept()`` fails with ENOMEM."""

    failures = 1

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return super().accept()


class Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


async def test_accept_without_memory_pauses_then_serves_the_waiting_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="omni_sidecar.edge.listener")
    sock = FailingOnce(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    refused: list[tuple[str, int]] = []
    listener = Listener([sock], Echo, lambda reason, count: refused.append((reason, count)))
    try:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        writer.write(b"ping")
        async with asyncio.timeout(DEADLINE):
            assert await reader.readexactly(4) == b"ping"
        waited = time.monotonic() - started
        writer.close()
    finally:
        listener.close()
    assert waited >= ACCEPT_RETRY_DELAY * 0.9, f"served after {waited:.2f} s: no pause"
    assert refused == [], "nothing was closed: the client waited in the backlog"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "ENOMEM" in lines[0], lines


async def test_bind_takes_every_address_of_the_host_and_port_0_picks_one() -> None:
    sockets = bind("127.0.0.1", 0)
    try:
        assert len(sockets) == 1
        host, port = sockets[0].getsockname()
        assert host == "127.0.0.1" and port > 0
        with pytest.raises(OSError):  # the port is taken now
            bind("127.0.0.1", port)
    finally:
        for sock in sockets:
            sock.close()


async def echoed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"ping")
    try:
        return await reader.readexactly(4)
    finally:
        writer.close()


async def test_a_connection_waits_in_the_backlog_while_not_accepting() -> None:
    """Not accepting (yet, or any more) leaves a connection in the kernel's backlog; the
    next listener on the same socket, another process's descriptor of it as under
    systemd, serves it (docs/design.md, Socket activation)."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(8)
    held.setblocking(False)
    first = Listener([held.dup()], Echo, lambda reason, count: None, accepting=False)
    second: Listener | None = None
    try:
        reader, writer = await asyncio.open_connection(*held.getsockname())
        answer = asyncio.ensure_future(echoed(reader, writer))
        await asyncio.sleep(50 * MS)
        assert not answer.done(), "served before accepting began"
        first.start_accepting()
        async with asyncio.timeout(DEADLINE):
            assert await answer == b"ping"

        first.stop_accepting()
        reader, writer = await asyncio.open_connection(*held.getsockname())
        answer = asyncio.ensure_future(echoed(reader, writer))
        await asyncio.sleep(50 * MS)
        assert not answer.done(), "accepted after stop_accepting"
        first.close()  # its descriptor only: the socket still listens, the client waits
        assert not answer.done()
        second = Listener([held.dup()], Echo, lambda reason, count: None)
        async with asyncio.timeout(DEADLINE):
            assert await answer == b"ping"
    finally:
        first.close()
        if second is not None:
            second.close()
        held.close()


@contextlib.contextmanager
def descriptors_used_up() -> Iterator[None]:
    """Every descriptor this process may open is taken (soft RLIMIT_NOFILE lowered to just
    above the highest open one, the rest filled with /dev/null); given back on exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    filler: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 16, hard))
    try:
        while True:
            try:
                filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE, exc
                break
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _closed_at_once(client: socket.socket) -> bool:
    """The listener closed this connection (EOF or reset), rather than keeping it."""
    client.settimeout(DEADLINE)
    try:
        return client.recv(1) == b""
    except ConnectionResetError:
        return True


async def test_every_episode_without_descriptors_refuses_and_counts_the_waiting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Out of descriptors, the listener spends its spare one to close the waiting
    connections at once and counts them, then takes the spare back: so a second
    episode is refused and counted the same (without it, one would be served on the
    spare's descriptor and the next would wait in the backlog)."""
    caplog.set_level(logging.WARNING, logger="omni_sidecar.edge.listener")
    (sock,) = bind("127.0.0.1", 0)
    address = sock.getsockname()
    refused: list[tuple[str, int]] = []
    listener = Listener([sock], Echo, lambda reason, count: refused.append((reason, count)))
    clients = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(3)]

    def total() -> int:
        return sum(count for _, count in refused)

    try:
        with descriptors_used_up():
            clients[0].connect(address)
            await wait_until(lambda: total() == 1, what="the first connection refused")
            clients[1].connect(address)
            clients[2].connect(address)
            await wait_until(lambda: total() == 3, what="both later connections refused")
        assert all(_closed_at_once(client) for client in clients)
    finally:
        listener.close()
        for client in clients:
            client.close()
    assert {reason for reason, _ in refused} == {FD_LIMIT}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "EMFILE" in lines[0], lines
