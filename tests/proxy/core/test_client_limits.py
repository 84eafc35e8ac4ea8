"""Per-session client limits in the core: frame rate, oversized engine frames,
and control frames that are never read."""

from __future__ import annotations

import dataclasses
import json

from proxy.core.lifecycle import Fact
from proxy.core.session_core import (
    CLOSE_POLICY_VIOLATION,
    DropReason,
    Outcome,
    SessionState,
)
from tests.proxy.core.helpers import (
    SessionPair,
    audio,
    make_settings,
    response_created,
    sized,
    transcript_delta,
    types,
)


def admitted(pair: SessionPair) -> bool:
    """One small client frame: under the frame rate (parsed and forwarded) or not."""
    return pair.client('{"type":"x.noop"}').event is not None


def rate_limited(rate: float = 2.0, burst: float = 4.0, close_after: float = 2.0) -> SessionPair:
    settings = dataclasses.replace(
        make_settings(),
        max_client_frame_rate=rate,
        client_frame_burst=burst,
        client_rate_limit_close_after=close_after,
    )
    return SessionPair(settings=settings)


class TestClientFrameRate:
    def test_burst_then_rate(self) -> None:
        pair = rate_limited(rate=2.0, burst=4.0)
        assert [admitted(pair) for _ in range(5)] == [
            True,
            True,
            True,
            True,
            False,
        ]
        pair.tick(0.5)  # one token back at 2 frames/s
        assert admitted(pair)
        assert not admitted(pair)

    def test_one_error_per_episode_then_close_1008_after_two_seconds(self) -> None:
        pair = rate_limited(rate=2.0, burst=4.0)
        for _ in range(4):
            admitted(pair)
        refused = 0
        while pair.core.state is SessionState.OPEN and refused < 10_000:
            refused += not admitted(pair)
            pair.tick(0.01)
        delivered = pair.deliver()
        errors = [d for d in delivered if d.type == "error"]
        assert len(errors) == 1
        assert errors[0].body["error"]["type"] == "rate_limit_error"
        assert errors[0].body["error"]["code"] == "client_rate_limited"
        assert delivered[-1].body["type"] == "session.closed"
        assert delivered[-1].body["reason"] == "client_rate_limited"
        assert pair.core.close_code == CLOSE_POLICY_VIOLATION
        assert pair.core.outcome is Outcome.RATE_LIMITED
        assert 2.0 <= pair.now <= 2.03, "closed 2 s into the episode (checked every 10 ms)"
        assert pair.core.drop_totals()[DropReason.CLIENT_RATE_LIMITED][0] == refused
        pair.collect_upstream()
        assert any(f["type"] == "session.close" for f in pair.upstream_sent)

    def test_a_pause_ends_the_episode_so_short_bursts_are_only_dropped(self) -> None:
        pair = rate_limited(rate=1.0, burst=1.0)
        for _ in range(5):  # five episodes of one refused frame, 1.5 s apart
            admitted(pair)
            admitted(pair)
            pair.tick(1.5)
        assert pair.core.state is SessionState.OPEN
        assert [d.body["error"]["code"] for d in pair.deliver()] == ["client_rate_limited"] * 5

    def test_zero_is_off(self) -> None:
        pair = SessionPair()  # make_settings: max_client_frame_rate=0
        assert all(admitted(pair) for _ in range(100_000))


class TestOversizedEngineFrame:
    def test_a_frame_larger_than_the_whole_budget_fails_its_response_and_names_the_size(
        self,
    ) -> None:
        pair = SessionPair(settings=make_settings(max_bytes=10_000))
        pair.upstream(response_created("r1"), audio("r1", 400, seq=1))
        big = audio("r1", 20_000, seq=2)
        pair.upstream(big, transcript_delta("r1"))
        delivered = pair.deliver()
        # The response's queued audio is purged with it, like any failed response.
        assert types(delivered) == ["response.created", "error", "response.done"]
        error = delivered[1].body["error"]
        assert error["code"] == "upstream_frame_too_large"
        assert str(len(big)) in error["message"] and "10000" in error["message"]
        assert delivered[2].body["response"]["status"] == "failed"
        assert pair.core.state is SessionState.OPEN, "not the client's fault: the session stays"
        assert {"type": "response.cancel", "response_id": "r1"}.items() <= pair.upstream_sent[
            0
        ].items()

    def test_one_that_fits_the_budget_is_queued_as_usual(self) -> None:
        pair = SessionPair(settings=make_settings(max_bytes=10_000))
        pair.upstream(sized({"type": "x.big"}, 9_000))
        assert types(pair.deliver()) == ["x.big"]


def test_unread_control_frames_overflow_like_output() -> None:
    pair = SessionPair()
    pair.upstream(response_created("r1"))
    assert pair.fact(Fact.CLIENT_PING, amount=10**6), "more unread pongs than the event budget"
    delivered = pair.deliver()
    assert types(delivered)[-3:] == ["error", "response.done", "session.closed"]
    assert delivered[-1].body["reason"] == "output_backpressure"
    assert pair.core.close_code == CLOSE_POLICY_VIOLATION
    assert pair.core.telemetry.overflows == 1
    assert json.loads(delivered[-2].text)["response"]["status"] == "failed"


def test_an_oversized_frame_after_its_responses_terminal_gets_no_second_terminal() -> None:
    pair = SessionPair(settings=make_settings(max_bytes=300))
    pair.upstream(
        response_created("ra"),
        '{"type":"response.done","response_id":"ra","response":{"id":"ra","status":"completed"}}',
    )
    pair.upstream(audio("ra", 400, seq=1))
    delivered = pair.deliver()
    assert types(delivered) == ["response.created", "response.done", "error"]
    assert delivered[-1].body["error"]["code"] == "upstream_frame_too_large"
