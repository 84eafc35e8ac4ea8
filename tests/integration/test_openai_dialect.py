"""The OpenAI Realtime dialect at the front door, with the ``openai`` SDK's clients (issue 39).

Each stock client, unmodified, through the sidecar in front of the simulator,
on both profiles: a 0.32-like engine with MiniCPM-o-like audio (PCM16 24 kHz
out, PCM16 16 kHz in) and a 0.30-like engine with Nemotron-like audio (PCM16
22.05 kHz in 80 ms packets out, ``pcm_f32le`` 16 kHz in, late audio after a
cancel). What a LiveKit- or Agents-SDK-style client does by default is sent as
such: ``semantic_vad`` turn detection, ``response.create`` without a commit,
``response.metadata``, a ``response.cancel`` without an id, the truncation of
the interrupted item, a cancel when nothing runs. Every frame the client gets
validates against the ``openai`` package's own server-event model of its type,
no ``error`` comes, audio is 24 kHz PCM16 lasting what the engine produced, and
no audio of the cancelled response arrives after the cancel.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import pytest

from engine_launcher.engine_config import EngineConfig
from tests.conftest import DEADLINE, TIMEOUT_FACTOR
from tests.integration.helpers import SimulatorChild, module_simulator, pcm16_b64
from tests.integration.openai_models import ServerEvents
from tests.integration.speech import chunks, needs_espeak, silence_24k, speech_24k

openai = pytest.importorskip("openai", reason="pip install 'openai[realtime]>=1.107'")
pytest.importorskip("websockets", reason="pip install 'openai[realtime]' (needs websockets)")

MODEL: Final = "omni-sim"
API_KEY: Final = "sk-test"
PACE: Final = ("--realtime-factor", f"{TIMEOUT_FACTOR:g}", "--response-seconds", "1")
#: 200 ms of 24 kHz PCM16 silence: what a stock client sends.
INPUT_AUDIO: Final = pcm16_b64(200, rate=24000)
PCM_24K: Final = {"type": "audio/pcm", "rate": 24000}
NAMES: Final = {
    "ga": ("response.output_audio.delta", "response.output_audio_transcript.delta"),
    "beta": ("response.audio.delta", "response.audio_transcript.delta"),
}


@dataclass(frozen=True)
class Profile:
    name: str
    sim: SimulatorChild
    version: str
    engine_rate: int


@pytest.fixture(scope="module")
def minicpmo_sim() -> Iterator[SimulatorChild]:
    args = ("--model", MODEL, "--engine-version", "0.32", "--audio-profile", "minicpmo")
    with module_simulator(*args, "--chunk-ms", "200", *PACE) as sim:
        yield sim


@pytest.fixture(scope="module")
def nemotron_sim() -> Iterator[SimulatorChild]:
    args = ("--model", MODEL, "--engine-version", "0.30", "--audio-profile", "nemotron")
    # 200 ms packets (the profile's own are 80 ms), as for minicpmo: a stack's
    # interruption must not race a packet the sidecar wrote before the cancel reached
    # it (on a loaded machine the cancel's round trip can take longer than 80 ms).
    with module_simulator(*args, "--chunk-ms", "200", "--late-audio-chunks", "3", *PACE) as sim:
        yield sim


@pytest.fixture(params=["minicpmo-0.32", "nemotron-0.30"])
def profile(request: pytest.FixtureRequest) -> Profile:
    if request.param.startswith("minicpmo"):
        return Profile(request.param, request.getfixturevalue("minicpmo_sim"), "0.32", 24000)
    return Profile(request.param, request.getfixturevalue("nemotron_sim"), "0.30", 22050)


async def start_sidecar(sidecar: Any, profile: Profile, **overrides: Any) -> Any:
    url = profile.sim.ws_url
    engine = EngineConfig(kind="external", upstream=url, version=profile.version)
    return await sidecar(upstream=url, engine=engine, **overrides)


@dataclass
class Session:
    """Every frame the client got, validated, in order."""

    conn: Any
    validator: ServerEvents
    events: list[dict[str, Any]] = field(default_factory=list)

    async def until(self, match: str | Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        check = (lambda e: e["type"] == match) if isinstance(match, str) else match
        async with asyncio.timeout(DEADLINE):
            while True:
                raw = await self.conn.recv_bytes()
                event = self.validator.validate(raw)
                self.conn.parse_event(raw)  # and the SDK's own parser takes it
                self.events.append(event)
                if check(event):
                    return event

    async def seen(self, kind: str) -> dict[str, Any]:
        """The first ``kind`` event got so far, or the next one."""
        got = self.of(kind)
        return got[0] if got else await self.until(kind)

    def of(self, kind: str, response_id: str | None = None, start: int = 0) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events[start:]
            if e["type"] == kind and (response_id is None or e.get("response_id") == response_id)
        ]


@contextlib.asynccontextmanager
async def connection(proxy: Any, flavour: str) -> AsyncIterator[Any]:
    host, port = proxy.sidecar.bound["listen"]
    if flavour == "ga":
        client = openai.AsyncOpenAI(
            base_url=f"http://{host}:{port}/v1", api_key=API_KEY, max_retries=0
        )
        manager = client.realtime.connect(model=MODEL)
    else:
        client = openai.AsyncOpenAI(
            api_key=API_KEY, websocket_base_url=f"ws://{host}:{port}/v1", max_retries=0
        )
        manager = client.beta.realtime.connect(model=MODEL)
    try:
        async with asyncio.timeout(DEADLINE):
            conn = await manager.__aenter__()
        try:
            yield conn
        finally:
            async with asyncio.timeout(DEADLINE):
                await manager.__aexit__(None, None, None)
    finally:
        await client.close()


def stock_session_update(flavour: str) -> dict[str, Any]:
    """What LiveKit's and the Agents SDK's defaults send: semantic VAD, 24 kHz PCM."""
    vad = {"type": "semantic_vad", "create_response": True, "interrupt_response": True}
    if flavour == "ga":
        return {
            "type": "realtime",
            "output_modalities": ["audio"],
            "instructions": "Be brief.",
            "audio": {
                "input": {"format": PCM_24K, "turn_detection": vad},
                "output": {"format": PCM_24K, "voice": "alloy"},
            },
        }
    return {
        "modalities": ["audio", "text"],
        "instructions": "Be brief.",
        "input_audio_format": "pcm16",
        "output_audio_format": "pcm16",
        "turn_detection": vad,
    }


def audio_ms(session: Session, flavour: str, response_id: str) -> tuple[float, float]:
    """(ms of 24 kHz PCM16 the client got, ms the engine said it produced)."""
    deltas = session.of(NAMES[flavour][0], response_id)
    pcm = b"".join(base64.b64decode(d["delta"]) for d in deltas)
    assert len(pcm) % 2 == 0
    engine_ms = max(
        (d.get("metadata") or {}).get("audio_duration_ms", 0) for d in deltas if "metadata" in d
    )
    return len(pcm) / 2 / 24000 * 1000, float(engine_ms)


@pytest.mark.parametrize("flavour", ["ga", "beta"])
async def test_a_stock_client_holds_a_call_on_both_profiles(
    flavour: str, profile: Profile, sidecar: Any
) -> None:
    proxy = await start_sidecar(sidecar, profile)
    async with connection(proxy, flavour) as conn:
        s = Session(conn, ServerEvents(flavour))
        created = await s.until("session.created")
        if flavour == "ga":
            assert created["session"]["audio"]["input"]["format"] == PCM_24K
            assert created["session"]["audio"]["output"]["format"] == PCM_24K
            assert created["session"]["model"] == MODEL
        else:
            assert created["session"]["input_audio_format"] == "pcm16"
        assert "resume_token" not in created
        await conn.session.update(session=stock_session_update(flavour))
        updated = await s.until(
            lambda e: e["type"] == "session.updated" and e["session"]["instructions"]
        )
        td = (
            updated["session"]["audio"]["input"]["turn_detection"]
            if flavour == "ga"
            else updated["session"]["turn_detection"]
        )
        # Taken, not refused: the sidecar's own turn detection does it.
        assert (td["type"], td["create_response"]) == ("semantic_vad", True)

        # Turn 1: response.create with uncommitted input, and the client's metadata.
        await conn.input_audio_buffer.append(audio=INPUT_AUDIO)
        await conn.send(
            {
                "type": "response.create",
                "event_id": "client_evt_1",
                "response": {"metadata": {"client_event_id": "client_evt_1"}},
            }
        )
        first = await s.until("response.created")
        assert first["response"]["metadata"] == {"client_event_id": "client_evt_1"}
        rid = first["response"]["id"]
        done = await s.until("response.done")
        assert done["response"]["status"] == "completed"
        assert done["response"]["metadata"] == {"client_event_id": "client_evt_1"}
        got_ms, engine_ms = audio_ms(s, flavour, rid)
        assert engine_ms >= 900
        assert abs(got_ms - engine_ms) <= 1000 / profile.engine_rate + 1000 / 24000

        # Turn 2: interrupted as LiveKit does: cancel without an id, then truncate the item.
        await conn.input_audio_buffer.append(audio=INPUT_AUDIO)
        await conn.response.create()
        delta = await s.until(NAMES[flavour][0])
        cancel_at = len(s.events)
        await conn.response.cancel()
        await conn.send(
            {
                "type": "conversation.item.truncate",
                "item_id": delta["item_id"],
                "content_index": 0,
                "audio_end_ms": 100,
            }
        )
        cancelled = await s.until(
            lambda e: e["type"] == "response.done" and e["response"]["id"] == delta["response_id"]
        )
        assert cancelled["response"]["status"] == "cancelled"
        assert cancelled["response"]["status_details"]["reason"] == "client_cancelled"
        late = s.of(NAMES[flavour][0], delta["response_id"], start=cancel_at)
        assert late == [], f"{len(late)} audio delta(s) of the cancelled response after the cancel"
        truncated = await s.seen("conversation.item.truncated")
        assert truncated["item_id"] == delta["item_id"]
        assert truncated["audio_end_ms"] == 100

        # A cancel when nothing runs (an interrupt between turns): no error.
        await conn.response.cancel()
        await conn.input_audio_buffer.append(audio=INPUT_AUDIO)
        await conn.input_audio_buffer.commit()
        await s.until("input_audio_buffer.committed")
    assert s.of("error") == []
    types = {e["type"] for e in s.events}
    assert "response.speak" not in types  # an engine extension OpenAI has no model for
    assert ("conversation.item.added" in types) is (flavour == "ga")
    if profile.version == "0.30":
        dropped = proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"})
        assert dropped >= 1  # the engine's late audio was there, and removed


async def test_the_engine_protocol_passes_untouched_with_duplex_1(
    profile: Profile, sidecar: Any
) -> None:
    """An OpenAI-looking client that asks for ``duplex=1`` gets the engine's own frames."""
    proxy = await start_sidecar(sidecar, profile)
    host, port = proxy.sidecar.bound["listen"]
    import aiohttp

    url = f"ws://{host}:{port}/v1/realtime?model={MODEL}&duplex=1"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as http, http.ws_connect(url, headers=headers) as ws:
        async with asyncio.timeout(DEADLINE):
            first = await ws.receive_json()
    assert first["type"] == "session.created"
    assert "resume_token" in first  # the engine's own object, not OpenAI's
    assert first["session"]["audio"]["output"]["sample_rate_hz"] == profile.engine_rate


async def send_pcm(conn: Any, pcm: bytes) -> None:
    for piece in chunks(pcm):
        await conn.input_audio_buffer.append(audio=base64.b64encode(piece).decode())


@needs_espeak
@pytest.mark.parametrize("flavour", ["ga", "beta"])
async def test_the_sidecar_takes_turns_and_barge_in_as_openai_does(
    flavour: str, profile: Profile, sidecar: Any
) -> None:
    """OpenAI's default server VAD, done by the sidecar: the client only streams audio.
    Speech, then silence: speech_started, speech_stopped, the commit and a response.
    Speech over that response: it is cancelled, and none of its audio follows."""
    proxy = await start_sidecar(sidecar, profile)
    async with connection(proxy, flavour) as conn:
        s = Session(conn, ServerEvents(flavour))
        await s.until("session.created")
        await send_pcm(conn, speech_24k("Hello there, what time is it?") + silence_24k(1200))
        started = await s.until("input_audio_buffer.speech_started")
        stopped = await s.until("input_audio_buffer.speech_stopped")
        assert stopped["item_id"] == started["item_id"]
        assert stopped["audio_end_ms"] > started["audio_start_ms"] + 500
        await s.seen("input_audio_buffer.committed")
        created = await s.seen("response.created")
        delta = await s.until(NAMES[flavour][0])
        assert delta["response_id"] == created["response"]["id"]
        # The user talks over it.
        await send_pcm(conn, speech_24k("No, stop, wait a moment."))
        await s.until(
            lambda e: e["type"] == "input_audio_buffer.speech_started" and e is not started
        )
        barge_at = len(s.events)
        done = await s.until(
            lambda e: (
                e["type"] == "response.done" and e["response"]["id"] == created["response"]["id"]
            )
        )
        assert done["response"]["status"] == "cancelled"
        late = s.of(NAMES[flavour][0], created["response"]["id"], start=barge_at)
        assert late == [], f"{len(late)} audio delta(s) of the interrupted response after it"
    assert s.of("error") == []
