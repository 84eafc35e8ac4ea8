"""The OpenAI Python SDK's realtime clients through the sidecar (issue: real clients).

``openai[realtime]`` connects with its own WebSocket stack (``websockets``),
sends ``Authorization: Bearer sk-test`` and ``?model=``, and parses every frame
into its pydantic event models. Two clients are covered:

- the GA client ``client.realtime.connect(model=...)`` (``base_url`` ``http://…/v1``,
  so the SDK derives ``ws://…/v1/realtime``) against the simulator in GA mode;
- the beta client ``client.beta.realtime.connect`` (``websocket_base_url``
  ``ws://…/v1``, header ``OpenAI-Beta: realtime=v1``) against the simulator in
  ``--event-names beta`` mode (vLLM-Omni 0.28 names: ``response.audio.delta``).

These run with ``client_dialect = "engine"``: the SDK reads the engine's own
protocol through the sidecar, as before the OpenAI dialect existed (the
default, ``auto``, gives these clients the OpenAI dialect:
tests/integration/test_openai_dialect.py). The SDK maps vLLM-Omni-only events (``response.speak``, ``session.heartbeat_ack``,
``session.closed``…) to a fallback model, so the tests branch on ``.type``
only. Pace: 200 ms chunks sent every 200 ms, so a cancel sent right after a
delta reaches the sidecar before the next one is produced; everything of the
cancelled response that the SDK reads after that is late audio, which the
sidecar must drop (the same script straight against the simulator sees it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import pytest

from tests.conftest import DEADLINE, TIMEOUT_FACTOR
from tests.integration.helpers import SimulatorChild, module_simulator, pcm16_b64

openai = pytest.importorskip("openai", reason="pip install 'openai[realtime]>=1.107'")
pytest.importorskip("websockets", reason="pip install 'openai[realtime]' (needs websockets)")

MODEL: Final = "omni-sim"
API_KEY: Final = "sk-test"
CHUNK_MS: Final = 200
#: 5 chunks per response, one every 200 ms (stretched by the timeout factor).
SIM_ARGS: Final = (
    "--model", MODEL, "--chunk-ms", str(CHUNK_MS),
    "--realtime-factor", f"{TIMEOUT_FACTOR:g}", "--response-seconds", "1",
    "--late-audio-chunks", "3",
)  # fmt: skip
#: 200 ms of 24 kHz PCM16 silence (the GA default input rate).
INPUT_AUDIO: Final = pcm16_b64(200, rate=24000)

GA_NAMES: Final = {
    "audio_delta": "response.output_audio.delta",
    "transcript_delta": "response.output_audio_transcript.delta",
}
BETA_NAMES: Final = {
    "audio_delta": "response.audio.delta",
    "transcript_delta": "response.audio_transcript.delta",
}


@pytest.fixture(scope="module")
def ga_sim() -> Iterator[SimulatorChild]:
    with module_simulator(*SIM_ARGS) as sim:
        yield sim


@pytest.fixture(scope="module")
def beta_sim() -> Iterator[SimulatorChild]:
    with module_simulator(*SIM_ARGS, "--event-names", "beta") as sim:
        yield sim


@dataclass
class Transcript:
    """What the SDK parsed, in arrival order, with the cancel's position marked."""

    events: list[Any] = field(default_factory=list)
    cancel_sent_at: int | None = None

    def types(self, start: int = 0) -> list[str]:
        return [e.type for e in self.events[start:]]

    def of(self, kind: str, response_id: str | None = None, start: int = 0) -> list[Any]:
        return [
            e
            for e in self.events[start:]
            if e.type == kind
            and (response_id is None or getattr(e, "response_id", None) == response_id)
        ]


async def recv_until(
    conn: Any, log: Transcript, match: str | Callable[[Any], bool], timeout: float = DEADLINE
) -> Any:
    """Read parsed events until one matches (a type or a predicate); bounded."""
    check = (lambda e: e.type == match) if isinstance(match, str) else match
    async with asyncio.timeout(timeout):
        while True:
            event = await conn.recv()
            log.events.append(event)
            if check(event):
                return event


@contextlib.asynccontextmanager
async def ga_connection(http_url: str) -> AsyncIterator[Any]:
    client = openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key=API_KEY, max_retries=0)
    try:
        async with asyncio.timeout(DEADLINE):
            manager = client.realtime.connect(model=MODEL)
            conn = await manager.__aenter__()
        try:
            yield conn
        finally:
            async with asyncio.timeout(DEADLINE):
                await manager.__aexit__(None, None, None)
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def beta_connection(ws_base: str) -> AsyncIterator[Any]:
    client = openai.AsyncOpenAI(api_key=API_KEY, websocket_base_url=ws_base, max_retries=0)
    try:
        async with asyncio.timeout(DEADLINE):
            manager = client.beta.realtime.connect(model=MODEL)
            conn = await manager.__aenter__()
        try:
            yield conn
        finally:
            async with asyncio.timeout(DEADLINE):
                await manager.__aexit__(None, None, None)
    finally:
        await client.close()


async def one_turn(conn: Any) -> None:
    """Append 200 ms, commit, ask for a response (SDK resource methods)."""
    await conn.input_audio_buffer.append(audio=INPUT_AUDIO)
    await conn.input_audio_buffer.commit()
    await conn.response.create()


async def completed_then_cancelled(conn: Any, names: dict[str, str]) -> Transcript:
    """A whole response, then a second one cancelled after its first audio delta."""
    log = Transcript()
    await one_turn(conn)
    done = await recv_until(conn, log, "response.done")
    assert done.response.status == "completed"
    await recv_until(conn, log, "rate_limits.updated")

    await one_turn(conn)
    first = await recv_until(conn, log, names["audio_delta"])
    log.cancel_sent_at = len(log.events)
    await conn.response.cancel()
    cancelled = await recv_until(
        conn, log, lambda e: e.type == "response.done" and e.response.id == first.response_id
    )
    assert cancelled.response.status == "cancelled"
    await recv_until(conn, log, "rate_limits.updated")
    return log


def check_audio(log: Transcript, names: dict[str, str]) -> tuple[str, str]:
    """The deltas decode to PCM16 and rebuild the transcript; returns (completed, cancelled) ids."""
    created = log.of("response.created")
    assert len(created) == 2
    completed_id, cancelled_id = (e.response.id for e in created)
    assert completed_id != cancelled_id
    deltas = log.of(names["audio_delta"], completed_id)
    assert len(deltas) == 5
    for delta in deltas:
        pcm = base64.b64decode(delta.delta)
        assert len(pcm) == 2 * 24000 * CHUNK_MS // 1000  # 24 kHz mono PCM16
    words = "".join(e.delta for e in log.of(names["transcript_delta"], completed_id))
    done = next(e for e in log.of("response.done") if e.response.id == completed_id)
    assert done.response.output[0].content[0].transcript == words
    return completed_id, cancelled_id


def assert_no_stale_audio(log: Transcript, names: dict[str, str], cancelled_id: str) -> None:
    assert log.cancel_sent_at is not None
    after = log.of(names["audio_delta"], cancelled_id, start=log.cancel_sent_at)
    assert after == [], f"{len(after)} audio delta(s) of the cancelled response after the cancel"
    tail = log.types(log.cancel_sent_at)
    assert tail[-2:] == ["response.done", "rate_limits.updated"]


# ------------------------------------------------------------------------------ GA


async def test_ga_client_runs_a_whole_session_through_the_sidecar(
    ga_sim: SimulatorChild, sidecar: Any
) -> None:
    proxy = await sidecar(upstream=ga_sim.ws_url, client_dialect="engine")
    async with ga_connection(proxy.http_url) as conn:
        log = Transcript()
        created = await recv_until(conn, log, "session.created")
        assert isinstance(created, openai.types.realtime.SessionCreatedEvent)
        assert created.session.model == MODEL  # ?model= reached the engine
        # With ?model= the engine opens a default session at once (created, updated).
        await recv_until(conn, log, "session.updated")
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "instructions": "Be brief.",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
            }
        )
        updated = await recv_until(conn, log, "session.updated")
        assert updated.session.instructions == "Be brief."

        turns = await completed_then_cancelled(conn, GA_NAMES)
        events = log.events + turns.events
        _, cancelled_id = check_audio(turns, GA_NAMES)
        assert_no_stale_audio(turns, GA_NAMES, cancelled_id)

        # Standard events parse into the SDK's own models ...
        realtime = openai.types.realtime
        by_type = {e.type: e for e in events}
        assert isinstance(by_type["response.created"], realtime.ResponseCreatedEvent)
        assert isinstance(by_type[GA_NAMES["audio_delta"]], realtime.ResponseAudioDeltaEvent)
        assert isinstance(by_type["response.done"], realtime.ResponseDoneEvent)
        assert isinstance(by_type["rate_limits.updated"], realtime.RateLimitsUpdatedEvent)
        # ... and vLLM-Omni-only ones into a fallback that still has .type.
        speak = by_type["response.speak"]
        assert not isinstance(speak, realtime.ResponseDoneEvent)
        assert speak.type == "response.speak"

        # vLLM-Omni extensions ride along: close the session the engine's way.
        await conn.send({"type": "session.close"})  # type: ignore[arg-type]
        closed = await recv_until(conn, log, "session.closed")
        assert closed.type == "session.closed"
        assert getattr(closed, "reason", None) == "client_close"
    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"}) >= 1


async def test_ga_script_straight_to_the_simulator_sees_stale_audio(ga_sim: SimulatorChild) -> None:
    """The same script without the sidecar: the engine flaw the sidecar removes is visible."""
    async with ga_connection(ga_sim.http_url) as conn:
        log = Transcript()
        await recv_until(conn, log, "session.created")
        turns = await completed_then_cancelled(conn, GA_NAMES)
    _, cancelled_id = check_audio(turns, GA_NAMES)
    assert turns.cancel_sent_at is not None
    late = turns.of(GA_NAMES["audio_delta"], cancelled_id, start=turns.cancel_sent_at)
    assert len(late) >= 1, "the simulator no longer sends late audio: this suite cannot fail"


# ---------------------------------------------------------------------------- beta


async def test_beta_client_runs_a_whole_session_through_the_sidecar(
    beta_sim: SimulatorChild, sidecar: Any
) -> None:
    proxy = await sidecar(upstream=beta_sim.ws_url, client_dialect="engine")
    host, port = proxy.sidecar.bound["listen"]
    async with beta_connection(f"ws://{host}:{port}/v1") as conn:
        log = Transcript()
        await recv_until(conn, log, "session.created")
        await recv_until(conn, log, "session.updated")
        await conn.session.update(
            session={
                "modalities": ["audio", "text"],
                "input_audio_format": "pcm16",
                "output_audio_format": "pcm16",
                "turn_detection": None,
            }
        )
        await recv_until(conn, log, "session.updated")
        turns = await completed_then_cancelled(conn, BETA_NAMES)
        _, cancelled_id = check_audio(turns, BETA_NAMES)
        assert_no_stale_audio(turns, BETA_NAMES, cancelled_id)

        beta = openai.types.beta.realtime
        by_type = {e.type: e for e in turns.events}
        assert isinstance(by_type[BETA_NAMES["audio_delta"]], beta.ResponseAudioDeltaEvent)
        assert isinstance(by_type["response.done"], beta.ResponseDoneEvent)
        assert by_type["response.speak"].type == "response.speak"
    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"}) >= 1
