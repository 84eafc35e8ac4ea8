"""The OpenAI Agents SDK's realtime session through the OpenAI dialect (issue 39).

``RealtimeRunner`` with its default model settings (``semantic_vad`` turn
detection, PCM16 both ways), pointed at the sidecar by ``model_config.url``,
in front of the simulator on both profiles. The SDK validates every server
event with the ``openai`` package's models and logs an error when one does not
validate; it learns a response runs from ``response.created`` and interrupts
with a truncation of the playing item. Asserted: no log record at ERROR from
the SDK, no ``error`` or exception event, audio at 24 kHz, and no audio of the
interrupted item after ``interrupt()``.

The engine ends no turns (the sidecar's own turn detection is not wired yet),
so the application asks for the reply itself, as LiveKit's ``generate_reply``
does: ``response.create`` through the SDK's raw-message API.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

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

agents = pytest.importorskip("agents", reason="pip install openai-agents (the test extra)")
realtime = pytest.importorskip("agents.realtime")
model_inputs = pytest.importorskip("agents.realtime.model_inputs")

SILENCE_200MS: Final = b"\x00\x00" * 4800  # 24 kHz PCM16


async def next_of(session: Any, kinds: set[str], seen: list[Any]) -> Any:
    async with asyncio.timeout(DEADLINE):
        async for event in session:
            seen.append(event)
            if event.type in kinds:
                return event
    raise AssertionError(f"the session ended before any of {kinds}")


async def test_the_agents_sdk_holds_a_call_and_an_interrupt_silences_the_answer(
    profile: Profile,  # noqa: F811
    sidecar: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = await start_sidecar(sidecar, profile)
    host, port = proxy.sidecar.bound["listen"]
    agent = realtime.RealtimeAgent(name="assistant", instructions="Be brief.")
    runner = realtime.RealtimeRunner(agent)
    config = {"url": f"ws://{host}:{port}/v1/realtime?model={MODEL}", "api_key": "sk-test"}
    seen: list[Any] = []
    with caplog.at_level(logging.ERROR, logger="openai.agents"):
        session = await runner.run(model_config=config)
        async with session:
            await session.send_audio(SILENCE_200MS)
            await session.model.send_event(
                model_inputs.RealtimeModelSendRawMessage(message={"type": "response.create"})
            )
            first = await next_of(session, {"audio"}, seen)
            assert len(first.audio.data) % 2 == 0
            await session.interrupt()
            interrupted_at = len(seen)
            await next_of(session, {"audio_interrupted"}, seen)
            # The reply ends (cancelled by the engine's barge-in or played out) ...
            await session.model.send_event(
                model_inputs.RealtimeModelSendRawMessage(message={"type": "response.cancel"})
            )
            await next_of(session, {"agent_end", "audio_end"}, seen)
            # ... and a second turn still works.
            await session.send_audio(SILENCE_200MS, commit=True)
            await session.model.send_event(
                model_inputs.RealtimeModelSendRawMessage(message={"type": "response.create"})
            )
            second = await next_of(session, {"audio"}, seen)
            assert second.item_id != first.item_id
    late = [e for e in seen[interrupted_at:] if e.type == "audio" and e.item_id == first.item_id]
    assert late == [], f"{len(late)} audio chunk(s) of the interrupted item after interrupt()"
    assert [e for e in seen if e.type == "error"] == [], [
        str(e.error)[:3000] for e in seen if e.type == "error"
    ]
    raw = [getattr(e, "data", None) for e in seen if e.type == "raw_model_event"]
    assert [d for d in raw if getattr(d, "type", "") == "exception"] == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
