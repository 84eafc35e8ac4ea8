"""Pipecat's OpenAI realtime service through the OpenAI dialect (issue 39).

``OpenAIRealtimeLLMService(base_url="ws://HOST:PORT/v1/realtime")`` in a pipeline,
unmodified, on both simulator profiles (tests/integration/voice_stacks.py), every
frame through a recording relay. Pipecat parses every server event with its own
models and stops its receive loop at the first one it cannot parse or at any
``error``. Two configurations:

- its default session (no turn detection sent: OpenAI's default server VAD, done
  by the sidecar's turn detection). The first context frame asks for a reply with
  no input at all (a greeting), played to its end; the user speaks (espeak-ng)
  and stops, and the next reply comes by itself; the user talks over it and the
  server barges in (``speech_started``, the reply cancelled, Pipecat truncates the
  playing item);
- its local turn detection (``turn_detection=False``): each
  ``UserStoppedSpeakingFrame`` is a commit and a ``response.create``; each reply is
  interrupted by an ``InterruptionFrame`` (clear, cancel, truncate).

Asserted: no ``ErrorFrame``, nothing logged at ERROR (loguru, ``asyncio``), no
``error`` on the wire; every audio frame 24 kHz mono; the greeting ends completed
and its frames last what the engine produced (within a sample; the 22.05 kHz
profile converted by the sidecar); after a barge-in no audio of the reply on the
wire after ``speech_started``, the application got exactly the audio before it and
no audio frame after Pipecat's ``ProposedUserStartedSpeakingFrame``; after an
``InterruptionFrame`` no audio frame of the reply.

tests/real_engine/test_real_stacks.py plays the greeting (:func:`greeting`) against
vLLM-Omni's real serving layer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import pytest

from tests.conftest import DEADLINE
from tests.integration.speech import chunks, needs_espeak, silence_24k
from tests.integration.voice_stacks import (  # noqa: F401 - fixtures
    API_KEY,
    AUDIO_DELTA,
    MODEL,
    RATE,
    RESPONSE_MS,
    TROUBLE_POLL,
    Call,
    LibraryErrors,
    WireTap,
    barge_in,
    minicpmo_sim,
    nemotron_sim,
    profile,
    response_done,
    speech_started,
    tap,
)

pytest.importorskip("pipecat", reason="pip install -e '.[stacks]' (pipecat-ai)")
frames = pytest.importorskip("pipecat.frames.frames")
llm_module = pytest.importorskip("pipecat.services.openai.realtime.llm")

#: 200 ms of 24 kHz PCM16 silence: the user's turn with Pipecat's local turn detection.
SILENCE_200MS: Final = silence_24k(200)


def pcm_frame(pcm: bytes) -> Any:
    return frames.InputAudioRawFrame(audio=pcm, sample_rate=RATE, num_channels=1)


class App:
    """A running pipeline [recorder, OpenAIRealtimeLLMService, recorder] against the tap:
    what reached its end, in order, read like a queue by :meth:`until`."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.seen: list[Any] = []
        #: Bytes of audio the application got per reply, as Pipecat brackets them (a
        #: new one after each ``LLMFullResponseEndFrame``).
        self.replies: list[int] = [0]
        self.read = 0
        self.worker: Any = None
        self._changed = asyncio.Event()

    def record(self, frame: Any, downstream: bool) -> None:
        if isinstance(frame, frames.ErrorFrame):
            self.call.surfaced.append(f"ErrorFrame: {frame.error}"[:2000])
        if not downstream:
            return
        self.seen.append(frame)
        if isinstance(frame, frames.OutputAudioRawFrame):
            self.replies[-1] += len(frame.audio)
            self.call.formats.add((frame.sample_rate, frame.num_channels))
        elif isinstance(frame, frames.LLMFullResponseEndFrame):
            self.replies.append(0)
        self._changed.set()

    async def send(self, *to_send: Any) -> None:
        for frame in to_send:
            await self.worker.queue_frame(frame)

    async def until(self, match: Callable[[Any], bool]) -> Any:
        """The next frame (after the last one returned) that matches, waiting for it; fails
        early on what :meth:`Call.troubles` reports (an ``ErrorFrame`` among them)."""
        async with asyncio.timeout(DEADLINE):
            while True:
                for n in range(self.read, len(self.seen)):
                    if match(self.seen[n]):
                        self.read = n + 1
                        return self.seen[n]
                self.read = len(self.seen)
                if problems := self.call.troubles():
                    raise AssertionError(f"the library failed: {problems}")
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), TROUBLE_POLL)

    def audio_since(self, n: int) -> list[Any]:
        """The audio frames from ``seen[n]`` to the last frame :meth:`until` returned."""
        return [f for f in self.seen[n : self.read] if isinstance(f, frames.OutputAudioRawFrame)]


def of(kind: type) -> Callable[[Any], bool]:
    return lambda frame: isinstance(frame, kind)


@contextlib.asynccontextmanager
async def pipecat_app(call: Call, **session: Any) -> AsyncIterator[App]:
    """The pipeline running against ``call.tap``; ``session``: the service's session
    properties (none: its defaults)."""
    from loguru import logger
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.workers.runner import WorkerRunner

    app = App(call)

    class Recorder(FrameProcessor):
        async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            app.record(frame, direction is FrameDirection.DOWNSTREAM)
            await self.push_frame(frame, direction)

    Service = llm_module.OpenAIRealtimeLLMService
    settings = Service.Settings(model=MODEL)
    if session:
        properties = llm_module.events.SessionProperties(**session)
        settings = Service.Settings(model=MODEL, session_properties=properties)
    llm = Service(api_key=API_KEY, base_url=f"{call.tap.ws_url}/v1/realtime", settings=settings)
    # The first recorder sees what goes upstream of the service (its ErrorFrames).
    app.worker = PipelineWorker(
        Pipeline([Recorder(), llm, Recorder()]),
        params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
        cancel_on_idle_timeout=False,
    )
    started = asyncio.Event()

    async def on_started(worker: Any, frame: Any) -> None:
        started.set()

    app.worker.event_handler("on_pipeline_started")(on_started)
    sink = logger.add(call.errors.loguru_sink, level="ERROR")
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(app.worker)
    running = asyncio.ensure_future(runner.run())
    try:
        async with asyncio.timeout(DEADLINE):
            await started.wait()
        yield app
    finally:
        with contextlib.suppress(Exception):
            await app.worker.queue_frame(frames.EndFrame())
        try:
            async with asyncio.timeout(DEADLINE):
                await running
        finally:
            logger.remove(sink)


async def greeting(call: Call, app: App, *, after: bytes = b"") -> str:
    """The first context frame, with no input at all (or after the user's audio
    ``after``): a reply, played to its end and checked whole. Its response id."""
    from pipecat.processors.aggregators.llm_context import LLMContext

    if after:
        await app.send(pcm_frame(after))
    await app.send(frames.LLMContextFrame(LLMContext()))
    rid: str = (await call.until(lambda e: e["type"] == "response.created"))["response"]["id"]
    await call.until(response_done(rid))
    await app.until(of(frames.LLMFullResponseEndFrame))
    call.audio[rid] = app.replies[0]
    call.assert_completed(rid)
    return rid


@needs_espeak
async def test_pipecat_default_session_greets_takes_turns_and_barges_in(
    tap: WireTap,  # noqa: F811
) -> None:
    """Defaults: OpenAI's server VAD, which the sidecar's own turn detection does."""
    call = Call(tap, LibraryErrors("pipecat"))
    with call.errors.installed(), call.explained():
        async with asyncio.timeout(DEADLINE * 3), pipecat_app(call) as app:
            first = await greeting(call, app)
            # The user speaks, then stops: the sidecar commits the turn, the reply comes.
            start = tap.mark()
            for piece in [*barge_in(), *chunks(silence_24k(1500))]:
                await app.send(pcm_frame(piece))
            created = await call.until(lambda e: e["type"] == "response.created", start=start)
            second = created["response"]["id"]
            await app.until(of(frames.ProposedUserStoppedSpeakingFrame))
            # The user talks over it.
            await call.until(lambda e: e.get("type") == AUDIO_DELTA, start=start)
            await app.until(of(frames.TTSAudioRawFrame))
            for piece in barge_in():
                await app.send(pcm_frame(piece))
            await call.until(response_done(second))
            await app.until(of(frames.ProposedUserStartedSpeakingFrame))
            spoke = app.read
            await app.until(of(frames.LLMFullResponseEndFrame))
            late = app.audio_since(spoke)
            assert late == [], f"{len(late)} audio frame(s) of the interrupted reply afterwards"
        assert first != second
        call.audio[second] = sum(app.replies[1:])
        barged_in = speech_started(call, start=tap.index("s2c", lambda e: e is created))
        call.assert_nothing_after(second, barged_in)
    call.assert_clean()


async def test_pipecat_with_local_turn_detection_holds_turns_and_interruptions(
    tap: WireTap,  # noqa: F811
) -> None:
    """``turn_detection: False`` (Pipecat's own VAD ends turns): each user stop is a
    commit and a ``response.create``; an interruption clears, cancels and truncates.
    The greeting and two turns, each interrupted after its first audio frame."""
    from pipecat.processors.aggregators.llm_context import LLMContext

    events = llm_module.events
    no_vad = events.AudioConfiguration(input=events.AudioInput(turn_detection=False))
    call = Call(tap, LibraryErrors("pipecat"))
    with call.errors.installed(), call.explained():
        async with asyncio.timeout(DEADLINE * 3), pipecat_app(call, audio=no_vad) as app:
            for turn in range(3):
                start = tap.mark()
                if turn == 0:
                    await app.send(frames.LLMContextFrame(LLMContext()))  # the greeting
                else:
                    await app.send(
                        frames.UserStartedSpeakingFrame(),
                        pcm_frame(SILENCE_200MS),
                        frames.UserStoppedSpeakingFrame(),
                    )
                created = await call.until(lambda e: e["type"] == "response.created", start)
                rid = created["response"]["id"]
                await app.until(of(frames.TTSAudioRawFrame))
                await app.send(frames.InterruptionFrame())
                await app.until(of(frames.InterruptionFrame))
                interrupted = app.read
                await app.until(of(frames.LLMFullResponseEndFrame))
                late = app.audio_since(interrupted)
                assert late == [], f"{len(late)} audio frame(s) after the interruption"
                await call.until(response_done(rid))
                cancel_at = tap.index("c2s", lambda e: e["type"] == "response.cancel", start)
                done = tap.of("response.done", cancel_at)
                assert [e["response"]["status"] for e in done] == ["cancelled"], call.diagnosis()
                wire = tap.audio_bytes(rid, start=cancel_at)
                assert wire == 0, f"{wire} bytes of the interrupted reply on the wire after it"
    call.assert_clean()
