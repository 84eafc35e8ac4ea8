"""Per-session limits (issue "hardening", docs/design.md, Admission and lifecycle; Settings), seen
from both peers.

Each limit is set small and hit on purpose; the test asserts what the client
sees (``error``, ``session.closed`` {reason}, the close code or HTTP status),
what reached the engine, and that the session or the other sessions go on
where the limit says they should. Times to close are measured and printed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import DEADLINE, MS, wait_until
from tests.fakes.scripted_engine import ScriptedEngine
from tests.fakes.stall_engine import StallEngine
from tests.integration.helpers import connect, pcm16_b64

pytestmark = pytest.mark.timeout(60)

KIB = 1024
#: One second of PCM16 mono at 16 kHz (32000 bytes), base64.
ONE_SECOND = pcm16_b64(1000)


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = await ScriptedEngine().start()
    yield scripted
    await scripted.aclose()


def append(audio: str = ONE_SECOND, event_id: str | None = None) -> str:
    body: dict[str, Any] = {"type": "input_audio_buffer.append", "audio": audio}
    if event_id is not None:
        body["event_id"] = event_id
    return orjson.dumps(body).decode()


async def handshake_status(url: str) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(url)
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status, dict(exc.headers or {})
        await ws.close()
        return 101, {}


# -- frame size ----------------------------------------------------------------------------------


async def test_oversized_client_frame_closes_1009_and_spares_the_others(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url, max_client_message_bytes=64 * KIB)
    async with connect(proxy.url) as other, connect(proxy.url) as client:
        conn_other = await engine.next_connection()
        conn = await engine.next_connection()
        await client.send(append(pcm16_b64(1400)))  # 44.8 KB + framing: fits
        assert (await conn.receive_event())["type"] == "input_audio_buffer.append"
        await client.send(append(pcm16_b64(1600)))  # 51 KB audio -> 68 KB base64
        assert await client.recv_until_closed() == []
        assert client.close_code == 1009
        await conn.wait_closed()
        assert conn.received_types() == ["input_audio_buffer.append", "session.close"]
        # The other session is untouched, both ways.
        await other.send({"type": "x.after"})
        assert (await conn_other.receive_event())["type"] == "x.after"
        await conn_other.send({"type": "x.back"})
        assert (await other.recv())["type"] == "x.back"


# -- input audio rate ------------------------------------------------------------------------------


async def test_input_audio_rate_limit_drops_the_excess_and_keeps_the_session(
    engine, sidecar
) -> None:
    """1.0x real time with a 10 s burst: the 11th second of audio sent at once is refused."""
    proxy = await sidecar(upstream=engine.ws_url, max_input_audio_rate=1.0)
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        started = time.monotonic()
        for n in range(14):
            await client.send(append(event_id=f"evt_{n}"))
        error = await client.recv_until("error")
        burst_seconds = time.monotonic() - started
        assert error["error"]["type"] == "rate_limit_error"
        assert error["error"]["code"] == "input_backpressure"
        assert "1x real time" in error["error"]["message"]
        # The session goes on: a later event is forwarded, in order after the accepted appends.
        await client.send({"type": "x.after"})
        received = []
        while not received or received[-1] != "x.after":
            received.append((await conn.receive_event())["type"])
        appends = received.count("input_audio_buffer.append")
        assert received == ["input_audio_buffer.append"] * appends + ["x.after"]
        # 10 s of burst, plus at most what refilled while the frames were in flight.
        assert 10 <= appends <= 10 + int(burst_seconds) + 1, (appends, burst_seconds)
        refused = 14 - appends
        # Each refused append got its own error; nothing else arrived.
        errors = [error]
        while len(errors) < refused:
            errors.append(await client.recv())
        assert all(e["type"] == "error" for e in errors)
        assert all(e["error"]["code"] == "input_backpressure" for e in errors)
        assert (
            proxy.metric("omni_sidecar_dropped_events_total", {"reason": "input_backpressure"})
            == refused
        )
        print(
            f"\nrate limit: {appends} s of audio accepted in a {burst_seconds * 1000:.0f} ms "
            f"burst, {refused} refused"
        )


async def test_refused_append_error_names_the_append(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url, max_input_audio_rate=1.0)
    async with connect(proxy.url) as client:
        await engine.next_connection()
        for n in range(11):
            await client.send(
                f'{{"type":"input_audio_buffer.append","event_id":"evt_{n}","audio":"{ONE_SECOND}"}}'
            )
        error = await client.recv_until("error")
        assert error["error"].get("event_id") == "evt_10"


async def test_input_audio_rate_follows_the_session_format(engine, sidecar) -> None:
    """At 24 kHz a second of audio is 48000 bytes: the same frames are only 2/3 s each.

    The format is the engine's (docs/design.md, Usage): its ``session.updated``
    applies it, not the client's ``session.update``.
    """
    proxy = await sidecar(upstream=engine.ws_url, max_input_audio_rate=1.0)
    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        session = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}
        await client.send({"type": "session.update", "session": session})
        await conn.receive_event()
        await conn.send({"type": "session.updated", "session": session})
        await client.recv_until("session.updated")
        for n in range(14):  # 14 x 2/3 s = 9.3 s: within the burst
            await client.send(append(event_id=f"evt_{n}"))
        await client.send({"type": "x.after"})
        types = [(await conn.receive_event())["type"] for _ in range(15)]
        assert types == ["input_audio_buffer.append"] * 14 + ["x.after"]


async def test_input_audio_rate_cannot_be_bypassed_with_duplicate_keys(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url, max_input_audio_rate=1.0)
    sneaky = '{"type":"input_audio_buffer.append","audio":"","audio":"' + ONE_SECOND + '"}'
    assert orjson.loads(sneaky)["audio"] == ONE_SECOND  # what the engine will append
    async with connect(proxy.url) as client:
        await engine.next_connection()
        for _ in range(14):
            await client.send(sneaky)
        await client.send({"type": "x.after"})
        # 14 s of audio in one burst: at least 3 must be refused.
        error = await client.recv_until("error", timeout=1.0)
        assert error["error"]["code"] == "input_backpressure"


# -- input backlog toward a stalled engine --------------------------------------------------------


async def test_stalled_engine_input_backlog_closes_1008(sidecar) -> None:
    stall = await StallEngine(complete_handshake=True).start()
    try:
        proxy = await sidecar(
            upstream=stall.ws_url,
            max_pending_input_bytes=256 * KIB,
            max_input_audio_rate=0.0,
            upstream_close_timeout=0.2,
            close_timeout=1.0,
        )
        frame = append(pcm16_b64(1500))  # 64 KB
        async with connect(proxy.url) as client:
            reader = asyncio.ensure_future(client.recv_until_closed())
            sent = 0
            started = time.monotonic()
            async with asyncio.timeout(DEADLINE):
                while not reader.done():
                    try:
                        await client.send(frame)
                    except (ConnectionError, aiohttp.ClientError, RuntimeError):
                        break
                    sent += 1
                    await asyncio.sleep(0)  # let the reader see the close
                events = await reader
            elapsed = time.monotonic() - started
        assert [e["type"] for e in events] == ["error", "session.closed"], events
        error, closed = events
        assert error["error"] == {
            **error["error"],
            "type": "rate_limit_error",
            "code": "input_backpressure",
        }
        assert closed["reason"] == "input_backpressure"
        assert client.close_code == 1008
        assert stall.handshakes == 1
        print(
            f"\ninput backlog: closed 1008 after {sent} frames ({sent * len(frame) // KIB} KiB) "
            f"in {elapsed * 1000:.0f} ms"
        )
        await wait_until(
            lambda: proxy.metric("omni_sidecar_sessions_total", {"outcome": "overflow"}) == 1,
            what="sessions_total{overflow}",
        )
    finally:
        await stall.aclose()


# -- timers ---------------------------------------------------------------------------------------


async def test_max_session_duration_closes_1000(engine, sidecar) -> None:
    limit = 300 * MS
    proxy = await sidecar(upstream=engine.ws_url, max_session_duration=limit)
    async with connect(proxy.url) as client:
        started = time.monotonic()
        conn = await engine.next_connection()
        await client.send({"type": "x.busy"})  # activity does not extend the limit
        events = await client.recv_until_closed()
        elapsed = time.monotonic() - started
    assert [e["type"] for e in events] == ["session.closed"]
    assert events[0]["reason"] == "max_session_duration"
    assert client.close_code == 1000
    assert limit * 0.9 <= elapsed < limit + DEADLINE / 4
    # The engine was asked to end the session too.
    close = await conn.receive_until("session.close")
    assert close[-1]["reason"] == "max_session_duration"
    print(f"\nmax_session_duration {limit:.2f} s: closed after {elapsed:.3f} s")


async def test_client_idle_timeout_closes_with_session_closed(engine, sidecar, caplog) -> None:
    limit = 300 * MS
    proxy = await sidecar(upstream=engine.ws_url, client_idle_timeout=limit)
    async with connect(proxy.url) as client:
        started = time.monotonic()
        await engine.next_connection()
        events = await client.recv_until_closed()
        elapsed = time.monotonic() - started
    print(
        f"\nclient_idle_timeout {limit:.2f} s: closed after {elapsed:.3f} s, "
        f"events {[e.get('type') for e in events]}, code {client.close_code}"
    )
    assert limit * 0.9 <= elapsed < limit + DEADLINE / 4
    assert [e["type"] for e in events] == ["session.closed"]
    assert events[0]["reason"] == "client_idle_timeout"
    assert client.close_code == 1000
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_active") == 0, what="no session active"
    )
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


async def test_client_idle_timeout_ends_an_idle_session(engine, sidecar) -> None:
    """What holds today: the idle session does end, and the engine is told."""
    limit = 300 * MS
    proxy = await sidecar(upstream=engine.ws_url, client_idle_timeout=limit)
    async with connect(proxy.url) as client:
        started = time.monotonic()
        conn = await engine.next_connection()
        await client.recv_until_closed()
        elapsed = time.monotonic() - started
    assert limit * 0.9 <= elapsed < limit + DEADLINE / 4
    assert (await conn.receive_until("session.close"))[-1]["type"] == "session.close"
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_active") == 0, what="no session active"
    )


# -- admission -------------------------------------------------------------------------------------


async def test_upstream_connect_timeout_is_502_within_the_timeout(sidecar) -> None:
    """The engine's port accepts TCP but never answers the WebSocket upgrade."""
    stall = await StallEngine(complete_handshake=False).start()
    try:
        limit = 300 * MS
        proxy = await sidecar(upstream=stall.ws_url, upstream_connect_timeout=limit)
        started = time.monotonic()
        status, _ = await handshake_status(proxy.url)
        elapsed = time.monotonic() - started
        assert status == 502
        assert stall.accepted == 1
        assert limit * 0.9 <= elapsed < limit + DEADLINE / 4
        assert proxy.metric("omni_sidecar_upstream_connect_failures_total") == 1
        assert (
            proxy.metric("omni_sidecar_sessions_rejected_total", {"reason": "upstream_unavailable"})
            == 1
        )
        assert proxy.metric("omni_sidecar_sessions_active") == 0
        print(f"\nupstream_connect_timeout {limit:.2f} s: 502 after {elapsed:.3f} s")
    finally:
        await stall.aclose()


async def test_max_sessions_per_ip(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url, max_sessions_per_ip=1)
    async with connect(proxy.url) as first:
        await engine.next_connection()
        status, headers = await handshake_status(proxy.url)
        assert status == 429 and "Retry-After" in headers
        assert len(engine.connections) == 1
        await first.send({"type": "x.still_here"})
        assert (await engine.connections[0].receive_event())["type"] == "x.still_here"
    assert proxy.metric("omni_sidecar_sessions_rejected_total", {"reason": "capacity"}) == 1
    # The slot comes back once the first session is over.
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_active") == 0, what="no session active"
    )
    assert (await handshake_status(proxy.url))[0] == 101
