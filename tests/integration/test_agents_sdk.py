"""The OpenAI Agents SDK's realtime session through the OpenAI dialect (issue 39).

``RealtimeRunner(agent).run(model_config={"url": ..., "api_key": ...})`` with its
default model settings (``semantic_vad`` turn detection, PCM16 both ways), pointed
at the sidecar by ``model_config.url``, on both simulator profiles
(tests/integration/voice_stacks.py), every frame through a recording relay. The SDK
validates every server event with the ``openai`` package's models and logs an error
when one does not validate; it learns a response runs from ``response.created``.

The application asks for each reply itself, as LiveKit's ``generate_reply`` does:
``response.create`` through the SDK's raw-message API, after ``send_audio``. Three
turns:

1. interrupted by the application: ``interrupt()`` (the SDK truncates the playing
   item, answered by the sidecar), then a ``response.cancel``;
2. played to its end;
3. interrupted by the user's speech (espeak-ng): its default ``semantic_vad`` leaves
   the cancel to the server, the sidecar's turn detection barges in.

Asserted: no log record at ERROR from the SDK or ``asyncio``, no ``error`` or
exception event, no ``error`` on the wire; after ``interrupt()`` an
``audio_interrupted`` event and no audio of the interrupted item; the second turn a
new item, ended completed, its audio lasting what the engine produced at 24 kHz
(within a sample; the 22.05 kHz profile converted by the sidecar); after the
barge-in's ``speech_started`` no audio of the reply on the wire, and the application
got exactly the audio before it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import DEADLINE
from tests.integration.speech import needs_espeak
from tests.integration.voice_stacks import (  # noqa: F401 - fixtures
    API_KEY,
    AUDIO_DELTA,
    MODEL,
    SPEECH,
    Call,
    Event,
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

pytest.importorskip("agents", reason="pip install -e '.[stacks]' (openai-agents)")
realtime = pytest.importorskip("agents.realtime")
model_inputs = pytest.importorskip("agents.realtime.model_inputs")


def created(event: Event) -> bool:
    return bool(event["type"] == "response.created")


@needs_espeak
async def test_the_agents_sdk_holds_a_call_and_interruptions_silence_the_answer(
    tap: WireTap,  # noqa: F811
) -> None:
    call = Call(tap, LibraryErrors("openai.agents"))
    agent = realtime.RealtimeAgent(name="assistant", instructions="Be brief.")
    config = {"url": f"{tap.ws_url}/v1/realtime?model={MODEL}", "api_key": API_KEY}
    items: dict[str, str] = {}  # the item each reply's audio came in
    heard: dict[str, int] = {}  # bytes of a reply the application got before interrupt()
    with call.errors.installed(), call.explained():
        session = await realtime.RealtimeRunner(agent).run(model_config=config)

        async def ask(message: str) -> None:
            raw = model_inputs.RealtimeModelSendRawMessage(message={"type": message})
            await session.model.send_event(raw)

        async def turn() -> tuple[str, int]:
            """The user's audio and ``response.create``: the reply's id, and where on the
            wire it was created."""
            start = tap.mark()
            await session.send_audio(SPEECH)
            await ask("response.create")
            event = await call.until(created, start=start)
            return event["response"]["id"], tap.index("s2c", lambda e: e is event, start)

        async def play(until: str, *, interrupt: bool = False) -> list[Any]:
            """The session's events until ``response.done`` of ``until``. ``interrupt``:
            ``interrupt()`` at its first audio, then a ``response.cancel`` when the SDK
            says the audio was interrupted; only the events after ``interrupt()``."""
            seen: list[Any] = []
            async for event in session:
                seen.append(event)
                if event.type == "audio":
                    rid = event.audio.response_id
                    call.got(rid, event.audio.data)
                    items.setdefault(rid, event.item_id)
                    if interrupt and rid not in heard:
                        heard[rid] = call.audio[rid]
                        await session.interrupt()
                        seen.clear()
                elif event.type == "error":
                    call.surfaced.append(f"error event: {event.error!r}"[:2000])
                elif event.type == "raw_model_event" and event.data.type == "exception":
                    call.surfaced.append(f"exception: {event.data.exception!r}"[:2000])
                elif event.type == "audio_interrupted" and interrupt:
                    interrupt = False
                    await ask("response.cancel")  # the SDK leaves the cancel to the server
                elif (
                    event.type == "raw_model_event"
                    and event.data.type == "raw_server_event"
                    and response_done(until)(event.data.data)
                ):
                    return seen
            raise AssertionError(f"the session ended before response.done of {until}")

        async with asyncio.timeout(DEADLINE * 3), session:
            await call.until(lambda e: e["type"] == "session.updated")
            # Turn 1: the application interrupts at the first audio.
            first, _ = await turn()
            after = await play(first, interrupt=True)
            assert "audio_interrupted" in [e.type for e in after], [e.type for e in after]
            late = [e for e in after if e.type == "audio" and e.item_id == items[first]]
            assert late == [], f"{len(late)} audio chunk(s) of the interrupted item afterwards"

            # Turn 2: played to its end, a new item.
            second, _ = await turn()
            await play(second)
            call.assert_completed(second)
            assert items[second] != items[first]

            # Turn 3: the user speaks over the reply.
            third, at = await turn()
            await call.until(lambda e: e.get("type") == AUDIO_DELTA, start=at)
            for piece in barge_in():
                await session.send_audio(piece)
            await play(third)
            call.assert_nothing_after(third, speech_started(call, start=at))
    assert call.audio[first] == heard[first], "audio of the interrupted item after interrupt()"
    # The SDK asks for the engine's history item, and the answer validates.
    assert tap.of("conversation.item.retrieved"), call.diagnosis()
    call.assert_clean()
