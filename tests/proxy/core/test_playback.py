"""The playback ledger in the core: pacing, heard estimate, acks, truncation."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from proxy.core.playback import AckMode, PlaybackSettings
from proxy.core.session_core import EndReason, SessionState
from tests.proxy.core.helpers import (
    SessionPair,
    b_response_cancel,
    dumps,
    make_settings,
    response_created,
    response_done,
    transcript_delta,
    types,
)

RATE = 24_000
#: 100 ms of pcm16 at 24 kHz: 4800 bytes = 6400 base64 characters.
CHUNK_CHARS = 6400


def chunk(response_id: str, seq: int, *, chars: int = CHUNK_CHARS, **extra: Any) -> str:
    body = {
        "type": "response.output_audio.delta",
        "response_id": response_id,
        "item_id": f"item_{response_id}",
        "delta": "A" * chars,
        "format": "pcm16",
        "sample_rate_hz": RATE,
        "seq": seq,
        **extra,
    }
    return dumps(body)


def pair(**playback: Any) -> SessionPair:
    settings = dataclasses.replace(
        make_settings(), playback=PlaybackSettings(**{"ack": AckMode.OFF, **playback})
    )
    return SessionPair(settings=settings)


def sent(p: SessionPair) -> list[dict[str, Any]]:
    p.collect_upstream()
    return p.upstream_sent


class TestPacing:
    def test_lead_never_exceeds_max_audio_lead_plus_one_chunk(self) -> None:
        p = pair(pacing=True, max_audio_lead=0.5)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(40)])
        worst = 0.0
        for _ in range(200):  # 2 s in 10 ms steps
            p.deliver()
            item = p.core.playback.items.get("r1")
            if item is not None:
                worst = max(worst, item.lead(p.now))
            p.tick(0.01)
        assert 0.5 <= worst <= 0.5 + 0.1 + 1e-9
        assert len([d for d in p.deliveries if d.is_audio]) == 25, "0.5 s lead + 2 s played"

    def test_events_behind_held_audio_keep_their_order(self) -> None:
        p = pair(pacing=True, max_audio_lead=0.0)
        p.upstream(response_created("r1"), chunk("r1", 0), chunk("r1", 1))
        p.upstream(transcript_delta("r1"), response_done("r1"))
        assert types(p.deliver()) == ["response.created", "response.output_audio.delta"]
        assert p.deadline() == pytest.approx(p.now + 0.1)
        assert p.take() is None, "nothing ready until then"
        p.tick(0.1)
        assert types(p.deliver()) == [
            "response.output_audio.delta",
            "response.output_audio_transcript.delta",
            "response.done",
        ]

    def test_a_cancel_removes_held_audio_at_once(self) -> None:
        p = pair(pacing=True, max_audio_lead=0.2)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(30)])
        p.deliver()
        p.client(b_response_cancel("r1"))
        p.upstream(response_created("r2"), chunk("r2", 0))
        assert types(p.deliver()) == ["response.created", "response.output_audio.delta"]
        assert [d.response_id for d in p.deliveries if d.is_audio].count("r1") == 3

    def test_above_max_paced_audio_bytes_audio_is_released_and_counted(self) -> None:
        p = pair(pacing=True, max_audio_lead=0.0, max_paced_audio_bytes=3 * CHUNK_CHARS)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(8)])
        p.deliver()
        assert p.core.playback.paced_bound_releases >= 4
        assert p.core.buffer.pending_events <= 3

    def test_closing_delivers_held_audio_at_once(self) -> None:
        p = pair(pacing=True, max_audio_lead=0.0)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(10)])
        p.core.receive(EndReason.SHUTDOWN, p.now)
        delivered = p.deliver()
        assert types(delivered)[-1] == "session.closed"
        assert len([d for d in delivered if d.is_audio]) == 10

    def test_off_releases_everything_at_once(self) -> None:
        p = pair(pacing=False)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(10)])
        assert len(p.deliver()) == 11 and p.deadline() is None

    def test_held_audio_must_fit_the_output_budget(self) -> None:
        with pytest.raises(ValueError, match="max_paced_audio_bytes"):
            dataclasses.replace(
                make_settings(max_bytes=1000),
                playback=PlaybackSettings(pacing=True, max_paced_audio_bytes=2000),
            )


class TestAcks:
    def test_acks_every_interval_then_a_final_one_when_done_playing(self) -> None:
        p = pair(ack=AckMode.AUTO, ack_interval=0.25)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(10)])
        p.upstream(response_done("r1"))
        p.deliver()  # 1 s of audio sent at t = 0
        for _ in range(120):
            p.timer()
            p.tick(0.01)
        acks = [f for f in sent(p) if f["type"] == "playback.ack"]
        played = [a["played_ms"] for a in acks]
        assert played == sorted(played) and played[-1] == 1000
        assert 4 <= len(acks) <= 6, played  # every 250 ms over 1 s, then the final one
        assert all(a["committed_ms"] == a["played_ms"] for a in acks)
        assert {a["item_id"] for a in acks} == {"item_r1"}
        assert all(a["event_id"].startswith("event_sidecar_ack_") for a in acks)
        assert p.timer() is None, "nothing more to say about r1"

    def test_the_first_ack_is_due_an_interval_after_the_audio_started(self) -> None:
        p = pair(ack=AckMode.AUTO, ack_interval=0.25)
        p.tick(5.0)  # the session is old; its audio is not
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(10)])
        p.deliver()
        p.tick(0.2)
        assert p.core.playback.acks_due(p.now) == [], "200 ms played: not an interval yet"
        assert p.core.playback.next_ack_at(p.now) == pytest.approx(5.25)
        p.tick(0.05)
        due = [json.loads(a) for a in p.core.playback.acks_due(p.now)]
        assert [(a["type"], a["played_ms"]) for a in due] == [("playback.ack", 250)]

    def test_the_engines_answers_to_our_acks_are_hidden(self) -> None:
        p = pair(ack=AckMode.AUTO)
        p.upstream(response_created("r1"), chunk("r1", 0))
        p.deliver()
        p.tick(0.3)
        p.timer()
        ack = sent(p)[-1]
        p.upstream(dumps({"type": "playback.acknowledged", "event": {"played_ms": 100}}))
        p.upstream(dumps({"type": "playback.acknowledged", "event": {"played_ms": 1}}))
        assert types(p.deliver()) == ["playback.acknowledged"], "only the one we did not cause"
        p.upstream(chunk("r1", 1))
        p.deliver()
        p.tick(0.3)
        p.timer()
        p.upstream(
            dumps(
                {
                    "type": "error",
                    "error": {"code": "playback_ack_too_late", "event_id": sent(p)[-1]["event_id"]},
                }
            )
        )
        assert types(p.deliver()) == []
        assert ack["type"] == "playback.ack"

    def test_a_client_that_acks_itself_is_never_acked_for(self) -> None:
        p = pair(ack=AckMode.AUTO)
        decision = p.client(dumps({"type": "playback.ack", "response_id": "r0", "played_ms": 0}))
        assert decision.forward
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(5)])
        p.upstream(response_done("r1"))
        p.deliver()
        for _ in range(100):
            p.timer()
            p.tick(0.05)
        p.client(b_response_cancel("r1"))
        assert [f["type"] for f in sent(p)] == []
        p.upstream(dumps({"type": "playback.acknowledged"}))
        assert types(p.deliver()) == ["playback.acknowledged"], "its own answers reach it"

    def test_always_acks_and_does_not_forward_the_clients_acks(self) -> None:
        p = pair(ack=AckMode.ALWAYS)
        decision = p.client(dumps({"type": "playback.ack", "response_id": "r0", "played_ms": 0}))
        assert not decision.forward
        p.upstream(response_created("r1"), chunk("r1", 0))
        p.deliver()
        p.tick(0.3)
        p.timer()
        assert [f["type"] for f in sent(p)] == ["playback.ack"]

    def test_off_sends_nothing(self) -> None:
        p = pair(ack=AckMode.OFF)
        p.upstream(response_created("r1"), chunk("r1", 0))
        p.deliver()
        p.tick(0.3)
        assert p.timer() is None
        p.client(b_response_cancel("r1"))
        assert sent(p) == []


class TestTruncation:
    def test_cancel_mid_playback_tells_the_engine_what_was_heard_before_the_cancel(
        self,
    ) -> None:
        p = pair(ack=AckMode.AUTO)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(20)])
        p.deliver()  # 2 s sent at once (no pacing)
        p.tick(0.7)
        p.client(b_response_cancel("r1"))
        frames = sent(p)
        assert frames[-1]["type"] == "playback.ack"
        assert frames[-1]["truncate"] is True
        assert frames[-1]["played_ms"] == 700
        assert p.core.playback.truncations_sidecar == 1
        assert p.take_lead_at_cancel() == [pytest.approx(1.3)]

    def test_engine_that_supports_truncate_gets_conversation_item_truncate(self) -> None:
        p = pair(ack=AckMode.AUTO)
        created = {
            "type": "session.created",
            "session": {"id": "s1", "capabilities": {"supports_audio_truncate": True}},
        }
        p.upstream(json.dumps(created), response_created("r1"), chunk("r1", 0), chunk("r1", 1))
        p.deliver()
        p.tick(0.15)
        p.client(b_response_cancel("r1"))
        truncate = sent(p)[-1]
        assert truncate["type"] == "conversation.item.truncate"
        assert (truncate["item_id"], truncate["content_index"], truncate["audio_end_ms"]) == (
            "item_r1",
            0,
            150,
        )
        p.upstream(dumps({"type": "conversation.item.truncated", "item_id": "item_r1"}))
        p.upstream(dumps({"type": "playback.acknowledged", "event": {"truncate": True}}))
        p.upstream(dumps({"type": "playback.acknowledged", "event": {"truncate": False}}))
        # Both answers to our truncate are hidden; the next acknowledgement is not ours.
        assert [d.body["event"]["truncate"] for d in p.deliver()] == [False]

    def test_a_client_that_truncated_itself_is_left_alone(self) -> None:
        p = pair(ack=AckMode.AUTO)
        p.upstream(response_created("r1"), chunk("r1", 0), chunk("r1", 1))
        p.deliver()
        p.tick(0.05)
        p.client(
            dumps(
                {
                    "type": "conversation.item.truncate",
                    "item_id": "item_r1",
                    "content_index": 0,
                    "audio_end_ms": 50,
                }
            )
        )
        p.client(b_response_cancel("r1"))
        assert [f["type"] for f in sent(p) if f["type"] != "response.cancel"] == []
        assert p.core.playback.truncations_client == 1

    def test_engine_side_cancel_also_truncates(self) -> None:
        p = pair(ack=AckMode.AUTO)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(10)])
        p.deliver()
        p.tick(0.4)
        p.upstream(dumps({"type": "overlap.decision", "action": "barge_in"}))
        assert sent(p)[-1]["played_ms"] == 400 and sent(p)[-1]["truncate"] is True

    def test_what_the_client_said_it_played_is_where_the_truncation_goes(self) -> None:
        # ``always``: the client's acks stay here; its played_ms is the truth, not the clock.
        p = pair(ack=AckMode.ALWAYS)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(20)])
        p.deliver()
        p.tick(0.9)
        ack = {"type": "playback.ack", "response_id": "r1", "played_ms": 300}
        assert not p.client(dumps(ack)).forward
        p.client(b_response_cancel("r1"))
        truncating = [f for f in sent(p) if f.get("truncate")]
        assert [f["played_ms"] for f in truncating] == [300]

    def test_an_older_report_never_moves_the_position_back(self) -> None:
        p = pair(ack=AckMode.ALWAYS)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(20)])
        p.deliver()
        p.tick(0.9)
        for played in (500, 200, True, "600"):
            ack = {"type": "playback.ack", "response_id": "r1", "played_ms": played}
            p.client(dumps(ack))
        p.client(b_response_cancel("r1"))
        assert [f["played_ms"] for f in sent(p) if f.get("truncate")] == [500]

    def test_a_reporting_client_heard_nothing_until_it_says_so(self) -> None:
        # The phone front door: the wall clock says 0.9 s, Twilio's marks said nothing yet.
        p = pair(ack=AckMode.ALWAYS, client_reports=True)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(20)])
        p.deliver()
        p.tick(0.9)
        assert p.core.playback.heard(p.now) == 0.0
        p.client(b_response_cancel("r1"))
        assert [f["played_ms"] for f in sent(p) if f.get("truncate")] == [0]

    def test_nothing_heard_nothing_truncated_after_done_playing(self) -> None:
        p = pair(ack=AckMode.AUTO)
        p.upstream(response_created("r1"), chunk("r1", 0), response_done("r1"))
        p.deliver()
        p.tick(0.5)
        p.timer()  # the final ack: r1 is over
        before = len(sent(p))
        p.client(b_response_cancel("r1"))
        assert len(sent(p)) == before
        assert p.core.state is SessionState.OPEN
