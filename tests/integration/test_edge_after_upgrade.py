"""The edge guards every request head on a connection until a WebSocket is really
established: a declined upgrade does not switch its guard off."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import DEADLINE


async def _response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


async def test_a_declined_upgrade_leaves_the_next_head_guarded(
    simulator: Any, sidecar: Any
) -> None:
    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(upstream=sim.ws_url, max_request_head_bytes=4096)
    host, port = proxy.sidecar.bound["listen"]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        async with asyncio.timeout(DEADLINE):
            writer.write(
                b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 8\r\n\r\n"
            )
            declined = await _response(reader)
            assert b" 426 " in declined.split(b"\r\n", 1)[0], declined
            # The same connection, now an oversized head: still refused (431) or closed.
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 8000 + b"\r\n\r\n")
            try:
                answer = await _response(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # closed: nothing unguarded was parsed
            assert b" 431 " in answer.split(b"\r\n", 1)[0], answer[:200]
    finally:
        writer.close()
