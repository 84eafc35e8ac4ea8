"""The playback ledger's settings and records (proxy/core/playback_state.py).

What the client has played is an estimate from wall time since its first audio,
never more than it was sent; what it holds unplayed is the lead.
"""

from __future__ import annotations

import math

import pytest

from proxy.core.playback_state import (
    ANSWER_CODES,
    DEFAULT_OUTPUT_RATE,
    AckErrorCode,
    AckMode,
    ItemPlayback,
    PlaybackSettings,
    audio_seconds,
)

#: 100 ms of PCM16 at 24 kHz: 4800 bytes, 6400 base64 characters.
CHUNK_CHARS = 6400


def test_audio_seconds_from_base64_length() -> None:
    assert audio_seconds(CHUNK_CHARS, "pcm16", 24_000) == pytest.approx(0.1)
    assert audio_seconds(CHUNK_CHARS, None, None) == pytest.approx(0.1)  # pcm16 24 kHz
    assert audio_seconds(1068, "g711_ulaw", None) == pytest.approx(0.1, abs=0.001)  # 8 kHz
    assert audio_seconds(12800, "pcm_f32le", 16_000) == pytest.approx(0.15)


def test_an_unknown_format_counts_as_16_bit_at_the_default_rate() -> None:
    seconds = audio_seconds(CHUNK_CHARS, "opus?", 0)
    assert seconds == pytest.approx(4800 / 2 / DEFAULT_OUTPUT_RATE)


def test_nothing_is_played_before_the_first_audio() -> None:
    item = ItemPlayback("r1", "item_r1", sent=2.0)
    assert item.played(100.0) == 0.0
    assert item.lead(100.0) == 2.0


def test_played_follows_wall_time_and_never_passes_what_was_sent() -> None:
    item = ItemPlayback("r1", "item_r1", started_at=10.0, sent=1.0)
    assert item.played(10.25) == pytest.approx(0.25)
    assert item.lead(10.25) == pytest.approx(0.75)
    assert item.played(20.0) == 1.0 and item.lead(20.0) == 0.0
    assert item.played(9.0) == 0.0, "a clock before the start plays nothing"


def test_a_new_item_has_written_no_ack_yet() -> None:
    item = ItemPlayback("r1", None)
    assert item.acked_ms == -1 and item.last_ack_at == -math.inf
    assert not item.done and not item.finished


def test_errors_matched_by_order_are_every_code_but_other() -> None:
    assert set(ANSWER_CODES.values()) == set(AckErrorCode) - {AckErrorCode.OTHER}
    assert ANSWER_CODES["playback_ack_too_late"] is AckErrorCode.PLAYBACK_ACK_TOO_LATE


def test_the_default_settings_ack_on_the_clients_behalf_unpaced() -> None:
    settings = PlaybackSettings()
    assert settings.ack is AckMode.AUTO and not settings.pacing
    assert settings.max_paced_audio_bytes > 0 and settings.ack_interval > 0
