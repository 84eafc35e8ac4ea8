"""Slow clients and the output budget (issue "backpressure core", docs/design.md, Output buffer;
Overflow policy).

A stalled client is a real aiohttp WebSocket with a 64 KiB receive buffer
that simply stops calling ``receive``: aiohttp pauses reading once its own
queue is full, the kernel buffers fill, the proxy's transport stays above its high-water mark and the
session's OutputBuffer grows, while the proxy keeps reading the engine at
full speed. The simulator sends 1 s chunks (64 KB frames) 10 ms apart: a response is
far larger than everything the sockets can absorb, yet a client that reads
keeps up with it easily.

The overflow is observed through the sidecar's metrics; only then does the
client read again, so the whole closing sequence is delivered before the
close deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.fakes.scripted_engine import ScriptedEngine
from tests.integration.helpers import (
    AUDIO_DELTA,
    Client,
    SimulatorChild,
    connect,
    module_simulator,
    request_response,
    rid_of,
    wait_metric,
)

Event = dict[str, Any]
KIB = 1024
MIB = 1024 * KIB

#: 30 chunks of 1 s (about 64 KB each as base64), one every 10 ms.
CHUNKS = 30

#: SO_RCVBUF of a stalled client: without it, receive autotuning lets the kernel
#: absorb megabytes and the proxy never has to hold anything.
STALLED = {"receive_buffer_bytes": 64 * KIB}

#: Small budgets so that a stalled client overflows after a few frames.
SMALL_LIMITS: dict[str, Any] = {
    "max_pending_output_bytes": 256 * KIB,
    "client_write_buffer_bytes": 16 * KIB,
    "close_timeout": 10.0,
}


@pytest.fixture(scope="module")
def flood_sim() -> Iterator[SimulatorChild]:
    with module_simulator(
        "--realtime-factor", "0.01", "--chunk-ms", "1000", "--response-seconds", str(CHUNKS),
        "--deterministic",
    ) as sim:  # fmt: skip
        yield sim


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = await ScriptedEngine().start()
    yield scripted
    await scripted.aclose()


def overflows(proxy: Any, policy: str) -> float:
    return float(proxy.metric("omni_sidecar_overflows_total", {"policy": policy}))


def assert_overflow_tail(events: list[Event], rid: str | None) -> None:
    """... error(output_backpressure) → response.done failed → session.closed, nothing after."""
    tail = events[-3:]
    assert [e["type"] for e in tail] == ["error", "response.done", "session.closed"], [
        e["type"] for e in events[-8:]
    ]
    error, done, closed = tail
    assert error["error"]["type"] == "rate_limit_error"
    assert error["error"]["code"] == "output_backpressure"
    assert rid_of(done) == rid
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"] == {"type": "failed", "reason": "output_backpressure"}
    assert closed["reason"] == "output_backpressure"
    # Never a second terminal for one response.
    assert [e for e in events if e["type"] == "response.done" and rid_of(e) == rid] == [done]


async def _start_stalled(client: Client) -> None:
    """Open the session and ask for a response, then read nothing."""
    await request_response(client, open_session=True)


async def test_stalled_client_overflow_closes_the_session_1008(flood_sim, sidecar) -> None:
    proxy = await sidecar(upstream=flood_sim.ws_url, **SMALL_LIMITS)
    async with connect(proxy.url, **STALLED) as client:
        await _start_stalled(client)
        await wait_metric(
            lambda: overflows(proxy, "close_session"), 1, what="overflows{close_session}"
        )
        events = await client.recv_until_closed()
        assert client.close_code == 1008
    created = next(e for e in events if e["type"] == "response.created")
    rid = rid_of(created)
    assert_overflow_tail(events, rid)
    audio = [e for e in events if e["type"] == AUDIO_DELTA]
    assert 0 < len(audio) < CHUNKS
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_total", {"outcome": "overflow"}) == 1,
        what="sessions_total{overflow}",
    )
    assert overflows(proxy, "close_session") == 1
    assert overflows(proxy, "fail_response") == 0
    assert overflows(proxy, "process_total") == 0
    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "overflow"}) > 0


async def test_overflow_cancels_and_closes_upstream(engine, sidecar) -> None:
    """What the engine sees: ``response.cancel`` for the failed response, then
    ``session.close`` {output_backpressure}; nothing it sends later reaches the client."""
    engine.answer_close = False
    # Without acks on the client's behalf the engine sees only the overflow's frames.
    proxy = await sidecar(upstream=engine.ws_url, playback_ack="off", **SMALL_LIMITS)
    frame = {"type": AUDIO_DELTA, "response_id": "r1", "delta": "A" * (64 * KIB)}

    def audio_read() -> float:
        return proxy.metric(
            "omni_sidecar_events_total", {"direction": "upstream_to_client", "kind": "audio"}
        )

    async with connect(proxy.url, **STALLED) as client:
        conn = await engine.next_connection()
        await conn.send({"type": "response.created", "response_id": "r1", "response": {"id": "r1"}})
        sent = 0
        while overflows(proxy, "close_session") == 0:
            assert sent < 200, "no overflow after 12 MiB"
            await conn.send({**frame, "n": sent})
            sent += 1
            await wait_until(lambda n=sent: audio_read() == n, what="the proxy read the frame")
        assert await conn.receive_event() == {"type": "response.cancel", "response_id": "r1"}
        close = await conn.receive_event()
        assert (close["type"], close["reason"]) == ("session.close", "output_backpressure")
        await conn.send({**frame, "n": -1})  # too late: suppressed
        await conn.send({"type": "session.closed", "reason": "output_backpressure"})
        events = await client.recv_until_closed()
        assert client.close_code == 1008
        await conn.wait_closed()
    assert_overflow_tail(events, "r1")
    numbers = [e["n"] for e in events if e["type"] == AUDIO_DELTA]
    assert numbers == list(range(len(numbers)))  # in order, a prefix, never the late one
    assert -1 not in numbers


async def test_fail_response_policy_keeps_the_session(flood_sim, sidecar) -> None:
    proxy = await sidecar(
        upstream=flood_sim.ws_url, overflow_policy="fail_response", **SMALL_LIMITS
    )
    async with connect(proxy.url, **STALLED) as client:
        await _start_stalled(client)
        await wait_metric(
            lambda: overflows(proxy, "fail_response"), 1, what="overflows{fail_response}"
        )
        rid1 = rid_of(await client.recv_until("response.created"))
        failed = await client.recv_until("response.done")
        assert rid_of(failed) == rid1
        assert failed["response"]["status_details"] == {
            "type": "failed",
            "reason": "output_backpressure",
        }
        error_at = max(i for i, e in enumerate(client.events) if e["type"] == "error")
        error = client.events[error_at]
        assert (error["error"]["type"], error["error"]["code"]) == (
            "rate_limit_error",
            "output_backpressure",
        )
        assert client.events[error_at + 1] is failed

        # The session goes on: the next response is delivered in full.
        mark = client.mark()
        await request_response(client)
        rid2 = rid_of(await client.recv_until("response.created"))
        done = await client.recv_until(lambda e: e["type"] == "response.done" and rid_of(e) == rid2)
        assert done["response"]["status"] == "completed"
        audio = [e for e in client.events[mark:] if e["type"] == AUDIO_DELTA]
        assert len(audio) == CHUNKS
        assert {rid_of(e) for e in audio} == {rid2}
        # Nothing more of the failed response, not even the engine's own response.done.
        assert [e for e in client.events[mark:] if rid_of(e) == rid1] == []
        assert [e for e in client.events if e["type"] == "response.done" and rid_of(e) == rid1] == [
            failed
        ]
        await client.send({"type": "session.close"})
        closing = await client.recv_until_closed()
        assert closing[-1]["type"] == "session.closed"
        assert client.close_code == 1000
    assert overflows(proxy, "fail_response") == 1
    assert overflows(proxy, "close_session") == 0
    assert proxy.metric("omni_sidecar_sessions_total", {"outcome": "overflow"}) == 0


async def test_a_stalled_session_does_not_hold_up_another(flood_sim, sidecar) -> None:
    """Session A stops reading with its whole response pending (no overflow: big
    budget); session B meanwhile gets its whole response, in order; then A reads
    and gets its own, complete."""
    proxy = await sidecar(
        upstream=flood_sim.ws_url, max_pending_output_bytes=8 * MIB,
        client_write_buffer_bytes=16 * KIB,
    )  # fmt: skip
    async with connect(proxy.url, **STALLED) as a, connect(proxy.url) as b:
        await _start_stalled(a)
        # A's output piles up in the proxy (everything the sockets cannot absorb).
        await wait_until(
            lambda: proxy.metric("omni_sidecar_output_pending_bytes") > 512 * KIB,
            what="A's output pending in the proxy",
        )
        await request_response(b, open_session=True)
        rid_b = rid_of(await b.recv_until("response.created"))
        done = await b.recv_until(lambda e: e["type"] == "response.done" and rid_of(e) == rid_b)
        assert done["response"]["status"] == "completed"
        await b.recv_until("rate_limits.updated")
        b_audio = [e for e in b.events if e["type"] == AUDIO_DELTA]
        assert len(b_audio) == CHUNKS
        # A was still stalled all along; now it reads everything, nothing lost.
        await a.recv_until("rate_limits.updated")
        a_audio = [e for e in a.events if e["type"] == AUDIO_DELTA]
        assert len(a_audio) == CHUNKS
        # Both sessions heard the same deterministic sequence of event types.
        assert a.types() == b.types()
    assert overflows(proxy, "close_session") == 0


async def _shed_scenario(engine: ScriptedEngine, sidecar: Any) -> Any:
    """A stalls with about 200 KiB pending (under its own 4 MiB budget and under
    the 256 KiB process cap); B reads, so its events never pend; one more frame
    for A tips the total over the cap: A, the largest, must be shed with the
    overflow sequence and 1008; B carries on."""
    engine.answer_close = False  # A's engine records every frame the shed sends
    proxy = await sidecar(
        upstream=engine.ws_url,
        max_pending_output_bytes=4 * MIB,
        max_total_pending_output_bytes=256 * KIB,
        client_write_buffer_bytes=16 * KIB,
        close_timeout=10.0,
    )
    async with connect(proxy.url, **STALLED) as a, connect(proxy.url) as b:
        conn_a, conn_b = engine.connections
        a_frame = {"type": AUDIO_DELTA, "response_id": "ra", "delta": "A" * (16 * KIB)}

        def pending() -> int:
            return int(proxy.metric("omni_sidecar_output_pending_bytes"))

        def audio_read() -> float:
            return proxy.metric(
                "omni_sidecar_events_total", {"direction": "upstream_to_client", "kind": "audio"}
            )

        await conn_a.send(
            {"type": "response.created", "response_id": "ra", "response": {"id": "ra"}}
        )
        sent = 0
        while pending() < 192 * KIB:
            assert sent < 1000, "A's output never piled up"
            await conn_a.send({**a_frame, "n": sent})
            sent += 1
            await wait_until(lambda n=sent: audio_read() == n, what="the proxy read A's frame")
        assert overflows(proxy, "process_total") == 0

        # B is reading: what it gets is written at once and never pends.
        await conn_b.send(
            {"type": "response.created", "response_id": "rb", "response": {"id": "rb"}}
        )
        assert (await b.recv())["type"] == "response.created"
        await conn_b.send({"type": AUDIO_DELTA, "response_id": "rb", "delta": "B" * (80 * KIB)})
        assert (await b.recv())["type"] == AUDIO_DELTA
        assert overflows(proxy, "process_total") == 0
        # One more 80 KiB event for the stalled A pushes the process total over the
        # cap (A's own 4 MiB budget is far away): A, the largest, is shed.
        await conn_a.send({**a_frame, "delta": "A" * (80 * KIB), "n": sent})
        await wait_metric(
            lambda: overflows(proxy, "process_total"), 1, what="overflows{process_total}"
        )

        a_events = await a.recv_until_closed()
        assert a.close_code == 1008
        assert_overflow_tail(a_events, "ra")
        # What A's engine received: each command of the shed exactly once. The engine
        # answers only after the proxy's frames of that tick are all in, so a second
        # copy could not hide behind its close.
        await conn_a.receive_until("session.close")
        await conn_a.send({"type": "session.closed", "reason": "output_backpressure"})
        await conn_a.close()
        await conn_a.wait_closed()
        commands = [t for t in conn_a.received_types() if t != "playback.ack"]
        assert commands == ["response.cancel", "session.close"], conn_a.received_types()
        engine.answer_close = True  # B's session.close below is answered as usual

        # B is untouched: its response goes on and the session closes normally.
        await conn_b.send({"type": AUDIO_DELTA, "response_id": "rb", "delta": "B" * KIB})
        await conn_b.send({"type": "response.done", "response_id": "rb",
                           "response": {"id": "rb", "status": "completed"}})  # fmt: skip
        assert (await b.recv())["type"] == AUDIO_DELTA
        assert (await b.recv())["response"]["status"] == "completed"
        await b.send({"type": "session.close"})
        assert [e["type"] for e in await b.recv_until_closed()] == ["session.closed"]
        assert b.close_code == 1000
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_total", {"outcome": "overflow"}) == 1,
        what="sessions_total{overflow}",
    )
    return proxy


async def test_process_total_cap_sheds_the_largest_session(engine, sidecar) -> None:
    proxy = await _shed_scenario(engine, sidecar)
    assert overflows(proxy, "process_total") == 1


async def test_process_total_shed_is_counted_once(engine, sidecar) -> None:
    proxy = await _shed_scenario(engine, sidecar)
    assert overflows(proxy, "process_total") == 1
    assert overflows(proxy, "close_session") == 0
