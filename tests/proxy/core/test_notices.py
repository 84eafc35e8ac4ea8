"""The events the sidecar itself writes (proxy/core/notices.py).

Each is what the engine would have written in its place (docs/engine-protocol.md,
Terminal events and errors), classified like an engine frame, so the rest of the
core treats it as one.
"""

from __future__ import annotations

import json

import pytest

from proxy.core import notices
from proxy.core.events import EventKind, classify_upstream


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        ("output_backpressure", "rate_limit_error"),
        ("client_rate_limited", "rate_limit_error"),
        ("engine_unavailable", "server_error"),
        ("upstream_frame_too_large", "server_error"),
        ("something_new", "invalid_request_error"),
    ],
)
def test_an_error_has_the_type_the_engine_derives_from_its_code(code: str, error_type: str) -> None:
    event = notices.error_event("e1", code, "why")
    assert event.kind is EventKind.ERROR
    assert event.body == {
        "type": "error",
        "event_id": "e1",
        "error": {"type": error_type, "code": code, "message": "why"},
    }


def test_an_error_echoes_the_clients_event_id_only_when_given() -> None:
    body = notices.error_event("e1", "bad_event", "m", client_event_id="c7").body
    assert body is not None and body["error"]["event_id"] == "c7"
    body = notices.error_event("e1", "bad_event", "m").body
    assert body is not None and "event_id" not in body["error"]


def test_a_failed_response_done_is_a_terminal_for_that_response() -> None:
    event = notices.response_failed("e2", "r1", "output_backpressure")
    assert event.kind is EventKind.RESPONSE_DONE
    assert event.response_id == "r1"
    body = event.body
    assert body is not None
    response = body["response"]
    assert response["status"] == "failed"
    assert response["status_details"] == {"type": "failed", "reason": "output_backpressure"}
    (item,) = response["output"]
    assert item["role"] == "assistant" and item["status"] == "failed"


def test_session_closed_names_the_session_or_an_empty_string() -> None:
    event = notices.session_closed("e3", None, "shutdown", detail="draining")
    assert event.kind is EventKind.SESSION_CLOSED
    assert event.body == {
        "type": "session.closed",
        "event_id": "e3",
        "session_id": "",
        "reason": "shutdown",
        "event": {"detail": "draining"},
    }
    compact = notices.compact_session_closed("e3", "duplex-1")
    assert compact.body is not None
    assert compact.body["reason"] == "close_details_exceed_output_limit"
    assert compact.body["session_id"] == "duplex-1" and compact.body["event"] == {}


def test_the_frames_sent_upstream_are_plain_json() -> None:
    assert json.loads(notices.response_cancel("r1")) == {
        "type": "response.cancel",
        "response_id": "r1",
    }
    assert json.loads(notices.session_close("client_gone")) == {
        "type": "session.close",
        "reason": "client_gone",
    }


def test_session_resumed_carries_the_generation_and_token_and_the_session_when_known() -> None:
    event = notices.session_resumed("e4", "duplex-1", None, generation=2, resume_token="t")
    assert event.body == {
        "type": "session.resumed",
        "event_id": "e4",
        "session_id": "duplex-1",
        "attachment_generation": 2,
        "resume_token": "t",
    }
    with_session = notices.session_resumed("e4", "d", {"id": "d"}, generation=1, resume_token="t")
    assert with_session.body is not None and with_session.body["session"] == {"id": "d"}


def test_replaced_and_resync_required_name_their_session() -> None:
    replaced = notices.session_replaced("e5", "d", 3)
    assert replaced.kind is EventKind.SESSION_REPLACED
    assert replaced.body is not None and replaced.body["attachment_generation"] == 3
    resync = notices.session_resync_required("e6", "d", "journal_trimmed")
    assert resync.body == {
        "type": "session.resync_required",
        "event_id": "e6",
        "session_id": "d",
        "reason": "journal_trimmed",
    }


def test_a_refused_resume_tells_nothing_about_why() -> None:
    body = notices.resume_refused().body
    assert body is not None and body["error"]["code"] in notices.RESUME_REFUSALS
    assert "event_id" not in body
    assert notices.resume_refused("c1").body == {**body, "event_id": "c1"}


def test_the_bound_token_replaces_the_engines_keeping_the_rest_of_the_frame_as_written() -> None:
    text = '{"type":"session.created", "resume_token":"engine-tok","session":{"id":"d"}}'
    swapped = notices.with_resume_token(classify_upstream(text), "bound")
    assert swapped.text == text.replace('"engine-tok"', '"bound"'), "spacing kept"
    assert swapped.kind is EventKind.SESSION_CREATED


def test_a_token_written_twice_makes_the_frame_written_anew_without_the_copy() -> None:
    """Only the bound token carries the engine's (the client resumes with nothing
    unbound): a copy elsewhere in the frame is made empty, even a session id."""
    text = '{"type":"session.created","resume_token":"t","session":{"id":"t","v":["t"]}}'
    swapped = notices.with_resume_token(classify_upstream(text), "bound")
    assert swapped.body == {
        "type": "session.created",
        "resume_token": "bound",
        "session": {"id": "", "v": [""]},
    }


@pytest.mark.parametrize(
    "text",
    [
        # A duplicate key a parser drops, spelling the token with an escape:
        '{"type":"session.created","resume_token":"\\u0065ngine-tok","resume_token":"engine-tok"}',
        '{"type":"session.created","x":"engine\\u002dtok","x":1,"resume_token":"engine-tok"}',
        # A copy the parser keeps:
        '{"type":"session.created","resume_token":"engine-tok","session":{"engine-tok":2}}',
    ],
)
def test_the_engines_token_reaches_the_client_only_inside_the_bound_one(text: str) -> None:
    swapped = notices.with_resume_token(classify_upstream(text), "bound")
    assert "engine-tok" not in swapped.text and "engine\\u" not in swapped.text
    assert "\\u0065" not in swapped.text and "\\u002d" not in swapped.text
    assert swapped.body is not None and swapped.body["resume_token"] == "bound"
