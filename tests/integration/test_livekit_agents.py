"""LiveKit Agents' OpenAI realtime model through the OpenAI dialect (issue 39).

``livekit-plugins-openai``'s ``RealtimeModel(base_url=...)`` with its defaults
(``semantic_vad``, 24 kHz PCM16 both ways), unmodified, on both simulator
profiles, driven the way an ``AgentSession`` drives it: audio pushed,
``generate_reply()`` (which waits up to 10 s for a ``response.created``
carrying its ``client_event_id`` in ``metadata``), then an interruption:
``interrupt()`` (``response.cancel``) and ``truncate()`` of the playing item.
Asserted: the reply is created, its audio frames are 24 kHz mono, no ``error``
event and nothing logged at ERROR by the plugin, no audio of the interrupted
reply after the interruption, and a second reply.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import aiohttp
import pytest

from tests.conftest import DEADLINE
from tests.integration.test_openai_dialect import (  # noqa: F401 - fixtures
    MODEL,
    Profile,
    minicpmo_sim,
    nemotron_sim,
    profile,
    start_sidecar,
)

rtc = pytest.importorskip("livekit.rtc", reason="pip install livekit-agents (the stacks extra)")
lk_realtime = pytest.importorskip("livekit.plugins.openai.realtime")

SAMPLES_200MS: Final = 4800


def silence() -> Any:
    return rtc.AudioFrame(
        data=b"\x00\x00" * SAMPLES_200MS,
        sample_rate=24000,
        num_channels=1,
        samples_per_channel=SAMPLES_200MS,
    )


async def first_message(generation: Any) -> Any:
    async with asyncio.timeout(DEADLINE):
        async for message in generation.message_stream:
            return message
    raise AssertionError("the generation has no message")


async def test_livekit_holds_a_call_and_an_interruption_silences_the_reply(
    profile: Profile,  # noqa: F811
    sidecar: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = await start_sidecar(sidecar, profile)
    host, port = proxy.sidecar.bound["listen"]
    errors: list[Any] = []
    with caplog.at_level(logging.ERROR, logger="livekit.agents"):
        async with aiohttp.ClientSession() as http:
            model = lk_realtime.RealtimeModel(
                base_url=f"http://{host}:{port}/v1",
                api_key="sk-test",
                model=MODEL,
                http_session=http,
            )
            session = model.session()
            session.on("error", errors.append)
            try:
                session.push_audio(silence())
                generation = await asyncio.wait_for(session.generate_reply(), DEADLINE)
                message = await first_message(generation)
                frames = message.audio_stream.__aiter__()
                first = await asyncio.wait_for(frames.__anext__(), DEADLINE)
                assert (first.sample_rate, first.num_channels) == (24000, 1)
                # The user talks over it: cancel, and truncate what was heard.
                session.interrupt()
                session.truncate(
                    message_id=message.message_id, modalities=["audio"], audio_end_ms=100
                )
                late = []
                async with asyncio.timeout(DEADLINE):
                    async for frame in frames:
                        late.append(frame)
                assert late == [], f"{len(late)} frame(s) of the interrupted reply afterwards"

                session.push_audio(silence())
                again = await asyncio.wait_for(session.generate_reply(), DEADLINE)
                second = await first_message(again)
                assert second.message_id != message.message_id
                async with asyncio.timeout(DEADLINE):
                    async for frame in second.audio_stream:
                        assert frame.sample_rate == 24000
            finally:
                await session.aclose()
                await model.aclose()
    assert errors == []
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged == [], [r.getMessage() for r in logged]
