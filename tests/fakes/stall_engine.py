"""Engines that misbehave on purpose, on real loopback sockets.

``StallEngine`` is a bare TCP listener on ``127.0.0.1:0``:

* ``complete_handshake=False``: it accepts the TCP connection and then says
  nothing, so a WebSocket handshake never completes (``upstream_connect_timeout``).
* ``complete_handshake=True``: it answers the upgrade with a valid ``101`` and
  then never reads or writes again. Its receive buffer is tiny, so whatever the
  proxy sends piles up in the proxy's own transport (``max_pending_input_bytes``).

``HostileEngine`` is a :class:`ScriptedEngine` that can also send frames no
engine should send (malformed JSON, non-objects, binary) when the test says so,
to check that the proxy drops and counts them and delivers the valid ones.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import socket
from collections.abc import Mapping
from typing import Any, Final

from tests.fakes.scripted_engine import EngineConnection, ScriptedEngine

__all__ = ["MALFORMED_UPSTREAM_FRAMES", "HostileEngine", "StallEngine"]

_FACTOR: Final = float(os.environ.get("OMNI_SIDECAR_TESTS_TIMEOUT_FACTOR", "1"))
DEADLINE: Final = 10.0 * _FACTOR
_WS_GUID: Final = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

#: Frames a broken engine might send; none is a JSON object with a string ``type``.
MALFORMED_UPSTREAM_FRAMES: Final[dict[str, str | bytes]] = {
    "truncated_json": '{"type": "response.output_audio.delta", "delta": "AAAA',
    "not_json": "this is not json",
    "empty": "",
    "array": '[{"type": "response.created"}]',
    "string": '"response.created"',
    "number": "42",
    "null": "null",
    "no_type": '{"event_id": "event_1", "response_id": "resp_1"}',
    "type_not_string": '{"type": 5, "response_id": "resp_1"}',
    "type_null": '{"type": null}',
    "deep_nesting": "[" * 5000,
    "deep_object": '{"type": "x.deep", "a": ' + "[" * 5000 + "]" * 5000 + "}",
    "binary": b"\x00\x01\x02 binary frame",
    "binary_json": b'{"type": "response.created"}',
}


def _accept_key(key: str) -> str:
    digest = hashlib.sha1((key + _WS_GUID).encode()).digest()
    return base64.b64encode(digest).decode()


class StallEngine:
    """A TCP listener that accepts and then stops cooperating.

    Args:
        complete_handshake: answer the WebSocket upgrade (then go silent) or not.
        receive_buffer_bytes: ``SO_RCVBUF`` of accepted sockets (the kernel
            doubles it); small, so that the proxy's writes back up quickly.
        handshake_delay: seconds to wait before answering the upgrade (an
            engine that is slow to accept a session).

    ``GET /health`` (no upgrade) answers 200 and is not a connection: the
    sidecar's readiness probe sees a healthy engine whose sessions stall.

    Attributes:
        accepted: connections accepted so far, health checks not counted.
        handshakes: upgrade requests answered with 101.
        health_checks: ``GET /health`` requests answered.
        request_headers: the header block of each upgrade request, lower-cased names.
    """

    def __init__(
        self,
        *,
        complete_handshake: bool,
        receive_buffer_bytes: int = 4096,
        handshake_delay: float = 0.0,
    ) -> None:
        self.complete_handshake = complete_handshake
        self.receive_buffer_bytes = receive_buffer_bytes
        self.handshake_delay = handshake_delay
        self.accepted = 0
        self.handshakes = 0
        self.health_checks = 0
        self.request_headers: list[dict[str, str]] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self.connected = asyncio.Event()
        self.upgraded = asyncio.Event()

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    async def start(self) -> StallEngine:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Set before listen(): accepted sockets inherit it and the window stays small.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer_bytes)
        sock.bind(("127.0.0.1", 0))
        self.port = int(sock.getsockname()[1])
        # limit: the StreamReader stops reading from the socket at 2 * limit.
        self._server = await asyncio.start_server(self._accept, sock=sock, limit=4096)
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, TimeoutError):
                async with asyncio.timeout(DEADLINE):
                    head = await reader.readuntil(b"\r\n\r\n")
                request_line, *lines = head.decode("latin-1").split("\r\n")
                headers: dict[str, str] = {}
                for line in lines:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                if request_line.startswith("GET /health ") and "upgrade" not in headers:
                    # The sidecar's readiness probe: this engine says it is healthy
                    # (its sessions are what stalls). Not counted as a connection.
                    self.health_checks += 1
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    )
                    await writer.drain()
                    writer.close()
                    return
                self.accepted += 1
                self.connected.set()
                if not self.complete_handshake:
                    return  # keep the socket open, say nothing
                self.request_headers.append(headers)
                key = headers.get("sec-websocket-key", "")
                if self.handshake_delay > 0:
                    await asyncio.sleep(self.handshake_delay)
                writer.write(
                    (
                        "HTTP/1.1 101 Switching Protocols\r\n"
                        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                        f"Sec-WebSocket-Accept: {_accept_key(key)}\r\n\r\n"
                    ).encode()
                )
                await writer.drain()
                self.handshakes += 1
                self.upgraded.set()
            # From here on: never read, never write. The reader's buffer fills,
            # asyncio pauses reading, the tiny kernel window closes.
        finally:
            if task is not None:
                self._handlers.discard(task)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._writers:
                transport = writer.transport
                with contextlib.suppress(Exception):
                    transport.abort()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DEADLINE):
                    await self._server.wait_closed()
            self._server = None


class HostileEngine(ScriptedEngine):
    """A scripted engine that also sends garbage on command.

    Usage::

        engine = await HostileEngine().start()
        conn = await engine.next_connection()
        await engine.send_malformed(conn, "truncated_json")
        await engine.send_frames(conn, [{"type": "x.ok"}, b"\\x00", "[1]"])
    """

    async def send_malformed(self, conn: EngineConnection, name: str) -> None:
        """Send one frame from :data:`MALFORMED_UPSTREAM_FRAMES` by name."""
        await self.send_raw(conn, MALFORMED_UPSTREAM_FRAMES[name])

    @staticmethod
    async def send_raw(conn: EngineConnection, frame: str | bytes) -> None:
        """A str goes out verbatim as a text frame, bytes as a binary frame."""
        if isinstance(frame, bytes):
            await conn.ws.send_bytes(frame)
        else:
            await conn.ws.send_str(frame)

    async def send_frames(
        self, conn: EngineConnection, frames: list[Mapping[str, Any] | str | bytes]
    ) -> None:
        """Send frames in order: mappings as JSON text, str verbatim, bytes as binary."""
        for frame in frames:
            if isinstance(frame, (str, bytes)):
                await self.send_raw(conn, frame)
            else:
                await conn.send(frame)
