"""A phone call's client side (proxy/session/twilio_side.py): what the reader and
the frame writer get from Twilio's frames, without sockets."""

from __future__ import annotations

import base64
from typing import Any, cast

import orjson

from proxy.core.audio_formats import MINICPMO_INPUT
from proxy.core.turns import TurnDetector
from proxy.core.twilio_call import BargeIn, CallOptions, CallStart, TwilioCall
from proxy.session.twilio_side import TwilioTranslator
from proxy.session.writer import ClientFrameWriter
from tests.proxy.core.test_twilio_call import LOUD, SPEECH_FRAMES, LevelStream

SID = "MZ1"
RID = "resp-1"


class RecordingWriter:
    """The frame writer's ``send_text``: frames written at once, in order."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send_text(self, text: str) -> None:
        self.sent.append(text)


def translator() -> tuple[TwilioTranslator, RecordingWriter]:
    options = CallOptions(engine_input=MINICPMO_INPUT, barge_in=BargeIn.SIDECAR)
    t = TwilioTranslator(TwilioCall(CallStart(SID), options, TurnDetector(LevelStream())))
    writer = RecordingWriter()
    t.writer = cast(ClientFrameWriter, writer)
    return t, writer


def twilio(body: dict[str, Any]) -> str:
    return orjson.dumps({"streamSid": SID, **body}).decode()


def media(payload: bytes) -> str:
    return twilio({"event": "media", "media": {"payload": base64.b64encode(payload).decode()}})


def engine(body: dict[str, Any]) -> str:
    return orjson.dumps(body).decode()


def test_start_opens_the_engine_session_once() -> None:
    t, _ = translator()
    start = twilio({"event": "start", "start": {"streamSid": SID}})
    (update,) = t.from_client(start)
    assert orjson.loads(update)["type"] == "session.update"
    assert t.from_client(start) == []


def test_what_is_not_a_twilio_message_is_ignored() -> None:
    t, writer = translator()
    assert t.from_client("not json") == []
    assert t.from_client('{"type": "response.create"}') == []
    assert writer.sent == []


def test_a_barge_in_the_sidecar_heard_is_written_to_twilio_at_once() -> None:
    t, writer = translator()
    t.to_client(engine({"type": "response.created", "response": {"id": RID}}))
    pcm = b"\x10\x00" * 1600  # 100 ms at 24 kHz, the engine's default output
    delta = {"type": "response.output_audio.delta", "response_id": RID}
    assert t.to_client(engine({**delta, "delta": base64.b64encode(pcm).decode()}))
    events: list[str] = []
    for _ in range(SPEECH_FRAMES):
        events += t.from_client(media(LOUD))
    # The clear went out through the writer, not through the session.
    assert [orjson.loads(f)["event"] for f in writer.sent] == ["clear"]
    assert "response.cancel" in [orjson.loads(e)["type"] for e in events]


def test_stop_closes_the_session_and_says_so() -> None:
    t, _ = translator()
    (close,) = t.from_client(twilio({"event": "stop"}))
    assert orjson.loads(close)["type"] == "session.close"
    assert t.stopped


def test_the_engines_events_become_twilio_frames() -> None:
    t, _ = translator()
    assert t.to_client(engine({"type": "response.output_audio_transcript.delta"})) == []
    assert t.to_client("not json") == []
