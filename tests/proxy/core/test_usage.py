"""Usage accounting (proxy/core/usage.py) through SessionCore: docs/design.md, Usage.

What a session's record says it used, against what its client appended and
what the engine produced, was written to the client and was heard.
"""

from __future__ import annotations

import dataclasses

import pytest

from proxy.core.session_core import SessionSettings
from proxy.core.usage import UNNAMED_KEY, AudioDirection, ResponseOutcome, UsageMeter
from tests.proxy.core import helpers as h
from tests.proxy.core.helpers import SessionPair, dumps, make_settings

#: pcm16 at 24 kHz (the output default): 48 000 bytes = 64 000 base64 characters per second.
CHARS_PER_SECOND_24K = 64_000
#: pcm16 at 16 kHz (the input default): 32 000 bytes = 42 666.7 characters per second.
CHARS_PER_SECOND_16K = 32_000 * 4 / 3


def _rate(max_input_audio_rate: float) -> SessionSettings:
    return dataclasses.replace(make_settings(), max_input_audio_rate=max_input_audio_rate)


def _record(pair: SessionPair, seconds: float = 10.0) -> dict[str, float]:
    core = pair.core
    return core.usage.record("alpha", seconds, core.playback.heard(pair.now)).fields()


def _done_with_usage(response_id: str, usage: object, status: str = "completed") -> str:
    return dumps(
        {
            "type": "response.done",
            "response_id": response_id,
            "response": {"id": response_id, "status": status, "usage": usage},
        }
    )


class TestAudioSeconds:
    def test_input_is_the_appended_audio_in_the_sessions_input_format(self) -> None:
        pair = SessionPair(settings=_rate(0.0))
        for _ in range(4):
            assert pair.client(h.b_audio_append(32_000)).forward
        assert _record(pair)["audio_in_seconds"] == pytest.approx(
            4 * 32_000 / CHARS_PER_SECOND_16K, abs=1e-3
        )

    def test_input_follows_the_engines_session_updated_to_24khz(self) -> None:
        pair = SessionPair(settings=_rate(0.0))
        update = {"input_audio_format": "pcm16", "sample_rate_hz": 24_000}
        pair.client(dumps({"type": "session.update", "session": update}))
        pair.upstream(dumps({"type": "session.updated", "session": update}))
        pair.client(h.b_audio_append(64_000))
        assert _record(pair)["audio_in_seconds"] == pytest.approx(1.0, abs=1e-3)

    def test_an_update_the_engine_has_not_answered_is_charged_at_the_longer_reading(
        self,
    ) -> None:
        pair = SessionPair(settings=_rate(0.0))
        update = {"input_audio_format": "pcm16", "sample_rate_hz": 24_000}
        pair.client(dumps({"type": "session.update", "session": update}))
        pair.client(h.b_audio_append(64_000))  # 1 s at 24 kHz, 1.5 s at 16 kHz
        assert _record(pair)["audio_in_seconds"] == pytest.approx(1.5, abs=1e-3)

    def test_a_refused_append_is_not_counted(self) -> None:
        # 4x real time with a 10 s burst: the 11th one-second append in no time is refused.
        pair = SessionPair(settings=_rate(4.0))
        forwarded = sum(pair.client(h.b_audio_append(42_668)).forward for _ in range(12))
        assert forwarded < 12
        assert _record(pair)["audio_in_seconds"] == pytest.approx(forwarded * 1.0, abs=0.01)

    def test_out_counts_cancelled_audio_delivered_only_what_was_written(self) -> None:
        pair = SessionPair()
        pair.upstream(h.session_created(), h.response_created("r1"))
        pair.upstream(*(h.audio("r1", 6_400, seq=i) for i in range(5)))  # 5 x 0.1 s
        pair.deliver()
        pair.client(h.b_response_cancel("r1"))
        pair.upstream(*(h.audio("r1", 6_400, seq=i) for i in range(5, 8)))  # late: dropped
        pair.upstream(h.response_done("r1", "cancelled"))
        pair.deliver()
        fields = _record(pair)
        assert fields["audio_out_seconds"] == pytest.approx(0.8, abs=1e-3)
        assert fields["audio_delivered_seconds"] == pytest.approx(0.5, abs=1e-3)

    def test_heard_is_what_played_by_the_end(self) -> None:
        pair = SessionPair()
        pair.upstream(h.session_created(), h.response_created("r1"))
        pair.upstream(*(h.audio("r1", CHARS_PER_SECOND_24K, seq=i) for i in range(3)))  # 3 s
        pair.deliver()
        pair.tick(1.25)
        fields = _record(pair)
        assert fields["audio_delivered_seconds"] == pytest.approx(3.0, abs=1e-3)
        assert fields["audio_heard_seconds"] == pytest.approx(1.25, abs=1e-3)
        pair.tick(5.0)
        assert _record(pair)["audio_heard_seconds"] == pytest.approx(3.0, abs=1e-3)

    def test_a_cancel_cuts_heard_at_the_playhead(self) -> None:
        pair = SessionPair()
        pair.upstream(h.session_created(), h.response_created("r1"))
        pair.upstream(*(h.audio("r1", CHARS_PER_SECOND_24K, seq=i) for i in range(3)))
        pair.deliver()
        pair.tick(0.5)
        pair.client(h.b_response_cancel("r1"))
        pair.tick(10.0)
        assert _record(pair)["audio_heard_seconds"] == pytest.approx(0.5, abs=1e-3)


class TestResponsesAndTokens:
    def test_outcomes_by_status_and_unfinished(self) -> None:
        pair = SessionPair()
        pair.upstream(h.session_created())
        for rid, status in (("r1", "completed"), ("r2", "cancelled"), ("r3", "failed")):
            pair.upstream(h.response_created(rid), h.response_done(rid, status))
        pair.upstream(h.response_created("r4"), h.response_done("r4", "incomplete"))
        pair.upstream(h.response_created("r5"))
        fields = _record(pair)
        assert fields["responses_started"] == 5
        assert [fields[f"responses_{o.value}"] for o in ResponseOutcome] == [1, 1, 1, 1, 1]

    def test_tokens_are_summed_from_response_usage(self) -> None:
        pair = SessionPair()
        pair.upstream(h.session_created(), h.response_created("r1"), h.response_created("r2"))
        pair.upstream(
            _done_with_usage("r1", {"input_tokens": 12, "output_tokens": 30, "total_tokens": 42}),
            _done_with_usage("r2", {"input_tokens": 3, "output_tokens": 4}),
        )
        fields = _record(pair)
        assert (fields["input_tokens"], fields["output_tokens"], fields["total_tokens"]) == (
            15,
            34,
            49,
        )

    @pytest.mark.parametrize(
        "usage",
        [None, "lots", [1, 2], {"input_tokens": "12", "output_tokens": -4, "total_tokens": True}],
    )
    def test_a_missing_or_odd_usage_counts_nothing(self, usage: object) -> None:
        pair = SessionPair()
        pair.upstream(h.session_created(), h.response_created("r1"), _done_with_usage("r1", usage))
        fields = _record(pair)
        assert (fields["input_tokens"], fields["output_tokens"], fields["total_tokens"]) == (
            0,
            0,
            0,
        )
        assert fields["responses_completed"] == 1


class TestRecord:
    def test_fields_name_every_direction_and_outcome(self) -> None:
        fields = UsageMeter().record(UNNAMED_KEY, 2.5, 0.0).fields()
        assert fields["key"] == UNNAMED_KEY and fields["session_seconds"] == 2.5
        for direction in AudioDirection:
            assert fields[f"audio_{direction.value}_seconds"] == 0.0
        for outcome in ResponseOutcome:
            assert fields[f"responses_{outcome.value}"] == 0

    def test_heard_never_exceeds_delivered(self) -> None:
        meter = UsageMeter()
        meter.delivered_chars, meter.seconds_per_char = 64_000, 1 / 64_000
        assert meter.record("a", 1.0, 5.0).audio_seconds[AudioDirection.HEARD] == 1.0
