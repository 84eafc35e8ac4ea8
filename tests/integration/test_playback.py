"""The playback ledger through the sidecar, against the simulator's own ledger.

The simulator keeps history like vLLM-Omni 0.30 (``--playback-commit-policy``)
and shows it at ``GET /debug/history``, so these tests compare what the model
believes it said with what the client could have heard:

- a stock OpenAI SDK GA client never acks: the sidecar paces, acks for it and,
  on a barge-in, truncates the engine's history at the heard position;
- with ``ack_only`` the next ``response.create`` after a clear is accepted;
- an engine that supports ``conversation.item.truncate`` is truncated with it;
- vLLM-Omni's own DuplexClient acks itself and is never acked for.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import pytest

from tests.conftest import DEADLINE, TIMEOUT_FACTOR, wait_until
from tests.integration.helpers import SimulatorChild, connect, module_simulator, pcm16_b64

if TYPE_CHECKING:
    from tests.integration.vllm_omni_wheel import VllmOmni

pytest_plugins = ["tests.integration.vllm_omni_wheel"]

MODEL: Final = "omni-sim"
CHUNK_MS: Final = 200
RESPONSE_SECONDS: Final = 4.0
LEAD: Final = 0.5
#: Scheduling slack on a loaded 2-core machine (seconds).
SLACK: Final = 0.15 * TIMEOUT_FACTOR
AUDIO_DELTA: Final = "response.output_audio.delta"


def _sim_args(*extra: str) -> tuple[str, ...]:
    return (
        "--model", MODEL, "--chunk-ms", str(CHUNK_MS),
        "--realtime-factor", f"{TIMEOUT_FACTOR:g}",
        "--response-seconds", str(RESPONSE_SECONDS), "--late-audio-chunks", "2",
        "--generation-speed", "4", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ack_only_sim() -> Iterator[SimulatorChild]:
    with module_simulator(*_sim_args("--playback-commit-policy", "ack_only")) as sim:
        yield sim


@pytest.fixture(scope="module")
def truncate_sim() -> Iterator[SimulatorChild]:
    with module_simulator(*_sim_args("--supports-audio-truncate")) as sim:
        yield sim


async def _history(sim: SimulatorChild) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(f"{sim.http_url}/debug/history") as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


def _audio_ms(delta_b64: str) -> float:
    return len(base64.b64decode(delta_b64)) / 2 / 24_000 * 1000


async def _assistant_item(sim: SimulatorChild, response_id: str) -> dict[str, Any]:
    history = await _history(sim)
    for session in history["sessions"].values():
        for item in [*session["items"], *session.get("pending", [])]:
            if item.get("response_id") == response_id:
                return dict(item)
    raise AssertionError(f"no history item for {response_id}: {history}")


async def test_stock_client_paced_lead_bounded_and_history_ends_where_the_user_stopped(
    ack_only_sim: SimulatorChild, sidecar: Any
) -> None:
    """OpenAI SDK GA client (never acks), engine 4x faster than real time."""
    openai = pytest.importorskip("openai")
    proxy = await sidecar(upstream=ack_only_sim.ws_url, playback_pacing=True, max_audio_lead=LEAD)
    host, port = proxy.sidecar.bound["listen"]
    client = openai.AsyncOpenAI(api_key="sk-test", base_url=f"http://{host}:{port}/v1")
    rng = random.Random(7)
    cancel_after = rng.randint(3, 10)  # a barge-in at a random point of the reply
    async with asyncio.timeout(DEADLINE * 3), client.realtime.connect(model=MODEL) as conn:
        await conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(200, rate=24000)})
        await conn.send({"type": "input_audio_buffer.commit"})
        await conn.send({"type": "response.create"})
        first: float | None = None
        received_ms = 0.0
        worst_lead = 0.0
        deltas = 0
        response_id = ""
        heard_ms = 0.0
        async for event in conn:
            if event.type == AUDIO_DELTA:
                now = time.monotonic()
                first = now if first is None else first
                received_ms += _audio_ms(event.delta)
                worst_lead = max(worst_lead, received_ms / 1000 - (now - first))
                deltas += 1
                response_id = event.response_id
                if deltas == cancel_after:
                    # What a 1x player has played by now: the heard position.
                    heard_ms = min(received_ms, (time.monotonic() - first) * 1000)
                    await conn.send({"type": "response.cancel"})
            if event.type == "response.done":
                break
        assert deltas >= cancel_after
        # Paced: never more than max_audio_lead + one chunk ahead of real time.
        assert worst_lead <= LEAD + CHUNK_MS / 1000 + SLACK, worst_lead
        # The engine's history for that reply ends within a chunk of what was heard.
        item = await _assistant_item(ack_only_sim, response_id)
        assert abs(item["audio_ms"] - heard_ms) <= CHUNK_MS + SLACK * 1000, (item, heard_ms)
        assert item["text"] != item["full_text"], "the history holds less than was generated"
        # ack_only: the next response after a clear is accepted (no stale playback wait).
        await conn.send({"type": "output_audio_buffer.clear"})
        await conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(200, rate=24000)})
        await conn.send({"type": "input_audio_buffer.commit"})
        await conn.send({"type": "response.create"})
        async for event in conn:
            assert event.type != "error" or "already_active" not in str(event), event
            if event.type == "response.created":
                break
    await wait_until(
        lambda: proxy.metric("omni_sidecar_truncations_total", {"source": "sidecar"}) >= 1,
        what="the sidecar's truncation counted",
    )
    assert proxy.metric("omni_sidecar_playback_acks_total") >= 1
    assert proxy.metric("omni_sidecar_audio_lead_at_cancel_seconds_count") == 1


async def test_an_engine_that_can_truncate_is_sent_conversation_item_truncate(
    truncate_sim: SimulatorChild, sidecar: Any
) -> None:
    proxy = await sidecar(upstream=truncate_sim.ws_url)
    async with connect(proxy.url) as client:
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(200)})
        await client.send({"type": "input_audio_buffer.commit"})
        await client.send({"type": "response.create"})
        delta = await client.recv_until(AUDIO_DELTA)
        started = time.monotonic()
        await asyncio.sleep(0.3 * TIMEOUT_FACTOR)  # let the user hear some of it
        heard = (time.monotonic() - started) * 1000
        url = f"{proxy.admin_url}/debug/sessions"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            sessions = (await response.json())["sessions"]
        ledger = sessions[0]["playback"]
        assert ledger["acking"] and not ledger["client_acks"]
        (item,) = ledger["items"]
        assert item["response_id"] == delta["response_id"] and item["delivered_ms"] > 0
        assert 0 < item["played_ms"] <= item["delivered_ms"]
        await client.send({"type": "response.cancel"})
        await client.recv_until("response.done")
        item = await _assistant_item(truncate_sim, delta["response_id"])  # while it is open
    assert heard - CHUNK_MS - SLACK * 1000 <= item["audio_ms"] <= heard + CHUNK_MS + SLACK * 1000
    # Both answers to our truncate (truncated, then acknowledged) are hidden.
    assert "conversation.item.truncated" not in client.types()
    assert "playback.acknowledged" not in client.types()
    assert proxy.metric("omni_sidecar_truncations_total", {"source": "sidecar"}) == 1


async def test_a_client_that_acks_itself_is_never_acked_for(
    vllm_omni: VllmOmni, ack_only_sim: SimulatorChild, sidecar: Any
) -> None:
    """vLLM-Omni's DuplexClient, acking each chunk as it plays it."""
    duplex = vllm_omni.client
    proxy = await sidecar(upstream=ack_only_sim.ws_url)
    host, port = proxy.sidecar.bound["listen"]
    acks: list[str] = []
    async with asyncio.timeout(DEADLINE * 3):
        client = duplex.DuplexClient(f"ws://{host}:{port}", model=MODEL)
        async with client:
            await client.stream_pcm(b"\x00\x00" * 3200, realtime=False)
            await client.commit(create_response=True)
            async for response in client.responses():
                if response.decision == "listen":
                    continue
                async for _chunk in response.audio():
                    await client.ack_playback(response.played_ms, response_id=response.response_id)
                    acks.append(response.response_id)
                break
    assert acks
    assert proxy.metric("omni_sidecar_playback_acks_total") == 0
