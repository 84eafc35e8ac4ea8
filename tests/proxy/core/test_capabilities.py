"""Engine capabilities (proxy/core/capabilities.py) and what a session does with them.

- the version decides the capabilities; config beats preflight beats the wire;
- the engine's answers to acks and truncations are settled by order (they
  carry no ``event_id`` on 0.32): the sidecar's own are hidden and counted by
  code, the client's own reach it, also when they interleave;
- a 0.32 engine (or one seen to refuse a truncation) is truncated only for
  items whose audio was relayed;
- a non-duplex session is sent no acks (known from its URL, or from the
  engine's ``invalid_event`` answer to the first one);
- a full engine's ``resource_exhausted`` before ``session.created`` is noted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from proxy.core.capabilities import (
    CapabilitySource,
    EngineCapabilities,
    EngineVersion,
    opens_at_connect,
    parse_version,
    session_is_duplex,
)
from proxy.core.engine_releases import RELEASES
from proxy.core.playback import ANSWER_TIMEOUT, AckErrorCode, AckMode, PlaybackSettings
from proxy.core.session_core import DropReason
from tests.proxy.core.helpers import (
    SessionPair,
    b_response_cancel,
    dumps,
    make_settings,
    response_created,
    response_done,
    session_created,
    types,
)
from tests.proxy.core.test_playback import chunk

V032 = EngineCapabilities.of(EngineVersion.V0_32, CapabilitySource.CONFIG)
NEWEST = RELEASES[-1].version


def pair(caps: EngineCapabilities | None = None, **playback: Any) -> SessionPair:
    options: dict[str, Any] = {"ack": AckMode.AUTO, **playback}
    settings = dataclasses.replace(make_settings(), playback=PlaybackSettings(**options))
    return SessionPair(settings=settings, capabilities=caps)


def sent(p: SessionPair) -> list[dict[str, Any]]:
    p.collect_upstream()
    return p.upstream_sent


def ack_error(code: str, event_id: str | None = None) -> str:
    error: dict[str, Any] = {"type": "invalid_request_error", "code": code, "message": "x"}
    if event_id is not None:
        error["event_id"] = event_id
    return dumps({"type": "error", "error": error})


def playing(p: SessionPair, seconds: float = 0.3) -> None:
    """One response's audio relayed and ``seconds`` of it played."""
    p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(10)])
    p.deliver()
    p.tick(seconds)


def own_ack(p: SessionPair) -> dict[str, Any]:
    """Let the ack timer fire (at its deadline, when that is later); the ack it sent."""
    deadline = p.deadline()
    assert deadline is not None, "an ack is due some time"
    p.now = max(p.now, deadline)
    p.timer()
    frame = sent(p)[-1]
    assert frame["type"] == "playback.ack"
    return frame


def client_ack(p: SessionPair, event_id: str | None = None) -> None:
    body: dict[str, Any] = {"type": "playback.ack", "response_id": "r1", "played_ms": 10}
    if event_id is not None:
        body["event_id"] = event_id
    assert p.client(dumps(body)).forward


class TestVersions:
    @pytest.mark.parametrize(
        ("text", "version"),
        [
            ("0.30.0", EngineVersion.V0_30),
            ("0.31.0rc1", EngineVersion.V0_31),
            ("0.32.0rc1", EngineVersion.V0_32),
            ("9.0.1", NEWEST),  # newer than every known release: the newest's behaviour
            ("0.29.9", EngineVersion.V0_30),
            ("dev", EngineVersion.UNKNOWN),
            (None, EngineVersion.UNKNOWN),
        ],
    )
    def test_parse(self, text: str | None, version: EngineVersion) -> None:
        assert parse_version(text) is version

    def test_capabilities_follow_the_version(self) -> None:
        old = EngineCapabilities.of(EngineVersion.V0_30, CapabilitySource.CONFIG)
        mid = EngineCapabilities.of(EngineVersion.V0_31, CapabilitySource.CONFIG)
        assert (old.bounded_output, old.drops_cancelled_audio, old.truncate_needs_audio_item) == (
            False,
            False,
            False,
        )
        assert (mid.bounded_output, mid.drops_cancelled_audio, mid.truncate_needs_audio_item) == (
            True,
            True,
            False,
        )
        assert V032.bounded_output and V032.truncate_needs_audio_item and V032.duplex_acks
        assert EngineCapabilities() == EngineCapabilities.of(
            EngineVersion.UNKNOWN, CapabilitySource.CONFIG
        ), "unknown: 0.30's behaviour, source unknown"

    def test_config_beats_preflight_beats_nothing(self) -> None:
        assert EngineCapabilities.resolve("0.31", "0.32.0rc1").source is CapabilitySource.CONFIG
        found = EngineCapabilities.resolve("auto", "0.32.0rc1")
        assert (found.version, found.source) == (EngineVersion.V0_32, CapabilitySource.PREFLIGHT)
        none = EngineCapabilities.resolve("auto", None)
        assert (none.version, none.source) == (EngineVersion.UNKNOWN, CapabilitySource.UNKNOWN)

    def test_the_wire_only_teaches_what_nothing_stronger_said_and_only_upwards(self) -> None:
        unknown = EngineCapabilities()
        learned = unknown.learn(EngineVersion.V0_32)
        assert (learned.version, learned.source) == (EngineVersion.V0_32, CapabilitySource.WIRE)
        assert learned.learn(EngineVersion.V0_31) is learned, "never down"
        configured = EngineCapabilities.resolve("0.30", None)
        assert configured.learn(EngineVersion.V0_32) is configured
        preflight = EngineCapabilities.resolve("auto", "0.31.0")
        assert preflight.learn(EngineVersion.V0_32) is preflight

    def test_view_uses_our_enum_values(self) -> None:
        assert V032.for_session(duplex=False).view() == {
            "version": "0.32",
            "source": "config",
            "bounded_output": True,
            "drops_cancelled_audio": True,
            "truncate_needs_audio_item": True,
            "duplex_acks": False,
        }


class TestUrl:
    @pytest.mark.parametrize(
        ("path", "query", "duplex"),
        [
            ("/v1/realtime", {}, True),
            ("/v1/realtime", {"duplex": "1"}, True),
            ("/v1/realtime", {"duplex": "on"}, True),
            ("/v1/realtime", {"duplex": "0"}, False),
            ("/v1/realtime", {"duplex": "no"}, False),
            ("/v1/duplex", {"duplex": "0"}, True),
        ],
    )
    def test_session_is_duplex(self, path: str, query: dict[str, str], duplex: bool) -> None:
        assert session_is_duplex(path, query) is duplex

    @pytest.mark.parametrize(
        ("query", "opens"),
        [
            ({}, False),
            ({"model": "m"}, True),
            ({"model": "m", "autostart": "0"}, False),
            ({"model": "m", "autostart": "false"}, False),
            ({"model": "m", "resume": "1"}, False),
            ({"model": ""}, False),
        ],
    )
    def test_opens_at_connect(self, query: dict[str, str], opens: bool) -> None:
        assert opens_at_connect(query) is opens


class TestAnswersByOrder:
    def test_our_acks_error_without_event_id_is_hidden_and_counted(self) -> None:
        p = pair(V032)
        playing(p)
        own_ack(p)
        p.upstream(ack_error("playback_ack_too_late"))
        assert types(p.deliver()) == []
        assert p.take_own_errors() == [AckErrorCode.PLAYBACK_ACK_TOO_LATE]
        assert p.core.drop_totals()[DropReason.PLAYBACK_ANSWER][0] == 1
        assert not p.core.playback.awaiting_answers

    def test_the_clients_own_acks_error_reaches_it(self) -> None:
        p = pair(V032)
        client_ack(p, "client_1")
        p.upstream(ack_error("playback_item_not_found"))
        assert types(p.deliver()) == ["error"]
        assert p.take_own_errors() == []

    def test_interleaved_answers_go_each_to_its_sender(self) -> None:
        p = pair(V032)
        playing(p)
        own_ack(p)  # ours first
        client_ack(p)  # then the client's (the sidecar stops acking: auto)
        p.upstream(ack_error("playback_ack_too_late"), ack_error("playback_item_mismatch"))
        delivered = p.deliver()
        assert [d.body["error"]["code"] for d in delivered] == ["playback_item_mismatch"]

    def test_client_first_then_ours(self) -> None:
        created = {
            "type": "session.created",
            "session": {"id": "s1", "capabilities": {"supports_audio_truncate": True}},
        }
        p = pair(None)
        p.upstream(dumps(created))
        assert types(p.deliver()) == ["session.created"]
        client_ack(p)  # the client acks itself: the sidecar only truncates now
        playing(p)
        p.client(b_response_cancel("r1"))
        assert sent(p)[0]["type"] == "conversation.item.truncate"
        p.upstream(dumps({"type": "playback.acknowledged"}), ack_error("bad_event"))
        assert types(p.deliver()) == ["playback.acknowledged"]
        assert p.take_own_errors() == [AckErrorCode.BAD_EVENT]

    def test_an_error_naming_another_event_is_not_ours(self) -> None:
        p = pair(V032)
        playing(p)
        own_ack(p)
        p.upstream(ack_error("bad_event", "client_event_7"))
        assert types(p.deliver()) == ["error"]
        assert p.core.playback.awaiting_answers, "ours is still in flight"

    def test_an_error_of_another_kind_is_not_an_answer(self) -> None:
        p = pair(V032)
        playing(p)
        own_ack(p)
        p.upstream(ack_error("engine_error"))
        assert types(p.deliver()) == ["error"]
        assert p.core.playback.awaiting_answers

    def test_an_answer_with_nothing_in_flight_reaches_the_client(self) -> None:
        p = pair(V032)
        p.upstream(ack_error("playback_ack_too_late"), dumps({"type": "playback.acknowledged"}))
        assert types(p.deliver()) == ["error", "playback.acknowledged"]

    def test_the_clients_truncate_is_answered_twice_then_ours(self) -> None:
        created = {
            "type": "session.created",
            "session": {"id": "s1", "capabilities": {"supports_audio_truncate": True}},
        }
        p = pair(V032)
        p.upstream(dumps(created))
        p.deliver()
        truncate = {"type": "conversation.item.truncate", "item_id": "item_r0", "audio_end_ms": 5}
        p.client(dumps({**truncate, "content_index": 0}))
        playing(p)
        own_ack(p)
        p.upstream(
            dumps({"type": "conversation.item.truncated", "item_id": "item_r0"}),
            dumps({"type": "playback.acknowledged", "event": {"truncate": True}}),
            ack_error("playback_ack_too_late"),
        )
        assert types(p.deliver()) == ["conversation.item.truncated", "playback.acknowledged"]
        assert p.take_own_errors() == [AckErrorCode.PLAYBACK_ACK_TOO_LATE]

    def test_a_frame_never_answered_is_forgotten_after_the_answer_timeout(self) -> None:
        p = pair(V032)
        # The client truncates; the engine answers with a code we do not know,
        # without event_id: that frame stays in flight...
        truncate = {"type": "conversation.item.truncate", "item_id": "x", "audio_end_ms": 0}
        p.client(dumps(truncate))
        p.upstream(ack_error("something_new"))
        assert types(p.deliver()) == ["error"]
        p.tick(ANSWER_TIMEOUT + 1)
        # ...but not for ever: our next ack's error is still taken for ours.
        playing(p)
        own_ack(p)
        p.upstream(ack_error("playback_ack_too_late"))
        assert types(p.deliver()) == []
        assert p.take_own_errors() == [AckErrorCode.PLAYBACK_ACK_TOO_LATE]

    def test_in_flight_is_bounded(self) -> None:
        p = pair(V032)
        for _ in range(300):
            client_ack(p)
        assert len(p.core.playback._awaited) == 256


class TestTruncationRule:
    def _cancel_after_empty_audio(self, caps: EngineCapabilities | None) -> SessionPair:
        p = pair(caps)
        p.upstream(response_created("r1"), chunk("r1", 0, chars=0))  # a delta with no audio
        p.deliver()
        p.tick(0.2)
        p.client(b_response_cancel("r1"))
        return p

    def test_0_32_is_not_truncated_for_an_item_that_produced_no_audio(self) -> None:
        p = self._cancel_after_empty_audio(V032)
        assert [f["type"] for f in sent(p)] == []
        assert p.core.playback.truncations_skipped == 1

    def test_0_32_is_truncated_for_an_item_whose_audio_was_relayed(self) -> None:
        p = pair(V032)
        playing(p)
        p.client(b_response_cancel("r1"))
        assert sent(p)[-1]["truncate"] is True

    def test_older_engines_keep_the_old_rule_until_the_wire_says_otherwise(self) -> None:
        p = self._cancel_after_empty_audio(None)
        (truncation,) = sent(p)
        assert truncation["truncate"] is True
        p.upstream(ack_error("bad_event"))  # 0.32's answer, no event_id
        assert types(p.deliver()) == []
        playback = p.core.playback
        assert p.take_learned() is EngineVersion.V0_32
        assert playback.capabilities.truncate_needs_audio_item
        assert playback.capabilities.source is CapabilitySource.WIRE
        assert p.take_learned() is None, "taken once"

    def test_a_bad_event_to_a_plain_ack_teaches_nothing(self) -> None:
        p = pair(None)
        playing(p)
        own_ack(p)
        p.upstream(ack_error("bad_event"))
        assert p.take_learned() is None

    def test_the_engines_own_output_bound_means_0_31(self) -> None:
        p = pair(None)
        p.upstream(ack_error("output_backpressure"))
        assert p.take_learned() is EngineVersion.V0_31
        assert types(p.deliver()) == ["error"], "the engine's error is the client's"


class TestNonDuplex:
    def test_a_session_known_non_duplex_is_never_acked(self) -> None:
        p = pair(V032.for_session(duplex=False))
        playing(p)
        assert p.timer() is None
        p.client(b_response_cancel("r1"))
        assert sent(p) == [], "no ack, no truncating ack"

    def test_invalid_event_to_our_ack_stops_the_acks(self) -> None:
        p = pair(None)
        p.upstream(response_created("r1"), *[chunk("r1", i) for i in range(20)])
        p.deliver()
        p.tick(0.3)
        own_ack(p)
        p.tick(0.3)
        own_ack(p)  # two in flight before the first answer
        p.upstream(ack_error("invalid_event"), ack_error("invalid_event"))
        assert types(p.deliver()) == []
        playback = p.core.playback
        assert not playback.acking and not playback.capabilities.duplex_acks
        before = len(sent(p))
        p.tick(0.3)
        assert p.timer() is None
        p.client(b_response_cancel("r1"))
        assert sent(p)[before:] == [], "no ack, no truncating ack"
        assert playback.own_errors == {AckErrorCode.INVALID_EVENT: 2}

    def test_the_clients_own_invalid_event_reaches_it(self) -> None:
        p = pair(None)
        client_ack(p)
        p.upstream(ack_error("invalid_event"))
        assert types(p.deliver()) == ["error"]
        assert p.core.playback.acking is False  # auto: the client acks itself


class TestEngineFull:
    def test_resource_exhausted_before_session_created_is_noted_and_passed_on(self) -> None:
        p = pair()
        p.upstream(
            dumps(
                {
                    "type": "error",
                    "error": {
                        "type": "rate_limit_error",
                        "code": "resource_exhausted",
                        "message": "duplex_session_capacity_exhausted: limit=1",
                        "retryable": True,
                    },
                }
            )
        )
        assert p.core.engine_full
        assert types(p.deliver()) == ["error"]

    def test_resource_exhausted_later_is_not_a_full_engine(self) -> None:
        p = pair()
        p.upstream(session_created(), ack_error("resource_exhausted"), response_done("r9"))
        assert not p.core.engine_full
