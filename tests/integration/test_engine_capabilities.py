"""Engine capabilities through a real sidecar (docs/design.md, Engine capabilities).

What a peer observes:

- the capabilities (from ``engine.version``, or learned on the wire) in
  ``/debug/summary`` and ``omni_sidecar_engine_info``;
- on a 0.32 engine, whose ack errors carry no ``event_id``, no error of the
  sidecar's own acks or truncations reaches the client, while the client's
  own erroring ack still gets its error (matched by order; counted in
  ``omni_sidecar_engine_ack_errors_total{code}``);
- a 0.32 engine is truncated only for items whose audio was relayed; an
  engine of unknown version that refuses such a truncation teaches the
  sidecar that rule;
- a non-duplex session is sent no acks (known from ``?duplex=0``), or none
  after the engine's first ``invalid_event``;
- a full engine: 503 ``engine_capacity`` + ``Retry-After`` before the upgrade,
  and the next connect within ``engine_full_backoff`` is refused without an
  upstream connect; said after the upgrade, the error reaches the client and
  the backoff starts all the same.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import pytest

from proxy.settings import EngineConfig
from tests.conftest import DEADLINE, wait_until
from tests.fakes.scripted_engine import EngineConnection, ScriptedEngine
from tests.integration.helpers import AUDIO_DELTA, connect, request_response, rid_of
from tests.integration.test_metrics import admin_json

pytestmark = pytest.mark.timeout(60)

Event = dict[str, Any]
MODEL: Final = "omni-sim"
#: One second of pcm16 silence at 24 kHz, base64.
ONE_SECOND: Final = base64.b64encode(bytes(48_000)).decode()


def external(url: str, version: str = "auto") -> dict[str, Any]:
    """Sidecar settings for an external engine at ``url`` with ``engine.version``."""
    return {"upstream": url, "engine": EngineConfig(kind="external", upstream=url, version=version)}


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = await ScriptedEngine().start()
    yield scripted
    await scripted.aclose()


async def _open(conn: EngineConnection, c: Any) -> None:
    await conn.send({"type": "session.created", "session": {"id": "s1"}})
    await c.recv_until("session.created")


def _audio(response_id: str, delta: str = ONE_SECOND) -> Event:
    return {
        "type": AUDIO_DELTA,
        "response_id": response_id,
        "item_id": f"item_{response_id}",
        "delta": delta,
    }


def _ack_error(code: str) -> Event:
    """As 0.32 sends an ack's error: no event_id."""
    return {
        "type": "error",
        "error": {"type": "invalid_request_error", "code": code, "message": "x"},
    }


async def _cancel_after_empty_audio(conn: EngineConnection, c: Any) -> None:
    """Open; the engine starts ``r1`` with one audio delta of no bytes (an item that
    produced no audio); the client, having read it, cancels ``r1``."""
    await _open(conn, c)
    await conn.send_all([{"type": "response.created", "response": {"id": "r1"}}, _audio("r1", "")])
    await c.recv_until(AUDIO_DELTA)
    await c.send({"type": "response.cancel", "response_id": "r1"})


async def _summary(proxy: Any) -> dict[str, Any]:
    return dict((await admin_json(proxy, "/debug/summary"))["engine_capabilities"])


def _engine_info(proxy: Any, version: str, source: str) -> float:
    return proxy.metric("omni_sidecar_engine_info", {"version": version, "source": source})


# -- capabilities shown ---------------------------------------------------------------------------


async def test_configured_version_is_shown_in_debug_and_the_metric(
    engine: ScriptedEngine, sidecar: Any
) -> None:
    proxy = await sidecar(**external(engine.ws_url, "0.32"))
    assert await _summary(proxy) == {
        "version": "0.32",
        "source": "config",
        "bounded_output": True,
        "drops_cancelled_audio": True,
        "truncate_needs_audio_item": True,
        "duplex_acks": True,
    }
    assert _engine_info(proxy, "0.32", "config") == 1.0
    assert _engine_info(proxy, "unknown", "unknown") == 0.0


# -- 0.32: answers matched by order ----------------------------------------------------------------


async def test_0_32_own_ack_errors_are_hidden_and_the_clients_own_reaches_it(
    engine: ScriptedEngine, sidecar: Any
) -> None:
    proxy = await sidecar(**external(engine.ws_url, "0.32"))
    async with connect(proxy.url) as c:
        conn = await engine.next_connection()
        await _open(conn, c)
        await conn.send_all([{"type": "response.created", "response": {"id": "r1"}}, _audio("r1")])
        await c.recv_until(AUDIO_DELTA)
        first = await conn.receive_until("playback.ack")
        assert first[-1]["event_id"].startswith("event_sidecar_ack_")
        await c.send(
            {"type": "playback.ack", "event_id": "client_ack", "response_id": "r1", "played_ms": 9}
        )
        # Every ack, in the order the engine got it, gets an event_id-less error:
        # the sidecar's own (sent before the client's) playback_ack_too_late, the
        # client's playback_item_not_found.
        own = 0
        while True:
            ack = (await conn.receive_until("playback.ack"))[-1] if own else first[-1]
            if ack["event_id"] == "client_ack":
                await conn.send(_ack_error("playback_item_not_found"))
                break
            own += 1
            await conn.send(_ack_error("playback_ack_too_late"))
        await conn.send({"type": "response.done", "response": {"id": "r1", "status": "completed"}})
        await c.recv_until("response.done")
    errors = [e["error"]["code"] for e in c.events if e["type"] == "error"]
    assert errors == ["playback_item_not_found"], "only the client's own"
    assert own >= 1
    code = {"code": "playback_ack_too_late"}
    assert proxy.metric("omni_sidecar_engine_ack_errors_total", code) == own
    assert (
        proxy.metric("omni_sidecar_engine_ack_errors_total", {"code": "playback_item_not_found"})
        == 0
    )


async def test_0_32_is_not_truncated_for_an_item_that_produced_no_audio(
    engine: ScriptedEngine, sidecar: Any
) -> None:
    proxy = await sidecar(**external(engine.ws_url, "0.32"))
    async with connect(proxy.url) as c:
        conn = await engine.next_connection()
        await _cancel_after_empty_audio(conn, c)
        await conn.receive_until("response.cancel")
    # A truncation would have gone to the engine before the cancel.
    assert "playback.ack" not in conn.received_types()
    assert proxy.metric("omni_sidecar_truncations_total", {"source": "sidecar"}) == 0


async def test_an_engine_that_refuses_a_truncation_teaches_the_sidecar_0_32(
    engine: ScriptedEngine, sidecar: Any
) -> None:
    proxy = await sidecar(**external(engine.ws_url))
    assert (await _summary(proxy))["source"] == "unknown"
    async with connect(proxy.url) as c:
        conn = await engine.next_connection()
        await _cancel_after_empty_audio(conn, c)
        truncation = (await conn.receive_until("playback.ack"))[-1]
        assert truncation["truncate"] is True, "0.30's rule: truncate what was started"
        await conn.send(_ack_error("bad_event"))  # 0.32's answer
        await conn.send({"type": "response.done", "response": {"id": "r1", "status": "cancelled"}})
        await c.recv_until("response.done")
    assert "error" not in c.types()
    assert proxy.metric("omni_sidecar_engine_ack_errors_total", {"code": "bad_event"}) == 1
    summary = await _summary(proxy)
    assert (summary["version"], summary["source"]) == ("0.32", "wire")
    assert summary["truncate_needs_audio_item"] is True
    assert _engine_info(proxy, "0.32", "wire") == 1.0


# -- non-duplex sessions (simulator --session-mode realtime) -----------------------------------


@pytest.fixture
async def plain_sim(simulator: Any) -> Any:
    """A 0.32 engine serving a model without session_mode duplex: acks get invalid_event."""
    return await simulator(
        "--engine-version", "0.32", "--session-mode", "realtime", "--model", MODEL,
        "--realtime-factor", "0.25", "--chunk-ms", "100", "--response-seconds", "0.8",
    )  # fmt: skip


async def _one_turn(c: Any) -> None:
    await request_response(c)
    rid = rid_of(await c.recv_until("response.created"))
    await c.recv_until(lambda e: e["type"] == "response.done" and rid_of(e) == rid)


async def _ledger(proxy: Any) -> dict[str, Any]:
    (session,) = (await admin_json(proxy, "/debug/sessions"))["sessions"]
    return dict(session["playback"])


async def test_a_session_that_says_duplex_0_is_never_acked(plain_sim: Any, sidecar: Any) -> None:
    proxy = await sidecar(upstream=plain_sim.ws_url)
    async with connect(proxy.url + "?duplex=0") as c:
        await c.recv_until("session.created")
        await _one_turn(c)
        ledger = await _ledger(proxy)
        assert ledger["acking"] is False and ledger["capabilities"]["duplex_acks"] is False

        async def all_played() -> bool:
            items = (await _ledger(proxy))["items"]
            return bool(items) and all(i["played_ms"] >= i["delivered_ms"] for i in items)

        # Every ack a duplex session would get is due by now; one more turn offers a ride.
        await wait_until(all_played, what="the reply played out (heard estimate)")
        await _one_turn(c)
    assert "error" not in c.types()
    assert proxy.metric("omni_sidecar_playback_acks_total") == 0
    assert proxy.metric("omni_sidecar_engine_ack_errors_total", {"code": "invalid_event"}) == 0


async def test_invalid_event_to_the_first_ack_stops_the_acks(plain_sim: Any, sidecar: Any) -> None:
    proxy = await sidecar(upstream=plain_sim.ws_url)
    async with connect(proxy.url) as c:  # nothing in the URL says non-duplex
        await c.recv_until("session.created")
        await _one_turn(c)
        await wait_until(
            lambda: (
                proxy.metric("omni_sidecar_engine_ack_errors_total", {"code": "invalid_event"}) >= 1
            ),
            what="the engine's invalid_event to the sidecar's ack",
        )
        sent = proxy.metric("omni_sidecar_playback_acks_total")
        await _one_turn(c)
        await _one_turn(c)
        # The client's own ack is refused too, and that error is the client's.
        await c.send({"type": "playback.ack", "response_id": "r", "played_ms": 1})
        error = await c.recv_until("error")
    assert error["error"]["code"] == "invalid_event"
    assert [e for e in c.events if e["type"] == "error"] == [error], "only the client's own"
    assert proxy.metric("omni_sidecar_playback_acks_total") == sent, "no ack after the refusal"
    refused = proxy.metric("omni_sidecar_engine_ack_errors_total", {"code": "invalid_event"})
    assert refused == sent, "every ack sent was answered and hidden"


# -- a full engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("link", ["picows", "aiohttp"])
async def test_the_wait_for_the_first_frame_ends_when_it_comes(
    engine: ScriptedEngine, sidecar: Any, link: str
) -> None:
    """An engine that takes its time to open: the upgrade follows its first frame
    at once (not engine_open_wait later), and that frame is relayed first."""
    proxy = await sidecar(upstream=engine.ws_url, engine_open_wait=10.0, upstream_client=link)
    async with aiohttp.ClientSession() as http:
        upgrade = asyncio.ensure_future(http.ws_connect(f"{proxy.url}?model={MODEL}"))
        conn = await engine.next_connection()
        await asyncio.sleep(0)  # let the handshake start waiting (it must wake on the frame)
        assert not upgrade.done(), "upgraded before the engine said anything"
        sent = time.monotonic()
        await conn.send({"type": "session.created", "session": {"id": "s1"}})
        ws = await asyncio.wait_for(upgrade, DEADLINE)
        took = time.monotonic() - sent
        first = await ws.receive(timeout=DEADLINE)
        await ws.close()
    assert took < 5.0, f"the handshake waited {took:.1f} s for a frame that had come"
    assert first.json()["type"] == "session.created"


async def _handshake(url: str) -> tuple[int, dict[str, str], float]:
    """(HTTP status, headers, seconds) of one WebSocket handshake; 101 when it upgraded."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(url)
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status, dict(exc.headers or {}), time.monotonic() - started
        await ws.close()
        return 101, {}, time.monotonic() - started


@pytest.fixture
async def full_sim(simulator: Any) -> Any:
    """A 0.32 engine with room for one session."""
    return await simulator(
        "--engine-version", "0.32", "--max-sessions", "1", "--realtime-factor", "0",
        "--model", MODEL,
    )  # fmt: skip


async def test_a_full_engine_is_answered_503_before_the_upgrade_then_not_touched(
    full_sim: Any, sidecar: Any
) -> None:
    proxy = await sidecar(upstream=full_sim.ws_url, engine_full_backoff=30.0, engine_open_wait=10.0)
    url = f"{proxy.url}?model={MODEL}"  # the engine opens at connect
    started = time.monotonic()
    async with connect(url) as holder:
        # An engine with room: its session.created ends the wait at once, and is relayed.
        assert time.monotonic() - started < 5.0, "the handshake waited out engine_open_wait"
        assert (await holder.recv())["type"] == "session.created"
        connects = proxy.metric("omni_sidecar_upstream_connects_total")
        status, headers, took = await _handshake(url)
        assert status == 503 and headers["Retry-After"] in {str(n) for n in range(25, 31)}
        assert proxy.metric("omni_sidecar_engine_full_total", {"kind": "handshake"}) == 1
        assert proxy.metric("omni_sidecar_upstream_connects_total") == connects + 1
        # Within the backoff: refused at once, the full engine is not asked again.
        status, headers, took_again = await _handshake(url)
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert proxy.metric("omni_sidecar_upstream_connects_total") == connects + 1
        rejected = {"reason": "engine_capacity"}
        assert proxy.metric("omni_sidecar_sessions_rejected_total", rejected) == 2
        ready = await admin_json(proxy, "/debug/summary")
        assert ready["sessions"]["rejected"]["engine_capacity"] == 2
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.http_url}/readyz") as resp:
            assert resp.status == 503 and "Retry-After" in resp.headers
            assert (await resp.json())["reason"] == "engine_capacity"
        print(f"\nfull engine: 503 in {took * 1000:.1f} ms; refused within backoff in "
              f"{took_again * 1000:.1f} ms")  # fmt: skip
        assert "error" not in holder.types()


async def test_retry_after_is_rounded_up_so_a_client_that_obeys_it_reaches_the_engine(
    full_sim: Any, sidecar: Any
) -> None:
    """``Retry-After`` is whole seconds: the remaining backoff rounded *up*. A
    client that waits exactly that long finds the backoff over and its handshake
    goes to the engine again; rounded down, it would come back early and be
    refused from the backoff once more, without the engine being asked."""
    backoff = 1.5
    proxy = await sidecar(
        upstream=full_sim.ws_url, engine_full_backoff=backoff, engine_open_wait=10.0
    )
    url = f"{proxy.url}?model={MODEL}"
    async with connect(url) as holder:
        assert (await holder.recv())["type"] == "session.created"
        status, headers, _took = await _handshake(url)  # the engine says full: backoff starts
        assert status == 503
        first = int(headers["Retry-After"])
        assert first == 2, f"{backoff} s of backoff left is Retry-After 2, not {first}"
        connects = proxy.metric("omni_sidecar_upstream_connects_total")
        status, headers, _took = await _handshake(url)  # within the backoff: not asked
        assert status == 503
        retry = int(headers["Retry-After"])
        assert proxy.metric("omni_sidecar_upstream_connects_total") == connects
        await asyncio.sleep(retry)  # the client obeys Retry-After to the second
        status, _headers, _took = await _handshake(url)
        assert status == 503  # still full (the holder is there), but the engine said so
        assert proxy.metric("omni_sidecar_upstream_connects_total") == connects + 1, (
            f"Retry-After {retry} sent the client back before the backoff ended"
        )


async def test_a_full_engine_that_says_so_after_the_upgrade_is_passed_on_and_backed_off(
    full_sim: Any, sidecar: Any
) -> None:
    proxy = await sidecar(upstream=full_sim.ws_url, engine_full_backoff=30.0)
    async with connect(f"{proxy.url}?model={MODEL}") as holder:
        await holder.recv_until("session.created")
        # No model in the URL: the engine opens on the client's first frame.
        async with connect(proxy.url) as late:
            await late.send({"type": "session.update", "session": {"modalities": ["audio"]}})
            error = await late.recv_until("error")
            assert error["error"]["code"] == "resource_exhausted"
            await late.recv_until_closed()
        await wait_until(
            lambda: proxy.metric("omni_sidecar_engine_full_total", {"kind": "session"}) == 1,
            what="the in-session refusal counted",
        )
        connects = proxy.metric("omni_sidecar_upstream_connects_total")
        status, headers, _took = await _handshake(proxy.url)
        assert status == 503 and "Retry-After" in headers
        assert proxy.metric("omni_sidecar_upstream_connects_total") == connects


async def test_without_the_wait_the_error_reaches_the_client(full_sim: Any, sidecar: Any) -> None:
    proxy = await sidecar(upstream=full_sim.ws_url, engine_open_wait=0.0, engine_full_backoff=0.0)
    url = f"{proxy.url}?model={MODEL}"
    async with connect(url) as holder:
        await holder.recv_until("session.created")
        async with connect(url) as second:
            error = await second.recv_until("error")
            assert error["error"]["code"] == "resource_exhausted"
            await asyncio.wait_for(second.recv_until_closed(), DEADLINE)
        status, _headers, _took = await _handshake(url)
        assert status == 101, "no backoff: the engine is asked again"


async def test_the_next_session_goes_to_another_replica(simulator: Any, sidecar: Any) -> None:
    """Two engines; the first is full (a session held on it directly, which the
    sidecar cannot count): the session placed there is refused 503, the next one
    goes to the second replica without touching the first."""
    args = ("--engine-version", "0.32", "--max-sessions", "1", "--realtime-factor", "0")
    full, free = await simulator(*args, "--model", MODEL), await simulator(*args, "--model", MODEL)
    engine = EngineConfig(
        kind="external", upstreams=(full.ws_url, free.ws_url), health_interval=0.2
    )
    proxy = await sidecar(engine=engine, engine_full_backoff=30.0)
    await wait_until(
        lambda: proxy.sidecar.router.states == ["ready", "ready"], what="both upstreams ready"
    )
    url = f"{proxy.url}?model={MODEL}"
    async with connect(f"{full.ws_url}?model={MODEL}") as direct:
        await direct.recv_until("session.created")
        status, headers, _took = await _handshake(url)  # placed on replica 0: full
        assert status == 503 and "Retry-After" in headers
        connects = proxy.metric("omni_sidecar_upstream_connects_total")
        async with connect(url) as placed:
            await placed.recv_until("session.created")
            (session,) = (await admin_json(proxy, "/debug/sessions"))["sessions"]
            assert session["engine"] == 1
        assert proxy.metric("omni_sidecar_upstream_connects_total") == connects + 1
        engines = (await admin_json(proxy, "/debug/summary"))["engines"]
        assert (
            engines[0]["engine_full_for_seconds"] > 0 and engines[1]["engine_full_for_seconds"] == 0
        )
