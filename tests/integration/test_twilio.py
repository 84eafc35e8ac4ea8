"""Phone calls through /v1/twilio: a scripted Twilio Media Streams caller (docs/design.md,
Phone front door).

The caller speaks Twilio's protocol over a real loopback socket to an in-process
sidecar in front of the simulator child, in both audio profiles: MiniCPM-o-like
(PCM16 16 kHz in, PCM16 24 kHz out, the engine's own voice detection) and
Nemotron-like (f32le 16 kHz in, PCM16 22.05 kHz out, the sidecar's detector).
What it says is speech synthesized by espeak-ng (skipped without it), sent as
20 ms mu-law frames at real-time pace; it plays what it gets back like Twilio
does (20 ms a frame, marks echoed when played up to them, ``clear`` drops the
queue and echoes its marks), so the marks the sidecar gets are the truth.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import numpy as np
import orjson
import pytest

from proxy.core.audio_convert import AudioConverter
from proxy.core.audio_formats import G711_ULAW, AudioError, AudioFormat, Encoding, decode_samples
from tests.aiohttp_private import abort
from tests.conftest import DEADLINE, MS, RunningSidecar, wait_until
from tests.integration.helpers import SimulatorChild, module_simulator, sim_metric

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="needs espeak-ng (apt-get install espeak-ng)"
)

FRAME: Final = 160  # bytes of mu-law: 20 ms at 8 kHz
FRAME_S: Final = 0.02
#: The simulator's chunk: one engine delta, one mark.
CHUNK_MS: Final = 100
#: The simulator's reply to every turn, generated twice as fast as it plays (real
#: engines run ahead of real time; the sidecar paces what Twilio gets).
REPLY_MS: Final = 4000
GENERATION_SPEED: Final = 2

PROFILES: Final = {
    "minicpmo": {
        "sim": ("--sample-rate", "24000"),
        "sidecar": {
            "twilio_engine_input_format": "pcm16",
            "twilio_turn_detection": "engine",
        },
    },
    "nemotron": {
        "sim": ("--sample-rate", "22050"),
        "sidecar": {
            "twilio_engine_input_format": "pcm_f32le",
            "twilio_turn_detection": "sidecar",
        },
    },
}


# -- speech -------------------------------------------------------------------------------


def _espeak(text: str, path: Path) -> bytes:
    """``text`` spoken by espeak-ng, as mu-law 8 kHz."""
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, timeout=30)
    with wave.open(str(path)) as wav:
        rate, pcm = wav.getframerate(), wav.readframes(wav.getnframes())
    converter = AudioConverter(AudioFormat(Encoding.PCM16, rate), G711_ULAW)
    out = converter.convert(pcm)
    assert isinstance(out, bytes)
    return out + converter.flush()


def _onset(mulaw: bytes) -> int:
    """Index of the first 20 ms frame whose level is speech (RMS above -30 dBFS)."""
    samples = decode_samples(Encoding.MULAW, mulaw)
    assert not isinstance(samples, AudioError)
    for i in range(len(samples) // FRAME):
        frame = samples[i * FRAME : (i + 1) * FRAME]
        if float(np.sqrt(np.mean(np.square(frame)))) > 10 ** (-30 / 20):
            return i
    raise AssertionError("no speech in the synthesized audio")


@dataclass(frozen=True)
class Speech:
    mulaw: bytes
    onset_frame: int  # frames of leading silence espeak-ng put before the voice


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Speech]:
    base = tmp_path_factory.mktemp("speech")
    out = {}
    for name, text in (
        ("question", "Hello, what is the weather like today?"),
        ("interrupt", "Wait, stop, I have another question."),
    ):
        audio = _espeak(text, base / f"{name}.wav")
        out[name] = Speech(audio, _onset(audio))
    return out


# -- the scripted Twilio side ---------------------------------------------------------------


SILENCE: Final = b"\xff" * FRAME


@dataclass
class Caller:
    """Twilio's half of a stream: sends the caller's frames, plays what comes back."""

    ws: aiohttp.ClientWebSocketResponse
    sid: str = "MZ00000000000000000000000000000001"
    #: (arrival time, payload) of every media frame, and of every clear.
    media: list[tuple[float, bytes]] = field(default_factory=list)
    clears: list[float] = field(default_factory=list)
    marks_echoed: list[str] = field(default_factory=list)
    other: list[dict[str, Any]] = field(default_factory=list)
    #: Twilio's playout queue: frames and marks in order.
    _queue: list[tuple[str, Any]] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    #: The phone network's delay before the caller hears the first frame (a jitter
    #: buffer): the sidecar cannot see it except through the marks.
    playout_delay: float = 0.3
    #: Frames the caller has heard, and how many of them when the first clear came.
    played: int = 0
    played_at_clear: int | None = None
    _audio: asyncio.Event = field(default_factory=asyncio.Event)

    async def open(self, custom: dict[str, str] | None = None) -> None:
        connected = {"event": "connected", "protocol": "Call", "version": "1.0.0"}
        await self.ws.send_str(orjson.dumps(connected).decode())
        start = {
            "event": "start",
            "sequenceNumber": "1",
            "streamSid": self.sid,
            "start": {
                "streamSid": self.sid,
                "accountSid": "AC00000000000000000000000000000001",
                "callSid": "CA00000000000000000000000000000001",
                "tracks": ["inbound"],
                "customParameters": custom or {},
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            },
        }
        await self.ws.send_str(orjson.dumps(start).decode())

    async def send_audio(self, mulaw: bytes, *, started: float | None = None) -> float:
        """Send ``mulaw`` as 20 ms frames at real-time pace; returns when the first went."""
        loop = asyncio.get_running_loop()
        t0 = loop.time() if started is None else started
        for i in range(0, len(mulaw) - FRAME + 1, FRAME):
            await _sleep_until(t0 + (i // FRAME) * FRAME_S)
            payload = base64.b64encode(mulaw[i : i + FRAME]).decode()
            media = {"track": "inbound", "payload": payload}
            msg = {"event": "media", "streamSid": self.sid, "media": media}
            if self.ws.closed:
                break
            await self.ws.send_str(orjson.dumps(msg).decode())
        return t0

    async def silence(self, seconds: float) -> None:
        await self.send_audio(SILENCE * round(seconds / FRAME_S))

    async def stop(self) -> None:
        await self.ws.send_str(
            orjson.dumps({"event": "stop", "streamSid": self.sid, "stop": {}}).decode()
        )

    async def run(self) -> None:
        """Read Twilio's side of the stream and play it out (20 ms a frame)."""
        player = asyncio.create_task(self._play())
        try:
            async for msg in self.ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    continue
                body = orjson.loads(msg.data)
                now = time.monotonic()
                kind = body.get("event")
                assert body.get("streamSid") == self.sid, body
                if kind == "media":
                    payload = base64.b64decode(body["media"]["payload"])
                    self.media.append((now, payload))
                    self._queue.append(("media", payload))
                    self._audio.set()
                elif kind == "mark":
                    self._queue.append(("mark", body["mark"]["name"]))
                elif kind == "clear":
                    self.clears.append(now)
                    if self.played_at_clear is None:
                        self.played_at_clear = self.played
                    dropped = [v for k, v in self._queue if k == "mark"]
                    self._queue.clear()
                    for name in dropped:  # Twilio echoes the marks a clear dropped
                        await self._echo(name)
                else:
                    self.other.append(body)
        finally:
            player.cancel()
            self.closed.set()

    async def _play(self) -> None:
        await self._audio.wait()
        await asyncio.sleep(self.playout_delay)
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            if self._queue and self._queue[0][0] == "mark":
                await self._echo(self._queue.pop(0)[1])
                continue
            if self._queue:
                self._queue.pop(0)
                self.played += 1
            tick = max(tick + FRAME_S, loop.time() - FRAME_S)
            await _sleep_until(tick)

    async def _echo(self, name: str) -> None:
        self.marks_echoed.append(name)
        if not self.ws.closed:
            msg = {"event": "mark", "streamSid": self.sid, "mark": {"name": name}}
            await self.ws.send_str(orjson.dumps(msg).decode())


async def _sleep_until(when: float) -> None:
    delay = when - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest) -> Iterator[tuple[str, SimulatorChild]]:
    name = request.param
    with module_simulator(
        "--chunk-ms",
        str(CHUNK_MS),
        "--response-seconds",
        str(REPLY_MS / 1000),
        "--generation-speed",
        str(GENERATION_SPEED),
        *PROFILES[name]["sim"],
    ) as sim:
        yield name, sim


Start = Callable[..., Awaitable[RunningSidecar]]


async def _sidecar(
    start: Start, profile: tuple[str, SimulatorChild], **extra: Any
) -> RunningSidecar:
    name, sim = profile
    return await start(upstream=sim.ws_url, **PROFILES[name]["sidecar"], **extra)


def _twilio_url(sc: RunningSidecar) -> str:
    return sc.url.replace("/v1/realtime", "/v1/twilio")


@pytest.fixture
async def calls() -> AsyncIterator[Callable[..., Awaitable[Caller]]]:
    """Factory: ``await calls(sidecar, headers=...)`` connects a caller and starts its reader."""
    http = aiohttp.ClientSession()
    tasks: list[asyncio.Task[None]] = []

    async def dial(sc: RunningSidecar, **kwargs: Any) -> Caller:
        ws = await http.ws_connect(_twilio_url(sc), **kwargs)
        caller = Caller(ws)
        tasks.append(asyncio.create_task(caller.run()))
        return caller

    yield dial
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await http.close()


async def _ask(caller: Caller, speech: Speech) -> None:
    """Say ``speech`` and keep the line open (silence) as a phone does."""
    await caller.silence(0.2)
    await caller.send_audio(speech.mulaw)


async def _keep_talking_silence(caller: Caller, until: Callable[[], bool]) -> None:
    """Silence frames (a phone line never stops sending) until ``until()``."""
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not until() and asyncio.get_running_loop().time() < deadline:
        await caller.silence(0.1)


async def _first_reply(sim: SimulatorChild) -> tuple[int, int]:
    """The first assistant reply in the engine's history (the one open session): the
    audio it keeps (ms) and the audio the engine generated of it (ms)."""
    async with aiohttp.ClientSession() as http, http.get(f"{sim.http_url}/debug/history") as r:
        sessions = (await r.json())["sessions"]
    (history,) = sessions.values()
    # A reply of which nothing was heard is out of history (its text too): under pending.
    replies = [i for i in history["items"] + history["pending"] if i.get("role") == "assistant"]
    assert replies, history
    return int(replies[0]["audio_ms"]), int(replies[0]["generated_ms"])


# -- the tests -------------------------------------------------------------------------------


async def test_call_gets_answer_in_mulaw_20ms_frames_at_real_time_pace(
    sidecar: Start, calls: Any, profile: tuple[str, SimulatorChild], speech: dict[str, Speech]
) -> None:
    sc = await _sidecar(sidecar, profile)
    caller = await calls(sc)
    await caller.open()
    await _ask(caller, speech["question"])
    # The answer: the simulator's 3 s reply, cut into 20 ms frames.
    await _keep_talking_silence(caller, lambda: len(caller.media) >= 100)
    assert len(caller.media) >= 100, "no answer"
    assert all(len(p) == FRAME for _, p in caller.media)
    first = caller.media[0][0]
    # Real-time pace: what has arrived is never more than the time since the first
    # frame plus the pacing lead (0.5 s) and one engine chunk (and a scheduling margin).
    arrived_s = [(t - first, (i + 1) * FRAME_S) for i, (t, _) in enumerate(caller.media[:100])]
    assert all(audio <= elapsed + 0.5 + CHUNK_MS / 1000 + 0.25 for elapsed, audio in arrived_s)
    # And not a burst: the 2 s of audio took at least a second to come.
    assert arrived_s[-1][0] >= 1.0
    # Marks are echoed, and the ledger acks what was heard (not what was sent).
    await wait_until(lambda: len(caller.marks_echoed) >= 3, what="marks echoed")
    assert sc.metric("omni_sidecar_front_door_sessions_total", {"front_door": "twilio"}) == 1


#: When the caller interrupts: early, while the engine still generates the answer
#: (the engine's voice detection hears it where it has one), or late, when the engine
#: is done and only Twilio and the sidecar's pacing still hold it (the sidecar's).
#: Frames the caller has heard of the answer by then.
WHEN: Final = {"early": 10, "late": round(REPLY_MS * 0.55 / 1000 / FRAME_S)}


@pytest.mark.parametrize("when", sorted(WHEN))
async def test_barge_in_clears_within_500_ms_and_no_old_audio_follows(
    sidecar: Start,
    calls: Any,
    profile: tuple[str, SimulatorChild],
    speech: dict[str, Speech],
    when: str,
) -> None:
    sc = await _sidecar(sidecar, profile)
    caller = await calls(sc)
    await caller.open()
    await _ask(caller, speech["question"])
    await _keep_talking_silence(caller, lambda: caller.played >= WHEN[when])
    assert caller.played >= WHEN[when], "no answer to interrupt"
    if when == "late":
        # The engine is done with the answer; only the sidecar's pacing and Twilio hold it.
        async def generated() -> bool:
            return (await _first_reply(profile[1]))[1] == REPLY_MS

        await wait_until(generated, what="the engine finished generating the answer")
        assert caller.media and not caller.clears
    answered = len(caller.media)
    interrupt = speech["interrupt"]
    t0 = await caller.send_audio(interrupt.mulaw)
    sent_done = asyncio.get_running_loop().time()
    onset = t0 + interrupt.onset_frame * FRAME_S
    assert caller.clears, "no clear"
    clear_at = caller.clears[0]
    # asyncio's loop clock and time.monotonic() are the same clock on Linux.
    assert clear_at - onset <= 500 * MS, f"clear {clear_at - onset:.3f} s after the speech onset"
    assert clear_at > onset - 0.05, "a clear before the caller spoke"
    # Nothing of the old answer after the clear: no frame until the caller's new
    # turn ended (the sidecar commits it only after its end-of-turn silence).
    late = [t for t, _ in caller.media[answered:] if t > clear_at and t < sent_done]
    assert late == [], f"{len(late)} frames of the cancelled answer after the clear"
    # The engine's history keeps what the caller heard by the marks, not what was
    # sent nor the sidecar's wall-clock estimate (the caller hears 0.3 s late).
    heard_ms = FRAME_S * 1000 * (caller.played_at_clear or 0)
    kept, generated = await _first_reply(profile[1])
    assert kept <= heard_ms, (kept, heard_ms)
    assert kept >= heard_ms - CHUNK_MS - 3 * FRAME_S * 1000, (kept, heard_ms)
    if when == "early":
        # And the engine stopped generating it (cancelled upstream, not just hidden).
        assert generated < REPLY_MS, f"the engine generated the whole reply ({generated} ms)"
    await caller.silence(1.0)
    source = "engine" if profile[0] == "minicpmo" and when == "early" else "sidecar"
    await caller.stop()
    await wait_until(
        lambda: sc.metric("omni_sidecar_twilio_clears_total", {"source": source}) >= 1,
        what="clear counted",
    )


async def test_stop_frees_the_engine_slot_within_a_second(
    sidecar: Start, calls: Any, profile: tuple[str, SimulatorChild], speech: dict[str, Speech]
) -> None:
    _, sim = profile
    sc = await _sidecar(sidecar, profile)
    caller = await calls(sc)
    await caller.open()
    await _ask(caller, speech["question"])
    await _keep_talking_silence(caller, lambda: len(caller.media) >= 10)  # mid-answer

    async def engine_sessions() -> float:
        return await sim_metric(sim, "vllm_omni_sim_sessions_active")

    assert sc.metric("omni_sidecar_sessions_active") == 1
    assert sc.metric("omni_sidecar_session_slots_used") == 1
    assert await engine_sessions() == 1
    await caller.stop()  # the caller hung up; Twilio keeps its socket open until we close

    async def freed() -> bool:
        slots = sc.metric("omni_sidecar_session_slots_used")
        return slots == 0 and await engine_sessions() == 0

    await wait_until(freed, timeout=1000 * MS, what="the call's slots freed within a second")
    assert sc.metric("omni_sidecar_sessions_active") == 0
    await wait_until(lambda: caller.closed.is_set(), what="Twilio's socket closed by the sidecar")


async def test_dropped_twilio_socket_frees_the_engine_slot(
    sidecar: Start, calls: Any, profile: tuple[str, SimulatorChild]
) -> None:
    _, sim = profile
    sc = await _sidecar(sidecar, profile, client_resume_grace=30.0)
    caller = await calls(sc)
    await caller.open()
    await caller.silence(0.3)
    await wait_until(lambda: sc.metric("omni_sidecar_sessions_active") == 1, what="session")
    abort(caller.ws)  # no close frame: Twilio's side of the network went away
    await wait_until(lambda: sc.metric("omni_sidecar_sessions_active") == 0, what="slot freed")

    async def engine_idle() -> bool:
        return await sim_metric(sim, "vllm_omni_sim_sessions_active") == 0

    await wait_until(engine_idle, what="the engine's session closed (not held for a resume)")


TOKEN: Final = "0123456789abcdef0123456789abcdef"


async def test_wrong_signature_is_refused_before_any_engine_session(
    sidecar: Start, calls: Any, simulator: Any
) -> None:
    from twilio.request_validator import RequestValidator

    sim = await simulator("--chunk-ms", str(CHUNK_MS))
    sc = await sidecar(upstream=sim.ws_url, twilio_auth_token=TOKEN, api_keys=("k-phone",))
    url = _twilio_url(sc)
    signed = "wss://" + url.removeprefix("ws://")
    for headers in ({}, {"X-Twilio-Signature": "bm90IHRoZSBzaWduYXR1cmU="}):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await calls(sc, headers=headers)
        assert refused.value.status == 403
    assert await sim_metric(sim, "vllm_omni_sim_sessions_opened_total") == 0
    assert sc.metric("omni_sidecar_sessions_rejected_total", {"reason": "bad_signature"}) == 2
    # The right signature (Twilio's, over the URL it was given) is let in, with no
    # key (the signature is the credential); a key it offers must be right.
    good = {"X-Twilio-Signature": RequestValidator(TOKEN).compute_signature(signed, {})}
    caller = await calls(sc, headers=good)
    await caller.open({"api_key": "wrong"})
    await wait_until(lambda: caller.closed.is_set(), what="a wrong key refused")
    assert caller.ws.close_code == 1008
    caller = await calls(sc, headers=good)
    await caller.open()
    await caller.silence(0.2)
    await wait_until(lambda: sc.metric("omni_sidecar_sessions_active") == 1, what="session")
    await caller.stop()


async def test_api_key_in_custom_parameters(sidecar: Start, calls: Any, simulator: Any) -> None:
    sim = await simulator("--chunk-ms", str(CHUNK_MS))
    sc = await sidecar(upstream=sim.ws_url, api_keys=("k-phone",))
    caller = await calls(sc)
    await caller.open({"api_key": "wrong"})
    await wait_until(lambda: caller.closed.is_set(), what="refused")
    assert caller.ws.close_code == 1008
    assert await sim_metric(sim, "vllm_omni_sim_sessions_opened_total") == 0
    caller = await calls(sc)
    await caller.open({"api_key": "k-phone", "voice": "v1", "instructions": "Be brief."})
    await caller.silence(1.0)
    assert sc.metric("omni_sidecar_sessions_active") == 1
    # The console's sessions list says it is a phone call.
    url = f"{sc.admin_url}/debug/sessions"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        (listed,) = (await resp.json())["sessions"]
    assert listed["front_door"] == "twilio"
    await caller.stop()
    await wait_until(lambda: caller.closed.is_set(), what="call over")
    # The call's audio is the key's usage (minutes of call audio, by key).
    audio_in = {"key": "unnamed", "direction": "in"}
    await wait_until(
        lambda: sc.metric("omni_sidecar_usage_audio_seconds_total", audio_in) >= 0.9,
        what="the call's second of audio in the key's usage",
    )


async def test_dead_engine_ends_the_call(sidecar: Start, calls: Any, simulator: Any) -> None:
    sim = await simulator("--chunk-ms", str(CHUNK_MS))
    sc = await sidecar(upstream=sim.ws_url)
    caller = await calls(sc)
    await caller.open()
    await caller.silence(0.2)
    await wait_until(lambda: sc.metric("omni_sidecar_sessions_active") == 1, what="session")
    sim.kill()
    await wait_until(lambda: caller.closed.is_set(), what="the call ended with the engine")
    await wait_until(lambda: sc.metric("omni_sidecar_sessions_active") == 0, what="slot freed")


async def test_ended_calls_leave_no_cyclic_garbage(
    sidecar: Start, calls: Any, simulator: Any
) -> None:
    """As every session (docs/design.md, Memory): a call's translator, detector and
    converters are freed by reference counting when the call ends."""
    import collections
    import gc

    from tests.integration.test_session_garbage import _theirs

    sim = await simulator("--chunk-ms", str(CHUNK_MS), "--realtime-factor", "0")
    sc = await sidecar(upstream=sim.ws_url)
    registry = sc.sidecar.state.registry

    async def one_call() -> None:
        caller = await calls(sc)
        await caller.open()
        await caller.silence(0.1)
        await caller.stop()
        await wait_until(lambda: caller.closed.is_set(), what="the call ended")

    for _ in range(2):  # warm up: imports, the model, caches
        await one_call()
    await wait_until(lambda: not registry.relays, what="the warm-up calls ended")
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            await one_call()
        await wait_until(lambda: not registry.relays, what="every call ended")
        await asyncio.sleep(0)
        gc.collect()
        theirs = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage if _theirs(o)
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not theirs, f"cyclic garbage of 5 calls: {theirs.most_common(12)}"
