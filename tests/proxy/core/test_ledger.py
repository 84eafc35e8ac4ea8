"""CancellationLedger (proxy/core/ledger.py): docs/design.md, Cancellation.

Open/active responses, cancels, the bounded tombstone set (LRU eviction, TTL
after the response's done was delivered) and failed responses. Time is always
an explicit ``now``.
"""

from __future__ import annotations

import pytest

from proxy.core.ledger import (
    DEFAULT_MAX_TOMBSTONES,
    DEFAULT_TOMBSTONE_TTL,
    CancellationLedger,
    Verdict,
)


def test_defaults_match_design() -> None:
    assert DEFAULT_MAX_TOMBSTONES == 256
    assert DEFAULT_TOMBSTONE_TTL == 60.0


def test_max_tombstones_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CancellationLedger(max_tombstones=0)


class TestOpenAndActive:
    def test_created_is_open_and_active(self) -> None:
        ledger = CancellationLedger()
        ledger.on_created("r1")
        assert ledger.open_responses() == ["r1"]
        assert ledger.is_open("r1")
        assert ledger.active_response() == "r1"

    def test_open_until_done_delivered(self) -> None:
        ledger = CancellationLedger()
        ledger.on_created("r1")
        ledger.on_done_received("r1")
        assert ledger.open_responses() == ["r1"]
        assert ledger.active_response() is None  # no longer producing output
        ledger.on_done_delivered("r1", 1.0)
        assert ledger.open_responses() == []
        assert not ledger.is_open("r1")

    def test_oldest_first_and_newest_active(self) -> None:
        ledger = CancellationLedger()
        for rid in ("r1", "r2", "r3"):
            ledger.on_created(rid)
        assert ledger.open_responses() == ["r1", "r2", "r3"]
        assert ledger.active_response() == "r3"
        ledger.on_done_received("r3")
        assert ledger.active_response() == "r2"
        ledger.cancel("r2", 0.0)
        assert ledger.active_response() == "r1"
        ledger.on_done_received("r1")
        assert ledger.active_response() is None

    def test_done_of_unknown_response_is_harmless(self) -> None:
        ledger = CancellationLedger()
        ledger.on_done_received("nope")
        ledger.on_done_delivered("nope", 0.0)
        assert ledger.open_responses() == []

    def test_open_responses_are_bounded(self) -> None:
        ledger = CancellationLedger(max_tombstones=3)
        for i in range(5):
            ledger.on_created(f"r{i}")
        assert ledger.open_responses() == ["r2", "r3", "r4"]
        assert ledger.statistics().open_responses == 3


class TestCancel:
    def test_cancel_named_drops_only_its_audio(self) -> None:
        ledger = CancellationLedger()
        ledger.on_created("r1")
        ledger.on_created("r2")
        assert ledger.cancel("r1", 0.0) is True
        assert ledger.verdict("r1", is_audio=True, now=0.0) is Verdict.CANCELLED
        assert ledger.verdict("r1", is_audio=False, now=0.0) is Verdict.LIVE
        assert ledger.verdict("r2", is_audio=True, now=0.0) is Verdict.LIVE
        assert ledger.verdict(None, is_audio=True, now=0.0) is Verdict.LIVE
        assert ledger.tombstoned() == ["r1"]
        assert ledger.cancelled_at("r1") == 0.0
        assert ledger.cancelled_at("r2") is None

    def test_cancel_all_open(self) -> None:
        # the session cancels every open response; here: all of them
        ledger = CancellationLedger()
        for rid in ("r1", "r2"):
            ledger.on_created(rid)
        ledger.on_done_received("r1")  # finished, audio maybe still queued: still open
        for rid in ledger.open_responses():
            ledger.cancel(rid, 5.0)
        assert ledger.verdict("r1", is_audio=True, now=5.0) is Verdict.CANCELLED
        assert ledger.verdict("r2", is_audio=True, now=5.0) is Verdict.CANCELLED
        ledger.on_created("r3")
        assert ledger.verdict("r3", is_audio=True, now=5.0) is Verdict.LIVE

    def test_cancel_twice_returns_false(self) -> None:
        ledger = CancellationLedger()
        assert ledger.cancel("r1", 1.0) is True
        assert ledger.cancel("r1", 2.0) is False
        assert ledger.cancelled_at("r1") == 1.0
        assert ledger.statistics().tombstones == 1

    def test_failed_drops_every_kind(self) -> None:
        ledger = CancellationLedger()
        ledger.on_created("r1")
        assert ledger.cancel("r1", 0.0, failed=True)
        assert ledger.verdict("r1", is_audio=True, now=0.0) is Verdict.FAILED
        assert ledger.verdict("r1", is_audio=False, now=0.0) is Verdict.FAILED

    def test_cancel_then_fail_upgrades(self) -> None:
        ledger = CancellationLedger()
        ledger.on_created("r1")
        ledger.cancel("r1", 0.0)
        assert ledger.cancel("r1", 1.0, failed=True) is False
        assert ledger.verdict("r1", is_audio=False, now=1.0) is Verdict.FAILED
        # and a later plain cancel does not downgrade it
        ledger.cancel("r1", 2.0)
        assert ledger.verdict("r1", is_audio=False, now=2.0) is Verdict.FAILED


class TestEviction:
    def test_lru_eviction_is_counted_and_late_audio_is_evicted(self) -> None:
        ledger = CancellationLedger(max_tombstones=2)
        ledger.cancel("r1", 0.0)
        ledger.cancel("r2", 0.0)
        ledger.cancel("r3", 0.0)
        assert ledger.tombstoned() == ["r2", "r3"]
        assert ledger.statistics().evictions == 1
        assert ledger.verdict("r1", is_audio=True, now=0.0) is Verdict.EVICTED
        assert ledger.verdict("r1", is_audio=True, now=0.0) is Verdict.EVICTED
        assert ledger.statistics().late_after_eviction == 2
        # non-audio of an evicted response is simply live and not counted
        assert ledger.verdict("r1", is_audio=False, now=0.0) is Verdict.LIVE
        assert ledger.statistics().late_after_eviction == 2
        assert ledger.verdict("r3", is_audio=True, now=0.0) is Verdict.CANCELLED

    def test_use_refreshes_lru_position(self) -> None:
        ledger = CancellationLedger(max_tombstones=2)
        ledger.cancel("r1", 0.0)
        ledger.cancel("r2", 0.0)
        assert ledger.verdict("r1", is_audio=True, now=0.0) is Verdict.CANCELLED  # r1 newest
        ledger.cancel("r3", 0.0)
        assert ledger.tombstoned() == ["r1", "r3"]
        assert ledger.verdict("r2", is_audio=True, now=0.0) is Verdict.EVICTED

    def test_recancel_after_eviction_tombstones_again(self) -> None:
        ledger = CancellationLedger(max_tombstones=1)
        ledger.cancel("r1", 0.0)
        ledger.cancel("r2", 0.0)
        assert ledger.cancel("r1", 1.0) is True
        assert ledger.verdict("r1", is_audio=True, now=1.0) is Verdict.CANCELLED

    def test_evicted_memory_is_bounded(self) -> None:
        ledger = CancellationLedger(max_tombstones=2)
        for i in range(10):
            ledger.cancel(f"r{i}", 0.0)
        assert ledger.statistics().evictions == 8
        # only the most recent evictions are remembered
        assert ledger.verdict("r0", is_audio=True, now=0.0) is Verdict.LIVE
        assert ledger.verdict("r7", is_audio=True, now=0.0) is Verdict.EVICTED


class TestTtl:
    def test_tombstone_of_open_response_never_expires_before_done_delivered(self) -> None:
        ledger = CancellationLedger(tombstone_ttl=10.0)
        ledger.on_created("r1")
        ledger.cancel("r1", 0.0)
        assert ledger.verdict("r1", is_audio=True, now=1_000.0) is Verdict.CANCELLED
        assert ledger.expire(1_000.0) == 0
        ledger.on_done_received("r1")
        assert ledger.verdict("r1", is_audio=True, now=2_000.0) is Verdict.CANCELLED
        ledger.on_done_delivered("r1", 2_000.0)
        assert ledger.verdict("r1", is_audio=True, now=2_009.999) is Verdict.CANCELLED
        assert ledger.statistics().expirations == 0
        assert ledger.verdict("r1", is_audio=True, now=2_010.0) is Verdict.EVICTED
        stats = ledger.statistics()
        assert (stats.expirations, stats.tombstones, stats.late_after_eviction) == (1, 0, 1)

    def test_cancel_after_done_delivered_starts_ttl_at_cancel(self) -> None:
        ledger = CancellationLedger(tombstone_ttl=10.0)
        ledger.on_created("r1")
        ledger.on_done_delivered("r1", 0.0)
        ledger.cancel("r1", 5.0)
        assert ledger.verdict("r1", is_audio=True, now=14.9) is Verdict.CANCELLED
        assert ledger.verdict("r1", is_audio=True, now=15.0) is Verdict.EVICTED

    def test_unknown_response_expires_ttl_after_cancel(self) -> None:
        ledger = CancellationLedger(tombstone_ttl=10.0)
        ledger.cancel("ghost", 0.0)
        assert ledger.expire(9.9) == 0
        assert ledger.expire(10.0) == 1
        assert ledger.tombstoned() == []
        assert ledger.statistics().expirations == 1
        assert ledger.verdict("ghost", is_audio=True, now=10.0) is Verdict.EVICTED

    def test_expire_only_expired(self) -> None:
        ledger = CancellationLedger(tombstone_ttl=10.0)
        ledger.on_created("open")
        ledger.cancel("open", 0.0)
        ledger.cancel("a", 0.0)
        ledger.cancel("b", 5.0)
        assert ledger.expire(12.0) == 1
        assert ledger.tombstoned() == ["open", "b"]
        assert ledger.expire(15.0) == 1
        assert ledger.tombstoned() == ["open"]

    def test_second_done_delivered_does_not_extend_ttl(self) -> None:
        ledger = CancellationLedger(tombstone_ttl=10.0)
        ledger.on_created("r1")
        ledger.cancel("r1", 0.0)
        ledger.on_done_delivered("r1", 0.0)
        ledger.on_done_delivered("r1", 8.0)
        assert ledger.verdict("r1", is_audio=True, now=10.0) is Verdict.EVICTED

    def test_failed_tombstone_expires_too(self) -> None:
        ledger = CancellationLedger(tombstone_ttl=10.0)
        ledger.on_created("r1")
        ledger.cancel("r1", 0.0, failed=True)
        ledger.on_done_delivered("r1", 1.0)
        assert ledger.verdict("r1", is_audio=False, now=10.9) is Verdict.FAILED
        assert ledger.verdict("r1", is_audio=False, now=11.0) is Verdict.LIVE


def test_statistics_snapshot() -> None:
    ledger = CancellationLedger(max_tombstones=2, tombstone_ttl=1.0)
    ledger.on_created("r1")
    ledger.on_created("r2")
    ledger.cancel("x", 0.0)
    ledger.cancel("y", 0.0)
    ledger.cancel("z", 0.0)
    ledger.expire(5.0)
    stats = ledger.statistics()
    assert stats.open_responses == 2
    assert stats.tombstones == 0
    assert stats.evictions == 1
    assert stats.expirations == 2
    assert stats.late_after_eviction == 0
