"""The engine simulator as a real child process, seen from a WebSocket client.

Each simulator runs as ``python -m engine_launcher.simulator`` on a free
loopback port; readiness is ``GET /health`` polled under a deadline. The tests
assert what a client observes: event order and shapes, error codes, close
codes, exit codes. A few tests drive the sans-I/O core directly where the wire
cannot show the property (the late-audio cap).
"""

from __future__ import annotations

import array
import asyncio
import base64
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import wave
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine_launcher.simulator.audio import load_wav, make_audio_bank, pcm16_rms
from engine_launcher.simulator.counters import SimulatorStats
from engine_launcher.simulator.duplex_session import DuplexSession
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.handlers import HANDLERS
from engine_launcher.simulator.outbox import CloseFrame
from tests.children import SimulatorChild

# Timeouts scale with the shared factor so slow CI machines can stretch them.
FACTOR = float(os.environ.get("OMNI_SIDECAR_TESTS_TIMEOUT_FACTOR", "1"))
DEADLINE = 10.0 * FACTOR
QUIET = 0.4 * FACTOR  # how long "nothing arrives" is watched for

Event = dict[str, Any]

RESPONSE_HEAD = [
    "response.created",
    "conversation.item.added",
    "conversation.item.created",
    "response.output_item.added",
    "response.content_part.added",
    "response.speak",
]
COMMIT_FANOUT = [
    "conversation.item.added",
    "conversation.item.created",
    "input_audio_buffer.committed",
    "conversation.item.input_audio_transcription.completed",
    "conversation.item.done",
]
GA = {
    "audio_delta": "response.output_audio.delta",
    "transcript_delta": "response.output_audio_transcript.delta",
    "audio_done": "response.output_audio.done",
    "transcript_done": "response.output_audio_transcript.done",
}
BETA = {
    "audio_delta": "response.audio.delta",
    "transcript_delta": "response.audio_transcript.delta",
    "audio_done": "response.audio.done",
    "transcript_done": "response.audio_transcript.done",
}


def terminal_types(names: dict[str, str], *, cleared: bool = False) -> list[str]:
    """The closing sequence of a response (docs/engine-protocol.md, Response sequence; Cancellation
    in the engine)."""
    head = ["output_audio_buffer.cleared"] if cleared else []
    return head + [
        names["audio_done"],
        names["transcript_done"],
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
        "rate_limits.updated",
    ]


def pcm16(ms: int, *, amplitude: float = 0.0, rate: int = 16000) -> str:
    """Base64 PCM16 mono: silence, or a 440 Hz tone of ``amplitude``."""
    n = rate * ms // 1000
    samples = array.array(
        "h", (int(32767 * amplitude * math.sin(2 * math.pi * 440 * i / rate)) for i in range(n))
    )
    if sys.byteorder != "little":
        samples.byteswap()
    return base64.b64encode(samples.tobytes()).decode()


# ------------------------------------------------------------------ processes


def http_get(url: str) -> tuple[int, bytes]:
    """GET returning (status, body); HTTP errors are answers, not exceptions."""
    try:
        with urllib.request.urlopen(url, timeout=2 * FACTOR) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Sim(SimulatorChild):
    """One simulator child process (in this session: the tests signal it themselves)."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        # Ready at the first HTTP answer of /health, whatever its status.
        super().__init__(
            *args, log_path=log_path, new_session=False, ready_status=None,
            ready_timeout=DEADLINE, stop_grace=DEADLINE,
        )  # fmt: skip
        self.base = self.http_url
        self.ws_base = f"ws://127.0.0.1:{self.port}"
        self.start()

    def wait_exit(self, timeout: float = DEADLINE) -> int:
        return super().wait_exit(timeout)


SimFactory = Callable[..., Sim]


@pytest.fixture(scope="module")
def module_sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFactory]:
    """Simulators shared by the module's tests, one process per distinct argv."""
    sims: dict[tuple[str, ...], Sim] = {}

    def start(*args: str) -> Sim:
        if args not in sims:
            sims[args] = Sim(list(args), tmp_path_factory.mktemp("sim") / "sim.log")
            sims[args].wait_ready()
        return sims[args]

    yield start
    for sim in sims.values():
        sim.kill()


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[SimFactory]:
    """Start simulators for one test; all are killed in the finalizer."""
    sims: list[Sim] = []

    def start(*args: str, ready: bool = True) -> Sim:
        sim = Sim(list(args), tmp_path / f"sim{len(sims)}.log")
        sims.append(sim)
        if ready:
            sim.wait_ready()
        return sim

    yield start
    for sim in sims:
        sim.kill()


FAST_ARGS = ("--realtime-factor", "0", "--chunk-ms", "200", "--response-seconds", "1")


@pytest.fixture(scope="module", params=["ga", "beta"])
def fast_sim(request: pytest.FixtureRequest, module_sims: SimFactory) -> Sim:
    """Unpaced (realtime factor 0), 5 chunks of 200 ms, deterministic ids."""
    return module_sims(*FAST_ARGS, "--deterministic", "--event-names", request.param)


@pytest.fixture(scope="module")
def ga_sim(module_sims: SimFactory) -> Sim:
    """The GA flavour of :func:`fast_sim` (the same process)."""
    return module_sims(*FAST_ARGS, "--deterministic", "--event-names", "ga")


@pytest.fixture(scope="module")
def paced_sim(module_sims: SimFactory) -> Sim:
    """0.4 s between chunks: a cancel sent right after a delta lands mid-gap."""
    return module_sims(
        "--chunk-ms", "100", "--realtime-factor", "4", "--response-seconds", "3",
        "--late-audio-chunks", "3",
    )  # fmt: skip


# -------------------------------------------------------------------- client


class Client:
    """A WebSocket client that records every text frame it receives."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.frames: list[str] = []

    async def send(self, event_type: str, **fields: Any) -> None:
        await self.ws.send_str(json.dumps({"type": event_type, **fields}))

    async def recv(self, timeout: float = DEADLINE) -> Event:
        msg = await self.ws.receive(timeout=timeout)
        assert msg.type is aiohttp.WSMsgType.TEXT, f"expected a text frame, got {msg!r}"
        self.frames.append(msg.data)
        event: Event = json.loads(msg.data)
        return event

    async def recv_until(self, event_type: str) -> list[Event]:
        """Receive up to and including the first event of ``event_type``."""
        events: list[Event] = []
        while True:
            events.append(await self.recv())
            if events[-1]["type"] == event_type:
                return events

    async def open(self, **session: Any) -> list[Event]:
        await self.send("session.update", session=session)
        return [await self.recv(), await self.recv()]

    async def speak(self, ms: int = 200, amplitude: float = 0.0) -> None:
        await self.send("input_audio_buffer.append", audio=pcm16(ms, amplitude=amplitude))

    async def expect_quiet_then_heartbeat(self) -> None:
        """Nothing but the heartbeat ack arrives: proves no stray events are queued."""
        await self.send("session.heartbeat")
        event = await self.recv()
        assert event["type"] == "session.heartbeat_ack", event


@asynccontextmanager
async def connect(
    sim: Sim, query: str = "autostart=0", path: str = "/v1/realtime"
) -> AsyncIterator[Client]:
    async with aiohttp.ClientSession() as http:
        url = f"{sim.ws_base}{path}" + (f"?{query}" if query else "")
        async with http.ws_connect(url, max_msg_size=0) as ws:
            yield Client(ws)


def types(events: list[Event]) -> list[str]:
    return [e["type"] for e in events]


async def start_response(client: Client, **session: Any) -> list[Event]:
    """Open, speak, commit with response_create; return events through response.speak."""
    await client.open(**session)
    await client.speak()
    await client.send("input_audio_buffer.commit", response_create=True)
    return await client.recv_until("response.speak")


# ------------------------------------------------------------ full sequence


async def test_full_response_sequence(fast_sim: Sim) -> None:
    names = BETA if "beta" in fast_sim.args else GA
    async with connect(fast_sim) as client:
        created, updated = await client.open(extra_body={"auto_response": False})
        assert created["type"] == "session.created"
        assert "server_event_seq" not in created
        session = created["session"]
        assert re.fullmatch(r"duplex-[0-9a-f]{32}", session["id"])
        assert session["epoch"] == 0
        assert session["capabilities"]["supports_barge_in"] is True
        assert session["capabilities"]["supports_audio_truncate"] is False
        assert session["capabilities"]["chunk_period_ms"] == 200
        assert session["audio"]["output"] == {"format": "pcm16", "sample_rate_hz": 24000}
        assert updated["type"] == "session.updated"
        assert updated["server_event_seq"] == 1

        await client.speak()
        await client.send("input_audio_buffer.commit", response_create=True)
        events = await client.recv_until("rate_limits.updated")

    chunks = [names["audio_delta"], names["transcript_delta"]] * 5
    assert types(events) == COMMIT_FANOUT + RESPONSE_HEAD + chunks + terminal_types(names)
    seqs = [e["server_event_seq"] for e in events]
    assert seqs == list(range(2, 2 + len(events)))
    assert all(re.fullmatch(r"event_[0-9a-f]{32}", e["event_id"]) for e in events)

    response = events[len(COMMIT_FANOUT) :]
    rid = response[0]["response_id"]
    assert re.fullmatch(rf"resp-{session['id']}-0-[0-9a-f]{{8}}", rid)
    assert all(e["response_id"] == rid for e in response[:-1])
    created_resp = response[0]["response"]
    assert created_resp["object"] == "realtime.response"
    assert created_resp["status"] == "in_progress"
    assert created_resp["metadata"]["duplex_event"] == {"epoch": 0, "turn_id": 1}
    deltas = [e for e in response if e["type"] == names["audio_delta"]]
    for n, delta in enumerate(deltas, start=1):
        assert delta["item_id"] == f"item_{rid}"
        assert (delta["output_index"], delta["content_index"]) == (0, 0)
        assert delta["format"] == "pcm16" and delta["sample_rate_hz"] == 24000
        # As the 0.30 engine: duration, mark and ledger are cumulative over the response.
        spoken = "".join(e["delta"] for e in response if e["type"] == names["transcript_delta"])
        text_chars = len(
            "".join(
                e["delta"]
                for e in response[: response.index(delta) + 2]
                if e["type"] == names["transcript_delta"]
            )
        )
        assert 0 < text_chars <= len(spoken)
        assert delta["metadata"] == {
            "session_id": session["id"],
            "epoch": 0,
            "model_speak": True,
            "end_of_turn": n == len(deltas),
            "playback": {
                "generated_ms": 200 * n, "sent_ms": 200 * n, "played_ms": 0, "committed_ms": 0,
            },
            "audio_duration_ms": 200 * n,
            "audio_text_marks": [{"text_chars": text_chars, "audio_end_ms": 200 * n}],
        }  # fmt: skip
        assert len(base64.b64decode(delta["delta"])) == 2 * 24000 * 200 // 1000
    done = response[-2]["response"]
    assert done["status"] == "completed"
    assert done["status_details"] == {"type": "completed", "reason": "stop"}
    assert done["output"][0]["status"] == "completed"
    assert done["metadata"]["committed"] is True
    assert response[-1]["rate_limits"] == []


async def test_deterministic_sessions_are_byte_identical(ga_sim: Sim) -> None:
    async def script() -> list[str]:
        async with connect(ga_sim) as client:
            await client.open(voice="alloy", extra_body={"auto_response": True})
            await client.speak(300)
            await client.send("input_audio_buffer.commit")
            await client.recv_until("rate_limits.updated")
            await client.send("session.close")
            await client.recv_until("session.closed")
            return client.frames

    first, second = await script(), await script()
    assert len(first) > 20
    assert first == second


# ------------------------------------------------------- commit and respond


async def test_commit_starts_response_only_when_asked(ga_sim: Sim) -> None:
    async with connect(ga_sim) as client:
        await client.open()
        await client.send("input_audio_buffer.commit")
        error = await client.recv()
        assert error["error"]["code"] == "input_audio_buffer_empty"

        await client.send("response.create")
        error = await client.recv()
        assert error["error"]["code"] == "response_create_without_input"

        await client.speak()
        await client.send("input_audio_buffer.commit")
        assert types([await client.recv() for _ in COMMIT_FANOUT]) == COMMIT_FANOUT
        await client.expect_quiet_then_heartbeat()  # no response.created

        await client.send("response.create")
        events = await client.recv_until("rate_limits.updated")
        assert events[0]["type"] == "response.created"

    async with connect(ga_sim) as client:
        await client.open(extra_body={"auto_response": True})
        await client.speak()
        await client.send("input.commit")  # alias
        events = await client.recv_until("response.done")
        assert types(events[: len(COMMIT_FANOUT) + 1]) == [*COMMIT_FANOUT, "response.created"]
        assert events[-1]["response"]["status"] == "completed"


async def test_text_item_counts_as_input_for_response_create(ga_sim: Sim) -> None:
    async with connect(ga_sim) as client:
        await client.open()
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hi"}],
        }
        await client.send("conversation.item.create", item=item)
        events = [await client.recv() for _ in range(3)]
        assert types(events) == COMMIT_FANOUT[:2] + ["conversation.item.done"]
        assert re.fullmatch(r"item_[0-9a-f]{32}", events[0]["item"]["id"])
        await client.send("response.create")
        events = await client.recv_until("response.done")
        assert events[0]["type"] == "response.created"
        assert events[-1]["response"]["status"] == "completed"


async def test_heartbeat_ack_and_event_ack(ga_sim: Sim) -> None:
    async with connect(ga_sim) as client:
        created, _ = await client.open()
        await client.send("session.event_ack", server_event_seq=1)  # silently accepted
        await client.send("session.heartbeat")
        ack = await client.recv()
        assert ack["type"] == "session.heartbeat_ack"
        assert ack["session_id"] == created["session"]["id"]
        assert ack["server_event_seq"] == 2


@pytest.mark.parametrize(
    ("close_type", "reason"), [("session.close", "bye"), ("close", None), ("close_session", None)]
)
async def test_session_close(ga_sim: Sim, close_type: str, reason: str | None) -> None:
    async with connect(ga_sim) as client:
        created, _ = await client.open()
        await client.send(close_type, **({"reason": reason} if reason else {}))
        closed = await client.recv()
        assert closed["type"] == "session.closed"
        assert closed["session_id"] == created["session"]["id"]
        assert closed["reason"] == (reason or "client_close")
        msg = await client.ws.receive(timeout=DEADLINE)
        assert msg.type is aiohttp.WSMsgType.CLOSE
        assert client.ws.close_code == 1000


async def test_autostart_with_model_opens_before_any_message(ga_sim: Sim) -> None:
    async with connect(ga_sim, query="model=custom-model") as client:
        created = await client.recv()
        assert created["type"] == "session.created"
        assert created["session"]["model"] == "custom-model"
        assert (await client.recv())["type"] == "session.updated"


# ------------------------------------------------------------------ errors


async def test_bad_input_gets_error_codes(ga_sim: Sim) -> None:
    async with connect(ga_sim) as client:
        # Any other first message opens a default session, then executes.
        await client.send("no.such.event", event_id="evt_client_1")
        assert types([await client.recv(), await client.recv()]) == [
            "session.created",
            "session.updated",
        ]
        error = await client.recv()
        assert error["type"] == "error"
        assert re.fullmatch(r"event_[0-9a-f]{32}", error["event_id"])
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["code"] == "unknown_event"
        assert error["error"]["event_id"] == "evt_client_1"

        for frame, code in [
            ("{not json", "invalid_json"),
            ("[1, 2]", "bad_event"),
            ('{"type": 5}', "bad_event"),
            ('{"type": "input_audio_buffer.append", "audio": "***"}', "bad_event"),
            ('{"type": "input.text.append", "text": "hi"}', "native_text_append_unsupported"),
        ]:
            await client.ws.send_str(frame)
            error = await client.recv()
            assert (error["type"], error["error"]["code"]) == ("error", code), frame

        await client.ws.send_str(
            '{"type":"input_audio_buffer.append","audio":"' + "A" * (15 * 1024 * 1024) + '"}'
        )
        error = await client.recv()
        assert error["error"]["code"] == "event_too_large"
        await client.expect_quiet_then_heartbeat()  # the socket survives


async def test_duplex_zero_gets_flat_error(ga_sim: Sim) -> None:
    async with connect(ga_sim, query="duplex=0") as client:
        assert await client.recv() == {
            "type": "error",
            "error": "Realtime API is not available",
            "code": "unsupported",
        }
        assert (await client.ws.receive(timeout=DEADLINE)).type is aiohttp.WSMsgType.CLOSE


async def test_http_surface(ga_sim: Sim) -> None:
    status, body = http_get(ga_sim.base + "/health")
    assert (status, json.loads(body)) == (200, {"status": "healthy"})
    status, body = http_get(ga_sim.base + "/v1/models")
    models = json.loads(body)
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["omni-sim"]
    status, body = http_get(ga_sim.base + "/metrics")
    text = body.decode()
    assert status == 200
    assert "# TYPE vllm_omni_sim_sessions_active gauge" in text
    assert re.search(r"^vllm_omni_sim_events_sent_total \d+$", text, re.MULTILINE)


# ------------------------------------------------------------ cancellation


@pytest.mark.parametrize(
    ("trigger", "fields", "reason", "cleared_input", "cleared_output"),
    [
        ("response.cancel", {}, "client_cancelled", False, False),
        ("output_audio_buffer.clear", {}, "output_audio_buffer_clear", False, True),
        ("barge_in", {}, "barge_in", False, False),
        ("turn.signal", {"event": "barge_in"}, "barge_in", False, False),
        ("turn.signal", {"event": "response.cancel"}, "client_cancelled", False, False),
        ("input.cancel", {}, "barge_in", True, False),
    ],
)
async def test_cancel_sends_late_audio_then_cancelled_terminal(
    paced_sim: Sim,
    trigger: str,
    fields: dict[str, Any],
    reason: str,
    cleared_input: bool,
    cleared_output: bool,
) -> None:
    async with connect(paced_sim) as client:
        head = await start_response(client)
        rid = head[-1]["response_id"]
        first = await client.recv_until(GA["audio_delta"])
        assert first[-1]["metadata"]["epoch"] == 0
        assert (await client.recv())["type"] == GA["transcript_delta"]

        await client.send(trigger, **fields)
        events = await client.recv_until("rate_limits.updated")

        expected = ["input_audio_buffer.cleared"] if cleared_input else []
        expected += [GA["audio_delta"], GA["transcript_delta"]] * 3
        expected += terminal_types(GA, cleared=cleared_output)
        assert types(events) == expected
        late = [e for e in events if e["type"] == GA["audio_delta"]]
        assert all(e["response_id"] == rid and e["metadata"]["epoch"] == 0 for e in late)
        done = events[-2]
        assert done["response_id"] == rid
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"] == {"type": "cancelled", "reason": reason}
        assert done["response"]["output"][0]["status"] == "cancelled"
        meta = done["response"]["metadata"]
        assert (meta["cancelled_epoch"], meta["epoch"], meta["committed"]) == (0, 1, False)
        await client.expect_quiet_then_heartbeat()  # producer stopped


async def test_response_not_active(paced_sim: Sim) -> None:
    async with connect(paced_sim) as client:
        await client.open()
        await client.send("response.cancel", event_id="evt_c1")
        error = await client.recv()
        assert error["error"]["code"] == "response_not_active"
        assert error["error"]["event_id"] == "evt_c1"
        # A named response while idle is silently ignored.
        await client.send("response.cancel", response_id="resp-gone")
        await client.expect_quiet_then_heartbeat()

        await client.speak()
        await client.send("input_audio_buffer.commit", response_create=True)
        rid = (await client.recv_until("response.speak"))[-1]["response_id"]
        await client.send("response.cancel", response_id="resp-other")
        error = await client.recv()
        assert error["error"]["code"] == "response_not_active"
        await client.send("response.create")
        error = await client.recv()
        assert error["error"]["code"] == "response_already_active"
        await client.send("response.cancel", response_id=rid)
        events = await client.recv_until("response.done")
        assert events[-1]["response"]["status"] == "cancelled"
        # The ids of a non-deterministic simulator are random but well-formed.
        assert re.fullmatch(r"resp-duplex-[0-9a-f]{32}-0-[0-9a-f]{8}", rid)


async def test_server_vad_barge_in(paced_sim: Sim) -> None:
    async with connect(paced_sim) as client:
        await start_response(client, turn_detection={"type": "server_vad"})
        await client.recv_until(GA["audio_delta"])
        # Silence during the response is not speech.
        await client.speak(100, amplitude=0.0)
        await client.send("session.heartbeat")
        events = await client.recv_until("session.heartbeat_ack")
        assert "input_audio_buffer.speech_started" not in types(events)

        await client.speak(100, amplitude=0.3)
        events = await client.recv_until("rate_limits.updated")
        start = types(events).index("input_audio_buffer.speech_started")
        decision = events[start + 1]
        assert decision["type"] == "overlap.decision"
        assert decision["action"] == "barge_in" and decision["epoch"] == 0
        after = events[start + 2 :]
        assert types(after) == [GA["audio_delta"], GA["transcript_delta"]] * 3 + terminal_types(GA)
        done = after[-2]["response"]
        assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        assert done["metadata"]["cancelled_epoch"] == 0


def test_late_audio_never_exceeds_what_was_left() -> None:
    config = SimulatorConfig(chunk_ms=100, response_seconds=0.3, late_audio_chunks=10)
    session = DuplexSession(config, make_audio_bank(100, 8000), SimulatorStats(), handlers=HANDLERS)
    session.receive_text(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16(100)}))
    session.receive_text(json.dumps({"type": "input_audio_buffer.commit", "response_create": True}))
    (rid,) = session.responses_to_start()
    session.produce_chunk(rid)
    session.events_to_send()
    session.receive_text(json.dumps({"type": "response.cancel"}))
    frames = session.events_to_send()
    events = [json.loads(f) for f in frames if not isinstance(f, CloseFrame)]
    assert types(events).count(GA["audio_delta"]) == 2  # 3 chunks, 1 produced, 10 allowed
    assert events[-2]["response"]["metadata"]["playback"]["generated_ms"] == 300


# ------------------------------------------------------------ audio and pace


def test_wav_voice_is_looped_in_chunks(tmp_path: Path) -> None:
    path = tmp_path / "voice.wav"
    pcm = base64.b64decode(pcm16(250, amplitude=0.5))  # 4000 samples at 16 kHz
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(pcm)
    bank = make_audio_bank(100, 16000, load_wav(str(path), 16000))
    chunks = [base64.b64decode(c) for c in bank.chunks]
    assert [len(c) for c in chunks] == [3200, 3200, 3200]
    assert chunks[0] == pcm[:3200]
    assert chunks[2] == pcm[6400:] + pcm[:1600]  # the tail wraps to the start
    assert bank.chunk(3) == bank.chunks[0]


def test_generated_voice_is_speech_like_pcm16() -> None:
    bank = make_audio_bank(80, 24000)
    chunks = [base64.b64decode(c) for c in bank.chunks]
    assert all(len(c) == 2 * 24000 * 80 // 1000 for c in chunks)
    levels = [pcm16_rms(c) for c in chunks]
    assert max(levels) > 0.05  # audible
    assert min(levels) < 0.01  # pauses between words


async def test_listen_events_only_when_asked(start_sim: SimFactory) -> None:
    sim = start_sim("--listen-events", "--chunk-ms", "100")
    async with connect(sim, query="model=omni-sim") as client:
        await client.recv_until("session.updated")
        listens = [await client.recv(), await client.recv()]
        assert types(listens) == ["response.listen", "response.listen"]
        assert listens[0]["epoch"] == 0
        assert listens[0]["response"]["status"] == "listening"
        assert "response_id" not in listens[0]  # no pre-created response to end


async def test_slow_client_grows_the_unbounded_outbox(start_sim: SimFactory) -> None:
    sim = start_sim("--realtime-factor", "0", "--response-seconds", "300")
    queued = re.compile(rb"^vllm_omni_sim_outbox_events (\d+)$", re.MULTILINE)
    async with connect(sim, query="model=omni-sim") as client:
        await client.speak()
        await client.send("input_audio_buffer.commit", response_create=True)
        # Never read: the engine keeps queueing instead of failing the session.
        deadline = time.monotonic() + DEADLINE
        while True:
            match = queued.search(http_get(sim.base + "/metrics")[1])
            assert match is not None
            if int(match.group(1)) > 100:
                break
            assert time.monotonic() < deadline, "outbox never grew"
            await asyncio.sleep(0.05)
        assert not client.ws.closed


# -------------------------------------------------------------- fault knobs


async def test_sigterm_closes_sessions_with_1001_and_exits_zero(start_sim: SimFactory) -> None:
    sim = start_sim()
    async with connect(sim, query="model=omni-sim") as client:
        created = await client.recv()
        await client.recv()
        sim.proc.send_signal(signal.SIGTERM)
        closed = await client.recv()
        assert closed["type"] == "session.closed"
        assert closed["reason"] == "shutdown"
        assert closed["session_id"] == created["session"]["id"]
        assert (await client.ws.receive(timeout=DEADLINE)).type is aiohttp.WSMsgType.CLOSE
        assert client.ws.close_code == 1001
    assert sim.wait_exit() == 0


def test_ignore_sigterm_survives_until_sigkill(start_sim: SimFactory) -> None:
    sim = start_sim("--ignore-sigterm")
    sim.proc.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        sim.proc.wait(timeout=QUIET)
    assert http_get(sim.base + "/health")[0] == 200
    sim.proc.send_signal(signal.SIGKILL)
    assert sim.wait_exit() == -signal.SIGKILL


def test_crash_after_exits_abruptly(start_sim: SimFactory) -> None:
    sim = start_sim("--crash-after", "0.3")
    assert sim.wait_exit() == 1


def test_health_fail_after_flips_to_503(start_sim: SimFactory) -> None:
    sim = start_sim("--health-fail-after", "1.0")
    assert http_get(sim.base + "/health")[0] == 200
    deadline = time.monotonic() + DEADLINE
    while (answer := http_get(sim.base + "/health"))[0] == 200:
        assert time.monotonic() < deadline, "health never failed"
        time.sleep(0.05)
    assert answer[0] == 503
    assert json.loads(answer[1]) == {"status": "unhealthy"}


def test_startup_delay_delays_listening(start_sim: SimFactory) -> None:
    sim = start_sim("--startup-delay", "0.6", ready=False)
    assert sim.wait_ready() >= 0.6


async def test_stall_after_stops_all_traffic_but_keeps_sockets(start_sim: SimFactory) -> None:
    sim = start_sim("--stall-after", "0.8")
    async with connect(sim, query="model=omni-sim", path="/v1/duplex") as client:
        await client.recv_until("session.updated")
        deadline = time.monotonic() + DEADLINE
        stalled = re.compile(rb"^vllm_omni_sim_stalled 1$", re.MULTILINE)
        while not stalled.search(http_get(sim.base + "/metrics")[1]):
            assert time.monotonic() < deadline, "never stalled"
            await asyncio.sleep(0.05)
        await client.send("session.heartbeat")
        with pytest.raises(TimeoutError):
            await client.ws.receive(timeout=QUIET)
        assert not client.ws.closed
        # Even stalled, SIGTERM stops it promptly (no drain to wait for).
        sim.proc.send_signal(signal.SIGTERM)
        assert sim.wait_exit() == 0
