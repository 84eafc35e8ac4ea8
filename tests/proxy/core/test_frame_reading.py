"""One reading of a frame: every field the sidecar decides from is read as the
engine's JSON parser (Python's ``json``) reads it (docs/design.md, Resume and
Per-session data path).

A differential property test in both directions: frames whose keys and string
values are spelled with JSON escapes (``"session\\u002eresume"``), repeated keys,
odd whitespace and audio payloads long enough for the fast path. The fast path
(``classify_client``, ``classify_upstream``, ``parse_resume``) must read every
field exactly as ``json.loads`` does, or refuse the frame; never a third reading.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.events import (
    AUDIO_DELTA_TYPES,
    ClientKind,
    EventKind,
    classify_client,
    classify_upstream,
)
from proxy.edge.resume import parse_resume
from tests.proxy.core.test_events import expected_client, expected_upstream

READING = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: The names the sidecar reads, in either direction, and a few it does not.
CLIENT_TYPES = (
    "session.resume",
    "response.cancel",
    "input_audio_buffer.append",
    "session.event_ack",
    "output_audio_buffer.clear",
    "turn.signal",
    "session.close",
    "response.create",
    "conversation.item.truncate",
)
UPSTREAM_TYPES = (
    "response.output_audio.delta",
    "response.audio.delta",
    "response.created",
    "response.done",
    "error",
    "session.created",
    "session.resumed",
    "session.replaced",
    "overlap.decision",
    "output_audio_buffer.cleared",
)
READ_KEYS = (
    "type",
    "response_id",
    "event_id",
    "session_id",
    "resume_token",
    "last_received_server_event_seq",
    "server_event_seq",
    "event",
    "action",
    "item_id",
    "audio",
    "delta",
)
BASE64 = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=",
    min_size=1100,
    max_size=1400,
)
WHITESPACE = st.sampled_from(["", "", " ", "\n", "\t ", "\r\n  "])


@st.composite
def spelled(draw: st.DrawFn, text: str) -> str:
    """A JSON string literal for ``text``, each character plain or escaped at random."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\' or code < 0x20:
            out.append(json.dumps(ch)[1:-1])
        elif code > 0xFFFF:
            out.append(ch)
        else:
            style = draw(st.integers(0, 4))
            if style == 0:
                out.append(f"\\u{code:04x}")
            elif style == 1:
                out.append(f"\\u{code:04X}")
            elif style == 2 and ch == "/":
                out.append("\\/")
            else:
                out.append(ch)
    out.append('"')
    return "".join(out)


@st.composite
def values(draw: st.DrawFn, key: str, types: tuple[str, ...]) -> str:
    """A JSON value for ``key``: mostly what the sidecar expects there, sometimes not."""
    if key == "type":
        return draw(spelled(draw(st.sampled_from(types))))
    if key in ("audio", "delta"):
        return '"' + draw(BASE64) + '"'  # plain: the fast path's case
    if key in ("last_received_server_event_seq", "server_event_seq"):
        kind = draw(st.integers(0, 5))
        if kind == 0:
            return json.dumps(draw(st.text(max_size=5)))
        if kind == 1:
            return "1.5"
        return str(draw(st.integers(-(2**63), 2**63 - 1)))
    if key == "event":
        return draw(spelled(draw(st.sampled_from(["barge_in", "response.cancel", "speaking"]))))
    if key == "action":
        return draw(spelled(draw(st.sampled_from(["barge_in", "continue"]))))
    if draw(st.integers(0, 6)) == 0:
        return draw(st.sampled_from(["null", "7", "[]", '{"id":"x"}', "true"]))
    return draw(spelled(draw(st.text(min_size=1, max_size=8))))


@st.composite
def frames(draw: st.DrawFn, types: tuple[str, ...], extra: tuple[str, ...] = ()) -> str:
    """An object of the read keys (some twice, some spelled with escapes) in any order."""
    keys = draw(st.lists(st.sampled_from(READ_KEYS + extra), max_size=8))
    keys.insert(draw(st.integers(0, len(keys))), "type")
    members = []
    for key in keys:
        name = draw(spelled(key))
        value = draw(values(key, types))
        members.append(f"{draw(WHITESPACE)}{name}{draw(WHITESPACE)}:{draw(WHITESPACE)}{value}")
    return "{" + ",".join(members) + draw(WHITESPACE) + "}"


@st.composite
def upstream_frames(draw: st.DrawFn) -> str:
    text = draw(frames(UPSTREAM_TYPES, extra=("response", "format", "sample_rate_hz")))
    if draw(st.booleans()):  # a response object for created/done
        status = draw(spelled(draw(st.sampled_from(["completed", "cancelled", "failed"]))))
        rid = draw(spelled(draw(st.text(min_size=1, max_size=6))))
        inner = f"{{{draw(spelled('id'))}:{rid},{draw(spelled('status'))}:{status}}}"
        text = text[:-1] + f",{draw(spelled('response'))}:{inner}}}"
    return text


def _int(value: object) -> int | None:
    return value if type(value) is int else None


def _without(body: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    return None if body is None else {k: v for k, v in body.items() if k != key}


class TestClientFrames:
    @READING
    @given(frames(CLIENT_TYPES))
    def test_every_field_is_read_as_the_engine_reads_it(self, text: str) -> None:
        body = json.loads(text)
        event = classify_client(text)
        got = (event.kind, event.type, event.response_id, event.cancels, event.audio_chars)
        if event.kind is ClientKind.AUDIO_APPEND:
            got = (event.kind, event.type, None, event.cancels, event.audio_chars)
        assert got == expected_client(body)
        event_id = body.get("event_id")
        assert event.event_id == (event_id if isinstance(event_id, str) else None)
        assert _without(event.body, "audio") == _without(body, "audio")

    @READING
    @given(frames(CLIENT_TYPES))
    def test_a_resume_is_one_whatever_its_spelling(self, text: str) -> None:
        """``"session\\u002eresume"`` is a resume to the engine, so it is one to the
        sidecar (its key check runs); its fields are the engine's."""
        body = json.loads(text)
        request = parse_resume(aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, text, None))
        if body.get("type") != "session.resume":
            assert request is None
            return
        assert request is not None
        session_id, token = body.get("session_id"), body.get("resume_token")
        cursor = body.get("last_received_server_event_seq", 0)
        well_formed = isinstance(session_id, str) and isinstance(token, str) and type(cursor) is int
        assert request.well_formed is well_formed
        if well_formed:
            assert (request.session_id, request.token, request.cursor) == (
                session_id,
                token,
                max(0, cursor),
            )

    @READING
    @given(BASE64, st.integers(0, 1000), st.sampled_from(["\x00", "\x1f", "\n", "\t"]))
    def test_an_append_with_a_raw_control_character_is_not_json(
        self, audio: str, at: int, control: str
    ) -> None:
        """The engine's parser refuses it, so the sidecar must not charge it as audio."""
        audio = audio[:at] + control + audio[at:]
        text = '{"type":"input_audio_buffer.append","audio":"' + audio + '"}'
        event = classify_client(text)
        assert event.kind is ClientKind.INVALID_JSON

    def test_what_only_the_engine_parser_accepts_is_refused_not_read_otherwise(self) -> None:
        """NaN, a lone surrogate escape, a number beyond double range: orjson refuses
        what Python's json reads; the sidecar answers an error and forwards nothing."""
        for text in (
            '{"type":"session.resume","session_id":"s","resume_token":"t","x":NaN}',
            '{"type":"session.resume","session_id":"\\ud800","resume_token":"t"}',
            '{"type":"response.cancel","response_id":"r","n":1e400}',
        ):
            json.loads(text)  # the engine would take it
            assert classify_client(text).kind is ClientKind.INVALID_JSON, text
            request = parse_resume(aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, text, None))
            assert request is None, text  # never a resume read differently

    def test_a_cursor_beyond_64_bits_is_a_malformed_resume(self) -> None:
        """Python reads it as an int, orjson as a float: refused, never a cursor of 0."""
        text = (
            '{"type":"session.resume","session_id":"s","resume_token":"t",'
            '"last_received_server_event_seq":123456789012345678901234567890}'
        )
        request = parse_resume(aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, text, None))
        assert request is not None and not request.well_formed


class TestUpstreamFrames:
    @READING
    @given(upstream_frames())
    def test_every_field_is_read_as_a_json_parser_reads_it(self, text: str) -> None:
        body = json.loads(text)
        event = classify_upstream(text)
        assert (
            event.kind,
            event.type,
            event.response_id,
            event.status,
            event.action,
        ) == expected_upstream(body)
        assert event.seq == _int(body.get("server_event_seq"))
        if event.kind is EventKind.AUDIO_DELTA:
            delta = body.get("delta")
            assert body["type"] in AUDIO_DELTA_TYPES
            assert event.audio_chars == (len(delta) if isinstance(delta, str) else 0)
            assert _without(event.audio_meta, "delta") == _without(body, "delta")
        elif event.body is not None:
            assert event.body == body
