"""OpenAISide: a session's OpenAI dialect as its client connection's translator.

What the dialect answers itself is written at once through the connection's
writer (validated against the ``openai`` package's models), what it forwards
is returned for the relay, in order, and engine events come back rewritten.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from proxy.core.capabilities import EngineVersion
from proxy.core.dialect import Flavour, OpenAIDialect, engine_dialect
from proxy.session.openai_side import OpenAISide
from tests.integration.openai_models import ServerEvents

pytest.importorskip("openai")


class Writer:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def send_text(self, text: str) -> None:
        self.sent.append(text)


def side(flavour: Flavour = Flavour.GA) -> tuple[OpenAISide, Writer]:
    ids = itertools.count()
    translator = OpenAISide(
        OpenAIDialect(flavour, engine_dialect(EngineVersion.V0_30), lambda: f"e{next(ids)}")
    )
    writer = Writer()
    translator.writer = writer  # type: ignore[assignment]
    return translator, writer


def test_a_truncation_it_answers_is_written_at_once_and_nothing_goes_on() -> None:
    translator, writer = side()
    translator.from_client('{"type":"session.update","session":{}}')
    truncate = {"type": "conversation.item.truncate", "item_id": "item_r1", "content_index": 0,
                "audio_end_ms": 300}  # fmt: skip
    assert translator.from_client(json.dumps(truncate)) == []
    (reply,) = writer.sent
    assert ServerEvents("ga").validate(reply)["type"] == "conversation.item.truncated"


def test_forwarded_frames_come_back_in_order_for_the_relay() -> None:
    translator, writer = side()
    forwards = translator.from_client('{"type":"response.create"}')
    # OpenAI's default turn detection first, then a turn for a create with no input.
    assert [json.loads(f)["type"] for f in forwards] == [
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
    ]
    assert writer.sent == []


def test_engine_events_come_back_in_the_flavours_shape(label: Any = None) -> None:
    translator, _ = side(Flavour.BETA)
    assert translator.label == "openai_beta"
    speak = '{"type":"response.speak","response_id":"r1"}'
    assert translator.to_client(speak) == []
