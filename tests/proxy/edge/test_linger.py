"""The lingering close (proxy/edge/linger.py) on a real loopback TCP connection, in process.

What the edge does after an error answer before the upgrade is tested end to
end against a ``serve`` child in tests/integration/test_attacks_edge.py. One
rule cannot be reached from there reliably: an answer the client never reads.
A lingering close closes the socket only once its answer is sent, so a client
that reads nothing would hold the socket (and its place under
``max_pending_handshakes``) for ever; the linger aborts it at
``lingering_time``. Here the server's send buffer is made small and the answer
large, so that most of it is still in the transport when the linger starts,
and the client never reads.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

from proxy.edge.linger import Linger
from tests.conftest import DEADLINE, MS, wait_until

#: An answer far larger than the two kernel buffers of the connection.
ANSWER_BYTES = 4 * 1024 * 1024


@dataclass
class Limits:
    lingering_time: float
    lingering_timeout: float
    max_lingering_bytes: int = 1024 * 1024


@dataclass
class Guard:
    """What a linger reports to (EdgeGuard's part)."""

    limits: Limits
    lingering: int = 0
    outcomes: list[str] = field(default_factory=list)

    def lingered(self, outcome: str) -> None:
        self.outcomes.append(outcome)


class ServerSide(asyncio.Protocol):
    """The server's end: hands what it reads and its loss to the linger (as the edge does)."""

    def __init__(self) -> None:
        self.linger: Linger | None = None
        self.lost_at: float | None = None

    def data_received(self, data: bytes) -> None:
        if self.linger is not None:
            self.linger.discard(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost_at = time.monotonic()
        if self.linger is not None:
            self.linger.lost(exc)


async def test_an_answer_the_client_never_reads_is_aborted_at_lingering_time() -> None:
    limit, quiet = 600 * MS, 100 * MS
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the accepted one inherits
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with listener, client:
        client.connect(listener.getsockname())
        accepted, _ = listener.accept()
        accepted.setblocking(False)
        transport, side = await loop.connect_accepted_socket(ServerSide, accepted)
        transport.write(b"x" * ANSWER_BYTES)  # the error answer, most of it still unsent
        assert transport.get_write_buffer_size() > 0
        guard = Guard(Limits(lingering_time=limit, lingering_timeout=quiet))
        started = time.monotonic()
        side.linger = Linger(transport, guard)
        assert guard.lingering == 1
        # The client neither reads nor sends: quiet after lingering_timeout, but its
        # answer is unsent, so the socket would wait on it; the abort ends it.
        await wait_until(
            lambda: guard.lingering == 0, timeout=limit + DEADLINE / 2, what="the linger ended"
        )
        held = time.monotonic() - started
        assert guard.outcomes == ["quiet"]
        assert held >= limit - 50 * MS, f"ended after {held:.2f} s, before lingering_time"
        assert side.lost_at is not None and transport.is_closing()
        # What the client sees: the bytes that had reached its kernel, then the end of
        # the connection; the rest of the answer was dropped with the transport.
        client.setblocking(False)
        got, ended = 0, False
        async with asyncio.timeout(DEADLINE):
            while not ended:
                try:
                    chunk = await loop.sock_recv(client, 1 << 16)
                except ConnectionResetError:
                    chunk = b""
                got += len(chunk)
                ended = not chunk
        print(f"\nunread answer: aborted after {held:.2f} s; {got} of {ANSWER_BYTES} B arrived")
        assert got < ANSWER_BYTES // 4
