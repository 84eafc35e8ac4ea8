"""Pipecat's OpenAI realtime service through the OpenAI dialect (issue 39).

``OpenAIRealtimeLLMService(base_url=...)`` with its default session (no turn
detection sent: OpenAI's default server VAD), unmodified, in a pipeline on
both simulator profiles. Pipecat parses every server event with its own
models and stops its receive loop at the first one it cannot parse or at any
``error``. The call: the user's audio, a context frame (``response.create``),
the reply's audio, then the user talks over it (loud audio: the engine's VAD
barges in, Pipecat truncates the playing item). Asserted: no ``ErrorFrame``,
24 kHz audio, no audio of the interrupted reply after the server said the user
started speaking, and a second reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
from collections.abc import Callable
from typing import Any, Final, Self

import pytest

from tests.conftest import DEADLINE
from tests.integration.speech import chunks, needs_espeak, silence_24k, speech_24k
from tests.integration.test_openai_dialect import (  # noqa: F401 - fixtures
    MODEL,
    Profile,
    minicpmo_sim,
    nemotron_sim,
    profile,
    start_sidecar,
)

pytest.importorskip("pipecat", reason="pip install pipecat-ai (the stacks extra)")
frames = pytest.importorskip("pipecat.frames.frames")
llm_module = pytest.importorskip("pipecat.services.openai.realtime.llm")
pipeline_module = pytest.importorskip("pipecat.pipeline.pipeline")
worker_module = pytest.importorskip("pipecat.pipeline.worker")
runner_module = pytest.importorskip("pipecat.workers.runner")
test_utils = pytest.importorskip("pipecat.tests.utils")
context_module = pytest.importorskip("pipecat.processors.aggregators.llm_context")
processor_module = pytest.importorskip("pipecat.processors.frame_processor")

RATE: Final = 24000  # the OpenAI clients' rate


def pcm_frame(pcm: bytes) -> Any:
    return frames.InputAudioRawFrame(audio=pcm, sample_rate=RATE, num_channels=1)


def audio(ms: int, *, loud: bool) -> Any:
    n = RATE * ms // 1000
    amplitude = 0.5 * 32767 if loud else 0.0
    pcm = struct.pack(
        f"<{n}h", *(int(amplitude * math.sin(2 * math.pi * 300 * i / RATE)) for i in range(n))
    )
    return frames.InputAudioRawFrame(audio=pcm, sample_rate=RATE, num_channels=1)


class Sink:
    """What reached the end of the pipeline, in order."""

    def __init__(self, queue: asyncio.Queue[Any]) -> None:
        self.queue = queue
        self.seen: list[Any] = []

    async def until(self, match: Callable[[Any], bool]) -> Any:
        async with asyncio.timeout(DEADLINE):
            while True:
                frame = await self.queue.get()
                self.seen.append(frame)
                assert not isinstance(frame, frames.ErrorFrame), frame
                if match(frame):
                    return frame

    def index(self, kind: type) -> int:
        return next(i for i, f in enumerate(self.seen) if isinstance(f, kind))


class Call:
    """A pipeline [the realtime service, a sink] running against the sidecar."""

    def __init__(self, llm: Any) -> None:
        self.received: asyncio.Queue[Any] = asyncio.Queue()
        down = processor_module.FrameDirection.DOWNSTREAM
        collector = test_utils.QueuedFrameProcessor(queue=self.received, queue_direction=down)
        self.worker = worker_module.PipelineWorker(
            pipeline_module.Pipeline([llm, collector]),
            cancel_on_idle_timeout=False,
            params=worker_module.PipelineParams(
                audio_in_sample_rate=RATE, audio_out_sample_rate=RATE
            ),
        )
        self.started = asyncio.Event()
        self.worker.event_handler("on_pipeline_started")(self._started)
        self.sink = Sink(self.received)
        self.running: asyncio.Future[Any] | None = None

    async def _started(self, worker: Any, frame: Any) -> None:
        self.started.set()

    async def __aenter__(self) -> Self:
        runner = runner_module.WorkerRunner()
        await runner.add_workers(self.worker)
        self.running = asyncio.ensure_future(runner.run())
        async with asyncio.timeout(DEADLINE):
            await self.started.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.running is not None
        if exc[0] is None:
            await self.worker.queue_frame(frames.EndFrame())
            async with asyncio.timeout(DEADLINE):
                await self.running
        elif not self.running.done():
            self.running.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.running

    async def send(self, *to_send: Any) -> None:
        for frame in to_send:
            await self.worker.queue_frame(frame)

    def no_errors(self) -> None:
        assert not [f for f in self.sink.seen if isinstance(f, frames.ErrorFrame)]


def service(proxy: Any, **session: Any) -> Any:
    host, port = proxy.sidecar.bound["listen"]
    Service = llm_module.OpenAIRealtimeLLMService
    settings = Service.Settings(model=MODEL)
    if session:
        settings = Service.Settings(
            model=MODEL, session_properties=llm_module.events.SessionProperties(**session)
        )
    return Service(api_key="sk-test", base_url=f"ws://{host}:{port}/v1/realtime", settings=settings)


@needs_espeak
async def test_pipecat_default_session_greets_barges_in_and_takes_turns(
    profile: Profile,  # noqa: F811
    sidecar: Any,
) -> None:
    """Defaults: OpenAI's server VAD, which the sidecar's own turn detection does. The
    first context frame asks for a reply with no input at all (a greeting); the user's
    speech over it barges in, and when the user stops, the next reply comes by itself."""
    proxy = await start_sidecar(sidecar, profile)
    async with Call(service(proxy)) as call:
        sink = call.sink
        await call.send(frames.LLMContextFrame(context_module.LLMContext()))
        first = await sink.until(lambda f: isinstance(f, frames.TTSAudioRawFrame))
        assert (first.sample_rate, first.num_channels) == (RATE, 1)
        # The user talks over the reply.
        for piece in chunks(speech_24k("Wait, wait, stop talking please.")):
            await call.send(pcm_frame(piece))
        await sink.until(lambda f: isinstance(f, frames.ProposedUserStartedSpeakingFrame))
        spoke = len(sink.seen)
        await sink.until(lambda f: isinstance(f, frames.LLMFullResponseEndFrame))
        late = [f for f in sink.seen[spoke:] if isinstance(f, frames.TTSAudioRawFrame)]
        assert late == [], f"{len(late)} audio frame(s) of the interrupted reply afterwards"
        # ... then stops: the sidecar commits the turn and the answer comes.
        for piece in chunks(silence_24k(1500)):
            await call.send(pcm_frame(piece))
        await sink.until(lambda f: isinstance(f, frames.ProposedUserStoppedSpeakingFrame))
        await sink.until(lambda f: isinstance(f, frames.TTSAudioRawFrame))
        await sink.until(lambda f: isinstance(f, frames.LLMFullResponseEndFrame))
    call.no_errors()


async def test_pipecat_with_local_turn_detection_holds_turns_and_interruptions(
    profile: Profile,  # noqa: F811
    sidecar: Any,
) -> None:
    """``turn_detection: False`` (Pipecat's own VAD ends turns): each user stop is a
    commit and a ``response.create``; an interruption clears, cancels and truncates."""
    proxy = await start_sidecar(sidecar, profile)
    events = llm_module.events
    no_vad = events.AudioConfiguration(input=events.AudioInput(turn_detection=False))
    async with Call(service(proxy, audio=no_vad)) as call:
        sink = call.sink
        await call.send(frames.LLMContextFrame(context_module.LLMContext()))
        await sink.until(lambda f: isinstance(f, frames.LLMFullResponseEndFrame))  # greeting
        for _ in range(2):
            await call.send(
                frames.UserStartedSpeakingFrame(),
                audio(200, loud=False),
                frames.UserStoppedSpeakingFrame(),
            )
            await sink.until(lambda f: isinstance(f, frames.TTSAudioRawFrame))
            await call.send(frames.InterruptionFrame())
            await sink.until(lambda f: isinstance(f, frames.InterruptionFrame))
            interrupted = len(sink.seen)
            await sink.until(lambda f: isinstance(f, frames.LLMFullResponseEndFrame))
            late = [f for f in sink.seen[interrupted:] if isinstance(f, frames.TTSAudioRawFrame)]
            assert late == [], f"{len(late)} audio frame(s) after the interruption"
    call.no_errors()
