"""SessionCore (proxy/core/session_core.py): the per-session policy, through SessionPair.

One class per behaviour (docs/design.md, Per-session data path; Cancellation; Overflow policy;
ClientVerdict and lifecycle; docs/engine-protocol.md, Bounded output upstream; Late audio after a
cancel): what the
client receives, in what order, what the proxy sends upstream itself, close
codes, drop counts and observations. Properties at the end drive random
interleavings of engine output, client cancels and deliveries.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.lifecycle import Fact
from proxy.core.session_core import (
    CLOSE_ABNORMAL_ENGINE,
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    DropReason,
    EndReason,
    Outcome,
    OverflowPolicy,
    SessionState,
)
from tests.proxy.core import helpers as h
from tests.proxy.core.helpers import Delivered, SessionPair, audio_of, make_settings, types

AUDIO = "response.output_audio.delta"
TRANSCRIPT = "response.output_audio_transcript.delta"


def pair(**kwargs: Any) -> SessionPair:
    return SessionPair(settings=make_settings(**kwargs))


def dones(out: list[Delivered]) -> list[tuple[str | None, str]]:
    return [(d.response_id, d.body["response"]["status"]) for d in out if d.type == "response.done"]


def assert_backpressure_error(d: Delivered) -> None:
    assert d.type == "error"
    assert d.body["error"]["type"] == "rate_limit_error"
    assert d.body["error"]["code"] == "output_backpressure"
    assert d.body["error"]["message"]
    assert d.body["event_id"].startswith("event_proxy_")


def assert_failed_done(d: Delivered, response_id: str) -> None:
    assert d.type == "response.done"
    assert d.response_id == response_id
    response = d.body["response"]
    assert response["id"] == response_id
    assert response["status"] == "failed"
    assert response["status_details"] == {"type": "failed", "reason": "output_backpressure"}
    assert response["metadata"]["committed"] is False


def assert_closed(d: Delivered, reason: str, session_id: str = "") -> None:
    """``session_id`` is "" until the engine's session.created named one."""
    assert d.closure
    assert d.type == "session.closed"
    assert d.body["reason"] == reason
    assert d.body["session_id"] == session_id


def state(p: SessionPair) -> SessionState:
    """The session state, read afresh (each call may have changed it)."""
    return p.core.state


def drop_events(p: SessionPair, reason: DropReason) -> int:
    return p.core.drop_totals()[reason][0]


# ================================================================================
# Normal relay
# ================================================================================


class TestRelay:
    def test_response_delivered_verbatim_and_in_order(self) -> None:
        p = pair()
        frames = [
            h.session_created("duplex-1"),
            h.response_created("r1"),
            h.audio("r1", seq=0),
            h.transcript_delta("r1", seq=0),
            h.audio("r1", seq=1, beta=True),
            h.transcript_delta("r1", seq=1),
            h.response_done("r1"),
            h.rate_limits_updated(),
        ]
        p.upstream(*frames)
        out = p.deliver()
        assert [d.text for d in out] == frames
        assert not any(d.closure for d in out)
        assert p.upstream_sent == []
        assert p.core.session_id == "duplex-1"
        assert state(p) is SessionState.OPEN
        assert p.core.statistics().open_responses == ()

    def test_client_frames_forwarded_verbatim(self) -> None:
        p = pair()
        frames = [
            h.dumps({"type": "session.update", "session": {"voice": "x"}}, spaced=True),
            h.b_audio_append(4096),
            h.b_response_create(),
            h.dumps({"type": "session.event_ack", "server_event_seq": 3}),
        ]
        for frame in frames:
            decision = p.client(frame)
            assert decision.forward
            assert decision.event.text is frame
        assert p.forwarded == frames
        assert p.upstream_sent == []
        assert p.deliver() == []

    def test_nothing_ready(self) -> None:
        p = pair()
        assert p.take() is None
        assert p.core.buffer.peek() is None

    def test_malformed_upstream_frame_dropped_and_counted(self) -> None:
        p = pair()
        p.upstream("not json", "[1]", h.rate_limits_updated())
        assert types(p.deliver()) == ["rate_limits.updated"]
        assert p.core.drop_totals()[DropReason.INVALID_UPSTREAM_FRAME] == (2, len("not json") + 3)

    def test_take_drops_resets(self) -> None:
        p = pair()
        p.upstream("x")
        assert p.take_drops() == {DropReason.INVALID_UPSTREAM_FRAME: (1, 1)}
        assert p.take_drops() == {}
        assert p.core.drop_totals()[DropReason.INVALID_UPSTREAM_FRAME] == (1, 1)


# ================================================================================
# Cancellation, client → upstream triggers
# ================================================================================

CLIENT_TRIGGERS = {
    "response.cancel named": h.b_response_cancel("r1"),
    "response.cancel without id": h.b_response_cancel(),
    "output_audio_buffer.clear named": h.b_output_audio_buffer_clear("r1"),
    "output_audio_buffer.clear without id": h.b_output_audio_buffer_clear(),
    "barge_in": h.b_barge_in(),
    "turn.signal barge_in": h.b_turn_signal("barge_in"),
    "turn.signal response.cancel": h.b_turn_signal("response.cancel"),
    "signal_turn barge_in": h.b_turn_signal("barge_in", alias=True),
    "signal_turn response.cancel": h.b_turn_signal("response.cancel", alias=True),
    "input.cancel": h.b_input_cancel(),
}

CLIENT_NON_TRIGGERS = {
    "turn.signal input.cancel": h.b_turn_signal("input.cancel"),
    "turn.signal other": h.b_turn_signal("end_of_turn"),
    "turn.signal object": h.b_turn_signal({"event": "barge_in"}),
    "input_audio_buffer.clear": h.dumps({"type": "input_audio_buffer.clear"}),
    "response.create": h.b_response_create(),
    "playback.ack": h.dumps({"type": "playback.ack", "response_id": "r1", "played_ms": 10}),
}


def _stream_then(p: SessionPair) -> None:
    """r1 created; one audio+transcript delivered; two more of each queued."""
    p.upstream(h.response_created("r1"), h.audio("r1", seq=0), h.transcript_delta("r1", seq=0))
    assert types(p.deliver()) == ["response.created", AUDIO, TRANSCRIPT]
    p.upstream(
        h.audio("r1", seq=1),
        h.transcript_delta("r1", seq=1),
        h.audio("r1", seq=2),
        h.transcript_delta("r1", seq=2),
    )


def _after_cancel_engine(p: SessionPair) -> list[str]:
    """What an engine 0.30 sends after a cancel (docs/engine-protocol.md, Late audio after a
    cancel), then a new response."""
    frames = [
        h.audio("r1", seq=3),  # late audio, produced before the engine saw the cancel
        h.transcript_delta("r1", seq=3),
        h.dumps({"type": "response.output_audio.done", "response_id": "r1"}),
        h.response_done("r1", "cancelled", reason="client_cancelled"),
        h.rate_limits_updated(),
        h.response_created("r2"),
        h.audio("r2", seq=10),
        h.transcript_delta("r2", seq=10),
        h.audio("r2", seq=11),
        h.response_done("r2"),
    ]
    p.upstream(*frames)
    return frames


class TestClientCancel:
    @pytest.mark.parametrize("trigger", list(CLIENT_TRIGGERS.values()), ids=list(CLIENT_TRIGGERS))
    def test_no_audio_after_cancel_rest_in_order_next_in_full(self, trigger: str) -> None:
        p = pair()
        _stream_then(p)
        decision = p.client(trigger)
        assert decision.forward
        assert p.forwarded == [trigger]  # the original text, untouched
        assert p.upstream_sent == []  # the client's own cancel is enough
        frames = _after_cancel_engine(p)
        out = p.deliver()

        assert audio_of(out, "r1") == []
        assert [d.text for d in out if d.response_id == "r1"] == [
            h.transcript_delta("r1", seq=1),
            h.transcript_delta("r1", seq=2),
            frames[1],
            frames[2],
            frames[3],
        ]
        assert [d.text for d in out if d.response_id == "r2"] == frames[5:]
        assert types(out)[5] == "rate_limits.updated"
        assert p.core.drop_totals()[DropReason.CANCELLED_AUDIO][0] == 2
        assert p.core.drop_totals()[DropReason.LATE_AUDIO][0] == 1
        assert state(p) is SessionState.OPEN
        assert p.core.statistics().cancels == 1

    @pytest.mark.parametrize(
        "frame", list(CLIENT_NON_TRIGGERS.values()), ids=list(CLIENT_NON_TRIGGERS)
    )
    def test_non_triggers_cancel_nothing(self, frame: str) -> None:
        p = pair()
        _stream_then(p)
        assert p.client(frame).forward
        p.upstream(
            h.audio("r1", seq=3),
            h.response_done("r1"),
            h.response_created("r2"),
            h.audio("r2", seq=10),
            h.audio("r2", seq=11),
            h.response_done("r2"),
        )
        out = p.deliver()
        assert len(audio_of(out, "r1")) == 3
        assert len(audio_of(out, "r2")) == 2
        assert dones(out) == [("r1", "completed"), ("r2", "completed")]
        assert p.core.statistics().cancels == 0

    def test_audio_taken_before_cancel_is_not_written_after_recheck(self) -> None:
        # the drain re-checks at the last moment: audio still queued when the
        # cancel arrives is skipped even if the buffer was not purged of it
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0), h.rate_limits_updated())
        p.deliver(1)
        p.core.ledger.cancel("r1", p.now)  # tombstone without purge
        assert types(p.deliver()) == ["rate_limits.updated"]
        assert drop_events(p, DropReason.CANCELLED_AUDIO) == 1

    def test_cancel_while_nothing_open(self) -> None:
        p = pair()
        assert p.client(h.b_response_cancel()).forward
        p.upstream(h.response_created("r1"), h.audio("r1"), h.response_done("r1"))
        assert len(audio_of(p.deliver(), "r1")) == 1
        assert p.core.statistics().cancels == 0


class TestCancelScope:
    def test_named_cancel_of_older_response_leaves_newer_alone(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1"), h.response_done("r1"))
        p.deliver()
        p.upstream(h.response_created("r2"), h.audio("r2", seq=1), h.audio("r2", seq=2))
        assert p.client(h.b_response_cancel("r1")).forward
        p.upstream(h.audio("r2", seq=3), h.audio("r1", seq=9), h.response_done("r2"))
        out = p.deliver()
        assert len(audio_of(out, "r2")) == 3
        assert audio_of(out, "r1") == []  # late audio of the named one is dropped
        assert dones(out) == [("r2", "completed")]

    def test_named_clear_of_one_open_response(self) -> None:
        p = pair()
        p.upstream(
            h.response_created("r1"),
            h.response_created("r2"),
            h.audio("r1", seq=1),
            h.audio("r2", seq=2),
        )
        p.client(h.b_output_audio_buffer_clear("r2"))
        out = p.deliver()
        assert len(audio_of(out, "r1")) == 1
        assert audio_of(out, "r2") == []

    def test_unnamed_cancel_covers_finished_response_with_queued_audio(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1", seq=1), h.response_done("r1"))
        p.upstream(h.response_created("r2"), h.audio("r2", seq=2))
        p.client(h.b_response_cancel())
        p.upstream(h.response_created("r3"), h.audio("r3", seq=3), h.response_done("r3"))
        out = p.deliver()
        assert audio_of(out, "r1") == [] and audio_of(out, "r2") == []
        assert len(audio_of(out, "r3")) == 1
        assert dones(out) == [("r1", "completed"), ("r3", "completed")]
        assert p.core.statistics().cancels == 2

    def test_unnamed_cancel_skips_responses_already_delivered(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.response_done("r1"))
        p.deliver()
        p.client(h.b_barge_in())
        assert p.core.ledger.tombstoned() == []
        p.upstream(h.audio("r1"))  # e.g. a straggler after completion: not cancelled
        assert len(audio_of(p.deliver(), "r1")) == 1

    def test_late_audio_dropped_until_ttl_after_done_delivered(self) -> None:
        p = pair(tombstone_ttl=10.0)
        p.upstream(h.response_created("r1"), h.audio("r1"))
        p.client(h.b_response_cancel("r1"))
        p.tick(100.0)
        p.upstream(h.audio("r1", seq=2))  # done not delivered yet: still dropped
        p.upstream(h.response_done("r1", "cancelled"))
        p.deliver()
        p.tick(9.0)
        p.upstream(h.audio("r1", seq=3))
        assert p.deliver() == []
        p.tick(1.0)
        p.upstream(h.audio("r1", seq=4))  # tombstone expired: forwarded, counted
        assert len(audio_of(p.deliver(), "r1")) == 1
        assert p.core.ledger.statistics().late_after_eviction == 1
        assert drop_events(p, DropReason.LATE_AUDIO) == 2


# ================================================================================
# Cancellation, upstream → client triggers
# ================================================================================

UPSTREAM_TRIGGERS = {
    "response.done cancelled": (h.response_done("r1", "cancelled", reason="turn_detected"), False),
    "response.done failed": (h.response_done("r1", "failed", reason="engine"), False),
    "output_audio_buffer.cleared named": (h.output_audio_buffer_cleared("r1"), False),
    "output_audio_buffer.cleared without id": (h.output_audio_buffer_cleared(), False),
    "overlap.decision barge_in": (h.overlap_decision("barge_in"), False),
    "speech_started with interrupt_on_speech_started": (h.speech_started(), True),
}


class TestUpstreamCancel:
    @pytest.mark.parametrize(
        ("trigger", "interrupt"), list(UPSTREAM_TRIGGERS.values()), ids=list(UPSTREAM_TRIGGERS)
    )
    def test_queued_and_late_audio_dropped_trigger_delivered(
        self, trigger: str, interrupt: bool
    ) -> None:
        p = pair(interrupt_on_speech_started=interrupt)
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0))
        p.deliver()
        queued = [
            h.audio("r1", seq=1),
            h.transcript_delta("r1", seq=1),
            h.audio("r1", seq=2),
            h.transcript_delta("r1", seq=2),
        ]
        p.upstream(*queued, trigger)
        tail = [h.audio("r1", seq=3), h.transcript_delta("r1", seq=3)]
        if "response.done" not in trigger:
            tail.append(h.response_done("r1", "cancelled"))
        nxt = [h.response_created("r2"), h.audio("r2", seq=4), h.response_done("r2")]
        p.upstream(*tail, *nxt)
        out = p.deliver()
        assert audio_of(out, "r1") == []
        expected = [queued[1], queued[3], trigger, tail[1], *tail[2:], *nxt]
        assert [d.text for d in out] == expected
        assert drop_events(p, DropReason.CANCELLED_AUDIO) == 2
        assert drop_events(p, DropReason.LATE_AUDIO) == 1
        assert p.upstream_sent == []

    def test_cancel_from_engine_done_touches_only_that_response(self) -> None:
        p = pair()
        p.upstream(
            h.response_created("r1"),
            h.response_created("r2"),
            h.audio("r1", seq=1),
            h.audio("r2", seq=2),
            h.response_done("r2", "cancelled"),
        )
        out = p.deliver()
        assert len(audio_of(out, "r1")) == 1 and audio_of(out, "r2") == []

    @pytest.mark.parametrize(
        ("frame", "interrupt"),
        [
            (h.speech_started(), False),
            (h.overlap_decision("listen"), True),
            (h.overlap_decision("drop"), False),
            (h.response_done("r1", "completed"), False),
            (h.dumps({"type": "input_audio_buffer.speech_stopped"}), True),
        ],
        ids=[
            "speech_started default",
            "overlap listen",
            "overlap drop",
            "done completed",
            "speech_stopped",
        ],
    )
    def test_non_triggers(self, frame: str, interrupt: bool) -> None:
        p = pair(interrupt_on_speech_started=interrupt)
        p.upstream(h.response_created("r1"), h.audio("r1", seq=1), frame, h.audio("r1", seq=2))
        out = p.deliver()
        assert len(audio_of(out, "r1")) == 2
        assert p.core.statistics().cancels == 0


# ================================================================================
# Invalid client frames
# ================================================================================


class TestInvalidClientFrames:
    @pytest.mark.parametrize(
        ("text", "code"),
        [
            ("not json", "invalid_json"),
            ('{"type": "response.cancel"', "invalid_json"),
            ("[1, 2]", "bad_event"),
            ('"response.cancel"', "bad_event"),
            ('{"type": 3}', "bad_event"),
            ('{"event_id": "e1"}', "bad_event"),
        ],
    )
    def test_error_to_client_not_forwarded(self, text: str, code: str) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1"))
        decision = p.client(text)
        assert not decision.forward
        assert p.forwarded == []
        assert p.upstream_sent == []
        out = p.deliver()
        assert types(out) == ["response.created", AUDIO, "error"]  # FIFO after queued output
        err = out[-1].body
        assert err["error"]["type"] == "invalid_request_error"
        assert err["error"]["code"] == code
        assert err["error"]["message"]
        assert p.core.drop_totals()[DropReason.INVALID_CLIENT_FRAME] == (1, len(text.encode()))
        assert state(p) is SessionState.OPEN
        # nothing of the session was cancelled by it
        assert p.core.statistics().cancels == 0

    def test_reject_echoes_client_event_id(self) -> None:
        p = SessionPair(
            settings=dataclasses.replace(
                make_settings(), max_input_audio_rate=1.0, input_burst_seconds=0.1
            )
        )
        text = h.dumps(
            {
                "type": "input_audio_buffer.append",
                "event_id": "c-7",
                "audio": h.audio_payload(16_000),  # 0.375 s at 16 kHz: over the burst
            }
        )
        assert not p.client(text).forward
        (d,) = p.deliver()
        assert d.body["error"]["code"] == "input_backpressure"
        assert d.body["error"]["event_id"] == "c-7"
        assert p.core.drop_totals()[DropReason.INPUT_BACKPRESSURE] == (1, len(text))
        assert p.core.close_code is None, "the session stays open"

    def test_after_close_no_error_is_queued(self) -> None:
        p = pair()
        p.core.receive(EndReason.SHUTDOWN, 0.0)
        assert not p.client("nope").forward
        out = p.deliver()
        assert types(out) == ["session.closed"]
        assert drop_events(p, DropReason.INVALID_CLIENT_FRAME) == 1


# ================================================================================
# Overflow: close_session (default)
# ================================================================================


class TestOverflowCloseSession:
    def test_exact_sequence_close_code_and_upstream(self) -> None:
        p = pair(max_events=4)
        p.upstream(h.session_created("duplex-x"))
        p.deliver()
        queued = [
            h.response_created("r1"),
            h.audio("r1", seq=0),
            h.transcript_delta("r1", seq=0),
            h.audio("r1", seq=1),
        ]
        p.upstream(*queued)
        overflowing = h.audio("r1", seq=2)
        p.upstream(overflowing)

        assert state(p) is SessionState.CLOSING
        assert p.core.close_code == CLOSE_POLICY_VIOLATION == 1008
        assert p.core.outcome is Outcome.OVERFLOW
        assert p.upstream_sent == [
            {"type": "response.cancel", "response_id": "r1"},
            {"type": "session.close", "reason": "output_backpressure"},
        ]
        # further ordinary events are suppressed, client frames no longer forwarded
        later = [h.audio("r1", seq=3), h.response_done("r1", "cancelled"), h.session_closed()]
        p.upstream(*later)
        assert not p.client(h.b_response_create()).forward
        assert p.upstream_sent[2:] == []

        out = p.deliver()
        assert [d.text for d in out[:2]] == [queued[0], queued[2]]
        assert types(out) == [
            "response.created",
            TRANSCRIPT,
            "error",
            "response.done",
            "session.closed",
        ]
        assert_backpressure_error(out[2])
        assert_failed_done(out[3], "r1")
        assert_closed(out[4], "output_backpressure", "duplex-x")
        assert [d.closure for d in out] == [False] * 4 + [True]
        assert state(p) is SessionState.CLOSED
        assert p.deliver() == []

        purged = len(h.audio("r1", seq=0)) + len(h.audio("r1", seq=1))
        later_bytes = sum(len(f) for f in later)
        assert p.core.drop_totals()[DropReason.OVERFLOW] == (
            1 + 2 + 3,
            len(overflowing) + purged + later_bytes,
        )
        assert p.core.drop_totals()[DropReason.CANCELLED_AUDIO] == (0, 0)
        assert p.core.statistics().overflows == 1

    def test_overflow_on_the_responses_own_done_gives_one_terminal(self) -> None:
        p = pair(max_events=4, reserve_events=1)
        p.upstream(
            h.response_created("r1"),
            h.audio("r1", seq=0),
            h.audio("r1", seq=1),
            h.audio("r1", seq=2),
            h.error("engine_error"),  # takes the only reserve slot
        )
        assert state(p) is SessionState.OPEN
        p.upstream(h.response_done("r1", "completed"))  # neither budget has room
        assert state(p) is SessionState.CLOSING
        out = p.deliver()
        assert types(out) == [
            "response.created",
            "error",
            "error",
            "response.done",
            "session.closed",
        ]
        assert out[1].body["error"]["code"] == "engine_error"
        assert_backpressure_error(out[2])
        assert dones(out) == [("r1", "failed")]
        assert_failed_done(out[3], "r1")
        assert p.upstream_sent[0] == {"type": "response.cancel", "response_id": "r1"}

    def test_queued_done_of_finished_response_is_not_doubled(self) -> None:
        p = pair(max_events=5)
        p.upstream(
            h.response_created("r1"),
            h.audio("r1", seq=1),
            h.response_done("r1"),
            h.response_created("r2"),
            h.audio("r2", seq=2),
        )
        p.upstream(h.audio("r2", seq=3))  # overflow: r2 is the active response
        out = p.deliver()
        assert types(out) == [
            "response.created",
            AUDIO,
            "response.done",
            "response.created",
            "error",
            "response.done",
            "session.closed",
        ]
        assert dones(out) == [("r1", "completed"), ("r2", "failed")]
        assert audio_of(out, "r2") == []
        assert p.upstream_sent == [
            {"type": "response.cancel", "response_id": "r2"},
            {"type": "session.close", "reason": "output_backpressure"},
        ]

    def test_no_active_response(self) -> None:
        p = pair(max_events=3)
        p.upstream(h.response_created("r1"), h.response_done("r1"), h.rate_limits_updated())
        p.upstream(h.other("session.updated"))
        out = p.deliver()
        assert types(out) == [
            "response.created",
            "response.done",
            "rate_limits.updated",
            "error",
            "session.closed",
        ]
        assert_backpressure_error(out[3])
        assert_closed(out[4], "output_backpressure")
        assert p.upstream_sent == [{"type": "session.close", "reason": "output_backpressure"}]
        assert p.core.close_code == 1008

    def test_reserve_lets_error_and_done_through_without_overflow(self) -> None:
        p = pair(max_events=3)
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0), h.audio("r1", seq=1))
        p.upstream(h.error("engine_error"), h.response_done("r1"))
        assert state(p) is SessionState.OPEN
        assert p.core.statistics().buffer.reserve_events == 2
        out = p.deliver()
        assert types(out) == ["response.created", AUDIO, AUDIO, "error", "response.done"]
        assert p.core.statistics().overflows == 0

    def test_shed_by_process_total(self) -> None:
        p = pair()
        p.upstream(h.session_created("duplex-s"), h.response_created("r1"), h.audio("r1"))
        p.core.receive(Fact.SHED, p.now)
        p.core.receive(Fact.SHED, p.now)  # idempotent
        p.collect_upstream()
        out = p.deliver()
        assert types(out) == [
            "session.created",
            "response.created",
            "error",
            "response.done",
            "session.closed",
        ]
        assert_failed_done(out[3], "r1")
        assert_closed(out[4], "output_backpressure", "duplex-s")
        # Counted by the registry as policy="process_total", not as a session overflow.
        assert p.core.statistics().overflows == 0
        assert p.core.close_code == 1008
        assert p.upstream_sent == [
            {"type": "response.cancel", "response_id": "r1"},
            {"type": "session.close", "reason": "output_backpressure"},
        ]

    def test_client_cancel_while_closing_still_stops_queued_audio(self) -> None:
        # Overflow closes the session, but audio of another response that is
        # still queued must stop at once when the client barges in.
        p = pair(max_events=5)
        p.upstream(
            h.response_created("r1"),
            h.audio("r1", seq=1),
            h.response_done("r1"),
            h.rate_limits_updated(),
            h.other("x.y"),
        )
        p.upstream(h.other("x.z"))  # overflow with no active response
        assert state(p) is SessionState.CLOSING
        p.deliver(1)
        assert not p.client(h.b_barge_in()).forward
        out = p.deliver()
        assert audio_of(out, "r1") == []
        assert out[-1].closure


# ================================================================================
# Overflow: fail_response
# ================================================================================


class TestOverflowFailResponse:
    def test_session_continues_failed_response_silenced_next_in_full(self) -> None:
        p = pair(max_events=4, policy=OverflowPolicy.FAIL_RESPONSE)
        p.upstream(
            h.response_created("r1"),
            h.audio("r1", seq=0),
            h.transcript_delta("r1", seq=0),
            h.audio("r1", seq=1),
        )
        p.upstream(h.audio("r1", seq=2))  # overflow
        assert state(p) is SessionState.OPEN
        assert p.core.close_code is None
        assert p.upstream_sent == [{"type": "response.cancel", "response_id": "r1"}]
        # the engine keeps going for a while, then confirms with its own terminal
        p.upstream(
            h.audio("r1", seq=3),
            h.transcript_delta("r1", seq=3),
            h.dumps({"type": "response.output_audio.done", "response_id": "r1"}),
            h.response_done("r1", "cancelled"),
        )
        out = p.deliver()
        assert types(out) == ["response.created", TRANSCRIPT, "error", "response.done"]
        assert_backpressure_error(out[2])
        assert_failed_done(out[3], "r1")
        # after the failed done was delivered, the engine's stragglers are still dropped
        p.upstream(h.transcript_delta("r1", seq=4), h.response_done("r1", "cancelled"))
        assert p.deliver() == []
        nxt = [
            h.response_created("r2"),
            h.audio("r2", seq=5),
            h.transcript_delta("r2", seq=5),
            h.response_done("r2"),
        ]
        p.upstream(*nxt)
        assert [d.text for d in p.deliver()] == nxt
        assert drop_events(p, DropReason.FAILED_RESPONSE) == 2 + 1 + 4 + 2
        assert drop_events(p, DropReason.OVERFLOW) == 0
        assert p.core.statistics().overflows == 1
        assert p.upstream_sent == [{"type": "response.cancel", "response_id": "r1"}]

    def test_item_events_without_response_id_are_attributed_by_item_id(self) -> None:
        """The real engine's conversation.item.* carry no response_id, only the
        assistant item ``item_<response_id>``: those of a failed response are dropped."""
        p = pair(max_events=4, policy=OverflowPolicy.FAIL_RESPONSE)
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0), h.audio("r1", seq=1))
        p.upstream(h.audio("r1", seq=2), h.audio("r1", seq=3))  # overflow → r1 failed
        item_done = h.dumps(
            {"type": "conversation.item.done", "item": {"id": "item_r1", "role": "assistant"}}
        )
        user_item = h.dumps({"type": "conversation.item.done", "item": {"id": "item_user1"}})
        p.upstream(item_done, user_item)
        out = p.deliver()
        assert [d.text for d in out if d.type == "conversation.item.done"] == [user_item]

    def test_unrelated_event_kept_after_the_failure(self) -> None:
        p = pair(max_events=4, policy=OverflowPolicy.FAIL_RESPONSE)
        p.upstream(
            h.response_created("r1"),
            h.audio("r1", seq=0),
            h.audio("r1", seq=1),
            h.audio("r1", seq=2),
        )
        p.upstream(h.rate_limits_updated())
        out = p.deliver()
        assert types(out) == ["response.created", "error", "response.done", "rate_limits.updated"]
        assert state(p) is SessionState.OPEN

    def test_own_done_overflowing_gives_one_terminal(self) -> None:
        p = pair(max_events=3, reserve_events=1, policy=OverflowPolicy.FAIL_RESPONSE)
        p.upstream(
            h.response_created("r1"),
            h.audio("r1", seq=0),
            h.audio("r1", seq=1),
            h.error("engine_error"),
        )
        p.upstream(h.response_done("r1", "completed"))
        p.upstream(h.response_done("r1", "completed"))  # a duplicate is dropped too
        out = p.deliver()
        assert types(out) == ["response.created", "error", "error", "response.done"]
        assert dones(out) == [("r1", "failed")]
        assert state(p) is SessionState.OPEN
        assert p.upstream_sent == [{"type": "response.cancel", "response_id": "r1"}]

    def test_no_response_to_fail_falls_back_to_close(self) -> None:
        p = pair(max_events=3, policy=OverflowPolicy.FAIL_RESPONSE)
        p.upstream(h.response_created("r1"), h.response_done("r1"), h.rate_limits_updated())
        p.upstream(h.other("session.updated"))
        out = p.deliver()
        assert types(out) == [
            "response.created",
            "response.done",
            "rate_limits.updated",
            "error",
            "session.closed",
        ]
        assert_closed(out[-1], "output_backpressure")
        assert p.core.close_code == CLOSE_POLICY_VIOLATION
        assert p.core.outcome is Outcome.OVERFLOW
        assert p.upstream_sent == [{"type": "session.close", "reason": "output_backpressure"}]

    def test_second_overflow_after_failure_without_response_closes(self) -> None:
        p = pair(max_events=2, policy=OverflowPolicy.FAIL_RESPONSE)
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0))
        p.upstream(h.audio("r1", seq=1))  # fails r1, session stays
        assert state(p) is SessionState.OPEN
        first = p.deliver()
        assert types(first) == ["response.created", "error", "response.done"]
        p.upstream(h.other("a.b"), h.other("a.c"))
        assert state(p) is SessionState.OPEN
        p.upstream(h.other("a.d"))  # full again, no response left to fail
        assert state(p) is SessionState.CLOSING
        out = p.deliver()
        assert types(out) == ["a.b", "a.c", "error", "session.closed"]
        assert_backpressure_error(out[2])
        assert_closed(out[3], "output_backpressure")
        assert p.core.statistics().overflows == 2
        assert p.core.close_code == 1008
        assert p.upstream_sent == [
            {"type": "response.cancel", "response_id": "r1"},
            {"type": "session.close", "reason": "output_backpressure"},
        ]

    def test_still_full_after_failing_closes(self) -> None:
        # nothing of r1 can be purged (no audio queued): the session is closed
        p = pair(max_events=3, policy=OverflowPolicy.FAIL_RESPONSE)
        p.upstream(
            h.response_created("r1"),
            h.transcript_delta("r1", seq=0),
            h.transcript_delta("r1", seq=1),
        )
        p.upstream(h.other("a.b"))
        out = p.deliver()
        assert types(out)[:3] == ["response.created", TRANSCRIPT, TRANSCRIPT]
        assert dones(out) == [("r1", "failed")]
        errors = [d for d in out if d.type == "error"]
        assert errors and all(d.body["error"]["code"] == "output_backpressure" for d in errors)
        assert out.index(errors[0]) < [d.type for d in out].index("response.done")
        assert_closed(out[-1], "output_backpressure")
        assert "a.b" not in types(out)
        assert p.core.close_code == 1008
        assert p.upstream_sent == [
            {"type": "response.cancel", "response_id": "r1"},
            {"type": "session.close", "reason": "output_backpressure"},
        ]


# ================================================================================
# Lifecycle: engine lost, shutdown, engine's session.closed, client gone
# ================================================================================


class TestLifecycle:
    def test_upstream_lost(self) -> None:
        p = pair()
        p.upstream(h.session_created("duplex-l"), h.response_created("r1"), h.audio("r1"))
        p.core.receive(Fact.ENGINE_LOST, p.now)
        p.upstream(h.audio("r1", seq=5))  # nothing more is accepted
        out = p.deliver()
        assert types(out) == [
            "session.created",
            "response.created",
            AUDIO,
            "error",
            "session.closed",
        ]
        assert out[3].body["error"]["type"] == "server_error"
        assert out[3].body["error"]["code"] == "engine_unavailable"
        assert_closed(out[4], "engine_unavailable", "duplex-l")
        assert p.core.close_code == CLOSE_ABNORMAL_ENGINE == 1011
        assert p.core.outcome is Outcome.ENGINE_UNAVAILABLE
        assert p.upstream_sent == []  # the engine is gone: nothing to tell it
        assert state(p) is SessionState.CLOSED

    def test_upstream_closed_cleanly(self) -> None:
        p = pair()
        p.core.receive(Fact.UPSTREAM_CLOSED, 0.0)
        out = p.deliver()
        assert types(out) == ["session.closed"]
        assert_closed(out[0], "upstream_closed")
        assert p.core.close_code == CLOSE_NORMAL
        assert p.core.outcome is Outcome.UPSTREAM_CLOSED

    def test_shutdown(self) -> None:
        p = pair()
        p.upstream(h.session_created("duplex-z"), h.response_created("r1"))
        p.core.receive(EndReason.SHUTDOWN, p.now)
        p.collect_upstream()
        out = p.deliver()
        assert types(out) == ["session.created", "response.created", "session.closed"]
        assert_closed(out[-1], "shutdown", "duplex-z")
        assert p.core.close_code == CLOSE_GOING_AWAY == 1001
        assert p.core.outcome is Outcome.SHUTDOWN
        assert p.upstream_sent == [{"type": "session.close", "reason": "shutdown"}]

    def test_first_close_wins(self) -> None:
        p = pair()
        p.core.receive(Fact.ENGINE_LOST, 0.0)
        p.core.receive(EndReason.SHUTDOWN, 0.0)
        p.core.receive(Fact.SHED, 0.0)
        out = p.deliver()
        assert [d.type for d in out] == ["error", "session.closed"]
        assert out[-1].body["reason"] == "engine_unavailable"
        assert p.core.close_code == 1011

    @pytest.mark.parametrize("client_closed", [False, True])
    def test_engine_session_closed_is_the_closure(self, client_closed: bool) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1"))
        if client_closed:
            assert p.client(h.b_session_close()).forward
        closed = h.session_closed("client_close" if client_closed else "idle_ttl_expired")
        p.upstream(closed, h.audio("r1", seq=2), h.response_done("r1"))
        out = p.deliver()
        assert [d.type for d in out] == ["response.created", AUDIO, "session.closed"]
        assert out[-1].text == closed and out[-1].closure
        assert p.core.close_code == CLOSE_NORMAL
        assert p.core.outcome is (
            Outcome.CLIENT_CLOSED if client_closed else Outcome.UPSTREAM_CLOSED
        )
        assert p.upstream_sent == []  # the client's own session.close was forwarded
        assert p.core.drop_totals()[DropReason.OVERFLOW] == (0, 0)

    def test_oversized_engine_session_closed_replaced(self) -> None:
        p = pair()
        p.upstream(h.session_created("duplex-b"))
        big = h.dumps(
            {
                "type": "session.closed",
                "session_id": "duplex-b",
                "reason": "engine_dead",
                "event": {"trace": "t" * 5000},
            }
        )
        p.upstream(big)
        out = p.deliver()
        assert_closed(out[-1], "close_details_exceed_output_limit", "duplex-b")
        assert out[-1].body["event"] == {}
        assert p.core.close_code == CLOSE_NORMAL

    def test_client_gone(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"))
        p.core.receive(Fact.CLIENT_GONE, p.now)
        assert state(p) is SessionState.CLOSED
        assert p.core.outcome is Outcome.CLIENT_CLOSED
        p.core.receive(Fact.CLIENT_GONE, p.now)
        p.collect_upstream()
        assert p.upstream_sent == [{"type": "session.close", "reason": "client_close"}]

    def test_client_gone_after_own_session_close_sends_nothing_more(self) -> None:
        p = pair()
        p.client(h.b_session_close())
        p.core.receive(Fact.CLIENT_GONE, p.now)
        p.collect_upstream()
        assert p.upstream_sent == []

    def test_client_gone_keeps_earlier_outcome(self) -> None:
        p = pair()
        p.core.receive(EndReason.SHUTDOWN, 0.0)
        p.core.receive(Fact.CLIENT_GONE, p.now)
        assert p.core.outcome is Outcome.SHUTDOWN
        p.collect_upstream()
        assert p.upstream_sent == [{"type": "session.close", "reason": "shutdown"}]


# ================================================================================
# Observations: cancel_to_silence, first_audio
# ================================================================================


class TestObservations:
    def test_cancel_to_silence_ignores_a_chunk_written_before_the_cancel(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0), h.audio("r1", seq=1))
        p.deliver(1)
        p.now = 1.0
        entry = p.take()  # drained: written at 1.0, before the cancel
        assert entry is not None
        p.now = 1.25
        p.client(h.b_response_cancel())
        assert tuple(map(list, p.take_observations())) == ([], [])
        p.now = 2.0
        p.upstream(h.response_done("r1", "cancelled"))
        p.deliver()
        silence, first = p.take_observations()
        assert silence == [pytest.approx(0.0)]
        assert first == []
        assert tuple(map(list, p.take_observations())) == ([], [])

    def test_cancel_to_silence_zero_when_purged(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1"))
        p.now = 3.0
        p.client(h.b_barge_in())
        p.client(h.b_barge_in())  # second cancel of the same response: one observation
        p.now = 4.0
        p.upstream(h.response_done("r1", "cancelled"))
        p.deliver()
        assert p.take_observations()[0] == [0.0]

    def test_cancel_to_silence_for_engine_cancel(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1"))
        p.deliver()
        p.now = 1.0
        p.upstream(h.response_done("r1", "cancelled"))
        p.now = 1.5
        p.deliver()
        assert p.take_observations()[0] == [0.0]

    def test_finish_observes_open_windows(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"))
        p.client(h.b_response_cancel("r1"))
        assert list(p.take_observations()[0]) == []
        p.core.receive(Fact.FINISHED, p.now)
        assert p.take_observations()[0] == [0.0]

    def test_first_audio_from_response_create(self) -> None:
        p = pair()
        p.now = 10.0
        p.client(h.b_response_create())
        p.now = 10.2
        p.upstream(h.response_created("r1"))
        p.now = 10.3
        p.upstream(h.audio("r1", seq=0), h.audio("r1", seq=1))
        assert types(p.deliver(2)) == ["response.created", AUDIO]
        p.now = 10.5
        p.deliver()
        silence, first = p.take_observations()
        assert silence == []
        assert first == [pytest.approx(0.3)]

    def test_first_audio_only_for_responses_with_a_create(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1"))  # e.g. server VAD response
        p.deliver()
        assert tuple(map(list, p.take_observations())) == ([], [])

    def test_first_audio_pairs_creates_in_order(self) -> None:
        p = pair()
        p.client(h.b_response_create())
        p.now = 1.0
        p.client(h.b_response_create())
        p.now = 2.0
        p.upstream(h.response_created("r1"), h.response_created("r2"), h.audio("r2"), h.audio("r1"))
        p.deliver()
        assert p.take_observations()[1] == [pytest.approx(1.0), pytest.approx(2.0)]


# ================================================================================
# Properties
# ================================================================================

RIDS = ["ra", "rb", "rc", "rd"]
NAMED_KINDS = ("response.cancel", "output_audio_buffer.clear")
TRIGGER_BUILDERS: dict[str, Callable[[str | None], str]] = {
    "response.cancel": h.b_response_cancel,
    "output_audio_buffer.clear": h.b_output_audio_buffer_clear,
    "barge_in": lambda _rid: h.b_barge_in(),
    "turn.signal": lambda _rid: h.b_turn_signal("barge_in"),
    "input.cancel": lambda _rid: h.b_input_cancel(),
}

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("created"), st.sampled_from(RIDS)),
        st.tuples(st.just("audio"), st.sampled_from(RIDS), st.integers(1, 60)),
        st.tuples(st.just("audio"), st.sampled_from(RIDS), st.integers(1, 60)),
        st.tuples(st.just("transcript"), st.sampled_from(RIDS)),
        st.tuples(
            st.just("done"),
            st.sampled_from(RIDS),
            st.sampled_from(["completed", "completed", "cancelled", "failed"]),
        ),
        st.tuples(
            st.just("cancel"),
            st.one_of(st.none(), st.sampled_from(RIDS)),
            st.sampled_from(sorted(TRIGGER_BUILDERS)),
        ),
        st.tuples(st.just("deliver"), st.integers(1, 4)),
        st.tuples(st.just("other")),
    ),
    max_size=60,
)


class _Run:
    """Drives a SessionPair from an op list and records what the property needs."""

    def __init__(self, p: SessionPair, *, strict: bool) -> None:
        self.p = p
        self.strict = strict  # the exact queue model holds (no overflow possible)
        self.created: set[str] = set()
        self.done_sent: set[str] = set()
        self.open: set[str] = set()  # created (accepted while open), done not delivered
        self.cancel_point: dict[str, int] = {}  # response → deliveries before its cancel
        self.accepted_dones: list[str] = []  # texts of engine dones accepted by the buffer
        self.seq = 0
        # exact model of the queue (valid while no overflow can happen)
        self.model: list[str] = []
        self.cancelled: set[str] = set()

    def _cancel(self, rids: set[str]) -> None:
        for rid in rids:
            self.cancel_point.setdefault(rid, len(self.p.deliveries))
            self.cancelled.add(rid)
        self.model = [
            t
            for t in self.model
            if not (json.loads(t)["type"] == AUDIO and json.loads(t).get("response_id") in rids)
        ]

    def _feed(self, text: str, *, rid: str | None = None, is_audio: bool = False) -> bool:
        buffer = self.p.core.buffer
        events, refused = buffer.pending_events, buffer.statistics().rejected_full
        self.p.upstream(text)
        # queued: one more event, and no offer refused (a refusal may queue a notice)
        accepted = buffer.statistics().rejected_full == refused and buffer.pending_events > events
        if not (is_audio and rid in self.cancelled):
            self.model.append(text)
        return accepted

    def _deliver(self, n: int | None) -> None:
        for d in self.p.deliver(n):
            if d.type == "response.done" and d.response_id is not None:
                self.open.discard(d.response_id)
            if self.strict:
                assert self.model, f"unexpected delivery {d.text[:80]}"
                assert d.text == self.model.pop(0)

    def apply(self, op: tuple[Any, ...]) -> None:
        core = self.p.core
        was_open = core.state is SessionState.OPEN
        kind = op[0]
        if kind == "created":
            rid = op[1]
            if rid in self.created:
                return
            self.created.add(rid)
            self._feed(h.response_created(rid))
            if was_open:
                self.open.add(rid)
        elif kind == "audio":
            self.seq += 1
            self._feed(h.audio(op[1], 4 * op[2], seq=self.seq), rid=op[1], is_audio=True)
        elif kind == "transcript":
            self.seq += 1
            self._feed(h.transcript_delta(op[1], seq=self.seq))
        elif kind == "done":
            rid, status = op[1], op[2]
            if rid in self.done_sent or rid not in self.created:
                return
            self.done_sent.add(rid)
            if was_open and status in ("cancelled", "failed"):
                self._cancel({rid})
            text = h.response_done(rid, status)
            if self._feed(text):
                self.accepted_dones.append(text)
        elif kind == "cancel":
            rid, trigger = op[1], op[2]
            frame = TRIGGER_BUILDERS[trigger](rid)
            if was_open or core.state is SessionState.CLOSING:
                if rid is not None and trigger in NAMED_KINDS:
                    self._cancel({rid})
                else:
                    self._cancel(set(self.open))
            self.p.client(frame)
        elif kind == "deliver":
            self._deliver(op[1])
        elif kind == "other":
            self._feed(h.rate_limits_updated())

    def finish(self) -> None:
        self._deliver(None)

    def check_no_audio_after_cancel(self) -> None:
        for index, d in enumerate(self.p.deliveries):
            if d.is_audio and d.response_id in self.cancel_point:
                assert index < self.cancel_point[d.response_id], (
                    f"audio of {d.response_id} delivered at {index}, "
                    f"cancelled at {self.cancel_point[d.response_id]}"
                )


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class TestProperties:
    @PROPERTY
    @given(OPS)
    def test_roomy_buffer_exact_model(self, ops: list[tuple[Any, ...]]) -> None:
        """No overflow possible: the client gets exactly the model's sequence."""
        run = _Run(pair(), strict=True)
        for op in ops:
            run.apply(op)
        run.finish()
        assert run.model == []
        run.check_no_audio_after_cancel()
        delivered = {d.text for d in run.p.deliveries}
        assert all(t in delivered for t in run.accepted_dones)
        assert state(run.p) is SessionState.OPEN
        assert drop_events(run.p, DropReason.OVERFLOW) == 0

    @PROPERTY
    @given(
        OPS,
        st.sampled_from(list(OverflowPolicy)),
        st.integers(2, 8),
        st.integers(300, 1500),
        st.sampled_from([None, "shutdown", "upstream_lost"]),
    )
    def test_tight_buffer_safety(
        self,
        ops: list[tuple[Any, ...]],
        policy: OverflowPolicy,
        max_events: int,
        max_bytes: int,
        end: str | None,
    ) -> None:
        """Overflow in play: the safety properties still hold."""
        run = _Run(pair(max_events=max_events, max_bytes=max_bytes, policy=policy), strict=False)
        for op in ops:
            run.apply(op)
            stats = run.p.core.buffer.statistics()
            assert stats.pending_events - stats.reserve_events <= max_events
            assert stats.pending_bytes - stats.reserve_bytes <= max_bytes
        if end == "shutdown":
            run.p.core.receive(EndReason.SHUTDOWN, run.p.now)
        elif end == "upstream_lost":
            run.p.core.receive(Fact.ENGINE_LOST, run.p.now)
        run.finish()
        out = run.p.deliveries

        run.check_no_audio_after_cancel()
        delivered = Counter(d.text for d in out)
        for text in run.accepted_dones:
            assert delivered[text] == 1, "an accepted response.done was not delivered"
        terminals = Counter(d.response_id for d in out if d.type == "response.done")
        assert all(n == 1 for n in terminals.values()), terminals
        closures = [i for i, d in enumerate(out) if d.closure]
        assert len(closures) <= 1
        if closures:
            assert closures[0] == len(out) - 1
            assert state(run.p) is SessionState.CLOSED
        if run.p.core.outcome is Outcome.OVERFLOW:
            assert out[-1].body["reason"] == "output_backpressure"
            assert any(
                d.type == "error" and d.body["error"]["code"] == "output_backpressure" for d in out
            )
            assert run.p.core.close_code == 1008
        # a failed response gets nothing after its failed terminal
        for i, d in enumerate(out):
            if (
                d.type == "response.done"
                and d.body["response"]["status"] == "failed"
                and (d.body["response"].get("status_details") or {}).get("reason")
                == "output_backpressure"
            ):
                assert not any(e.response_id == d.response_id for e in out[i + 1 :])


class TestCancelRacingCreate:
    """A cancel without a response id sent before the engine's response.created
    reached the proxy still covers that response (it is born cancelled)."""

    def test_response_created_after_the_cancel_is_silenced(self) -> None:
        p = pair()
        p.client(h.dumps({"type": "response.create"}))
        p.client(h.dumps({"type": "response.cancel"}))
        p.upstream(
            h.response_created("r1"),
            h.audio("r1", seq=0),
            h.transcript_delta("r1", seq=0),
            h.response_done("r1", "cancelled"),
        )
        out = p.deliver()
        assert types(out) == ["response.created", TRANSCRIPT, "response.done"]
        assert drop_events(p, DropReason.LATE_AUDIO) == 1

    def test_a_refused_create_does_not_cancel_the_next_response(self) -> None:
        p = pair()
        p.client(h.dumps({"type": "response.create", "event_id": "c1"}))
        p.upstream(
            h.dumps(
                {
                    "type": "error",
                    "error": {"code": "response_create_without_input", "event_id": "c1"},
                }
            )
        )
        p.client(h.dumps({"type": "response.cancel"}))  # nothing in flight any more
        p.client(h.dumps({"type": "response.create"}))
        p.upstream(h.response_created("r2"), h.audio("r2", seq=0), h.response_done("r2"))
        assert types(p.deliver()) == ["error", "response.created", AUDIO, "response.done"]

    def test_a_commit_with_response_create_counts_as_a_request(self) -> None:
        p = pair()
        p.client(h.dumps({"type": "input_audio_buffer.commit", "response_create": True}))
        p.client(h.dumps({"type": "barge_in"}))
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0))
        assert types(p.deliver()) == ["response.created"]

    def test_a_stale_request_does_not_cancel_a_later_response(self) -> None:
        p = pair()
        p.client(h.dumps({"type": "response.create"}))  # never answered
        p.tick(60.0)
        p.client(h.dumps({"type": "response.cancel"}))
        p.client(h.dumps({"type": "response.create"}))
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0))
        assert types(p.deliver()) == ["response.created", AUDIO]


class TestDrain:
    """``drain(now, room)`` is the core's one output: events within the room, frames upstream."""

    def test_events_are_taken_while_they_fit_the_room(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), *[h.audio("r1", 400, seq=i) for i in range(5)])
        room = len(h.response_created("r1")) + len(h.audio("r1", 400, seq=0))
        out = p.core.drain(p.now, room)
        assert [e.event.type for e in out.to_client] == ["response.created", AUDIO]
        out = p.core.drain(p.now, 1)
        assert len(out.to_client) == 1, "one event larger than the room still goes alone"

    def test_no_room_takes_nothing_but_frames_for_the_engine_still_come(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0))
        p.core.receive_client(h.b_response_cancel("r1"), p.now)
        out = p.core.drain(p.now, 0)
        assert list(out.to_client) == []
        assert [json.loads(f)["type"] for f in out.to_upstream] == ["response.cancel"]

    def test_the_close_frame_comes_once_the_session_is_over(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"))
        assert p.core.drain(p.now, 0).close is None, "open: no close"
        p.core.receive(EndReason.SHUTDOWN, p.now)
        out = p.core.drain(p.now, 1)
        assert [e.event.type for e in out.to_client] == ["response.created"]
        assert out.close == (CLOSE_GOING_AWAY, b"shutdown"), "closing: deliver, then close"
        out = p.core.drain(p.now, 1 << 20)
        assert [e.event.type for e in out.to_client] == ["session.closed"]
        assert out.close == (CLOSE_GOING_AWAY, b"shutdown")

    def test_a_report_only_when_something_changed(self) -> None:
        p = pair()
        for text in (h.response_created("r1"), h.audio("r1", seq=0)):
            p.core.receive_upstream(text, p.now)
        assert p.core.drain(p.now, 0).report is None, "ordinary events are no news"
        p.core.receive_upstream("not json", p.now)
        report = p.core.drain(p.now, 0).report
        assert report is not None
        assert report.drops == {DropReason.INVALID_UPSTREAM_FRAME: (1, len("not json"))}
        assert p.core.drain(p.now, 0).report is None, "taken once"


class TestTombstoneExpiry:
    def test_expired_tombstones_go_when_a_later_done_is_delivered(self) -> None:
        p = pair()
        p.upstream(h.response_created("r1"), h.audio("r1", seq=0))
        p.client(h.dumps({"type": "response.cancel", "response_id": "r1"}))
        p.upstream(h.response_done("r1", "cancelled"))
        p.deliver()
        assert p.core.ledger.tombstoned() == ["r1"]
        p.tick(p.core.settings.tombstone_ttl + 1)
        p.upstream(h.response_created("r2"), h.response_done("r2"))
        p.deliver()
        assert p.core.ledger.tombstoned() == []
        assert p.core.ledger.statistics().expirations == 1


# ================================================================================
# Resume (docs/design.md, Resume): held, journal, replay, tokens, takeover, bounds
# ================================================================================

GRACE = 30.0


class Resumable:
    """A SessionPair whose engine offers resume and numbers its events (``server_event_seq``)."""

    def __init__(self, *, journal_bytes: int = 1 << 20, **kwargs: Any) -> None:
        settings = dataclasses.replace(
            make_settings(**kwargs),
            client_resume_grace=GRACE,
            resume_journal_bytes=journal_bytes,
            resume_journal_ttl=60.0,
        )
        self.p = SessionPair(settings=settings)
        self.seq = 0
        #: What the last ``resume`` was told besides (``SessionCore.attach``).
        self.notice: str | None = None
        created = {
            "type": "session.created",
            "event_id": "event_sc",
            "session": {"id": "duplex-1", "capabilities": {"supports_session_resume": True}},
            "resume_token": "engine-token",
        }
        self.engine(h.dumps(created))
        #: The token the client got in session.created (bound, in place of the engine's).
        self.created_token = self.p.deliver()[0].body["resume_token"]

    def engine(self, *frames: str) -> list[int]:
        """Engine frames, each numbered; returns their seqs."""
        seqs = []
        for frame in frames:
            self.seq += 1
            body = json.loads(frame)
            body["server_event_seq"] = self.seq
            self.p.upstream(h.dumps(body))
            seqs.append(self.seq)
        return seqs

    def drop(self) -> bool:
        return self.p.core.receive(Fact.CLIENT_DROPPED, self.p.now)

    def resume(self, cursor: int) -> tuple[bool, list[Delivered]]:
        """Resume at ``cursor``; ``notice`` keeps what ``attach`` said besides."""
        resumed, self.notice = self.p.resume(cursor)
        if not resumed:
            return False, []
        return True, self.p.deliver(1000)


def seqs_of(out: list[Delivered]) -> list[int]:
    return [d.body["server_event_seq"] for d in out if "server_event_seq" in d.body]


class TestResumeHeld:
    def test_a_drop_is_held_with_the_grace_as_its_deadline_without_playback_acks(self) -> None:
        r = Resumable()
        assert not r.p.core.playback.acking
        r.p.tick(5.0)
        assert r.drop()
        assert r.p.core.held
        assert r.p.core.drain(r.p.now, 0).deadline == 5.0 + GRACE

    def test_when_the_grace_runs_out_the_session_ends_as_a_normal_close(self) -> None:
        r = Resumable()
        r.drop()
        r.p.tick(GRACE - 0.01)
        r.p.timer()
        assert state(r.p) is SessionState.OPEN
        r.p.tick(0.01)
        r.p.timer()
        assert not r.p.core.held
        assert state(r.p) is not SessionState.OPEN
        assert [f["type"] for f in r.p.upstream_sent] == ["session.close"]

    @pytest.mark.parametrize("how", ["close_frame", "session_close", "not_resumable"])
    def test_a_client_that_meant_to_leave_is_not_held(self, how: str) -> None:
        r = Resumable() if how != "not_resumable" else None
        p = r.p if r is not None else pair()
        if how == "session_close":
            p.client(h.b_session_close())
        held = p.fact(Fact.CLIENT_CLOSED if how == "close_frame" else Fact.CLIENT_DROPPED)
        assert not held
        assert not p.core.held


class TestResumeReplay:
    def test_the_notice_then_every_seq_after_the_cursor_once_then_live(self) -> None:
        r = Resumable()
        r.engine(h.response_created("r1"), *[h.audio("r1", seq=i) for i in range(4)])
        written = r.p.deliver()
        cursor = seqs_of(written)[1]  # the client got two; the rest died in flight
        assert r.drop()
        queued = r.engine(h.transcript_delta("r1"), h.response_done("r1"))  # while held
        assert r.p.deliver() == [], "nothing is written while held"
        resumed, out = r.resume(cursor)
        assert resumed
        assert out[0].type == "session.resumed"
        assert out[0].body["session_id"] == "duplex-1"
        assert out[0].body["attachment_generation"] == 1
        assert seqs_of(out) == list(range(cursor + 1, queued[-1] + 1))
        live = r.engine(h.other("rate_limits.updated"))
        assert seqs_of(r.p.deliver()) == live
        assert not r.p.core.held

    def test_a_replay_is_reported_for_the_metric(self) -> None:
        r = Resumable()
        r.engine(*[h.transcript_delta("r1", seq=i) for i in range(5)])
        cursor = seqs_of(r.p.deliver())[0]
        r.drop()
        core = r.p.core
        assert r.p.resume(cursor) == (True, None)
        report = core.drain(r.p.now, 0).report
        assert report is not None
        assert report.replayed == 5 - 1

    def test_audio_of_a_response_cancelled_after_it_was_journaled_is_not_replayed(self) -> None:
        r = Resumable()
        r.engine(h.response_created("r1"), *[h.audio("r1", seq=i) for i in range(3)])
        cursor = seqs_of(r.p.deliver())[0]  # the client has response.created only
        r.drop()
        r.engine(h.response_done("r1", "cancelled"))  # the engine cancels it while held
        resumed, out = r.resume(cursor)
        assert resumed
        assert audio_of(out, "r1") == [], "cancelled audio replayed"
        assert dones(out) == [("r1", "cancelled")]

    def test_a_replayed_event_is_journaled_once(self) -> None:
        r = Resumable()
        r.engine(*[h.transcript_delta("r1", seq=i) for i in range(3)])
        cursor = seqs_of(r.p.deliver())[0]
        r.drop()
        r.resume(cursor)
        assert r.drop()
        resumed, out = r.resume(cursor)
        assert resumed
        assert seqs_of(out) == [cursor + 1, cursor + 2]


class TestResumeGap:
    def test_a_cursor_older_than_the_journal_gets_resync_and_stays_held(self) -> None:
        r = Resumable(journal_bytes=2048)
        r.engine(*[h.transcript_delta("r1", "x" * 200, seq=i) for i in range(20)])
        r.p.deliver()
        r.drop()
        resumed, out = r.resume(1)
        assert not resumed
        assert out == []
        assert r.p.core.held, "still held: a resume from a later cursor may come"
        assert r.notice is not None, "the new connection is told why"
        notice = json.loads(r.notice)
        assert notice["type"] == "session.resync_required"
        assert notice["reason"] == "journal_gap"
        assert notice["session_id"] == "duplex-1"
        assert r.resume(r.seq)[0], "the newest cursor still resumes"

    def test_an_ack_trims_what_a_resume_could_replay(self) -> None:
        r = Resumable()
        r.engine(*[h.transcript_delta("r1", seq=i) for i in range(4)])
        r.p.deliver()
        before = r.p.core.journal_bytes
        ack = r.p.client(h.dumps({"type": "session.event_ack", "server_event_seq": r.seq - 1}))
        assert ack.forward, "the ack still goes to the engine"
        assert 0 < r.p.core.journal_bytes < before
        r.drop()
        assert not r.resume(r.seq - 2)[0]
        assert r.resume(r.seq - 1)[0]


class TestResumeTokens:
    def test_rotated_on_every_resume(self) -> None:
        r = Resumable()
        r.drop()
        core = r.p.core
        assert r.p.resume(0) == (True, None)
        out = r.p.deliver(10)
        token = out[0].body["resume_token"]
        assert token != r.created_token
        assert core.resume_token_matches(token)
        assert not core.resume_token_matches(r.created_token), "a spent token"

    def test_a_takeover_of_a_connection_that_still_looks_alive(self) -> None:
        """Not held (a half-open connection): the resume takes over; the old one is told."""
        r = Resumable()
        assert not r.p.core.held
        resumed, out = r.resume(r.seq)
        assert resumed
        assert out[0].body["attachment_generation"] == 1
        assert r.notice is not None, "the connection left behind is told"
        replaced = json.loads(r.notice)
        assert replaced["type"] == "session.replaced"
        assert replaced["session_id"] == "duplex-1"
        assert replaced["attachment_generation"] == 0


class TestResumeBounds:
    def test_the_journal_keeps_no_more_than_resume_journal_bytes(self) -> None:
        limit = 8 * 1024
        r = Resumable(journal_bytes=limit)
        for i in range(100):
            r.engine(h.audio("r1", 400, seq=i))
            r.p.deliver()
            assert 0 < r.p.core.journal_bytes <= limit
        assert r.p.core.drain(r.p.now, 0).journal_bytes == r.p.core.journal_bytes

    def test_the_journal_gives_way_to_the_queue_inside_the_output_budget(self) -> None:
        budget = 16 * 1024
        r = Resumable(journal_bytes=1 << 20, max_bytes=budget)
        for i in range(40):
            r.engine(h.audio("r1", 400, seq=i))
            r.p.deliver()
        assert r.p.core.journal_bytes <= budget
        r.drop()
        for i in range(20):  # queued while held
            r.engine(h.audio("r1", 400, seq=100 + i))
            core = r.p.core
            assert core.pending_bytes + core.journal_bytes <= budget
        assert state(r.p) is SessionState.OPEN

    def test_the_process_cap_trims_the_journal(self) -> None:
        r = Resumable()
        r.engine(*[h.transcript_delta("r1", seq=i) for i in range(10)])
        r.p.deliver()
        before = r.p.core.journal_bytes
        freed = r.p.core.trim_journal(before // 2)
        assert freed >= before // 2
        assert r.p.core.journal_bytes == before - freed
        r.drop()
        assert not r.resume(1)[0]

    def test_memory_held_for_resume_stays_within_resume_journal_bytes(self) -> None:
        """Small frames, never acked: what the session keeps for a resume is what the
        journal counts (tracemalloc), not the frames' size beside parsed bodies."""
        import gc
        import tracemalloc

        limit = 128 * 1024
        r = Resumable(journal_bytes=limit)
        frames = [h.transcript_delta(f"resp_{i % 7}", "hello", seq=i) for i in range(3000)]
        r.engine(*frames[:500])  # warm: the ledger's and usage's own sizes settle
        r.p.deliver()
        r.p.deliveries.clear()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for frame in frames[500:]:
                r.engine(frame)
                r.p.deliver()
                r.p.deliveries.clear()
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert r.p.core.journal_bytes <= limit
        assert grown <= limit + 32 * 1024, f"{grown} bytes held for a {limit}-byte journal"
