"""The relay's protocol contract, seen from both peers (issue "foundation").

A scripted engine (``tests/fakes/scripted_engine.py``) records exactly what the
proxy forwards and sends exactly the frames, close codes and deaths a test
asks for; clients are real aiohttp WebSockets on loopback. Assertions are
about what a peer observes: frames, their order, close codes, HTTP statuses
and the sidecar's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

import aiohttp
import orjson
import pytest

from proxy.settings import EngineConfig
from tests.conftest import DEADLINE, MS, free_port, wait_until
from tests.fakes.scripted_engine import MODELS_BODY, ScriptedEngine
from tests.integration.helpers import RawWebSocket, connect, request_response, wait_metric

EngineFactory = Callable[..., Awaitable[ScriptedEngine]]


@pytest.fixture
async def scripted() -> AsyncIterator[EngineFactory]:
    """Factory: ``await scripted(echo=True)`` starts a scripted engine on loopback."""
    engines: list[ScriptedEngine] = []

    async def start(**kwargs: Any) -> ScriptedEngine:
        engine = await ScriptedEngine(**kwargs).start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.aclose()


def _tick(n: int) -> dict[str, Any]:
    return {"type": "x.tick", "n": n}


# -- pass-through ---------------------------------------------------------------------------


async def test_unknown_event_types_pass_untouched_both_ways(scripted, sidecar) -> None:
    engine = await scripted(echo=True)
    proxy = await sidecar(upstream=engine.ws_url)
    # Odd spacing, key order, non-ASCII and numbers a re-serialiser would change.
    from_client = '{ "type" : "x.vendor.custom",  "n":1.50, "nested":{"é":[1,null,true]} }'
    from_engine = '{"z":0,"type":"x.engine.custom","response_id":"resp_9","list":[ ]}'
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        await client.send(from_client)
        assert await conn.receive_text() == from_client
        msg = await client.ws.receive(timeout=DEADLINE)
        assert msg.data == from_client  # the echo came back byte for byte too
        await conn.send(from_engine)
        msg = await client.ws.receive(timeout=DEADLINE)
        assert msg.type is aiohttp.WSMsgType.TEXT
        assert msg.data == from_engine


# -- invalid client frames ------------------------------------------------------------------

_BAD_FRAMES: list[tuple[str | bytes, str]] = [
    ("{not json", "invalid_json"),
    ('{"no_type": 1}', "bad_event"),
    ('{"type": 5}', "bad_event"),
    ("[1, 2]", "bad_event"),
    ('"just a string"', "bad_event"),
    (b"\x00\x01binary", "binary_unsupported"),
]


async def test_invalid_client_frames_get_an_error_and_are_not_forwarded(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url)
    ticks = 200
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(connect(proxy.url))
        conn_a = await engine.next_connection()
        b = await stack.enter_async_context(connect(proxy.url))
        conn_b = await engine.next_connection()

        async def stream_to_b() -> None:
            for n in range(ticks):
                await conn_b.send(_tick(n))
                if n % 10 == 0:
                    await asyncio.sleep(0)

        async def misbehave_on_a() -> list[dict[str, Any]]:
            errors = []
            for frame, _code in _BAD_FRAMES:
                if isinstance(frame, bytes):
                    await a.ws.send_bytes(frame)
                else:
                    await a.send(frame)
                errors.append(await a.recv())
            return errors

        _, errors = await asyncio.gather(stream_to_b(), misbehave_on_a())

        assert [e["type"] for e in errors] == ["error"] * len(_BAD_FRAMES)
        assert [e["error"]["code"] for e in errors] == [code for _, code in _BAD_FRAMES]
        assert {e["error"]["type"] for e in errors} == {"invalid_request_error"}

        # Nothing was forwarded: the first frame the engine sees is the next valid one.
        await a.send({"type": "x.marker"})
        assert (await conn_a.receive_event())["type"] == "x.marker"
        assert conn_a.received_types() == ["x.marker"]
        assert conn_a.binary_frames == 0
        # ...and the session goes on in both directions.
        await conn_a.send({"type": "x.after"})
        assert (await a.recv())["type"] == "x.after"

        # The other session saw none of it and got every event, in order.
        got = [await b.recv() for _ in range(ticks)]
        assert got == [_tick(n) for n in range(ticks)]
        assert conn_b.received == []

    assert proxy.metric(
        "omni_sidecar_dropped_events_total", {"reason": "invalid_client_frame"}
    ) == len(_BAD_FRAMES)


async def test_client_frame_over_the_limit_closes_1009(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url, max_client_message_bytes=64 * 1024)
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        await client.send({"type": "x.fits", "pad": "a" * (60 * 1024)})
        assert (await conn.receive_event())["type"] == "x.fits"
        await client.send({"type": "x.too_big", "pad": "a" * (64 * 1024)})
        assert await client.recv_until_closed() == []
        assert client.close_code == 1009
    await conn.wait_closed()
    assert "x.too_big" not in conn.received_types()
    assert conn.received_types() == ["x.fits", "session.close"]


# -- lifecycle ---------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_answers", [True, False], ids=["engine-answers", "engine-silent"])
async def test_client_disconnect_sends_session_close_and_closes_upstream(
    scripted, sidecar, engine_answers: bool
) -> None:
    engine = await scripted(answer_close=engine_answers)
    proxy = await sidecar(upstream=engine.ws_url, upstream_close_timeout=0.3)
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        await client.send({"type": "x.hello"})
        assert (await conn.receive_event())["type"] == "x.hello"
    # The client closed (1000) on leaving the block.
    close = await conn.receive_event()
    assert close["type"] == "session.close"
    await conn.wait_closed()
    assert conn.close_code == 1000
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_total", {"outcome": "client_closed"}) == 1,
        what="sessions_total{client_closed}",
    )
    assert proxy.metric("omni_sidecar_sessions_active") == 0


async def test_engine_session_closed_then_1000_reaches_the_client(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url)
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        closed = {"type": "session.closed", "session_id": "s1", "reason": "idle_timeout"}
        await conn.send_all([_tick(0), _tick(1), _tick(2), closed])
        await conn.close(1000)
        events = await client.recv_until_closed()
        assert events == [_tick(0), _tick(1), _tick(2), closed]
        assert client.close_code == 1000
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_total", {"outcome": "upstream_closed"}) == 1,
        what="sessions_total{upstream_closed}",
    )


async def test_engine_close_1000_without_session_closed(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url)
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        await conn.send(_tick(0))
        await conn.close(1000)
        events = await client.recv_until_closed()
    assert [e["type"] for e in events] == ["x.tick", "session.closed"]
    assert events[1]["reason"] == "upstream_closed"
    assert client.close_code == 1000


@pytest.mark.parametrize("death", ["abort", "close-1011"])
async def test_engine_lost_without_session_closed_fails_the_session(
    scripted, sidecar, death: str
) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url)
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        await conn.send_all([_tick(n) for n in range(5)])
        # The proxy has read them all before the engine goes away.
        await wait_metric(
            lambda: proxy.metric(
                "omni_sidecar_events_total",
                {"direction": "upstream_to_client", "kind": "control"},
            ),
            5,
            what="upstream events read",
        )
        if death == "abort":
            conn.abort()
        else:
            await conn.close(1011)
        events = await client.recv_until_closed()
        assert [e["type"] for e in events] == ["x.tick"] * 5 + ["error", "session.closed"]
        assert [e["n"] for e in events[:5]] == list(range(5))
        error = events[5]["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
        assert events[6]["reason"] == "engine_unavailable"
        assert client.close_code == 1011
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_total", {"outcome": "engine_unavailable"}) == 1,
        what="sessions_total{engine_unavailable}",
    )


# -- admission and HTTP ------------------------------------------------------------------------


async def test_upstream_unreachable_is_502_before_the_upgrade(sidecar, simulator) -> None:
    # Health says ready (engine.health_url: a simulator's /health) but the session
    # port refuses: 502. Without a health answer it would be 503 not_ready.
    sim = await simulator()
    proxy = await sidecar(
        engine=EngineConfig(
            kind="external",
            upstream=f"ws://127.0.0.1:{free_port()}/v1/realtime",
            health_url=f"{sim.http_url}/health",
        ),
        upstream_connect_timeout=2.0,
    )
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        async with connect(proxy.url):
            pass
    assert info.value.status == 502
    # The same refusal, read as an HTTP answer: a JSON body naming the reason.
    headers = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    http_url = proxy.url.replace("ws://", "http://")
    async with aiohttp.ClientSession() as http, http.get(http_url, headers=headers) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_unavailable"
    labels = {"reason": "upstream_unavailable"}
    assert proxy.metric("omni_sidecar_sessions_rejected_total", labels) == 2
    assert proxy.metric("omni_sidecar_upstream_connect_failures_total") == 2
    assert proxy.metric("omni_sidecar_sessions_started_total") == 0


async def test_query_string_and_authorization_are_forwarded(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url)
    url = proxy.url + "?model=omni-x&autostart=0&note=a%20b&empty="
    async with connect(
        url, headers={"Authorization": "Bearer sk-test"}, protocols=("realtime",)
    ) as client:
        conn = await engine.next_connection()
        # The proxy accepts the client's subprotocol; the engine is not asked for it.
        assert client.ws.protocol == "realtime"
        assert "Sec-WebSocket-Protocol" not in conn.headers
    assert conn.path == "/v1/realtime"
    assert parse_qsl(conn.query_string, keep_blank_values=True) == [
        ("model", "omni-x"),
        ("autostart", "0"),
        ("note", "a b"),
        ("empty", ""),
    ]
    assert conn.headers["Authorization"] == "Bearer sk-test"


async def test_health_readiness_and_reverse_proxied_paths(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url)
    base = proxy.http_url
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/healthz") as resp:
            assert resp.status == 200
        async with http.get(base + "/readyz") as resp:
            assert resp.status == 200
            assert (await resp.json())["status"] == "ready"
        async with http.get(base + "/v1/models") as resp:
            assert resp.status == 200
            assert resp.headers["X-Scripted-Engine"] == "1"
            assert await resp.json() == MODELS_BODY
        async with http.get(base + "/health") as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "healthy"}
        async with http.post(base + "/v1/anything?a=1&b=two", data=b"hello engine") as resp:
            assert resp.status == 200
            echo = await resp.json()
    assert echo["method"] == "POST"
    assert echo["path_qs"] == "/v1/anything?a=1&b=two"
    assert echo["body"] == "hello engine"


async def test_duplex_route_relays_like_realtime(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url)
    duplex = proxy.url.replace("/v1/realtime", "/v1/duplex")
    async with connect(duplex + "?model=m") as client:
        conn = await engine.next_connection()
        assert conn.path == "/v1/duplex"
        assert conn.query_string == "model=m"
        await client.send({"type": "session.update", "session": {}})
        assert (await conn.receive_event())["type"] == "session.update"
        await client.send("{broken")
        assert (await client.recv())["error"]["code"] == "invalid_json"
        await conn.send({"type": "session.created", "session": {"id": "s1"}})
        assert (await client.recv())["type"] == "session.created"
        await client.send({"type": "session.close"})
        events = await client.recv_until_closed()
        assert [e["type"] for e in events] == ["session.closed"]
        assert client.close_code == 1000


async def test_duplex_route_against_the_simulator_matches_realtime(simulator, sidecar) -> None:
    sim = await simulator(
        "--realtime-factor", "0", "--deterministic", "--chunk-ms", "200",
        "--response-seconds", "0.6",
    )  # fmt: skip
    proxy = await sidecar(upstream=sim.ws_url)

    async def frames(url: str) -> list[str]:
        async with connect(url) as client:
            await request_response(client, open_session=True)
            await client.recv_until("rate_limits.updated")
            await client.send({"type": "session.close"})
            await client.recv_until_closed()
            assert client.close_code == 1000
            return client.frames

    via_realtime = await frames(proxy.url)
    via_duplex = await frames(proxy.url.replace("/v1/realtime", "/v1/duplex"))
    assert orjson.loads(via_realtime[-1])["type"] == "session.closed"
    assert via_duplex == via_realtime


async def test_large_invalid_append_frame_is_not_forwarded(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url)
    audio = "A" * 4096
    # Not JSON: a second string follows the audio value without a key.
    broken = '{"type":"input_audio_buffer.append","audio":"' + audio + '" "oops"}'
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        await client.send(broken)
        await client.send('{"type":"x.marker"}')
        first = await conn.receive_text()
        assert first == '{"type":"x.marker"}', f"forwarded upstream: {first[:60]}..."
        error = await client.recv()
        assert error["error"]["code"] == "invalid_json"


# -- the closing handshake -------------------------------------------------------------------

#: How long "the server has not closed TCP yet" is watched for.
QUIET = 300 * MS


async def test_proxy_waits_for_the_clients_close_reply(scripted, sidecar) -> None:
    engine = await scripted()
    proxy = await sidecar(upstream=engine.ws_url, close_timeout=5.0)
    raw = await RawWebSocket.connect(proxy.url)
    try:
        conn = await engine.next_connection()
        conn.abort()
        events, code = await raw.read_until_close()
        assert [e["type"] for e in events] == ["error", "session.closed"]
        assert code == 1011
        # RFC 6455 §7.1.1: the server closes TCP after the closing handshake.
        assert not await raw.eof_within(QUIET), "TCP closed before the client's Close reply"
        raw.send_close(1011)
        assert await raw.eof_within(DEADLINE)
    finally:
        raw.close()
