"""The client listener's accept loop (proxy/edge/listener.py) on real loopback sockets.

Running out of file descriptors is tested end to end against a ``serve`` child
under ``prlimit`` (tests/integration/test_attacks_edge.py). Here, in process:
an ``accept()`` that fails for lack of memory pauses accepting for
``ACCEPT_RETRY_DELAY`` (instead of spinning on a socket that stays readable),
says so in one log line, and then takes the waiting client, which is served
as usual.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

import pytest

from proxy.edge.listener import ACCEPT_RETRY_DELAY, Listener, bind
from tests.conftest import DEADLINE, MS


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
