"""Attacks on the client listener's edge (issue 12 items 1, 2, 8), as an attacker sees them.

A real ``omni-sidecar serve`` process in front of a real simulator child;
five healthy sessions stream one long response each alongside every attack
and are sequence-checked at the end (``server_event_seq`` 1, 2, 3... without a
gap, audio still arriving during the attack). Each row asserts what the
attacker observes (status line, EOF), what the engine observes (its own
``sessions_total``) and what the operator observes (RSS from ``/proc``,
``omni_sidecar_rejected_connections_total{reason}``, one log line per refusal).
Measured figures are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shlex
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import DEADLINE, MS, wait_until
from tests.integration.helpers import (
    AUDIO_DELTA,
    Client,
    connect,
    module_simulator,
    pcm16_b64,
)
from tests.integration.leakcheck import MIB, rss_bytes
from tests.integration.served import Served, ready, serve

pytestmark = pytest.mark.timeout(120)

#: One long, real-time response per healthy session: it streams through every attack.
STREAMING = shlex.split(
    "--chunk-ms 100 --realtime-factor 1 --response-seconds 120 --sample-rate 8000"
)
HEALTHY = 5
KEY = base64.b64encode(os.urandom(16)).decode()


# -- the processes ----------------------------------------------------------------------------


@contextlib.contextmanager
def served(tmp_path: Path, *flags: str) -> Iterator[Served]:
    # --playback-ack off: the sidecar then answers no engine event itself, so
    # every one reaches the client and server_event_seq has no gap.
    with (
        module_simulator(*STREAMING) as sim,
        serve(tmp_path, sim.ws_url, "--playback-ack", "off", *flags, sim=sim) as server,
    ):
        yield server


# -- healthy sessions alongside ----------------------------------------------------------------


@dataclass
class Healthy:
    """Five sessions, each streaming one long response, read in the background."""

    clients: list[Client] = field(default_factory=list)
    audio_at: list[float] = field(default_factory=list)

    def audio_since(self, moment: float) -> int:
        return sum(1 for t in self.audio_at if t >= moment)

    def check_order(self) -> None:
        """Engine events carry server_event_seq 1, 2, 3... in every session."""
        for n, client in enumerate(self.clients):
            seqs = [e["server_event_seq"] for e in client.events if "server_event_seq" in e]
            gaps = [(a, b) for a, b in itertools.pairwise(seqs) if b != a + 1] or (
                [] if not seqs or seqs[0] == 1 else [(0, seqs[0])]
            )
            around = [
                (e.get("server_event_seq"), e.get("type"))
                for e in client.events
                if gaps and gaps[0][0] - 3 <= e.get("server_event_seq", -9) <= gaps[0][1] + 1
            ]
            assert not gaps, f"session {n}: seq gaps {gaps[:3]}; around the first: {around}"
            assert not [e for e in client.events if e.get("type") == "error"], client.events[-3:]


@contextlib.asynccontextmanager
async def healthy_sessions(url: str) -> AsyncIterator[Healthy]:
    healthy = Healthy()
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(HEALTHY):
            healthy.clients.append(await stack.enter_async_context(connect(url)))
        for client in healthy.clients:
            for event in (
                {"type": "session.update", "session": {"modalities": ["audio", "text"]}},
                {"type": "input_audio_buffer.append", "audio": pcm16_b64(100)},
                {"type": "input_audio_buffer.commit"},
                {"type": "response.create"},
            ):
                await client.send(event)

        async def read(client: Client) -> None:
            while True:
                event = await client.recv(timeout=DEADLINE * 6)
                if event.get("type") == AUDIO_DELTA:
                    healthy.audio_at.append(time.monotonic())

        tasks = [asyncio.ensure_future(read(c)) for c in healthy.clients]
        try:
            await wait_until(lambda: len(healthy.audio_at) >= HEALTHY, what="healthy audio")
            yield healthy
            # Still streaming after the attack: each session gets audio again.
            after = time.monotonic()
            await wait_until(
                lambda: healthy.audio_since(after) >= HEALTHY, what="healthy audio after"
            )
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    healthy.check_order()


# -- raw sockets --------------------------------------------------------------------------------


async def open_raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def read_answer(reader: asyncio.StreamReader, timeout: float = DEADLINE) -> bytes:
    """Everything the server sends until it closes (b'' for a bare close or reset)."""
    chunks = []
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    line = answer.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 else 0


async def healthz_on_a_new_connection(port: int) -> int:
    """The status a fresh connection's ``GET /healthz`` gets: room for one more connection."""
    reader, writer = await open_raw(port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return status_of(await read_answer(reader))
    finally:
        writer.close()


class RssSampler:
    """The process's peak VmRSS while ``sample()`` runs in the background."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_bytes(pid)

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes(self.pid))
            await asyncio.sleep(5 * MS)


# -- the rows ---------------------------------------------------------------------------------------


async def test_500_connections_with_huge_unfinished_heads(tmp_path: Path) -> None:
    """~960 KB of valid header fields each, never finished: 431 after 32 KiB, memory returns."""
    with served(tmp_path) as server:
        await ready(server)
        async with healthy_sessions(server.ws):
            before = server.rss()
            sampler = RssSampler(server.proc.pid)
            sampling = asyncio.ensure_future(sampler.run())
            field_value = b"a" * 7900  # under aiohttp's 8 KiB field limit
            statuses: list[int] = []

            async def attacker(n: int) -> None:
                reader, writer = await open_raw(server.port)
                try:
                    writer.write(b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n")
                    for i in range(120):  # 120 x 8 KB = 960 KB, and no final CRLF
                        writer.write(b"X-Pad-%d: %s\r\n" % (i, field_value))
                        await writer.drain()
                except ConnectionError:
                    pass
                statuses.append(status_of(await read_answer(reader)))
                writer.close()

            started = time.monotonic()
            await asyncio.gather(*(attacker(n) for n in range(500)))
            elapsed = time.monotonic() - started
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
            too_large = await server.rejected("head_too_large")
            at_once = await server.rejected("pending_handshakes")
            assert too_large + at_once == 500, (too_large, at_once)
            assert too_large > 0
            # Only the 431 or a reset: never a request that went through.
            assert set(statuses) <= {431, 0}, set(statuses)
            peak_growth = sampler.peak - before

            async def settled() -> bool:
                return server.rss() - before <= 10 * MIB

            await wait_until(settled, timeout=DEADLINE, what="RSS back within 10 MiB")
            after = server.rss()

            # The most a client can hold without being refused: 250 heads just under
            # the cap, kept open (they would last until the head deadline), then left.
            held = []
            for _ in range(250):
                _, writer = await open_raw(server.port)
                writer.write(b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n")
                for i in range(4):
                    writer.write(b"X-Pad-%d: %s\r\n" % (i, field_value))
                held.append(writer)
            await wait_until(
                lambda: _equals(server.gauge("omni_sidecar_pending_handshakes"), 250),
                what="250 heads held",
            )
            held_growth = server.rss() - before
            for writer in held:
                writer.close()
            await wait_until(
                lambda: _equals(server.gauge("omni_sidecar_pending_handshakes"), 0),
                what="held heads gone",
            )
            await wait_until(settled, timeout=DEADLINE, what="RSS back within 10 MiB")
            after_held = server.rss()
        print(
            f"\n500 x 960 KB heads: {too_large:.0f} x 431, {at_once:.0f} closed at once, "
            f"{elapsed:.1f} s; RSS {before / MIB:.1f} MiB -> peak +{peak_growth / MIB:.1f} MiB "
            f"-> after {after / MIB:.1f} MiB; 250 x 31 KB heads held: "
            f"+{held_growth / MIB:.1f} MiB, after they left {after_held / MIB:.1f} MiB"
        )
        assert peak_growth < 64 * MIB
        assert held_growth < 64 * MIB
        assert server.log().count("head_too_large") == too_large


async def test_1000_slow_heads_are_closed_by_the_head_deadline(tmp_path: Path) -> None:
    """One byte a second each; all closed about request_head_timeout after they opened."""
    deadline = 1.0
    with served(
        tmp_path,
        "--request-head-timeout", str(deadline),
        "--max-pending-handshakes", "2000",
    ) as server:  # fmt: skip
        await ready(server)
        async with healthy_sessions(server.ws):
            lifetimes: list[float] = []
            answers: list[int] = []

            async def slow(n: int) -> None:
                reader, writer = await open_raw(server.port)
                opened = time.monotonic()
                request = b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n"

                async def drip() -> None:
                    with contextlib.suppress(ConnectionError):
                        for byte in request:
                            writer.write(bytes([byte]))
                            await asyncio.sleep(1.0)

                dripping = asyncio.ensure_future(drip())
                answer = await read_answer(reader, timeout=deadline + DEADLINE)
                lifetimes.append(time.monotonic() - opened)
                answers.append(status_of(answer))
                dripping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await dripping
                writer.close()

            batches = [range(i, i + 100) for i in range(0, 1000, 100)]
            tasks = []
            for batch in batches:  # a connect storm above the listen backlog would only retry SYNs
                tasks += [asyncio.ensure_future(slow(n)) for n in batch]
                await asyncio.sleep(10 * MS)
            await asyncio.gather(*tasks)
            assert len(lifetimes) == 1000
            assert await server.rejected("head_timeout") == 1000
            assert set(answers) == {408}, set(answers)
        print(
            f"\n1000 slow heads: all closed by the {deadline:g} s head deadline after "
            f"{min(lifetimes):.2f}-{max(lifetimes):.2f} s"
        )
        assert max(lifetimes) < deadline + 2.0


def raw_handshake(
    method: str = "GET",
    version: str = "HTTP/1.1",
    *,
    key: str | None = KEY,
    ws_version: str | None = "13",
    connection: str | None = "Upgrade",
) -> bytes:
    lines = [f"{method} /v1/realtime {version}", "Host: x", "Upgrade: websocket"]
    if connection is not None:
        lines.append(f"Connection: {connection}")
    if key is not None:
        lines.append(f"Sec-WebSocket-Key: {key}")
    if ws_version is not None:
        lines.append(f"Sec-WebSocket-Version: {ws_version}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


MALFORMED: dict[str, tuple[bytes, int, str]] = {
    "bad key": (raw_handshake(key="c2hvcnQ="), 400, "bad_key"),
    "no key": (raw_handshake(key=None), 400, "bad_key"),
    "bad version": (raw_handshake(ws_version="8"), 426, "bad_version"),
    "no Connection: Upgrade": (raw_handshake(connection="keep-alive"), 400, "bad_connection"),
    "POST": (raw_handshake("POST"), 400, "bad_method"),
    "HTTP/1.0": (raw_handshake(version="HTTP/1.0"), 400, "bad_http_version"),
}


async def send_handshake(port: int, request: bytes) -> tuple[int, bytes]:
    reader, writer = await open_raw(port)
    writer.write(request)
    answer = await read_answer(reader)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return status_of(answer), head + b"\r\n\r\n" + body


async def test_malformed_upgrades_never_reach_the_engine(tmp_path: Path) -> None:
    # Room for all 300 at once: this row is about slots, not the pending-handshake cap.
    with served(
        tmp_path, "--max-sessions", str(HEALTHY + 1), "--max-pending-handshakes", "1000"
    ) as server:
        await ready(server)
        async with healthy_sessions(server.ws):
            engine_before = await server.engine_sessions()
            for name, (request, status, reason) in MALFORMED.items():
                got, answer = await send_handshake(server.port, request)
                assert got == status, (name, answer[:200])
                body = orjson.loads(answer.partition(b"\r\n\r\n")[2])
                assert body["error"]["code"] == reason, (name, body)
                if status == 426:
                    assert b"Sec-WebSocket-Version: 13" in answer
            # 300 at once, while every slot but one is taken by the healthy sessions.
            started = time.monotonic()
            results = await asyncio.gather(
                *(
                    send_handshake(server.port, list(MALFORMED.values())[n % 6][0])
                    for n in range(300)
                )
            )
            elapsed = time.monotonic() - started
            assert {status for status, _ in results} == {400, 426}
            # The one free slot is still free: a valid client gets in now.
            async with connect(server.ws) as late:
                await late.send({"type": "session.update", "session": {}})
                await late.recv_until("session.updated")
            engine_after = await server.engine_sessions()
            assert engine_after - engine_before == 1, (engine_before, engine_after)
            refused = await server.rejected("bad_handshake")
            assert refused == len(MALFORMED) + 300
        log = server.log()
        assert log.count("refused handshake from 127.0.0.1: 400 bad_method") == 1 + 50
        assert log.count("refused handshake from 127.0.0.1: 426 bad_version") == 1 + 50
        print(
            f"\nmalformed upgrades: {len(MALFORMED)} kinds + 300 in parallel answered in "
            f"{elapsed * 1000:.0f} ms; the engine saw 0 of them"
        )


async def test_pending_handshake_cap_closes_new_connections_at_once(tmp_path: Path) -> None:
    cap = 50
    with served(tmp_path, "--max-pending-handshakes", str(cap)) as server:
        await ready(server)
        async with healthy_sessions(server.ws):
            idle = [await open_raw(server.port) for _ in range(cap)]
            await wait_until(
                lambda: _equals(server.gauge("omni_sidecar_pending_handshakes"), cap),
                what="the idle connections accepted",
            )
            # Connection cap + 1: closed at once, before it sends a byte.
            reader, writer = await open_raw(server.port)
            started = time.monotonic()
            assert await read_answer(reader, timeout=DEADLINE) == b""
            closed_after = time.monotonic() - started
            writer.close()
            await wait_until(lambda: _true(server.rejected("pending_handshakes")), what="counted")
            # One of the idle ones finishes its head: there is room again.
            idle_reader, idle_writer = idle.pop()
            idle_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert status_of(await read_answer(idle_reader)) == 200
            idle_writer.close()
            assert await healthz_on_a_new_connection(server.port) == 200
            for _, w in idle:
                w.close()
        assert await server.rejected("pending_handshakes") == 1
        assert "refused connection from 127.0.0.1: closed, pending_handshakes" in server.log()
        print(
            f"\npending cap {cap}: connection {cap + 1} closed after {closed_after * 1000:.1f} ms"
        )


async def _true(value: Any) -> bool:
    return bool(await value)


async def _equals(value: Any, expected: float) -> bool:
    return bool(await value == expected)


async def test_proxy_protocol_from_an_untrusted_peer_closes_the_connection(
    tmp_path: Path,
) -> None:
    with served(tmp_path) as server:
        await ready(server)
        reader, writer = await open_raw(server.port)
        writer.write(b"PROXY TCP4 203.0.113.7 127.0.0.1 5555 80\r\nGET /healthz HTTP/1.1\r\n\r\n")
        assert await read_answer(reader) == b""
        writer.close()
        assert await server.rejected("untrusted_proxy_header") == 1
        assert "refused connection from 127.0.0.1: closed, untrusted_proxy_header" in server.log()


async def test_normal_clients_pass_the_edge(tmp_path: Path) -> None:
    """Keep-alive requests, a large-but-legal head, a valid upgrade: nothing refused."""
    with served(tmp_path) as server:
        await ready(server)
        async with aiohttp.ClientSession() as http:
            for _ in range(3):  # one keep-alive connection, three heads
                async with http.get(
                    f"http://127.0.0.1:{server.port}/healthz",
                    headers={f"X-Big-{i}": "b" * 4000 for i in range(7)},  # 28 KB head
                ) as resp:
                    assert resp.status == 200
            async with http.ws_connect(server.ws) as ws:
                await ws.send_str(orjson.dumps({"type": "session.update", "session": {}}).decode())
                msg = await ws.receive(timeout=DEADLINE)
                assert msg.type is aiohttp.WSMsgType.TEXT
        for reason in ("head_too_large", "head_timeout", "pending_handshakes", "bad_handshake"):
            assert await server.rejected(reason) == 0, reason


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One whole response with a Content-Length, leaving the connection open."""
    async with asyncio.timeout(DEADLINE):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status_of(head), await reader.readexactly(length)


async def test_keep_alive_heads_are_bounded_too(tmp_path: Path) -> None:
    """After a first good request, the next head has the same cap and deadline."""
    with served(tmp_path, "--request-head-timeout", "1") as server:
        await ready(server)
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        # A huge second head: 431.
        reader, writer = await open_raw(server.port)
        writer.write(request)
        assert (await read_response(reader))[0] == 200
        with contextlib.suppress(ConnectionError):
            writer.write(b"GET /healthz HTTP/1.1\r\n")
            for i in range(8):
                writer.write(b"X-Pad-%d: %s\r\n" % (i, b"p" * 7000))
                await writer.drain()
        assert status_of(await read_answer(reader)) == 431
        writer.close()
        # A slow second head: 408 about one deadline after the first answer.
        reader, writer = await open_raw(server.port)
        writer.write(request)
        assert (await read_response(reader))[0] == 200
        answered = time.monotonic()
        writer.write(b"GET /heal")
        assert status_of(await read_answer(reader)) == 408
        waited = time.monotonic() - answered
        writer.close()
        assert 0.8 < waited < 3.0, waited
        # A field over aiohttp's per-field limit on the client listener: 400.
        reader, writer = await open_raw(server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n" % (b"f" * 9000))
        assert status_of(await read_answer(reader)) == 400
        writer.close()
        assert await server.rejected("head_too_large") == 1
        assert await server.rejected("head_timeout") == 1
        assert await server.rejected("bad_request_head") == 1
        assert "refused connection from 127.0.0.1: 400 bad_request_head" in server.log()

        async def none_pending() -> bool:
            return await server.gauge("omni_sidecar_pending_handshakes") == 0

        await wait_until(none_pending, what="no connection left pending")


# -- lingering close -------------------------------------------------------------------------------


#: 64 x 8 KB of header fields (under aiohttp's 8 KiB field limit): 512 KB, far over
#: the 32 KiB head cap and under max_lingering_bytes.
HEAD_FIELDS = [b"X-Pad-%d: %s\r\n" % (i, b"p" * 7900) for i in range(64)]
#: The same amount of plain bytes, sent after a head the server answers at once.
FILLER = [b"z" * 8000] * 64


async def blast(port: int, head: bytes, chunks: list[bytes], *, rcvbuf: int = 4096) -> bytes:
    """Send ``head`` and ``chunks`` as fast as the socket takes them, then read the answer.

    A small receive buffer, as on a busy client. The writes go on after the
    server has answered; a server that closes with those bytes unread resets
    the connection, and a client whose write then fails loses the answer it
    had not read yet (asyncio's transport closes on the failed write).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(head)
            for chunk in chunks:
                writer.write(chunk)
                await writer.drain()
        return await read_answer(reader)
    finally:
        writer.close()


async def test_a_large_head_sent_fast_gets_its_431_every_time(tmp_path: Path) -> None:
    """The answer is not destroyed by a reset while the client is still sending (100 of 100)."""
    with served(tmp_path) as server:
        await ready(server)
        started = time.monotonic()
        head = b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n"
        statuses = [status_of(await blast(server.port, head, HEAD_FIELDS)) for _ in range(100)]
        elapsed = time.monotonic() - started
        print(f"\n100 x 512 KB heads sent at once: {statuses.count(431)} x 431 in {elapsed:.2f} s")
        assert statuses.count(431) == 100, statuses
        # Each client read its answer and closed: every linger ended that way.
        await wait_until(
            lambda: _equals(server.gauge(lingered("client_closed")), 100),
            what="100 lingering closes ended by the client",
        )
        assert await server.gauge("omni_sidecar_lingering_connections") == 0


API_KEY = "sk-linger-test"

#: Other error answers that end the connection before the upgrade, each sent
#: to a client still sending 512 KB: (head, status).
FAST_SENDERS: dict[str, tuple[bytes, int]] = {
    "aiohttp's parser: a field over 8 KiB": (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"f" * 9000 + b"\r\n\r\n",
        400,
    ),
    "handshake: another WebSocket version": (raw_handshake(ws_version="8"), 426),
    "handshake: a bad key": (raw_handshake(key="c2hvcnQ="), 400),
    "reverse proxy: Content-Length over the body cap": (
        b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Length: 100000000\r\n\r\n" % API_KEY.encode(),
        413,
    ),
    "auth: a 401 to a client that asked to close": (
        b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        + b"Content-Length: 100000000\r\n\r\n",
        401,
    ),
}


async def test_every_error_answer_before_the_upgrade_survives_a_fast_sender(
    tmp_path: Path,
) -> None:
    """400 (parser and handshake), 426, 413, 401: each answer arrives, 100 of 100 times."""
    with served(tmp_path, "--max-http-body-bytes", "1000000", "--api-keys", API_KEY) as server:
        await ready(server)
        lost = {}
        for name, (head, status) in FAST_SENDERS.items():
            started = time.monotonic()
            statuses = [status_of(await blast(server.port, head, FILLER)) for _ in range(100)]
            elapsed = time.monotonic() - started
            print(f"\n{name}: {statuses.count(status)} of 100 x {status} in {elapsed:.2f} s")
            lost[name] = 100 - statuses.count(status)
        assert lost == dict.fromkeys(FAST_SENDERS, 0)
        await wait_until(
            lambda: _equals(server.gauge(lingered("client_closed")), 100 * len(FAST_SENDERS)),
            what="every lingering close ended by the client",
        )


def lingered(outcome: str) -> str:
    return f'omni_sidecar_lingering_closes_total{{outcome="{outcome}"}}'


#: A head over a 1 KiB max_request_head_bytes, not finished.
OVER_1_KIB = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 4000 + b"\r\n"


async def answered(port: int, request: bytes = OVER_1_KIB) -> tuple[socket.socket, bytes]:
    """A raw client that sent ``request`` and read the answer up to the server's FIN.

    The server shuts its write side after the answer (the FIN) and goes on
    reading: the socket stays open for whatever the client still sends.
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request)
    chunks = []
    async with asyncio.timeout(DEADLINE):
        while chunk := await loop.sock_recv(sock, 65536):
            chunks.append(chunk)
    return sock, b"".join(chunks)


async def send_until_closed(sock: socket.socket, chunk: bytes, pause: float) -> int:
    """Send ``chunk`` every ``pause`` seconds until the server's close fails a send; bytes sent."""
    loop = asyncio.get_running_loop()
    sent = 0
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(DEADLINE):
            while True:
                await loop.sock_sendall(sock, chunk)
                sent += len(chunk)
                if pause:
                    await asyncio.sleep(pause)
    return sent


async def test_past_the_byte_cap_reading_stops_until_lingering_time(tmp_path: Path) -> None:
    cap, limit = 256 * 1024, 2.0
    with served(
        tmp_path,
        "--max-request-head-bytes", "1024",
        "--max-lingering-bytes", str(cap),
        "--lingering-time", str(limit), "--lingering-timeout", "60",
    ) as server:  # fmt: skip
        await ready(server)
        sock, answer = await answered(server.port)
        answered_at = time.monotonic()
        assert status_of(answer) == 431
        with sock:
            sent = await send_until_closed(sock, b"z" * 16384, 0)
        elapsed = time.monotonic() - answered_at
        print(f"\nlingering byte cap {cap} B: {sent} B sent, closed after {elapsed:.2f} s")
        assert sent >= cap
        # Reading stopped at the cap: the kernel's buffers took the rest, not us
        # (an unthrottled loopback sender moves gigabytes in lingering_time).
        assert sent < 64 * MIB, sent
        # Not closed at the cap (that reset could destroy an answer still unread):
        # at lingering_time.
        assert 0.8 * limit <= elapsed < limit + DEADLINE / 2, elapsed
        assert await server.gauge(lingered("byte_limit")) == 1
        assert await server.gauge("omni_sidecar_lingering_connections") == 0


async def test_a_client_that_keeps_sending_is_closed_at_lingering_time(tmp_path: Path) -> None:
    """Every byte heard restarts the quiet clock: a client that sends more often than
    ``lingering_timeout`` is read until ``lingering_time``, never closed as quiet."""
    limit, quiet = 1.5, 0.3
    with served(
        tmp_path,
        "--max-request-head-bytes", "1024",
        "--lingering-time", str(limit), "--lingering-timeout", str(quiet),
    ) as server:  # fmt: skip
        await ready(server)
        sock, answer = await answered(server.port)
        answered_at = time.monotonic()
        assert status_of(answer) == 431
        with sock:  # 1 KB every 20 ms: never quiet for 300 ms, far under the byte cap
            sent = await send_until_closed(sock, b"z" * 1024, 20 * MS)
        elapsed = time.monotonic() - answered_at
        print(f"\nlingering_time {limit:g} s: closed after {elapsed:.2f} s, {sent} B sent")
        assert 0.8 * limit <= elapsed < limit + 2.0, elapsed
        assert await server.gauge(lingered("time_limit")) == 1
        assert await server.gauge(lingered("quiet")) == 0


async def test_a_quiet_client_is_closed_after_lingering_timeout(tmp_path: Path) -> None:
    quiet = 0.5
    with served(
        tmp_path,
        "--max-request-head-bytes", "1024",
        "--lingering-time", "60", "--lingering-timeout", str(quiet),
    ) as server:  # fmt: skip
        await ready(server)
        sock, answer = await answered(server.port)
        answered_at = time.monotonic()
        assert status_of(answer) == 431
        with sock:  # sends nothing, closes nothing
            await wait_until(
                lambda: _equals(server.gauge(lingered("quiet")), 1), what="the quiet linger ended"
            )
            elapsed = time.monotonic() - answered_at
            # The server's socket is gone: a byte sent now is answered with a reset.
            sent = await send_until_closed(sock, b"z", 5 * MS)
        print(f"\nlingering_timeout {quiet:g} s: closed after {elapsed:.2f} s")
        assert 0.8 * quiet <= elapsed < quiet + 2.0
        assert sent < 1024
        assert await server.gauge("omni_sidecar_lingering_connections") == 0


async def test_lingering_connections_count_against_the_pending_cap(tmp_path: Path) -> None:
    cap = 3
    with served(
        tmp_path,
        "--max-request-head-bytes", "1024", "--max-pending-handshakes", str(cap),
        "--lingering-time", "60", "--lingering-timeout", "60",
    ) as server:  # fmt: skip
        await ready(server)
        await wait_until(
            lambda: _equals(server.gauge("omni_sidecar_pending_handshakes"), 0),
            what="the readiness probe's connection gone",
        )
        lingering = [await answered(server.port) for _ in range(cap)]
        assert [status_of(answer) for _, answer in lingering] == [431] * cap
        assert await server.gauge("omni_sidecar_lingering_connections") == cap
        assert await server.gauge("omni_sidecar_pending_handshakes") == 0
        # The cap is full of lingering sockets: one more connection is closed at once.
        reader, writer = await open_raw(server.port)
        assert await read_answer(reader) == b""
        writer.close()
        assert await server.rejected("pending_handshakes") == 1
        # One lingering client closes: its place is free again.
        first, _ = lingering.pop()
        first.close()
        await wait_until(
            lambda: _equals(server.gauge(lingered("client_closed")), 1), what="one linger ended"
        )
        assert await healthz_on_a_new_connection(server.port) == 200
        for sock, _ in lingering:
            sock.close()
        await wait_until(
            lambda: _equals(server.gauge("omni_sidecar_lingering_connections"), 0),
            what="every linger ended",
        )
        assert await server.gauge(lingered("client_closed")) == cap


async def test_an_error_answer_with_the_cap_full_closes_at_once(tmp_path: Path) -> None:
    """A 503 written while the pending cap is full is not lingered: closed at once (no_room)."""
    cap = 2
    with served(
        tmp_path,
        "--max-pending-handshakes", str(cap),
        "--max-sessions", "1", "--admission-timeout", "1",
    ) as server:  # fmt: skip
        await ready(server)
        async with connect(server.ws) as session:  # takes the one session slot
            await session.send({"type": "session.update", "session": {}})
            await session.recv_until("session.updated")
            pending = "omni_sidecar_pending_handshakes"
            idle = [await open_raw(server.port)]
            reader, writer = await open_raw(server.port)
            await wait_until(lambda: _equals(server.gauge(pending), 2), what="both accepted")
            # Its head complete, this handshake waits (up to 1 s) for a slot ...
            writer.write(raw_handshake(connection="Upgrade, close"))
            await wait_until(lambda: _equals(server.gauge(pending), 1), what="its head complete")
            # ... while a second idle connection fills the pending cap again.
            idle.append(await open_raw(server.port))
            await wait_until(lambda: _equals(server.gauge(pending), cap), what="the cap full")
            answer = await read_answer(reader)
            writer.close()
            for _, idle_writer in idle:
                idle_writer.close()
        assert status_of(answer) == 503
        assert await server.gauge(lingered("no_room")) == 1
        assert await server.gauge("omni_sidecar_lingering_connections") == 0


async def test_running_out_of_file_descriptors_is_counted_and_logged_once(
    tmp_path: Path,
) -> None:
    """The sidecar runs under ``RLIMIT_NOFILE`` 64 (``prlimit``, in front of its
    command) and an attacker opens 120 connections. Those it has no descriptor
    for are closed at once (EOF, not a hang in the backlog), each counted in
    ``rejected_connections_total{reason="fd_limit"}``, with one log line for
    the lot; once the attacker leaves, the listener accepts again."""
    limit, opened = 64, 120
    with (
        module_simulator("--realtime-factor", "0") as sim,
        serve(tmp_path, sim.ws_url, prefix=("prlimit", f"--nofile={limit}:{limit}", "--")) as server,
    ):  # fmt: skip
        await ready(server)
        held = [await open_raw(server.port) for _ in range(opened)]
        # The sidecar runs out: the first connections it cannot take are closed at once.
        await wait_until(
            lambda: any(reader.at_eof() for reader, _ in held), what="a connection closed at once"
        )

        async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
            """200 from a connection the sidecar took, 0 from one it closed at once."""
            with contextlib.suppress(ConnectionError):
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            try:
                return status_of(await read_answer(reader))
            finally:
                writer.close()

        statuses = await asyncio.gather(*(ask(reader, writer) for reader, writer in held))
        refused = statuses.count(0)
        # Each either answered or closed at once (those answered free descriptors, so
        # how many of the rest still find none depends on the machine's pace).
        assert statuses.count(200) + refused == opened, sorted(set(statuses))
        assert refused >= 1, refused
        # Read once the attacker's connections are gone: the admin listener needs a
        # descriptor too.
        await wait_until(
            lambda: _equals(server.rejected("fd_limit"), refused),
            what=f"{refused} fd_limit refusals counted",
        )
        lines = [line for line in server.log().splitlines() if "accept() failed (EMFILE" in line]
        print(f"\nRLIMIT_NOFILE {limit}: {refused} of {opened} connections closed at once, "
              f"{len(lines)} log line(s)")  # fmt: skip
        assert len(lines) == 1, lines
        assert f"RLIMIT_NOFILE {limit}" in lines[0]
        assert await healthz_on_a_new_connection(server.port) == 200
        async with connect(server.ws) as client:
            await client.send({"type": "session.update", "session": {}})
            await client.recv_until("session.updated")
