"""A tiny engine that a test drives frame by frame, on a real loopback socket.

The simulator speaks the protocol faithfully; this fake speaks nothing by
itself, so a test can produce exact frames, exact close codes, an abrupt
death or a silent stall, and can see exactly what the proxy forwarded.

Routes: WebSocket ``/v1/realtime`` and ``/v1/duplex``; ``GET /health`` (200);
``GET /v1/models``; any other HTTP request is answered with a JSON echo of
what arrived (method, path with query, body, headers), so reverse proxying is
observable.

Usage::

    engine = ScriptedEngine()
    await engine.start()
    ...client connects through the proxy...
    conn = await engine.next_connection()
    assert (await conn.receive_event())["type"] == "session.update"
    await conn.send({"type": "session.created", "session": {"id": "s1"}})
    conn.abort()  # the engine dies without a close frame
    await engine.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

__all__ = ["MODELS_BODY", "EngineConnection", "ScriptedEngine"]

_FACTOR: Final = float(os.environ.get("OMNI_SIDECAR_TESTS_TIMEOUT_FACTOR", "1"))
DEADLINE: Final = 10.0 * _FACTOR

#: What ``GET /v1/models`` answers.
MODELS_BODY: Final[dict[str, Any]] = {
    "object": "list",
    "data": [{"id": "scripted-engine", "object": "model", "owned_by": "tests"}],
}

_SESSION_CLOSE_TYPES: Final = frozenset({"session.close", "close", "close_session"})


class EngineConnection:
    """One upstream WebSocket as the engine sees it.

    Attributes:
        path: the request path (``/v1/realtime`` or ``/v1/duplex``).
        query_string: the raw query string the proxy sent.
        headers: the upgrade request's headers.
        received: every text frame received, in order, as sent by the proxy.
        binary_frames: how many binary frames arrived.
        closed: set once the socket has ended (either side).
        close_code: the close code once closed (None before or on abort).
    """

    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self._request = request
        self.ws = ws
        self.path = request.path
        self.query_string = request.query_string
        self.headers = request.headers.copy()
        self.received: list[str] = []
        self.binary_frames = 0
        self.closed = asyncio.Event()
        self.close_code: int | None = None
        self._inbox: asyncio.Queue[str | None] = asyncio.Queue()

    # -- what the proxy sent ---------------------------------------------------------------

    def _record(self, text: str) -> None:
        self.received.append(text)
        self._inbox.put_nowait(text)

    def _ended(self) -> None:
        self.close_code = self.ws.close_code
        self.closed.set()
        self._inbox.put_nowait(None)

    async def receive_text(self, timeout: float = DEADLINE) -> str:
        """The next text frame from the proxy; AssertionError if the socket ended first."""
        async with asyncio.timeout(timeout):
            text = await self._inbox.get()
        if text is None:
            self._inbox.put_nowait(None)  # stay ended for later callers
            raise AssertionError(f"upstream socket closed (code {self.close_code}) first")
        return text

    async def receive_event(self, timeout: float = DEADLINE) -> dict[str, Any]:
        """The next text frame, parsed."""
        event = orjson.loads(await self.receive_text(timeout))
        assert isinstance(event, dict), event
        return event

    async def receive_until(
        self, event_type: str, timeout: float = DEADLINE
    ) -> list[dict[str, Any]]:
        """Events up to and including the first one of ``event_type``."""
        seen: list[dict[str, Any]] = []
        async with asyncio.timeout(timeout):
            while True:
                event = await self.receive_event()
                seen.append(event)
                if event.get("type") == event_type:
                    return seen

    def received_types(self) -> list[str]:
        out = []
        for text in self.received:
            with contextlib.suppress(orjson.JSONDecodeError):
                event = orjson.loads(text)
                if isinstance(event, dict):
                    out.append(str(event.get("type")))
                    continue
            out.append("<not an event>")
        return out

    # -- what the engine does ----------------------------------------------------------------

    async def send(self, event: Mapping[str, Any] | str) -> None:
        """Send one text frame: a dict is serialised, a str goes out verbatim."""
        text = event if isinstance(event, str) else orjson.dumps(dict(event)).decode()
        await self.ws.send_str(text)

    async def send_all(self, events: list[Mapping[str, Any] | str]) -> None:
        for event in events:
            await self.send(event)

    async def close(self, code: int = 1000, message: bytes = b"") -> None:
        """Close politely with ``code``."""
        async with asyncio.timeout(DEADLINE):
            await self.ws.close(code=code, message=message)

    def abort(self) -> None:
        """Die abruptly: reset the TCP connection, no close frame."""
        transport = self._request.transport
        if transport is not None:
            transport.abort()

    async def wait_closed(self, timeout: float = DEADLINE) -> None:
        async with asyncio.timeout(timeout):
            await self.closed.wait()


class ScriptedEngine:
    """An aiohttp server on ``127.0.0.1:0`` that records and obeys the test.

    Args:
        echo: send every received text frame straight back, unchanged.
        answer_close: answer ``session.close`` like the real engine does:
            ``session.closed`` {reason client_close}, then close 1000.
    """

    def __init__(self, *, echo: bool = False, answer_close: bool = True) -> None:
        self.echo = echo
        self.answer_close = answer_close
        self.connections: list[EngineConnection] = []
        self.http_requests: list[dict[str, Any]] = []
        self._new: asyncio.Queue[EngineConnection] = asyncio.Queue()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> ScriptedEngine:
        app = web.Application()
        app.router.add_get("/v1/realtime", self._websocket)
        app.router.add_get("/v1/duplex", self._websocket)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._echo_http)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            for conn in self.connections:
                if not conn.closed.is_set():
                    conn.abort()
            async with asyncio.timeout(DEADLINE):
                await self._runner.cleanup()
            self._runner = None

    async def next_connection(self, timeout: float = DEADLINE) -> EngineConnection:
        """The next upstream WebSocket the proxy opens."""
        async with asyncio.timeout(timeout):
            return await self._new.get()

    # -- handlers ---------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(MODELS_BODY, headers={"X-Scripted-Engine": "1"})

    async def _echo_http(self, request: web.Request) -> web.Response:
        body = await request.read()
        record = {
            "method": request.method,
            "path_qs": request.path_qs,
            "body": body.decode("utf-8", "replace"),
            "headers": dict(request.headers),
        }
        self.http_requests.append(record)
        return web.json_response(record, status=200, headers={"X-Scripted-Engine": "1"})

    async def _websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0, autoping=True)
        await ws.prepare(request)
        conn = EngineConnection(request, ws)
        self.connections.append(conn)
        self._new.put_nowait(conn)
        try:
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.TEXT:
                    conn._record(msg.data)
                    if self.echo:
                        await ws.send_str(msg.data)
                    if self.answer_close and _is_session_close(msg.data):
                        await ws.send_str(
                            orjson.dumps(
                                {"type": "session.closed", "reason": "client_close"}
                            ).decode()
                        )
                        await ws.close(code=1000, message=b"client_close")
                        break
                elif msg.type is aiohttp.WSMsgType.BINARY:
                    conn.binary_frames += 1
                else:  # ERROR
                    break
        except (ConnectionError, aiohttp.ClientError):
            pass
        finally:
            conn._ended()
        return ws


def _is_session_close(text: str) -> bool:
    try:
        event = orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return isinstance(event, dict) and event.get("type") in _SESSION_CLOSE_TYPES
