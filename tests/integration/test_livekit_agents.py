"""LiveKit Agents' OpenAI realtime model through the OpenAI dialect (issue 39).

``livekit-plugins-openai``'s ``RealtimeModel(base_url="http://HOST:PORT/v1")`` with
its defaults (``semantic_vad``, 24 kHz PCM16 both ways), unmodified, on both
simulator profiles (tests/integration/voice_stacks.py), driven through its
``RealtimeSession`` the way an ``AgentSession`` drives it (no LiveKit server is
involved in the model's connection): audio frames pushed, ``generate_reply()``
(which waits up to 10 s for a ``response.created`` carrying its
``client_event_id`` in ``metadata``), one reply played to its end, then a second
one interrupted after its first frame: ``interrupt()`` (``response.cancel``) and
``truncate()`` of the playing item at what was played. Every frame goes through a
recording relay. Asserted:

- both replies are created (``generate_reply()`` resolves), with different ids;
- the ``Authorization: Bearer`` key reaches the sidecar;
- the completed reply ends completed, and its audio reached the application as
  24 kHz mono frames lasting what the engine produced (within a sample; the
  22.05 kHz profile converted by the sidecar);
- the interrupted reply ends cancelled with no audio of it on the wire after the
  ``response.cancel``, and the application got exactly the audio before it;
- every frame 24 kHz mono; no ``error`` on the wire, no ``error`` event from the
  session, nothing logged at ERROR by the plugin or ``asyncio``.

tests/real_engine/test_real_stacks.py runs the same call (:func:`livekit_call`)
against vLLM-Omni's real serving layer.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import DEADLINE
from tests.integration.voice_stacks import (  # noqa: F401 - fixtures
    API_KEY,
    MODEL,
    RATE,
    RESPONSE_MS,
    SPEECH,
    Call,
    LibraryErrors,
    WireTap,
    minicpmo_sim,
    nemotron_sim,
    profile,
    response_done,
    tap,
)

pytest.importorskip("livekit.rtc", reason="pip install -e '.[stacks]' (livekit-agents)")
pytest.importorskip("livekit.plugins.openai.realtime", reason="pip install -e '.[stacks]'")


async def livekit_call(tap: WireTap, reply_ms: int = RESPONSE_MS) -> Call:  # noqa: F811
    """The call: a reply played to its end, then one interrupted; both checked on the wire."""
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
                assert first is not None
                async for message in generation.message_stream:
                    async for frame in message.audio_stream:
                        call.got(first, bytes(frame.data), frame.sample_rate, frame.num_channels)
                await call.until(response_done(first))
                call.assert_completed(first)

                # Turn 2: interrupted after its first audio, as AgentSession does it.
                say(SPEECH)
                generation = await session.generate_reply()
                second = generation.response_id
                assert second is not None
                assert second != first, "the second reply is the first one again"
                mark = -1
                async for message in generation.message_stream:
                    async for frame in message.audio_stream:
                        call.got(second, bytes(frame.data), frame.sample_rate, frame.num_channels)
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


async def test_livekit_holds_a_call_and_an_interruption_silences_the_reply(
    tap: WireTap,  # noqa: F811
) -> None:
    call = await livekit_call(tap)
    call.assert_clean()
    assert tap.handshakes[0]["Authorization"] == f"Bearer {API_KEY}"
