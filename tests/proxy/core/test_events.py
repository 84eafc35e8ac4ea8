"""Event classification (proxy/core/events.py).

The classification table for both directions, the prefix scan of large audio
frames (it must agree with a full parse), and properties: any text is
classified without raising, and for every valid JSON object the result equals
what a full ``json.loads`` says (docs/design.md, Per-session data path, docs/engine-protocol.md,
Client events; Server events; Version differences).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.events import (
    AUDIO_DELTA_TYPES,
    ClientKind,
    EventKind,
    classify_client,
    classify_upstream,
    frame_size,
)
from tests.proxy.core import helpers as h

#: The classification table, written out independently of the implementation.
UPSTREAM_TABLE: dict[str, EventKind] = {
    "response.output_audio.delta": EventKind.AUDIO_DELTA,
    "response.audio.delta": EventKind.AUDIO_DELTA,
    "response.created": EventKind.RESPONSE_CREATED,
    "response.done": EventKind.RESPONSE_DONE,
    "error": EventKind.ERROR,
    "session.created": EventKind.SESSION_CREATED,
    "session.resumed": EventKind.SESSION_CREATED,
    "session.closed": EventKind.SESSION_CLOSED,
    "session.replaced": EventKind.SESSION_REPLACED,
    "output_audio_buffer.cleared": EventKind.OUTPUT_AUDIO_CLEARED,
    "overlap.decision": EventKind.OVERLAP_DECISION,
    "input_audio_buffer.speech_started": EventKind.SPEECH_STARTED,
}

CLIENT_TABLE: dict[str, ClientKind] = {
    "response.cancel": ClientKind.RESPONSE_CANCEL,
    "output_audio_buffer.clear": ClientKind.OUTPUT_AUDIO_BUFFER_CLEAR,
    "barge_in": ClientKind.BARGE_IN,
    "turn.signal": ClientKind.TURN_SIGNAL,
    "signal_turn": ClientKind.TURN_SIGNAL,
    "input.cancel": ClientKind.INPUT_CANCEL,
    "response.create": ClientKind.RESPONSE_CREATE,
    "input_audio_buffer.append": ClientKind.AUDIO_APPEND,
    "session.close": ClientKind.SESSION_CLOSE,
    "close": ClientKind.SESSION_CLOSE,
    "close_session": ClientKind.SESSION_CLOSE,
    "session.update": ClientKind.SESSION_UPDATE,
    "session.resume": ClientKind.SESSION_RESUME,
    "session.event_ack": ClientKind.EVENT_ACK,
}

ALWAYS_CANCELS = {
    ClientKind.RESPONSE_CANCEL,
    ClientKind.OUTPUT_AUDIO_BUFFER_CLEAR,
    ClientKind.BARGE_IN,
    ClientKind.INPUT_CANCEL,
}

BIG = 4096  # base64 chars: well above the scan threshold


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


# ================================================================================
# Upstream table
# ================================================================================


class TestUpstreamTable:
    @pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
    def test_audio_delta_small(self, beta: bool) -> None:
        ev = classify_upstream(h.audio("resp-1", 16, beta=beta))
        assert ev.kind is EventKind.AUDIO_DELTA
        assert ev.is_audio
        assert ev.type == ("response.audio.delta" if beta else "response.output_audio.delta")
        assert ev.response_id == "resp-1"

    def test_response_created(self) -> None:
        ev = classify_upstream(h.response_created("resp-1"))
        assert ev.kind is EventKind.RESPONSE_CREATED
        assert ev.response_id == "resp-1"
        assert ev.status == "in_progress"
        assert not ev.is_audio

    @pytest.mark.parametrize("status", ["completed", "cancelled", "failed"])
    def test_response_done_status(self, status: str) -> None:
        ev = classify_upstream(h.response_done("resp-1", status))
        assert ev.kind is EventKind.RESPONSE_DONE
        assert ev.response_id == "resp-1"
        assert ev.status == status

    def test_response_done_id_from_response_object(self) -> None:
        text = h.dumps({"type": "response.done", "response": {"id": "r9", "status": "failed"}})
        ev = classify_upstream(text)
        assert (ev.kind, ev.response_id, ev.status) == (EventKind.RESPONSE_DONE, "r9", "failed")

    def test_response_created_id_from_response_object(self) -> None:
        text = h.dumps({"type": "response.created", "response": {"id": "r9"}})
        ev = classify_upstream(text)
        assert (ev.kind, ev.response_id, ev.status) == (EventKind.RESPONSE_CREATED, "r9", None)

    def test_response_done_without_response_object(self) -> None:
        ev = classify_upstream(h.dumps({"type": "response.done", "response": "x"}))
        assert (ev.kind, ev.response_id, ev.status) == (EventKind.RESPONSE_DONE, None, None)

    def test_top_level_response_id_wins_over_response_id_field(self) -> None:
        text = h.dumps({"type": "response.done", "response_id": "top", "response": {"id": "inner"}})
        assert classify_upstream(text).response_id == "top"

    def test_error(self) -> None:
        ev = classify_upstream(h.error("engine_error"))
        assert ev.kind is EventKind.ERROR
        assert ev.response_id is None

    def test_session_created_and_closed(self) -> None:
        assert classify_upstream(h.session_created()).kind is EventKind.SESSION_CREATED
        assert classify_upstream(h.session_closed()).kind is EventKind.SESSION_CLOSED

    @pytest.mark.parametrize("rid", [None, "resp-3"])
    def test_output_audio_buffer_cleared(self, rid: str | None) -> None:
        ev = classify_upstream(h.output_audio_buffer_cleared(rid))
        assert ev.kind is EventKind.OUTPUT_AUDIO_CLEARED
        assert ev.response_id == rid

    @pytest.mark.parametrize("action", ["barge_in", "listen", "drop"])
    def test_overlap_decision_action(self, action: str) -> None:
        ev = classify_upstream(h.overlap_decision(action))
        assert ev.kind is EventKind.OVERLAP_DECISION
        assert ev.action == action

    def test_overlap_decision_non_string_action(self) -> None:
        ev = classify_upstream(h.dumps({"type": "overlap.decision", "action": 3}))
        assert ev.kind is EventKind.OVERLAP_DECISION
        assert ev.action is None

    def test_speech_started(self) -> None:
        assert classify_upstream(h.speech_started()).kind is EventKind.SPEECH_STARTED

    def test_response_bound_other(self) -> None:
        ev = classify_upstream(h.transcript_delta("resp-1"))
        assert ev.kind is EventKind.RESPONSE_OTHER
        assert ev.response_id == "resp-1"

    @pytest.mark.parametrize(
        "type_", ["rate_limits.updated", "session.updated", "gander.future_event", ""]
    )
    def test_unknown_or_unbound_is_other(self, type_: str) -> None:
        ev = classify_upstream(h.dumps({"type": type_, "x": 1}))
        assert ev.kind is EventKind.OTHER
        assert ev.type == type_

    def test_non_string_response_id_is_ignored(self) -> None:
        ev = classify_upstream(h.dumps({"type": "x.y", "response_id": 5}))
        assert ev.kind is EventKind.OTHER
        assert ev.response_id is None

    def test_body_is_parsed_object_and_text_untouched(self) -> None:
        text = h.response_created("resp-1")
        ev = classify_upstream(text)
        assert ev.text is text
        assert ev.body == json.loads(text)

    @pytest.mark.parametrize(
        "text",
        [
            "",
            "not json",
            "{",
            '{"type": "error"',
            "[]",
            '["response.done"]',
            '"response.done"',
            "null",
            "42",
            "{}",
            '{"type": 5}',
            '{"type": null}',
            '{"type": ["error"]}',
            "NaN",
        ],
    )
    def test_malformed(self, text: str) -> None:
        ev = classify_upstream(text)
        assert ev.kind is EventKind.MALFORMED
        assert ev.type == ""
        assert ev.response_id is None
        assert ev.size == len(text.encode())


# ================================================================================
# Scan path for large audio frames
# ================================================================================


class TestAudioScan:
    @pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
    @pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
    def test_large_frame_is_scanned(self, spaced: bool, beta: bool) -> None:
        text = h.audio("resp-big", BIG, beta=beta, spaced=spaced)
        if spaced:
            assert '": "' in text
        ev = classify_upstream(text)
        assert ev.body is None  # scanned, not parsed
        assert ev.kind is EventKind.AUDIO_DELTA
        assert ev.response_id == "resp-big"
        assert ev.type in AUDIO_DELTA_TYPES
        assert ev.size == len(text)

    def test_whitespace_and_newlines_everywhere(self) -> None:
        body = {
            "type": "response.output_audio.delta",
            "response_id": "resp-ws",
            "delta": h.audio_payload(BIG),
        }
        text = json.dumps(body, indent=2)
        ev = classify_upstream(text)
        assert ev.body is None
        assert ev.response_id == "resp-ws"

    def test_small_frame_is_parsed(self) -> None:
        ev = classify_upstream(h.audio("resp-1", 16))
        assert ev.body is not None

    @pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
    def test_response_id_after_delta_is_scanned_too(self, spaced: bool) -> None:
        body = {
            "type": "response.output_audio.delta",
            "delta": h.audio_payload(BIG),
            "response_id": "resp-after",
        }
        ev = classify_upstream(h.dumps(body, spaced=spaced))
        assert ev.body is None  # scan path: the members after the payload are parsed
        assert ev.kind is EventKind.AUDIO_DELTA
        assert ev.response_id == "resp-after"

    def test_no_response_id_at_all(self) -> None:
        body = {"type": "response.output_audio.delta", "delta": h.audio_payload(BIG)}
        ev = classify_upstream(h.dumps(body))
        assert ev.kind is EventKind.AUDIO_DELTA
        assert ev.response_id is None

    @pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
    @pytest.mark.parametrize(
        ("pairs", "expected"),
        [
            # a value equal to "delta" before the real key
            ([("item_id", "delta"), ("response_id", "r1"), ("delta", "BLOB")], "r1"),
            # a value equal to "response_id" before the real key
            ([("item_id", "response_id"), ("response_id", "r2"), ("delta", "BLOB")], "r2"),
            # the response_id's value is itself "delta"
            ([("response_id", "delta"), ("delta", "BLOB")], "delta"),
            # a value "response_id" before the delta, the real key after it
            ([("item_id", "response_id"), ("delta", "BLOB"), ("response_id", "r3")], "r3"),
            # a value looking like a key/value pair
            ([("item_id", ',"delta":'), ("response_id", "r4"), ("delta", "BLOB")], "r4"),
            ([("item_id", ', "response_id": "x"'), ("response_id", "r5"), ("delta", "BLOB")], "r5"),
            # a nested response_id before the top-level one
            (
                [("metadata", {"response_id": "wrong"}), ("response_id", "r6"), ("delta", "BLOB")],
                "r6",
            ),
            # a nested delta before the top-level one
            ([("response_id", "r7"), ("metadata", {"delta": "x"}), ("delta", "BLOB")], "r7"),
            ([("response_id", "r8"), ("metadata", ["delta"]), ("delta", "BLOB")], "r8"),
            # response_id null before, real one nowhere
            ([("response_id", None), ("delta", "BLOB")], None),
            # response_id not a string
            ([("response_id", 12), ("delta", "BLOB")], None),
            # key names that merely contain the words
            (
                [
                    ("x_response_id", "no"),
                    ("response_idx", "no"),
                    ("delta", "BLOB"),
                    ("response_id", "r9"),
                ],
                "r9",
            ),
            ([("deltas", "no"), ("response_id", "r10"), ("delta", "BLOB")], "r10"),
            # an escaped quote in a value before the delta
            ([("item_id", 'a"b'), ("response_id", "r11"), ("delta", "BLOB")], "r11"),
            # the delta is nested only: top-level delta missing
            ([("response_id", "r12"), ("metadata", {"delta": "BLOB"})], "r12"),
        ],
    )
    def test_tricky_frames_get_the_right_response_id(
        self, pairs: list[tuple[str, Any]], expected: str | None, spaced: bool
    ) -> None:
        body: dict[str, Any] = {"type": "response.output_audio.delta"}
        blob = h.audio_payload(BIG)
        for key, value in pairs:
            if value == "BLOB":
                value = blob
            elif isinstance(value, dict):
                value = {k: blob if v == "BLOB" else v for k, v in value.items()}
            body[key] = value
        text = h.dumps(body, spaced=spaced)
        ev = classify_upstream(text)
        assert ev.kind is EventKind.AUDIO_DELTA
        assert ev.response_id == expected
        assert ev.size == len(text.encode())

    def test_type_not_first_is_scanned_too(self) -> None:
        body = {
            "response_id": "r1",
            "type": "response.output_audio.delta",
            "delta": h.audio_payload(BIG),
        }
        ev = classify_upstream(h.dumps(body))
        assert ev.body is None  # key order does not matter to the splice
        assert (ev.kind, ev.response_id) == (EventKind.AUDIO_DELTA, "r1")

    def test_nested_delta_before_the_payload_falls_back_to_parse(self) -> None:
        text = (
            '{"type":"response.output_audio.delta","metadata":{"delta":"x"},'
            '"response_id":"r1","delta":"' + h.audio_payload(BIG) + '"}'
        )
        ev = classify_upstream(text)
        assert ev.body is not None
        assert (ev.kind, ev.response_id) == (EventKind.AUDIO_DELTA, "r1")

    def test_repeated_payload_key_resolves_like_a_full_parse(self) -> None:
        empty_last = (
            '{"type":"input_audio_buffer.append","audio":"' + h.audio_payload(BIG) + '","audio":""}'
        )
        empty_first = (
            '{"type":"input_audio_buffer.append","audio":"","audio":"' + h.audio_payload(BIG) + '"}'
        )
        assert classify_client(empty_last).audio_chars == 0
        assert classify_client(empty_first).audio_chars == len(h.audio_payload(BIG))

    def test_large_non_audio_is_parsed(self) -> None:
        text = h.error(pad=BIG)
        ev = classify_upstream(text)
        assert ev.body is not None
        assert ev.kind is EventKind.ERROR

    def test_large_transcript_with_delta_key_is_not_audio(self) -> None:
        text = h.transcript_delta("resp-1", "x" * BIG)
        ev = classify_upstream(text)
        assert ev.kind is EventKind.RESPONSE_OTHER
        assert ev.response_id == "resp-1"

    def test_truncated_large_audio_is_malformed(self) -> None:
        text = h.audio("resp-1", BIG)[:-40]
        ev = classify_upstream(text)
        assert ev.kind is EventKind.MALFORMED


# ================================================================================
# Client table
# ================================================================================


class TestClientTable:
    @pytest.mark.parametrize("rid", [None, "resp-1"])
    def test_response_cancel(self, rid: str | None) -> None:
        ev = classify_client(h.b_response_cancel(rid))
        assert ev.kind is ClientKind.RESPONSE_CANCEL
        assert ev.cancels
        assert ev.response_id == rid
        assert ev.event_id == "evt_cancel"
        assert ev.is_valid

    @pytest.mark.parametrize("rid", [None, "resp-1"])
    def test_output_audio_buffer_clear(self, rid: str | None) -> None:
        ev = classify_client(h.b_output_audio_buffer_clear(rid))
        assert ev.kind is ClientKind.OUTPUT_AUDIO_BUFFER_CLEAR
        assert ev.cancels
        assert ev.response_id == rid

    def test_barge_in(self) -> None:
        ev = classify_client(h.b_barge_in())
        assert (ev.kind, ev.cancels) == (ClientKind.BARGE_IN, True)

    def test_input_cancel(self) -> None:
        ev = classify_client(h.b_input_cancel())
        assert (ev.kind, ev.cancels) == (ClientKind.INPUT_CANCEL, True)

    @pytest.mark.parametrize("alias", [False, True], ids=["turn.signal", "signal_turn"])
    @pytest.mark.parametrize(
        ("signal", "cancels"),
        [
            ("barge_in", True),
            ("response.cancel", True),
            ("input.cancel", False),
            ("end_of_turn", False),
            ("", False),
            (None, False),
            (1, False),
            ({"event": "barge_in"}, False),
            (["barge_in"], False),
        ],
    )
    def test_turn_signal(self, signal: Any, cancels: bool, alias: bool) -> None:
        ev = classify_client(h.b_turn_signal(signal, alias=alias))
        assert ev.kind is ClientKind.TURN_SIGNAL
        assert ev.cancels is cancels

    def test_turn_signal_without_event(self) -> None:
        ev = classify_client(h.dumps({"type": "turn.signal"}))
        assert (ev.kind, ev.cancels) == (ClientKind.TURN_SIGNAL, False)

    def test_response_create(self) -> None:
        ev = classify_client(h.b_response_create())
        assert (ev.kind, ev.cancels, ev.event_id) == (
            ClientKind.RESPONSE_CREATE,
            False,
            "evt_create",
        )

    @pytest.mark.parametrize("type_", ["session.close", "close", "close_session"])
    def test_session_close_aliases(self, type_: str) -> None:
        ev = classify_client(h.dumps({"type": type_}))
        assert (ev.kind, ev.cancels) == (ClientKind.SESSION_CLOSE, False)

    @pytest.mark.parametrize("type_", ["input_audio_buffer.commit", "playback.ack", "new.thing"])
    def test_other(self, type_: str) -> None:
        ev = classify_client(h.dumps({"type": type_, "response_id": "r"}))
        assert ev.kind is ClientKind.OTHER
        assert not ev.cancels
        assert ev.is_valid

    def test_session_update(self) -> None:
        text = h.dumps({"type": "session.update", "session": {"sample_rate_hz": 16000}})
        ev = classify_client(text)
        assert (ev.kind, ev.cancels) == (ClientKind.SESSION_UPDATE, False)
        assert ev.body == json.loads(text)

    def test_small_append_is_parsed(self) -> None:
        ev = classify_client(h.b_audio_append(64))
        assert (ev.kind, ev.audio_chars, ev.cancels) == (ClientKind.AUDIO_APPEND, 64, False)

    @pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
    def test_large_append_audio_length(self, spaced: bool) -> None:
        text = h.b_audio_append(BIG, spaced=spaced)
        ev = classify_client(text)
        assert (ev.kind, ev.audio_chars) == (ClientKind.AUDIO_APPEND, BIG)
        # Parsed whole, as the engine parses it (one reading: docs/design.md, Resume).
        assert ev.body == json.loads(text)
        assert ev.size == len(text)

    def test_large_append_with_nested_audio_first(self) -> None:
        body = {
            "type": "input_audio_buffer.append",
            "meta": {"audio": "AAAA"},
            "audio": h.audio_payload(BIG),
        }
        ev = classify_client(h.dumps(body))
        assert (ev.kind, ev.audio_chars) == (ClientKind.AUDIO_APPEND, BIG)

    def test_append_with_non_string_audio(self) -> None:
        body = {"type": "input_audio_buffer.append", "audio": 5, "pad": "x" * BIG}
        ev = classify_client(h.dumps(body))
        assert (ev.kind, ev.audio_chars) == (ClientKind.AUDIO_APPEND, 0)

    @pytest.mark.parametrize("text", ["", "nope", "{", '{"type": "x"', "NaN", "{'type': 'x'}"])
    def test_invalid_json(self, text: str) -> None:
        ev = classify_client(text)
        assert ev.kind is ClientKind.INVALID_JSON
        assert not ev.is_valid
        assert not ev.cancels
        assert ev.detail

    @pytest.mark.parametrize(
        "text",
        [
            "[]",
            '["response.cancel"]',
            '"response.cancel"',
            "null",
            "1",
            "{}",
            '{"type": 1}',
            '{"type": null}',
            '{"event_id": "e"}',
        ],
    )
    def test_bad_event(self, text: str) -> None:
        ev = classify_client(text)
        assert ev.kind is ClientKind.BAD_EVENT
        assert not ev.is_valid
        assert not ev.cancels
        assert ev.detail


# ================================================================================
# Frame size
# ================================================================================


class TestFrameSize:
    @pytest.mark.parametrize(
        "text", ["", "abc", "é", "€uro", "😀", '{"type":"x","t":"héllo wörld 😀"}', "\x00"]
    )
    def test_utf8_length(self, text: str) -> None:
        assert frame_size(text) == len(text.encode("utf-8"))
        assert classify_upstream(text).size == len(text.encode("utf-8"))
        assert classify_client(text).size == len(text.encode("utf-8"))

    def test_non_ascii_audio_frame(self) -> None:
        body = {
            "type": "response.output_audio.delta",
            "response_id": "résp-€",
            "delta": h.audio_payload(BIG),
        }
        text = h.dumps(body)
        ev = classify_upstream(text)
        assert ev.body is None
        assert ev.response_id == "résp-€"
        assert ev.size == len(text.encode("utf-8")) == len(text) + 3

    def test_lone_surrogate_does_not_raise(self) -> None:
        # Not reachable from a WebSocket (text frames are strict UTF-8), but
        # "never raises" is the contract.
        for text in ("\ud800", '{"type":"x","v":"\udfff"}'):
            up = classify_upstream(text)
            assert up.kind is EventKind.MALFORMED
            assert classify_client(text).kind is ClientKind.INVALID_JSON
            assert up.size >= len(text)


# ================================================================================
# Properties
# ================================================================================

UPSTREAM_TYPES = [
    *sorted(UPSTREAM_TABLE),
    "response.output_audio_transcript.delta",
    "rate_limits.updated",
    "x.unknown",
]
CLIENT_TYPES = [*sorted(CLIENT_TABLE), "playback.ack"]

TRICKY_STRINGS = st.sampled_from(
    [
        "delta",
        "response_id",
        "audio",
        "type",
        "event",
        ",",
        "{",
        "}",
        "[",
        ":",
        '"',
        "\\",
        ',"delta":"',
        ', "response_id": "x", ',
        '"response_id":"fake"',
        "response.output_audio.delta",
        "barge_in",
        "response.cancel",
        "é😀",
        " \n\t",
    ]
)

BLOBS = st.integers(min_value=0, max_value=700).map(lambda n: "QUJD" * n)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    TRICKY_STRINGS,
    st.text(max_size=12),
    BLOBS,
)

VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.sampled_from(["delta", "response_id", "id", "status", "audio", "k"]),
            children,
            max_size=3,
        ),
    ),
    max_leaves=6,
)

KEYS = st.sampled_from(
    [
        "response_id",
        "delta",
        "audio",
        "item_id",
        "event_id",
        "event",
        "action",
        "response",
        "metadata",
        "status",
        "x_response_id",
        "deltas",
    ]
)


@st.composite
def json_objects(draw: st.DrawFn, type_values: list[str]) -> str:
    """A valid JSON object, often with ``type`` first and a big payload."""
    type_value = draw(
        st.one_of(
            st.sampled_from(type_values),
            st.text(max_size=10),
            SCALARS.filter(lambda v: not isinstance(v, str)),
        )
    )
    fields = draw(st.dictionaries(KEYS, VALUES, max_size=6))
    if draw(st.booleans()):
        payload_key = draw(st.sampled_from(["delta", "audio"]))
        fields[payload_key] = draw(BLOBS)
    if draw(st.booleans()):
        response = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "id": st.one_of(st.text(max_size=5), st.integers()),
                    "status": st.sampled_from(["completed", "cancelled", "failed", 3]),
                },
            )
        )
        fields["response"] = response
    items = list(fields.items())
    position = 0 if draw(st.integers(0, 3)) else draw(st.integers(0, len(items)))
    items.insert(position, ("type", type_value))
    return _render(dict(items), draw)


def _render(obj: dict[str, Any], draw: st.DrawFn) -> str:
    style = draw(st.sampled_from(["compact", "spaced", "indent"]))
    ensure_ascii = draw(st.booleans())
    if style == "compact":
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=ensure_ascii)
    if style == "spaced":
        return json.dumps(obj, ensure_ascii=ensure_ascii)
    return json.dumps(obj, indent=1, ensure_ascii=ensure_ascii)


SIMPLE_STRINGS = st.from_regex(r"[a-z0-9_.-]{0,12}", fullmatch=True)
SIMPLE_VALUES = st.one_of(SIMPLE_STRINGS, st.integers(0, 10**6), st.booleans(), st.none())
FLAT_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    TRICKY_STRINGS,
    st.text(max_size=12),
)


@st.composite
def payload_frames(draw: st.DrawFn, type_value: str, payload_key: str) -> str:
    """Frames shaped like audio: ``type`` first, mostly flat, one big base64 value.

    These are the frames the prefix scan is meant for, so the property below
    exercises the scan and not only the parse.
    """
    tricky = draw(st.integers(0, 3)) == 0
    fields = draw(
        st.dictionaries(
            st.sampled_from(
                [
                    "response_id",
                    "item_id",
                    "event_id",
                    "x_response_id",
                    "deltas",
                    "audios",
                    "format",
                    "output_index",
                ]
            ),
            FLAT_VALUES if tricky else SIMPLE_VALUES,
            max_size=5,
        )
    )
    if draw(st.integers(0, 3)):
        fields["response_id"] = draw(
            st.one_of(TRICKY_STRINGS, st.text(max_size=8)) if tricky else SIMPLE_STRINGS
        )
    if draw(st.integers(0, 4)) == 0:
        fields["metadata"] = draw(VALUES)
    items = list(fields.items())
    if "response_id" in fields and draw(st.booleans()):
        items.remove(("response_id", fields["response_id"]))
        items.insert(0, ("response_id", fields["response_id"]))
    items.insert(
        draw(st.integers(0, len(items))),
        (payload_key, "QUJD" * draw(st.integers(min_value=256, max_value=600))),
    )
    items.insert(0, ("type", type_value))
    obj = dict(items)
    return _render(obj, draw)


UPSTREAM_FRAMES = st.one_of(
    json_objects(UPSTREAM_TYPES),
    st.sampled_from(sorted(AUDIO_DELTA_TYPES)).flatmap(lambda t: payload_frames(t, "delta")),
    payload_frames("response.output_audio.delta", "delta"),
)
CLIENT_FRAMES = st.one_of(
    json_objects(CLIENT_TYPES),
    payload_frames("input_audio_buffer.append", "audio"),
    payload_frames("input_audio_buffer.append", "audio"),
)


def expected_upstream(body: Any) -> tuple[EventKind, str, str | None, str | None, str | None]:
    """(kind, type, response_id, status, action) from a full parse and the table."""
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        return EventKind.MALFORMED, "", None, None, None
    type_ = body["type"]
    rid = _str(body.get("response_id"))
    status = action = None
    kind = UPSTREAM_TABLE.get(type_)
    if kind is None:
        kind = EventKind.RESPONSE_OTHER if rid is not None else EventKind.OTHER
    elif kind in (EventKind.RESPONSE_DONE, EventKind.RESPONSE_CREATED):
        response = body.get("response")
        if isinstance(response, dict):
            status = _str(response.get("status"))
            if rid is None:
                rid = _str(response.get("id"))
    elif kind is EventKind.OVERLAP_DECISION:
        action = _str(body.get("action"))
    return kind, type_, rid, status, action


def expected_client(body: Any) -> tuple[ClientKind, str, str | None, bool, int]:
    """(kind, type, response_id, cancels, audio_chars) from a full parse."""
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        return ClientKind.BAD_EVENT, "", None, False, 0
    type_ = body["type"]
    kind = CLIENT_TABLE.get(type_, ClientKind.OTHER)
    if kind is ClientKind.AUDIO_APPEND:
        audio_value = body.get("audio")
        chars = len(audio_value) if isinstance(audio_value, str) else 0
        # a scanned append does not look at response_id; the engine ignores it too
        return kind, type_, None, False, chars
    cancels = kind in ALWAYS_CANCELS or (
        kind is ClientKind.TURN_SIGNAL and body.get("event") in ("barge_in", "response.cancel")
    )
    return kind, type_, _str(body.get("response_id")), cancels, 0


PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class TestProperties:
    @PROPERTY_SETTINGS
    @given(st.text(alphabet=st.one_of(st.characters(), st.characters(categories=["Cs"]))))
    def test_arbitrary_text_never_raises(self, text: str) -> None:
        up = classify_upstream(text)
        cl = classify_client(text)
        assert up.text is text and cl.text is text
        assert up.size == cl.size

    @PROPERTY_SETTINGS
    @given(UPSTREAM_FRAMES, st.data())
    def test_mangled_json_never_raises(self, text: str, data: st.DataObject) -> None:
        cut = data.draw(st.integers(0, len(text)))
        junk = data.draw(st.sampled_from(["", "}", '"', "\\", "{", ",", "\x00", "é"]))
        mangled = text[:cut] + junk + text[cut + 1 :]
        classify_upstream(mangled)
        classify_client(mangled)

    @PROPERTY_SETTINGS
    @given(UPSTREAM_FRAMES)
    def test_upstream_scan_agrees_with_full_parse(self, text: str) -> None:
        body = json.loads(text)
        ev = classify_upstream(text)
        assert (ev.kind, ev.type, ev.response_id, ev.status, ev.action) == expected_upstream(body)
        assert ev.size == len(text.encode("utf-8"))
        if ev.body is not None:
            assert ev.body == body

    @PROPERTY_SETTINGS
    @given(CLIENT_FRAMES)
    def test_client_scan_agrees_with_full_parse(self, text: str) -> None:
        body = json.loads(text)
        ev = classify_client(text)
        got = (ev.kind, ev.type, ev.response_id, ev.cancels, ev.audio_chars)
        expected = expected_client(body)
        if ev.kind is ClientKind.AUDIO_APPEND:
            got = (ev.kind, ev.type, None, ev.cancels, ev.audio_chars)
        assert got == expected
        assert ev.size == len(text.encode("utf-8"))
        if ev.body is not None:  # a scanned append's body is all but its audio
            assert ev.body in (body, {**body, "audio": ""})

    @PROPERTY_SETTINGS
    @given(
        st.one_of(
            st.lists(SCALARS, max_size=3),
            SCALARS,
        )
    )
    def test_non_object_json_is_rejected(self, value: Any) -> None:
        text = json.dumps(value)
        assert classify_client(text).kind is ClientKind.BAD_EVENT
        assert classify_upstream(text).kind is EventKind.MALFORMED

    @PROPERTY_SETTINGS
    @given(st.text(min_size=1, max_size=50))
    def test_text_that_is_not_json(self, text: str) -> None:
        try:
            json.loads(text)
        except ValueError:
            assert classify_client(text).kind is ClientKind.INVALID_JSON
            assert classify_upstream(text).kind is EventKind.MALFORMED
