"""``ResponseRequests`` (proxy/core/response_requests.py): responses asked for, not created yet.

A cancel without a response id covers the requests in flight ("born cancelled",
docs/design.md, Cancellation); an engine error that refuses a request removes it.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.events import classify_client
from proxy.core.response_requests import (
    CREATE_IN_FLIGHT,
    MAX_PENDING_CREATES,
    ResponseRequests,
    commit_creates_response,
)
from tests.proxy.core.helpers import dumps


def _error(code: str | None = None, event_id: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": "invalid_request_error"}
    if code is not None:
        error["code"] = code
    if event_id is not None:
        error["event_id"] = event_id
    return {"type": "error", "error": error}


def test_the_created_response_gets_the_time_its_request_was_asked() -> None:
    requests = ResponseRequests()
    requests.asked(1.0, "ev1")
    requests.asked(2.0, "ev2")
    assert requests.created("r1") is False
    assert requests.created("r2") is False
    assert requests.asked_at == {"r1": 1.0, "r2": 2.0}


def test_a_cancel_without_an_id_makes_the_requests_in_flight_born_cancelled() -> None:
    requests = ResponseRequests()
    requests.asked(0.0, None)
    requests.asked(0.5, None)
    requests.cancel_in_flight(1.0)
    assert [requests.created("r1"), requests.created("r2")] == [True, True]
    requests.asked(2.0, None)
    assert requests.created("r3") is False, "a request after the cancel is not covered"


def test_a_request_older_than_the_in_flight_window_is_not_cancelled() -> None:
    requests = ResponseRequests()
    requests.asked(0.0, None)
    requests.asked(CREATE_IN_FLIGHT, None)
    requests.cancel_in_flight(CREATE_IN_FLIGHT + 0.5)
    assert requests.created("r1") is True, "one request is covered, whichever is created"
    assert requests.created("r2") is False


def test_an_error_echoing_the_event_id_removes_that_request() -> None:
    requests = ResponseRequests()
    requests.asked(0.0, "a")
    requests.asked(1.0, "b")
    requests.refused(_error(event_id="a"))
    requests.created("r1")
    assert requests.asked_at == {"r1": 1.0}


@pytest.mark.parametrize(
    "code", ["response_create_without_input", "response_already_active", "input_audio_buffer_empty"]
)
def test_an_error_refusing_a_response_removes_the_oldest_request(code: str) -> None:
    requests = ResponseRequests()
    requests.asked(0.0, None)
    requests.asked(1.0, None)
    requests.refused(_error(code=code))
    requests.created("r1")
    assert requests.asked_at == {"r1": 1.0}


def test_other_errors_leave_the_requests_alone() -> None:
    requests = ResponseRequests()
    requests.asked(0.0, "a")
    requests.refused(_error(code="rate_limited"))
    requests.refused(_error(event_id="unknown"))
    requests.refused(None)
    requests.refused({"type": "error", "error": "text"})
    requests.created("r1")
    assert requests.asked_at == {"r1": 0.0}


def test_a_refused_request_is_no_longer_born_cancelled() -> None:
    requests = ResponseRequests()
    requests.asked(0.0, "a")
    requests.cancel_in_flight(0.5)
    requests.refused(_error(event_id="a"))
    requests.asked(1.0, "b")
    assert requests.created("r1") is False, "the cancel covered only the refused request"


def test_it_remembers_at_most_max_pending_creates_dropping_the_oldest() -> None:
    requests = ResponseRequests()
    for i in range(MAX_PENDING_CREATES + 1):
        requests.asked(float(i), None)
    requests.created("r1")
    assert requests.asked_at == {"r1": 1.0}


@pytest.mark.parametrize(
    ("body", "creates"),
    [
        ({"type": "input_audio_buffer.commit", "response_create": True}, True),
        ({"type": "input.commit", "create_response": True}, True),
        ({"type": "input_audio_buffer.commit"}, False),
        ({"type": "input_audio_buffer.commit", "response_create": False}, False),
        ({"type": "response.create", "response_create": True}, False),
    ],
)
def test_a_commit_asks_for_a_response_only_when_it_says_so(
    body: dict[str, Any], creates: bool
) -> None:
    assert commit_creates_response(classify_client(dumps(body))) is creates
