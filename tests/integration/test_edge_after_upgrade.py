"""The edge guards every request head on a connection until a WebSocket is really
established: a declined upgrade does not switch its guard off."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import DEADLINE, wait_until
from tests.integration.helpers import RawWebSocket, connect, request_response


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


async def test_an_unmasked_client_frame_closes_that_session_with_1002(
    simulator: Any, sidecar: Any
) -> None:
    """RFC 6455 §5.1: a client must mask every frame, and a server must close the
    connection on one that is not. After a real upgrade, an unmasked text frame
    (a valid event, were it masked) is not taken: the client gets close 1002 and
    nothing else, the violation is counted once, and another session goes on."""
    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(upstream=sim.ws_url)
    series = ("omni_sidecar_client_protocol_violations_total", {"reason": "unmasked_frame"})
    async with connect(proxy.url) as healthy:
        await request_response(healthy, open_session=True)
        await healthy.recv_until("response.done")
        raw = await RawWebSocket.connect(proxy.url)
        try:
            # A masked frame first (taken), then in the same write an unmasked one.
            raw.send_frame(0x1, b'{"type":"session.update","session":{}}')
            event = b'{"type":"session.update","session":{"modalities":["text"]}}'
            raw.writer.write(bytes([0x81, len(event)]) + event)
            events, code = await raw.read_until_close()
        finally:
            raw.writer.close()
        assert code == 1002, (code, events)
        # At most the masked frame's answer; the unmasked one reached nobody.
        assert len([e for e in events if e["type"] == "session.updated"]) <= 1, events
        await wait_until(lambda: proxy.metric(*series) == 1, what="the violation counted")
        # The other session is untouched.
        await request_response(healthy)
        await healthy.recv_until("response.done")
        assert healthy.close_code is None
    assert proxy.metric(*series) == 1
