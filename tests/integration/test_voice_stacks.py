"""The voice stacks users already run, unchanged, through the sidecar (issue 39, item 5).

Each stack is a minimal application in its default configuration: only its URL
and API key point at the sidecar (no option that exists only to get past the
sidecar). It connects through the sidecar in front of the simulator on both
profiles (a 0.32-like engine with MiniCPM-o-like audio, a 0.30-like engine with
Nemotron-like audio and late audio after a cancel), sends 24 kHz PCM16, asks for
a reply the way the stack does, lets one reply play out and interrupts another
the way the stack does. Each test asserts:

- the stack connected and held the call (replies were created and ended);
- nothing went wrong inside the library: no error or exception it logged or
  raised, no validation error of a server event, no error event it surfaced;
- no ``error`` event on the wire;
- the completed reply's audio reached the application as 24 kHz PCM16 lasting
  what the engine produced (the sidecar converts the 22.05 kHz profile);
- after the interruption, no audio of the interrupted reply: none on the wire,
  and the application got exactly the audio the wire carried before it.

Every frame between stack and sidecar goes through a recording relay
(:class:`WireTap`), so the wire is seen the same way for every stack. Each stack
also has a test file of its own (test_livekit_agents.py, test_pipecat.py,
test_agents_sdk.py); this one holds all three to the same wire-level checks.

The stacks, pinned in the ``stacks`` extra (pyproject.toml):

- LiveKit Agents' OpenAI plugin, ``RealtimeModel(base_url="http://HOST:PORT/v1")``,
  driven through its ``RealtimeSession`` the way ``AgentSession`` drives it
  (no LiveKit server is involved in the model's connection): audio frames in,
  ``generate_reply()``, and at the interruption ``interrupt()`` then
  ``truncate()`` at what was played;
- Pipecat's ``OpenAIRealtimeLLMService(base_url="ws://HOST:PORT/v1/realtime")`` in
  a pipeline: audio frames in, the first context frame asks for the reply;
  interrupted the way Pipecat is with server-side turn detection (its default):
  the user speaks (espeak-ng), the server cancels;
- the OpenAI Agents SDK, ``RealtimeRunner(agent).run(model_config={"url": ...})``:
  ``send_audio``, a ``response.create``, interrupted by speech (its default
  ``semantic_vad`` leaves the cancel to the server).

The user's speech over a reply needs espeak-ng (.ci/run installs it); the sidecar's
turn detection, a voice-activity model, hears it as speech.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import math
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import pytest

from engine_launcher.engine_config import EngineConfig
from tests.conftest import DEADLINE
from tests.integration.helpers import SimulatorChild
from tests.integration.speech import chunks, needs_espeak, speech_24k
from tests.integration.voice_stacks import (
    API_KEY,
    AUDIO_DELTA,
    MODEL,
    PROFILES,
    RESPONSE_MS,
    Event,
    LibraryErrors,
    Profile,
    WireTap,
    profile_simulator,
)

RATE: Final = 24000  # what every stack asks for (and assumes) in and out


def pcm16(ms: int, amplitude: float) -> bytes:
    """24 kHz PCM16 mono, a 440 Hz tone (0.3: speech to an energy VAD)."""
    n = RATE * ms // 1000
    samples = array.array(
        "h", (int(32767 * amplitude * math.sin(2 * math.pi * 440 * i / RATE)) for i in range(n))
    )
    if sys.byteorder != "little":
        samples.byteswap()
    return samples.tobytes()


#: The user's turn before each reply. Loud: vLLM-Omni 0.30 takes a commit of only quiet
#: audio for silence (response.listen, no reply); a tone, so that no voice-activity
#: model takes it for speech and ends the turn on its own.
SPEECH: Final = pcm16(200, amplitude=0.3)


def barge_in() -> list[bytes]:
    """The user talking over a reply: espeak-ng speech in 100 ms pieces (what the
    sidecar's turn detection, a voice-activity model, takes for speech)."""
    return chunks(speech_24k("Wait, wait, stop talking please."))


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minicpmo_sim() -> Iterator[SimulatorChild]:
    with profile_simulator(PROFILES["minicpmo-0.32"]) as sim:
        yield sim


@pytest.fixture(scope="module")
def nemotron_sim() -> Iterator[SimulatorChild]:
    with profile_simulator(PROFILES["nemotron-0.30"]) as sim:
        yield sim


@pytest.fixture(params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest) -> tuple[Profile, SimulatorChild]:
    p = PROFILES[request.param]
    return p, request.getfixturevalue(f"{p.name}_sim")


@pytest.fixture
async def tap(profile: tuple[Profile, SimulatorChild], sidecar: Any) -> AsyncIterator[WireTap]:
    """The sidecar in front of the profile's simulator, behind a recording relay."""
    p, sim = profile
    engine = EngineConfig(kind="external", upstream=sim.ws_url, version=p.version)
    proxy = await sidecar(upstream=sim.ws_url, engine=engine)
    host, port = proxy.sidecar.bound["listen"]
    async with WireTap.running(f"ws://{host}:{port}") as relay:
        yield relay


# -- what every call must show -----------------------------------------------------------------


@dataclass
class Call:
    """What one application saw, beside what the wire carried."""

    tap: WireTap
    errors: LibraryErrors
    #: Errors the library handed to the application (events, frames, exceptions).
    surfaced: list[str] = field(default_factory=list)
    #: Bytes of PCM the application got, per reply (in the order the replies came).
    audio: dict[str, int] = field(default_factory=dict)
    #: Sample rates of the application's audio frames, where the stack labels them.
    rates: set[int] = field(default_factory=set)
    #: How long the engine's replies last.
    reply_ms: int = RESPONSE_MS

    async def until(self, match: Callable[[Event], bool], start: int = 0) -> Event:
        """The next server event that matches; fails early on an error event or a library error."""
        return await self.tap.until(match, start=start, trouble=self.troubles)

    def troubles(self) -> list[str]:
        return [*self.errors.records, *self.surfaced, *self.tap.failures]

    def got(self, response_id: str, pcm: bytes, rate: int | None = None) -> None:
        self.audio[response_id] = self.audio.get(response_id, 0) + len(pcm)
        if rate is not None:
            self.rates.add(rate)

    def diagnosis(self) -> str:
        types = [f"{d}:{e.get('type')}" for d, e in self.tap.log if e.get("type") != AUDIO_DELTA]
        return (
            f"\nlibrary errors: {self.errors.records}\nsurfaced: {self.surfaced}"
            f"\ntap failures: {self.tap.failures}\ninvalid (openai GA models): {self.tap.invalid}"
            f"\nwire errors: {self.tap.of('error')}"
            f"\nwire (audio deltas left out): {types[:80]}"
        )

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """An exception inside carries the diagnosis (unless it already does)."""
        try:
            yield
        except Exception as exc:
            if "\nlibrary errors: " in str(exc):
                raise
            what = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
            raise AssertionError(f"{what}{self.diagnosis()}") from exc

    def assert_clean(self) -> None:
        """No library error, nothing surfaced, no error event on the wire."""
        assert self.tap.failures == [], self.diagnosis()
        assert self.errors.records == [], self.diagnosis()
        assert self.surfaced == [], self.diagnosis()
        assert self.tap.of("error") == [], self.diagnosis()

    def assert_completed(self, response_id: str) -> None:
        """The reply ended completed, its audio at 24 kHz lasting what the engine produced."""
        done = [e for e in self.tap.of("response.done") if e["response"]["id"] == response_id]
        assert [e["response"]["status"] for e in done] == ["completed"], self.diagnosis()
        wire = self.tap.audio_bytes(response_id)
        assert self.audio.get(response_id) == wire, self.diagnosis()
        got_ms = wire / 2 / RATE * 1000
        # Resampled from 22.05 kHz: within one sample of each rate.
        assert abs(got_ms - self.reply_ms) <= 1000 / 22050 + 1000 / RATE, (
            f"as 24 kHz PCM16 the reply lasts {got_ms} ms; the engine produced {self.reply_ms} ms"
        )
        assert self.rates <= {RATE}, self.rates

    def assert_nothing_after(self, response_id: str, mark: int) -> None:
        """Interrupted at ``tap.log[mark]``: cancelled, and no audio of it after that."""
        done = [e for e in self.tap.of("response.done") if e["response"]["id"] == response_id]
        assert [e["response"]["status"] for e in done] == ["cancelled"], self.diagnosis()
        late = self.tap.audio_bytes(response_id, start=mark)
        assert late == 0, (
            f"{late} bytes of the interrupted reply on the wire after it: "
            f"{self.tap.summary(mark - 3)}"
        )
        before = self.tap.audio_bytes(response_id, stop=mark)
        assert before > 0, "interrupted before any audio: the test did not interrupt a reply"
        got = self.audio.get(response_id, 0)
        assert got == before, f"the application got {got} bytes of it, the wire had {before}"


def speech_started(call: Call) -> int:
    """Where the server said the user barged in (it cancels the reply there)."""
    started = [
        n
        for n, (d, e) in enumerate(call.tap.log)
        if e["type"] == "input_audio_buffer.speech_started"
    ]
    if not started:
        updated = call.tap.of("session.updated")
        in_effect = updated[-1]["session"].get("audio", {}).get("input", {}) if updated else {}
        pytest.fail(
            "the user's speech did not interrupt the reply: no input_audio_buffer.speech_started;"
            f" turn_detection in effect: {in_effect.get('turn_detection', '(none)')!r}"
            + call.diagnosis()
        )
    return started[0]


def response_done(response_id: str) -> Callable[[Event], bool]:
    return lambda e: e.get("type") == "response.done" and e["response"]["id"] == response_id


# -- LiveKit Agents ----------------------------------------------------------------------------


async def livekit_call(tap: WireTap, reply_ms: int = RESPONSE_MS) -> Call:
    from livekit import rtc
    from livekit.plugins.openai import realtime as lk

    call = Call(tap, LibraryErrors("livekit"), reply_ms=reply_ms)
    with call.errors.installed(), call.explained():
        model = lk.RealtimeModel(base_url=f"{tap.http_url}/v1", api_key=API_KEY, model=MODEL)
        session = model.session()
        session.on("error", lambda ev: call.surfaced.append(repr(ev.error)))

        def say(pcm: bytes) -> None:
            frame = rtc.AudioFrame(pcm, RATE, 1, len(pcm) // 2)
            session.push_audio(frame)

        try:
            async with asyncio.timeout(DEADLINE * 3):
                await session.update_instructions("Be brief.")
                # Turn 1: played to its end.
                say(SPEECH)
                generation = await session.generate_reply()
                first = generation.response_id
                async for message in generation.message_stream:
                    async for frame in message.audio_stream:
                        call.got(first, bytes(frame.data), frame.sample_rate)
                await call.until(response_done(first))
                call.assert_completed(first)

                # Turn 2: interrupted after its first audio, as AgentSession does it.
                say(SPEECH)
                generation = await session.generate_reply()
                second = generation.response_id
                mark = -1
                async for message in generation.message_stream:
                    async for frame in message.audio_stream:
                        call.got(second, bytes(frame.data), frame.sample_rate)
                        if mark < 0:  # the first frame: the user talks over it
                            mark = tap.mark()
                            session.interrupt()
                            played_ms = frame.samples_per_channel * 1000 // frame.sample_rate
                            session.truncate(
                                message_id=message.message_id,
                                modalities=["audio"],
                                audio_end_ms=played_ms,
                            )
                await call.until(response_done(second))
                # The cancel reached the wire after the mark: count from it.
                cancel_at = tap.index("c2s", lambda e: e["type"] == "response.cancel", mark)
                call.assert_nothing_after(second, cancel_at)
        finally:
            async with asyncio.timeout(DEADLINE):
                await session.aclose()
                await model.aclose()
    return call


async def test_livekit_agents_realtime_model(tap: WireTap) -> None:
    pytest.importorskip("livekit.plugins.openai", reason="pip install -e '.[stacks]'")
    call = await livekit_call(tap)
    call.assert_clean()
    assert tap.handshakes[0]["Authorization"] == f"Bearer {API_KEY}"


# -- Pipecat -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def pipecat_pipeline(tap: WireTap, call: Call, reply: str) -> AsyncIterator[Any]:
    """A running pipeline: [recorder, OpenAIRealtimeLLMService, recorder]; yields its worker.

    ``reply`` names the reply whose audio the application gets (one reply per call).
    """
    from loguru import logger
    from pipecat.frames.frames import EndFrame, ErrorFrame, OutputAudioRawFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.workers.runner import WorkerRunner

    class Recorder(FrameProcessor):
        async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, ErrorFrame):
                call.surfaced.append(f"ErrorFrame: {frame.error}"[:2000])
            elif isinstance(frame, OutputAudioRawFrame) and direction is FrameDirection.DOWNSTREAM:
                call.got(reply, frame.audio, frame.sample_rate)
            await self.push_frame(frame, direction)

    llm = OpenAIRealtimeLLMService(
        api_key=API_KEY,
        base_url=f"{tap.ws_url}/v1/realtime",
        settings=OpenAIRealtimeLLMService.Settings(model=MODEL),
    )
    pipeline = Pipeline([Recorder(), llm, Recorder()])
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
        cancel_on_idle_timeout=False,
    )
    sink = logger.add(call.errors.loguru_sink, level="ERROR")
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.ensure_future(runner.run())
    try:
        yield worker
    finally:
        with contextlib.suppress(Exception):
            await worker.queue_frame(EndFrame())
        try:
            async with asyncio.timeout(DEADLINE):
                await running
        finally:
            logger.remove(sink)


async def pipecat_reply(tap: WireTap, *, interrupt: bool, reply_ms: int = RESPONSE_MS) -> Call:
    from pipecat.frames.frames import InputAudioRawFrame, LLMContextFrame
    from pipecat.processors.aggregators.llm_context import LLMContext

    call = Call(tap, LibraryErrors("pipecat"), reply_ms=reply_ms)
    with call.errors.installed(), call.explained():
        async with asyncio.timeout(DEADLINE * 3):
            async with pipecat_pipeline(tap, call, reply="reply") as worker:
                await worker.queue_frame(InputAudioRawFrame(SPEECH, RATE, 1))
                await worker.queue_frame(LLMContextFrame(LLMContext()))
                created = await call.until(lambda e: e["type"] == "response.created")
                rid = created["response"]["id"]
                if interrupt:
                    await call.until(lambda e: e.get("type") == AUDIO_DELTA)
                    for piece in barge_in():
                        await worker.queue_frame(InputAudioRawFrame(piece, RATE, 1))
                    await call.until(response_done(rid))
                else:
                    await call.until(response_done(rid))
    call.audio = {rid: call.audio.get("reply", 0)}
    if interrupt:
        started = speech_started(call)
        call.assert_nothing_after(rid, started)
    else:
        call.assert_completed(rid)
    return call


async def test_pipecat_openai_realtime_reply(tap: WireTap) -> None:
    pytest.importorskip("pipecat.services.openai.realtime.llm", reason="pip install -e '.[stacks]'")
    call = await pipecat_reply(tap, interrupt=False)
    call.assert_clean()


@needs_espeak
async def test_pipecat_openai_realtime_barge_in(tap: WireTap) -> None:
    pytest.importorskip("pipecat.services.openai.realtime.llm", reason="pip install -e '.[stacks]'")
    call = await pipecat_reply(tap, interrupt=True)
    call.assert_clean()


# -- OpenAI Agents SDK -------------------------------------------------------------------------


async def agents_call(tap: WireTap) -> Call:
    from agents.realtime import RealtimeAgent, RealtimeRunner
    from agents.realtime.model_inputs import RealtimeModelSendRawMessage

    call = Call(tap, LibraryErrors("openai.agents"))
    agent = RealtimeAgent(name="assistant", instructions="Be brief.")
    config = {"url": f"{tap.ws_url}/v1/realtime?model={MODEL}", "api_key": API_KEY}
    with call.errors.installed(), call.explained():
        session = await RealtimeRunner(agent).run(model_config=config)  # type: ignore[arg-type]
        ask = RealtimeModelSendRawMessage(message={"type": "response.create"})

        async def play(until: str) -> None:
            """Read the session's events until ``response.done`` of ``until``."""
            async for event in session:
                if event.type == "audio":
                    call.got(event.audio.response_id, event.audio.data)
                elif event.type == "error":
                    call.surfaced.append(f"error event: {event.error!r}"[:2000])
                elif event.type == "raw_model_event" and event.data.type == "exception":
                    call.surfaced.append(f"exception: {event.data.exception!r}"[:2000])
                elif (
                    event.type == "raw_model_event"
                    and event.data.type == "raw_server_event"
                    and response_done(until)(event.data.data)
                ):
                    return

        async with asyncio.timeout(DEADLINE * 3), session:
            await call.until(lambda e: e["type"] == "session.updated")
            # Turn 1: played to its end.
            await session.send_audio(SPEECH)
            await session.model.send_event(ask)
            first = (await call.until(lambda e: e["type"] == "response.created"))["response"]["id"]
            await play(first)
            call.assert_completed(first)

            # Turn 2: the user speaks over the reply.
            start = tap.mark()
            await session.send_audio(SPEECH)
            await session.model.send_event(ask)
            created = await call.until(lambda e: e["type"] == "response.created", start=start)
            second = created["response"]["id"]
            await call.until(lambda e: e.get("type") == AUDIO_DELTA, start=start)
            for piece in barge_in():
                await session.send_audio(piece)
            await play(second)
            call.assert_nothing_after(second, speech_started(call))
    return call


@needs_espeak
async def test_openai_agents_sdk_realtime_runner(tap: WireTap) -> None:
    pytest.importorskip("agents.realtime", reason="pip install -e '.[stacks]'")
    call = await agents_call(tap)
    call.assert_clean()
