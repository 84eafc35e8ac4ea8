"""Client text frames take the parser's hand-over (``compat.push_text``), with either engine link.

The push path is what makes a client frame cost no queue and no task wake-up
(docs/design.md, Relay shell). It used to be able to turn itself off silently
(a missing aiohttp hook, a link that could not send without waiting); these
tests see it taken in a real session over loopback, through aiohttp's real
parser, and see the engine get every frame once, in order.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import DEADLINE
from tests.fakes.scripted_engine import ScriptedEngine

FRAMES = 40


@pytest.mark.parametrize("upstream_client", ["picows", "aiohttp"])
async def test_client_text_frames_are_pushed_by_the_parser(
    sidecar: Any, upstream_client: str
) -> None:
    engine = await ScriptedEngine().start()
    try:
        proxy = await sidecar(upstream=engine.ws_url, upstream_client=upstream_client)
        async with aiohttp.ClientSession() as http, http.ws_connect(proxy.url) as ws:
            conn = await engine.next_connection()
            await conn.send({"type": "session.created", "session": {"id": "s1"}})
            msg = await ws.receive(timeout=DEADLINE)
            assert orjson.loads(msg.data)["type"] == "session.created"
            (relay,) = proxy.sidecar.sessions.relays.values()
            # The reader task starts before the intake task in the relay's TaskGroup
            # and turns the push on in its first step, before anything is relayed.
            assert relay.side.reader.pushing, "the push path is on once the session runs"
            sent = [
                orjson.dumps({"type": "input_audio_buffer.append", "audio": "AAAA", "n": i})
                for i in range(FRAMES)
            ]
            for text in sent:
                await ws.send_str(text.decode())
            got = [await conn.receive_event() for _ in range(FRAMES)]
            assert [event["n"] for event in got] == list(range(FRAMES))
            # Every one of them reached the engine, none through aiohttp's queue: each
            # came through the parser's hand-over.
            assert relay.side.reader.frames_read == 0
    finally:
        await engine.aclose()
