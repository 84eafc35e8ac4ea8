"""The sidecar in front of vLLM-Omni's real serving layer (``make test-real-engine``).

Needs vllm + vllm-omni (and their CUDA torch builds) installed: 0.30.0, or
0.32.0rc1 with ``VLLM_OMNI=0.32.0rc1``; skipped otherwise. No GPU and no
weights: vLLM-Omni's own router and ``OmniDuplexSessionHandler`` run on uvicorn
over a stand-in engine (``stand_in_engine.py``) whose wire events come from the
engine's real Realtime projection. Clients: vLLM-Omni's installed
``DuplexClient`` and the OpenAI SDK.

The same tests run on every release; where the releases differ they assert
what the installed one does (``RELEASE``):

- late audio after a cancel: 0.30 delivers it (numbered), the sidecar removes
  it, so a client behind the sidecar sees a ``server_event_seq`` gap per removed
  delta; 0.31+ removes it before numbering, so the sidecar has nothing to drop
  and the sequence has no gap, with or without the sidecar;
- ``playback.ack`` ``truncate: true`` (the sidecar's ack at a cancel): 0.30
  parses it away, 0.32 hands it to the engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import pytest

pytest.importorskip(
    "vllm_omni.entrypoints",
    reason="needs vllm + vllm-omni: make test-real-engine [VLLM_OMNI=0.32.0rc1]",
)
uvicorn = pytest.importorskip("uvicorn")

from proxy.core.session_core import DropReason
from tests.conftest import DEADLINE, TIMEOUT_FACTOR, free_port
from tests.integration.helpers import pcm16_b64
from tests.integration.vllm_omni_wheel import run_duplex_session
from tests.real_engine.stand_in_engine import (
    RELEASE,
    Pace,
    StandInEngine,
    build_app,
    build_omni,
)

pytestmark = pytest.mark.real_engine

MODEL: Final = "omni-stand-in"
AUDIO_DELTA: Final = "response.output_audio.delta"
PACE: Final = Pace(chunk_ms=200, chunks=5, interval_s=0.2 * TIMEOUT_FACTOR, late_chunks=3)


@dataclass
class RealServer:
    engine: StandInEngine
    app: Any
    port: int

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def _serving(engine: StandInEngine) -> AsyncIterator[RealServer]:
    app = build_app(build_omni(engine, model=MODEL))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    async with asyncio.timeout(DEADLINE):
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
    try:
        yield RealServer(engine, app, port)
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            async with asyncio.timeout(DEADLINE):
                await task


@pytest.fixture
async def real_server() -> AsyncIterator[RealServer]:
    """vLLM-Omni's app (router + duplex handler) on uvicorn, loopback, ephemeral port."""
    async with _serving(StandInEngine(PACE)) as server:
        yield server


@pytest.fixture
async def resumable_server() -> AsyncIterator[RealServer]:
    """The same, its stand-in engine advertising resume: the serving layer's own
    tokens and journal (``session_attachment``) are in play."""
    async with _serving(StandInEngine(PACE, resumable=True)) as server:
        yield server


def _client_module() -> Any:
    from vllm_omni.clients import duplex

    return duplex


def _seq_gaps(events: list[dict[str, Any]]) -> list[int]:
    """``server_event_seq`` values missing between the first and last one received."""
    seqs = [e["server_event_seq"] for e in events if "server_event_seq" in e]
    assert seqs == sorted(set(seqs)), seqs
    return sorted(set(range(seqs[0], seqs[-1] + 1)) - set(seqs))


def test_installed_release_is_a_known_one() -> None:
    """The tier's per-release expectations cover the installed vllm-omni."""
    assert RELEASE.version in {"0.30.0", "0.32.0rc1"}, RELEASE


async def test_health_route_is_vllm_omnis_own(real_server: RealServer) -> None:
    import aiohttp

    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{real_server.http_url}/health") as resp,
    ):
        assert resp.status == 200
        assert await resp.json() == {"status": "healthy"}


async def test_duplex_client_session_through_the_sidecar(
    real_server: RealServer, sidecar: Any
) -> None:
    acks: list[int] = []
    handler = real_server.app.state.openai_serving_duplex
    registry = handler._attachment_registry
    acknowledge = registry.acknowledge

    async def recording_acknowledge(session_id: str, sequence: int) -> int:
        acks.append(sequence)
        return await acknowledge(session_id, sequence)

    registry.acknowledge = recording_acknowledge  # the real handler's journal trim

    proxy = await sidecar(upstream=real_server.ws_url)
    host, port = proxy.sidecar.bound["listen"]
    run = await run_duplex_session(
        _client_module(),
        f"ws://{host}:{port}",
        model=MODEL,
        deadline=DEADLINE,
        audio_type=AUDIO_DELTA,
    )
    received = run.received()
    assert received[0]["type"] == "session.created"
    assert run.session_id and run.session_id.startswith("duplex-")
    assert run.statuses == ("completed", "cancelled")

    deltas = [
        e for e in received if e["type"] == AUDIO_DELTA and e["response_id"] == run.completed_id
    ]
    assert len(deltas) == PACE.chunks
    assert run.completed_audio == b"".join(base64.b64decode(e["delta"]) for e in deltas)
    assert run.completed_transcript == "Hello from the stand-in engine"

    after = run.after_first_sent("response.cancel")
    stale = [e for e in after if e["type"] == AUDIO_DELTA and e["response_id"] == run.cancelled_id]
    assert stale == []
    assert real_server.engine.late_audio_sent >= 1  # the engine did queue some
    removed = {
        reason.value: proxy.metric("omni_sidecar_dropped_events_total", {"reason": reason.value})
        for reason in DropReason
    }
    dropped = removed[DropReason.LATE_AUDIO.value]
    if RELEASE.removes_cancelled_audio:
        assert dropped == 0  # the engine removed it before numbering: nothing reached us
    else:
        assert dropped >= 1  # delivered by the engine, removed by the sidecar
    # DuplexClient sends no playback.ack: the sidecar acks for it and hides the answers.
    assert removed[DropReason.PLAYBACK_ANSWER.value] >= 1
    # The engine numbers without gaps; every frame the sidecar removed (late audio,
    # answers to its own acks, ...) was numbered: one gap each, no others.
    assert len(_seq_gaps(received)) == sum(removed.values())

    # Acks went through the sidecar into the real handler's journal.
    seqs = [e["server_event_seq"] for e in received if "server_event_seq" in e]
    assert acks == seqs[:-1]
    assert received[-1]["type"] == "session.closed"
    assert received[-1]["reason"] == "client_close"
    assert run.closed_expected and run.close_code == 1000


async def test_duplex_client_straight_to_real_serving(real_server: RealServer) -> None:
    """Control, no sidecar: 0.30 delivers late audio after a cancel, 0.31+ removes it."""
    run = await run_duplex_session(
        _client_module(),
        f"ws://127.0.0.1:{real_server.port}",
        model=MODEL,
        deadline=DEADLINE,
        audio_type=AUDIO_DELTA,
    )
    assert run.statuses == ("completed", "cancelled")
    assert real_server.engine.late_audio_sent >= 1
    after = run.after_first_sent("response.cancel")
    stale = [e for e in after if e["type"] == AUDIO_DELTA and e["response_id"] == run.cancelled_id]
    if RELEASE.removes_cancelled_audio:
        assert stale == []
    else:
        assert len(stale) >= 1
    assert _seq_gaps(run.received()) == []  # the handler numbers what it sends, gap-free


async def test_openai_ga_client_through_the_sidecar(real_server: RealServer, sidecar: Any) -> None:
    """With ``client_dialect = "engine"``, as tests/integration/test_openai_sdk.py: the
    SDK reads the engine's own events (``session.close`` answered by ``session.closed``);
    the voice stacks through the OpenAI dialect: test_real_stacks.py."""
    openai = pytest.importorskip("openai")
    proxy = await sidecar(upstream=real_server.ws_url, client_dialect="engine")
    client = openai.AsyncOpenAI(base_url=f"{proxy.http_url}/v1", api_key="sk-test", max_retries=0)
    events: list[Any] = []

    async def until(conn: Any, match: Any) -> Any:
        check = (lambda e: e.type == match) if isinstance(match, str) else match
        async with asyncio.timeout(DEADLINE):
            while True:
                event = await conn.recv()
                events.append(event)
                if check(event):
                    return event

    try:
        async with asyncio.timeout(DEADLINE * 4):
            async with client.realtime.connect(model=MODEL) as conn:
                # ?model= opens a default session at once (docs/engine-protocol.md, Opening a
                # session).
                await until(conn, "session.created")
                await until(conn, "session.updated")
                await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
                await until(conn, "session.updated")
                pcm = pcm16_b64(200, amplitude=0.3)  # speech-like: silence would be "listen"
                for _ in range(2):
                    await conn.input_audio_buffer.append(audio=pcm)
                    await conn.input_audio_buffer.commit()
                    await until(conn, "input_audio_buffer.committed")
                    await conn.response.create()
                    first = await until(conn, AUDIO_DELTA)
                    if len([e for e in events if e.type == "response.created"]) == 2:
                        break
                    await until(conn, "response.done")
                mark = len(events)
                await conn.response.cancel()
                done = await until(
                    conn, lambda e: e.type == "response.done" and e.response.id == first.response_id
                )
                assert done.response.status == "cancelled"
                stale = [
                    e for e in events[mark:]
                    if e.type == AUDIO_DELTA and e.response_id == first.response_id
                ]  # fmt: skip
                assert stale == []
                await conn.send({"type": "session.close"})  # type: ignore[arg-type]
                closed = await until(conn, "session.closed")
                assert closed.reason == "client_close"
    finally:
        await client.close()
    statuses = [e.response.status for e in events if e.type == "response.done"]
    assert statuses == ["completed", "cancelled"]
    assert real_server.engine.late_audio_sent >= 1
    # The GA client sends no playback.ack: the sidecar acks for it and, at the
    # cancel, tells the engine where playback stopped with `truncate: true`.
    cancel_ack = [a for a in real_server.engine.acks if a.response_id == first.response_id][-1]
    if RELEASE.keeps_ack_truncate:
        assert cancel_ack.truncate is True
    else:
        assert not hasattr(cancel_ack, "truncate")  # 0.30's parser drops the field


async def test_duplex_client_resumes_through_the_sidecar_after_a_cut(
    resumable_server: RealServer, sidecar: Any
) -> None:
    """DuplexClient (the installed one, default ReconnectPolicy) through the sidecar
    to vLLM-Omni's serving layer; its TCP connection is cut after the first audio
    delta. The sidecar holds the session (the serving layer never sees the drop),
    the client resumes with the serving layer's own token, and gets every event
    after its cursor once; the response completes."""
    from tests.integration.test_duplex_client import CuttableRelay, FirstConnectionCut

    proxy = await sidecar(upstream=resumable_server.ws_url, playback_ack="off")
    host, port = proxy.sidecar.bound["listen"]
    cut = FirstConnectionCut(port)
    received = cut.received

    tone = base64.b64decode(pcm16_b64(400, amplitude=0.3))
    async with CuttableRelay(port) as cut.relay:
        client = _client_module().DuplexClient(
            f"ws://{host}:{port}", model=MODEL, heartbeat_interval_s=None, connect=cut.connect
        )
        async with asyncio.timeout(DEADLINE * 4), client:
            responses = client.responses()
            await client.stream_pcm(tone, chunk_ms=200, realtime=False)
            await client.commit()
            async with asyncio.timeout(DEADLINE * 2):
                handle = await anext(responses)
                await handle.wait()
    assert cut.connections == 2
    before = [e for n, e in received if n == 1]
    after = [e for n, e in received if n == 2]
    assert before[0]["type"] == "session.created" and before[0].get("resume_token")
    cursor = max(e["server_event_seq"] for e in before if "server_event_seq" in e)
    assert after[0]["type"] == "session.resumed"
    seqs = [e["server_event_seq"] for e in after if "server_event_seq" in e]
    removed = sum(
        proxy.metric("omni_sidecar_dropped_events_total", {"reason": reason.value})
        for reason in DropReason
    )
    gaps = set(range(cursor + 1, seqs[-1] + 1)) - set(seqs)
    assert seqs == sorted(set(seqs)) and min(seqs) > cursor and len(gaps) <= removed
    assert handle.done_event.raw["response"]["status"] == "completed"
    assert len([e for _, e in received if e["type"] == AUDIO_DELTA]) == PACE.chunks
    assert proxy.metric("omni_sidecar_resumes_total", {"result": "resumed"}) == 1
