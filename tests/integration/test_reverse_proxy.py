"""Reverse-proxied HTTP (issue 12 item 6; proxy/edge/reverse_proxy.py), over real loopback sockets.

An in-test engine records every request it gets (headers, body bytes); the
sidecar runs in-process on ephemeral ports. Asserted: what the engine saw,
what the client got back, the edge metric and the access/refusal log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.children import SidecarChild
from tests.conftest import DEADLINE, free_port, wait_until

pytestmark = pytest.mark.timeout(60)

MIB = 1024 * 1024
CAP = 1 * MIB


@dataclass
class Seen:
    headers: dict[str, str]
    body_bytes: int
    complete: bool


@dataclass
class Engine:
    """An HTTP engine that answers /health and records every other request."""

    port: int
    seen: list[Seen] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.json_response({"status": "ok"})
        received = 0
        complete = False
        try:
            while chunk := await request.content.readany():
                received += len(chunk)
            complete = True
        except (aiohttp.ClientPayloadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.seen.append(Seen(dict(request.headers), received, complete))
            self.done.set()
        return web.json_response(
            {"received": received},
            headers={
                "Connection": "X-Secret-Reply",
                "X-Secret-Reply": "hop",
                "X-Reply-Kept": "end-to-end",
                "Keep-Alive": "timeout=5",
            },
        )


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    port = free_port()
    scripted = Engine(port)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", scripted.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield scripted
    await runner.cleanup()


async def raw_request(
    port: int, head: bytes, body_chunks: AsyncIterator[bytes] | None = None
) -> bytes:
    """Send a request (streaming its body) and read the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        writer.write(head)
        if body_chunks is not None:
            with contextlib.suppress(ConnectionError):
                async for chunk in body_chunks:
                    writer.write(chunk)
                    await writer.drain()

    sending = asyncio.ensure_future(send())
    answer = b""
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(DEADLINE):
            while not _complete(answer) and (data := await reader.read(65536)):
                answer += data
    sending.cancel()
    with contextlib.suppress(asyncio.CancelledError, ConnectionError):
        await sending
    writer.close()
    return answer


def _complete(answer: bytes) -> bool:
    """A whole response with a Content-Length (the server may linger before it closes)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


async def chunked(total: int, chunk: int = 64 * 1024) -> AsyncIterator[bytes]:
    piece = b"x" * chunk
    framed = b"%x\r\n%s\r\n" % (len(piece), piece)
    for _ in range(total // chunk):
        yield framed
    yield b"0\r\n\r\n"


async def test_hop_by_hop_and_connection_named_headers_are_dropped_both_ways(
    engine: Engine, sidecar
) -> None:
    proxy = await sidecar(upstream=engine.ws_url)
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{proxy.http_url}/v1/models",
            headers={
                "Connection": "keep-alive, X-Secret",
                "X-Secret": "must not reach the engine",
                "X-Kept": "end-to-end",
                "Keep-Alive": "timeout=5",
                "TE": "trailers",
                "Proxy-Authorization": "Basic eDp5",
            },
        ) as resp,
    ):
        assert resp.status == 200
        assert resp.headers.get("X-Reply-Kept") == "end-to-end"
        assert "X-Secret-Reply" not in resp.headers
        assert "Keep-Alive" not in resp.headers
        assert resp.headers.get("Connection", "").lower() in ("", "keep-alive")
    [seen] = engine.seen
    lowered = {k.lower(): v for k, v in seen.headers.items()}
    assert lowered.get("x-kept") == "end-to-end"
    for dropped in ("x-secret", "keep-alive", "te", "proxy-authorization"):
        assert dropped not in lowered, (dropped, lowered)
    assert "x-secret" not in lowered.get("connection", "").lower()


async def test_a_100_mib_chunked_body_gets_413_and_is_not_forwarded_in_full(
    engine: Engine, sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    proxy = await sidecar(upstream=engine.ws_url, max_http_body_bytes=CAP)
    port = proxy.sidecar.bound["listen"][1]
    head = (
        b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/octet-stream\r\n\r\n"
    )
    answer = await raw_request(port, head, chunked(100 * MIB))
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"body_too_large" in answer
    await asyncio.wait_for(engine.done.wait(), DEADLINE)
    [seen] = engine.seen
    assert not seen.complete
    assert seen.body_bytes <= CAP + 256 * 1024, seen.body_bytes
    assert (
        proxy.metric("omni_sidecar_rejected_connections_total", {"reason": "body_too_large"}) == 1
    )
    assert "refused http POST /v1/upload from 127.0.0.1: 413 body_too_large" in caplog.text
    print(f"\n100 MiB chunked body: 413; the engine got {seen.body_bytes / MIB:.2f} MiB of it")


async def test_a_declared_oversized_body_is_refused_before_the_engine(
    engine: Engine, sidecar
) -> None:
    proxy = await sidecar(upstream=engine.ws_url, max_http_body_bytes=CAP)
    port = proxy.sidecar.bound["listen"][1]
    head = b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (100 * MIB)
    answer = await raw_request(port, head)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert engine.seen == []


@pytest.mark.parametrize("size", [0, 1, CAP])
async def test_bodies_up_to_the_cap_go_through_whole(engine: Engine, sidecar, size: int) -> None:
    proxy = await sidecar(upstream=engine.ws_url, max_http_body_bytes=CAP)

    async def body() -> AsyncIterator[bytes]:
        left = size
        while left > 0:
            n = min(left, 100_000)
            yield b"y" * n
            left -= n

    async with aiohttp.ClientSession() as http:
        # Chunked (a generator) and with a Content-Length.
        for data in (body(), b"y" * size):
            async with http.post(f"{proxy.http_url}/v1/upload", data=data) as resp:
                assert resp.status == 200
                assert (await resp.json())["received"] == size
    assert [s.body_bytes for s in engine.seen] == [size, size]


async def test_one_access_line_per_proxied_request(
    engine: Engine, sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    proxy = await sidecar(upstream=engine.ws_url)
    async with aiohttp.ClientSession() as http, http.get(f"{proxy.http_url}/v1/models?x=1") as resp:
        body = await resp.read()
    await wait_until(lambda: "http GET /v1/models 200" in caplog.text, what="access line")
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("http GET")]
    assert f" 200 {len(body)} bytes " in line
    assert line.endswith("client 127.0.0.1")


async def test_both_rows_through_a_real_serve_process(engine: Engine, tmp_path: Path) -> None:
    """The same two attack rows against ``omni-sidecar serve`` as a child process."""
    log = tmp_path / "serve.log"
    served = SidecarChild(
        "--upstream", engine.ws_url, "--max-http-body-bytes", str(CAP),
        log_path=log, ready_timeout=3 * DEADLINE, stop_grace=DEADLINE,
    )  # fmt: skip
    async with served:
        port = served.port
        engine.seen.clear()
        answer = await raw_request(
            port,
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close, X-Secret\r\n"
            b"X-Secret: hop\r\nX-Kept: end\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert b"X-Secret-Reply" not in answer and b"X-Reply-Kept: end-to-end" in answer
        [seen] = engine.seen
        assert "X-Secret" not in seen.headers and seen.headers.get("X-Kept") == "end"
        engine.seen.clear()
        engine.done.clear()
        head = b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        answer = await raw_request(port, head, chunked(100 * MIB))
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        await asyncio.wait_for(engine.done.wait(), DEADLINE)
        [seen] = engine.seen
        assert not seen.complete and seen.body_bytes <= CAP + 256 * 1024
        text = log.read_text(errors="replace")
        assert "refused http POST /v1/upload from 127.0.0.1: 413 body_too_large" in text
        assert "http GET /v1/models 200 " in text
