"""Readiness of an ``external`` engine, through a real ``omni-sidecar serve`` child.

The sidecar probes the upstream itself (``GET /health`` on its host:port, a
WebSocket handshake when that answers 400, 404, 405, 426 or not HTTP): nothing
listening means ``/readyz`` 503, ``omni_sidecar_engine_up 0`` and 503 for
clients (never "ready" with every client getting 502); an engine appearing on
the port makes it ready; the engine going away again makes it not ready within
``health_failures × health_interval + probe timeout`` (3 × 2 s + 2 s by default).

WebSocket-only servers as a new user finds them (the ``websockets`` library:
426 to a plain GET; picows: 400; a 405 route; a port that answers a GET with
something other than HTTP) read ready within two probes; a 5xx ``/health``
stays not ready without a handshake. ``engine.probe`` picks ``health``,
``websocket`` or ``tcp`` outright, and ``/readyz`` names the probe that said
ready. The handshake asks for ``autostart=0`` and closes 1000 before any
client event: the simulator, given ``model=`` (which opens a session on
connect otherwise), counts no opened session across many probes, and the
servers log no error for them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import picows
import pytest
from aiohttp import web
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as websockets_serve
from websockets.http11 import Request

from engine_launcher.process import UpstreamProbe
from tests.children import ChildNotReady, SidecarChild, SimulatorChild
from tests.conftest import DEADLINE, free_port, wait_until

if TYPE_CHECKING:
    from tests.integration.vllm_omni_wheel import VllmOmni

pytestmark = pytest.mark.timeout(90)
pytest_plugins = ["tests.integration.vllm_omni_wheel"]

#: Defaults of engine.health_failures, engine.health_interval and the probe timeout.
DETECTION_BOUND = 3 * 2.0 + 2.0


class Serve(SidecarChild):
    """``serve --log-level info *args``; its log is printed when it stops."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        super().__init__(
            "--log-level", "info", *args,
            log_path=tmp_path / "serve.log", ready_timeout=DEADLINE, stop_grace=DEADLINE,
        )  # fmt: skip
        self.admin = self.admin_port

    async def readyz(self) -> tuple[int, dict[str, object]] | None:
        try:
            url = f"http://127.0.0.1:{self.port}/readyz"
            timeout = aiohttp.ClientTimeout(total=1)
            async with aiohttp.ClientSession() as http, http.get(url, timeout=timeout) as resp:
                return resp.status, await resp.json()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def engine_up(self) -> float | None:
        try:
            url = f"http://127.0.0.1:{self.admin}/metrics"
            async with aiohttp.ClientSession() as http, http.get(url) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, OSError):
            return None
        for line in text.splitlines():
            if line.startswith("omni_sidecar_engine_up "):
                return float(line.split()[1])
        return None

    async def handshake_status(self) -> int:
        async with aiohttp.ClientSession() as http:
            try:
                ws = await http.ws_connect(f"ws://127.0.0.1:{self.port}/v1/realtime")
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status
            await ws.close()
            return 101

    async def engine_detail(self) -> str:
        """``/readyz`` ``engines[0].detail``: the last word of the engine's supervisor."""
        answer = await self.readyz()
        assert answer is not None
        engines = answer[1]["engines"]
        assert isinstance(engines, list)
        return str(engines[0].get("detail", ""))

    async def ready_after(self, what: str) -> float:
        """Seconds from now until ``/readyz`` answers 200 (``what``: for the failure)."""
        started = time.monotonic()
        try:
            await self.ready()
        except ChildNotReady as exc:
            raise ChildNotReady(f"{what}: {exc}") from None
        return time.monotonic() - started


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, *args: str) -> AsyncIterator[Serve]:
    """Started, not waited for (the tests watch readiness themselves); stopped on exit."""
    srv = Serve(tmp_path, *args)
    srv.start()
    try:
        yield srv
    finally:
        await srv.astop()
        print(srv.log_tail())


@contextlib.contextmanager
def simulator_on(port: int, log: Path | None = None) -> Iterator[SimulatorChild]:
    """A simulator on ``port``, started, not waited for (the sidecar finds it); stopped on exit."""
    sim = SimulatorChild(port=port, log_path=log, cwd=None)
    sim.start()
    try:
        yield sim
    finally:
        sim.stop()
        if log is not None:
            print(f"simulator log:\n{sim.log_tail(2000)}")


async def test_unreachable_upstream_is_not_ready_until_an_engine_answers(tmp_path: Path) -> None:
    engine_port = free_port()
    started = time.monotonic()
    async with serve(tmp_path, "--upstream", f"ws://127.0.0.1:{engine_port}/v1/realtime") as srv:

        async def answered_503() -> bool:
            answer = await srv.readyz()
            return answer is not None and answer[0] == 503

        async def probed_and_503() -> bool:
            # /readyz is 503 "engine is starting" from the first moment; the detail
            # names the upstream only once the first probe has failed, which on a
            # busy machine can come after the first 503 a poll sees.
            answer = await srv.readyz()
            return (
                answer is not None
                and answer[0] == 503
                and f"127.0.0.1:{engine_port}" in str(answer[1].get("detail"))
            )

        await wait_until(probed_and_503, timeout=DEADLINE, what="/readyz 503 naming the upstream")
        print(f"\nunreachable upstream -> /readyz 503 after {time.monotonic() - started:.2f} s")
        answer = await srv.readyz()
        assert answer is not None
        status, body = answer
        assert (status, body["reason"]) == (503, "not_ready")
        assert f"127.0.0.1:{engine_port}" in str(body["detail"])
        assert await srv.engine_up() == 0.0
        assert await srv.handshake_status() == 503  # not 502

        with simulator_on(engine_port, tmp_path / "simulator.log") as sim:
            appeared = time.monotonic()

            async def ready() -> bool:
                answer = await srv.readyz()
                return answer is not None and answer[0] == 200

            await wait_until(ready, timeout=DEADLINE, what="/readyz 200")
            print(f"engine appeared -> /readyz 200 after {time.monotonic() - appeared:.2f} s")
            assert await srv.engine_up() == 1.0
            assert await srv.handshake_status() == 101

            sim.kill()
            gone_at = time.monotonic()
            await wait_until(answered_503, timeout=DETECTION_BOUND + 1.0, what="/readyz 503 again")
            took = time.monotonic() - gone_at
            print(f"engine gone -> /readyz 503 after {took:.2f} s (bound {DETECTION_BOUND} s)")
            assert took >= 2 * 2.0 * 0.9  # not at the first failed probe: 3 are needed
            assert await srv.engine_up() == 0.0
            assert await srv.handshake_status() == 503
        assert srv.proc.poll() is None


async def test_upstream_without_a_health_route_is_probed_with_a_handshake(
    tmp_path: Path,
) -> None:
    """``/health`` 404: a WebSocket handshake on the upstream URL decides."""
    handshakes = 0

    async def realtime(request: web.Request) -> web.WebSocketResponse:
        nonlocal handshakes
        handshakes += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/v1/realtime", realtime)
    runner = web.AppRunner(app)
    await runner.setup()
    engine_port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", engine_port)
    await site.start()
    try:
        async with serve(
            tmp_path, "--upstream", f"ws://127.0.0.1:{engine_port}/v1/realtime"
        ) as srv:

            async def ready() -> bool:
                answer = await srv.readyz()
                return answer is not None and answer[0] == 200

            await wait_until(ready, timeout=DEADLINE, what="/readyz 200 via a handshake")
            assert handshakes >= 1
            assert await srv.engine_up() == 1.0
    finally:
        await runner.cleanup()


# -- WebSocket-only engines ---------------------------------------------------------------------

#: Probe period of the tests below (engine.health_interval): short, so that several
#: probes happen within a second or two; the first probe runs at start either way.
INTERVAL = "0.25"


@dataclass
class Seen:
    """What a stand-in engine saw, in order."""

    port: int = 0
    #: Request targets (path and query) of every HTTP request, handshakes included.
    requests: list[str] = field(default_factory=list)
    #: Targets of the handshakes that completed (101).
    handshakes: list[str] = field(default_factory=list)
    #: Close codes the engine received, one per closed WebSocket.
    close_codes: list[int] = field(default_factory=list)
    #: ERROR records the server library logged (tracebacks of failed handshakes…).
    errors: list[str] = field(default_factory=list)

    @property
    def health_gets(self) -> int:
        return sum(1 for target in self.requests if urlsplit(target).path == "/health")


class _Errors(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


def _own_logger(seen: Seen, name: str) -> logging.Logger:
    logger = logging.getLogger(f"tests.readiness.{name}.{id(seen)}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(_Errors(seen.errors))
    return logger


@contextlib.asynccontextmanager
async def _listening(server: asyncio.Server) -> AsyncIterator[int]:
    """The port ``server`` listens on; the server closed on the way out."""
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[int]:
    """``app`` served on a free loopback port (yielded); cleaned up on the way out."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def websockets_engine() -> AsyncIterator[Seen]:
    """The ``websockets`` library's server: a plain GET gets 426 (and an ERROR traceback)."""
    seen = Seen()

    def record(connection: ServerConnection, request: Request) -> None:
        seen.requests.append(request.path)

    async def session(ws: ServerConnection) -> None:
        seen.handshakes.append(ws.request.path if ws.request else "")
        async for _message in ws:
            pass
        seen.close_codes.append(ws.protocol.close_rcvd.code if ws.protocol.close_rcvd else 1006)

    logger = _own_logger(seen, "websockets")
    async with websockets_serve(
        session, "127.0.0.1", 0, process_request=record, logger=logger
    ) as server:
        seen.port = next(iter(server.sockets)).getsockname()[1]
        yield seen


class _PicowsSession(picows.WSListener):  # type: ignore[misc]
    def __init__(self, seen: Seen, target: str) -> None:
        self.seen, self.target = seen, target

    def on_ws_connected(self, transport: picows.WSTransport) -> None:
        self.seen.handshakes.append(self.target)

    def on_ws_frame(self, transport: picows.WSTransport, frame: picows.WSFrame) -> None:
        if frame.msg_type == picows.WSMsgType.CLOSE:
            self.seen.close_codes.append(int(frame.get_close_code()))
            transport.send_close(frame.get_close_code())
            transport.disconnect()


@contextlib.asynccontextmanager
async def picows_engine() -> AsyncIterator[Seen]:
    """A picows server: a plain GET gets 400."""
    seen = Seen()

    def listener(request: picows.WSUpgradeRequest) -> _PicowsSession:
        target = bytes(request.path).decode()
        seen.requests.append(target)
        return _PicowsSession(seen, target)

    server = await picows.ws_create_server(
        listener, "127.0.0.1", 0, logger_name=_own_logger(seen, "picows")
    )
    async with _listening(server) as port:
        seen.port = port
        yield seen


@contextlib.asynccontextmanager
async def aiohttp_engine(health: int) -> AsyncIterator[Seen]:
    """An aiohttp server: ``GET /health`` answers ``health`` (405: a POST-only route)."""
    seen = Seen()

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.requests.append(request.path_qs)
        return await handler(request)  # type: ignore[no-any-return]

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=health)

    async def realtime(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        seen.handshakes.append(request.path_qs)
        async for _message in ws:
            pass
        seen.close_codes.append(ws.close_code or 1006)
        return ws

    app = web.Application(middlewares=[record])
    if health == 405:
        app.router.add_post("/health", answer)
    else:
        app.router.add_get("/health", answer)
    app.router.add_get("/v1/realtime", realtime)
    async with _serving(app) as port:
        seen.port = port
        yield seen


_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


@contextlib.asynccontextmanager
async def non_http_engine() -> AsyncIterator[Seen]:
    """Answers a plain GET with a greeting that is not HTTP; completes WebSocket handshakes."""
    seen = Seen()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            target = head.split(" ", 2)[1]
            seen.requests.append(target)
            headers = {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(":") for line in head.split("\r\n")[1:])
            }
            if headers.get("upgrade", "").lower() != "websocket":
                writer.write(b"SSH-2.0-stand-in\r\n")
                return
            key = headers["sec-websocket-key"].encode()
            accept = base64.b64encode(hashlib.sha1(key + _WS_GUID).digest()).decode()
            writer.write(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n".encode()
            )
            seen.handshakes.append(target)
            first, size = await reader.readexactly(2)
            mask = await reader.readexactly(4)
            payload = bytes(
                b ^ mask[i % 4] for i, b in enumerate(await reader.readexactly(size & 0x7F))
            )
            if first & 0x0F == 0x8:  # close
                seen.close_codes.append(int.from_bytes(payload[:2], "big"))
                writer.write(b"\x88\x02" + payload[:2])
        except (asyncio.IncompleteReadError, ConnectionError, IndexError, KeyError):
            seen.close_codes.append(1006)
        finally:
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()

    async with _listening(await asyncio.start_server(connection, "127.0.0.1", 0)) as port:
        seen.port = port
        yield seen


StandIn = Callable[[], contextlib.AbstractAsyncContextManager[Seen]]
STAND_INS: dict[str, tuple[StandIn, str]] = {
    "websockets": (websockets_engine, "GET /health -> 426"),
    "picows": (picows_engine, "GET /health -> 400"),
    "405": (lambda: aiohttp_engine(405), "GET /health -> 405"),
    "not-http": (non_http_engine, "GET /health: not HTTP"),
}


@pytest.mark.parametrize("name", list(STAND_INS))
async def test_websocket_only_engine_reads_ready_within_two_probes(
    tmp_path: Path, name: str
) -> None:
    """auto: /health says "no such route" → a handshake decides; it asks for no session."""
    stand_in, answer = STAND_INS[name]
    # 1 s between probes: /readyz, polled here, must show ready before a third probe
    # even on a loaded machine; the first probe runs at once.
    async with stand_in() as seen, serve(
        tmp_path, "--upstream", f"ws://127.0.0.1:{seen.port}/v1/realtime?model=m",
        "--engine-health-interval", "1",
    ) as srv:  # fmt: skip
        took = await srv.ready_after(f"/readyz 200 in front of {name}")
        print(f"\n{name}: ready {took:.2f} s after serve started, requests {seen.requests}")
        assert seen.health_gets == 1
        assert 1 <= len(seen.handshakes) <= 2, seen.requests  # within two probes
        detail = await srv.engine_detail()
        assert "probe websocket" in detail and answer in detail, detail
        assert await srv.engine_up() == 1.0

        # Several probes later: still one GET /health, every handshake asked for no
        # session and was closed 1000, and the server logged at most the refused GET.
        await wait_until(lambda: len(seen.close_codes) >= 3, timeout=DEADLINE, what="3 probes")
        assert seen.health_gets == 1
        for target in seen.handshakes:
            assert parse_qs(urlsplit(target).query) == {"model": ["m"], "autostart": ["0"]}
        assert set(seen.close_codes) == {1000}
        assert len(seen.errors) <= 1, seen.errors
        answered = await srv.readyz()
        assert answered is not None and answered[0] == 200


async def test_a_failing_health_route_is_not_ready_and_not_handed_over(tmp_path: Path) -> None:
    """auto: a 5xx /health means an unwell engine, not a missing route: no handshake."""
    async with aiohttp_engine(503) as seen, serve(
        tmp_path, "--upstream", f"ws://127.0.0.1:{seen.port}/v1/realtime",
        "--engine-health-interval", INTERVAL,
    ) as srv:  # fmt: skip
        await wait_until(lambda: seen.health_gets >= 3, timeout=DEADLINE, what="3 probes")
        answer = await srv.readyz()
        assert answer is not None and answer[0] == 503
        assert "GET /health -> 503" in str(answer[1]["detail"])
        assert seen.handshakes == []
        assert await srv.handshake_status() == 503


async def test_probe_health_does_not_hand_over(tmp_path: Path) -> None:
    """engine.probe = health: 426 is an answer like any other, so never ready."""
    async with websockets_engine() as seen, serve(
        tmp_path, "--upstream", f"ws://127.0.0.1:{seen.port}/v1/realtime",
        "--engine-probe", "health", "--engine-health-interval", INTERVAL,
    ) as srv:  # fmt: skip
        await wait_until(lambda: seen.health_gets >= 3, timeout=DEADLINE, what="3 probes")
        answer = await srv.readyz()
        assert answer is not None and answer[0] == 503
        assert "GET /health -> 426" in str(answer[1]["detail"])
        assert seen.handshakes == []


async def test_probe_tcp_needs_only_a_listening_port(tmp_path: Path) -> None:
    """engine.probe = tcp: a port that accepts and says nothing is ready; nothing is sent."""
    received: list[bytes] = []

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read(1024))
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    async with _listening(server) as port, serve(
        tmp_path, "--upstream", f"ws://127.0.0.1:{port}/v1/realtime",
        "--engine-probe", "tcp", "--engine-health-interval", INTERVAL,
    ) as srv:  # fmt: skip
        await srv.ready_after("/readyz 200 on a TCP probe")
        detail = await srv.engine_detail()
        assert f"probe tcp: connect 127.0.0.1:{port} ok" in detail, detail
        await wait_until(lambda: len(received) >= 2, timeout=DEADLINE, what="2 probes")
        assert set(received) == {b""}


async def test_probe_websocket_opens_no_session_on_the_simulator(tmp_path: Path) -> None:
    """engine.probe = websocket on an engine that opens a session on connect given model=.

    The simulator counts opened sessions (``vllm_omni_sim_sessions_opened_total``)
    apart from accepted sockets (``vllm_omni_sim_sessions_total``): many probe
    sockets, no session. One plain connect with the same query opens one, so
    the count is not blind.
    """
    engine_port = free_port()
    sim_log = tmp_path / "simulator.log"
    upstream = f"ws://127.0.0.1:{engine_port}/v1/realtime?model=sim"

    async def sim_metrics() -> dict[str, float]:
        url = f"http://127.0.0.1:{engine_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            text = await resp.text()
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    with simulator_on(engine_port, sim_log):
        async with serve(
            tmp_path, "--upstream", upstream, "--engine-probe", "websocket",
            "--engine-health-interval", INTERVAL,
        ) as srv:  # fmt: skip
            await srv.ready_after("/readyz 200 on a WebSocket probe")
            assert "probe websocket: handshake ok" in await srv.engine_detail()

            async def probed(times: int) -> Callable[[], Awaitable[bool]]:
                async def done() -> bool:
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        return (await sim_metrics())["vllm_omni_sim_sessions_total"] >= times
                    return False

                return done

            await wait_until(await probed(5), timeout=DEADLINE, what="5 probe sockets")
            values = await sim_metrics()
            print(f"\nsimulator after probes: {values['vllm_omni_sim_sessions_total']:.0f} "
                  f"sockets, {values['vllm_omni_sim_sessions_opened_total']:.0f} sessions")  # fmt: skip
            assert values["vllm_omni_sim_sessions_opened_total"] == 0

        # The same query without autostart=0 opens a session on connect.
        async with aiohttp.ClientSession() as http, http.ws_connect(upstream) as ws:
            first = await ws.receive_json(timeout=DEADLINE)
            assert first["type"] == "session.created"
        assert (await sim_metrics())["vllm_omni_sim_sessions_opened_total"] == 1
    log = sim_log.read_text(errors="replace")
    assert "Traceback" not in log and "ERROR" not in log, log[-2000:]


async def test_each_pool_upstream_is_probed_on_its_own(tmp_path: Path) -> None:
    """engine.upstreams: every replica hands over (or not) by its own endpoint's answer."""
    async with websockets_engine() as first, picows_engine() as second, serve(
        tmp_path, "--engine-kind", "external", "--engine-upstreams",
        f"ws://127.0.0.1:{first.port}/v1/realtime,ws://127.0.0.1:{second.port}",
        "--engine-health-interval", INTERVAL,
    ) as srv:  # fmt: skip

        async def both_admit() -> bool:
            answer = await srv.readyz()
            if answer is None:
                return False
            engines = answer[1].get("engines")
            return isinstance(engines, list) and all(e["admitting"] for e in engines)

        await wait_until(both_admit, timeout=DEADLINE, what="both replicas ready")
        answer = await srv.readyz()
        assert answer is not None
        details = [str(e["detail"]) for e in answer[1]["engines"]]  # type: ignore[union-attr]
        assert "probe websocket: GET /health -> 426" in details[0], details
        assert "probe websocket: GET /health -> 400" in details[1], details
        assert urlsplit(second.handshakes[0]).path == "/v1/realtime"  # no path: the default


@pytest.mark.parametrize(("kind", "said"), [("websocket", "handshake ok"), ("tcp", "connect")])
async def test_a_child_engine_is_probed_as_engine_probe_says(
    tmp_path: Path, kind: str, said: str
) -> None:
    """A child (here the simulator) takes the same setting: its port, its /v1/realtime."""
    async with serve(tmp_path, "--engine-kind", "simulator", "--engine-probe", kind) as srv:
        await srv.ready_after(f"/readyz 200 with a {kind} probe of the child")
        detail = await srv.engine_detail()
        assert f"(probe {kind}: {said}" in detail, detail
        assert await srv.handshake_status() == 101


@dataclass
class DuplexSlots:
    """vLLM-Omni's duplex capacity (``duplex_session.max_sessions``, default 1)."""

    limit: int = 1
    open: int = 0
    opened: int = 0
    refused: int = 0


@contextlib.asynccontextmanager
async def vllm_omni_like_engine(envelope: Any, slots: DuplexSlots) -> AsyncIterator[Seen]:
    """``/v1/realtime`` taking a connection the way vLLM-Omni's duplex serving layer does.

    Accept, then let the wheel's own ``RealtimeEnvelope`` read the query: a
    session opens on connect when it says so (``model=`` without
    ``autostart=0``), else with the first client event; each open session
    holds one of ``slots.limit`` slots, and one over the limit is refused with
    ``duplex_session_capacity_exhausted``. No ``/health`` route (404).
    """
    seen = Seen()

    async def realtime(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        seen.handshakes.append(request.path_qs)
        wire = envelope.RealtimeEnvelope.from_query_params(request.query)
        holds = False
        try:
            wants = wire.initial_open_payload() is not None
            if not wants:
                message = await ws.receive()
                if message.type is aiohttp.WSMsgType.TEXT:
                    wire.first_message(json.loads(message.data))
                    wants = True
            if wants and slots.open >= slots.limit:
                slots.refused += 1
                await ws.send_json(
                    {"type": "error", "error": {"code": "resource_exhausted", "message":
                     f"duplex_session_capacity_exhausted: limit={slots.limit}"}}
                )  # fmt: skip
            elif wants:
                holds = True
                slots.open += 1
                slots.opened += 1
                await ws.send_json({"type": "session.created", "session": {"id": "s"}})
                async for _message in ws:
                    pass
        finally:
            slots.open -= holds
            await ws.close()
            seen.close_codes.append(ws.close_code or 1006)
        return ws

    app = web.Application()
    app.router.add_get("/v1/realtime", realtime)
    async with _serving(app) as port:
        seen.port = port
        yield seen


async def test_probes_leave_the_only_duplex_slot_free_on_a_vllm_omni_like_engine(
    tmp_path: Path, vllm_omni: VllmOmni
) -> None:
    """Many handshake probes (``model=`` in the upstream URL), then a client gets the slot."""
    from tests.integration.vllm_omni_wheel import WheelUnavailable, load_realtime_envelope

    try:
        envelope = load_realtime_envelope(vllm_omni)
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
    slots = DuplexSlots(limit=1)
    async with vllm_omni_like_engine(envelope, slots) as seen, serve(
        tmp_path, "--upstream", f"ws://127.0.0.1:{seen.port}/v1/realtime?model=m",
        "--engine-health-interval", INTERVAL,
    ) as srv:  # fmt: skip
        await srv.ready_after("/readyz 200 via a handshake")
        assert "probe websocket: GET /health -> 404" in await srv.engine_detail()
        await wait_until(lambda: len(seen.close_codes) >= 4, timeout=DEADLINE, what="4 probes")
        assert (slots.opened, slots.refused) == (0, 0)
        assert set(seen.close_codes) == {1000}

        # The slot is free: a client's session (model= and no autostart=0) opens on connect.
        url = f"ws://127.0.0.1:{srv.port}/v1/realtime?model=m"
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            first = await ws.receive_json(timeout=DEADLINE)
            assert first["type"] == "session.created", first
        assert (slots.opened, slots.refused) == (1, 0)


# -- the probe itself, in process ------------------------------------------------------------


async def test_refused_and_silent_endpoints_are_unhealthy_without_a_handshake() -> None:
    refused = f"ws://127.0.0.1:{free_port()}/v1/realtime"
    stages = {"auto": "tcp", "health": "tcp", "websocket": "websocket", "tcp": "tcp"}
    for kind, stage in stages.items():
        probe = UpstreamProbe(refused, kind=kind, timeout=1)  # type: ignore[arg-type]
        try:
            result = await probe()
        finally:
            await probe.aclose()
        assert (result.ok, result.stage) == (False, stage), (kind, result)
        assert probe.no_health_route is None  # a refusal never hands over

    connections: list[bytes] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(b"")
        await reader.read()  # never answers; the probe gives up
        writer.close()

    async with _listening(await asyncio.start_server(silent, "127.0.0.1", 0)) as port:
        probe = UpstreamProbe(f"ws://127.0.0.1:{port}/v1/realtime", timeout=0.3)
        try:
            result = await probe()
        finally:
            await probe.aclose()
    assert (result.ok, result.stage) == (False, "health")
    assert "no answer within 0.3 s" in result.detail
    assert len(connections) == 1  # no handshake after the timeout
