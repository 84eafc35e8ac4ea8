"""Quota decisions (proxy/core/quota_rules.py) with wall time passed in: docs/design.md, Quotas.

Windows (the UTC minute, the UTC day), their boundaries, ``Retry-After`` for
each quota, and counts that belong to a key name across changed limits.
"""

from __future__ import annotations

import calendar

import pytest

from proxy.core.quota_rules import (
    MAX_SESSIONS_RETRY_AFTER,
    KeyQuota,
    LocalQuotaBook,
    QuotaKind,
    day_window,
    seconds_to_next_minute,
    seconds_to_utc_midnight,
)

#: 2027-03-10 23:59:58.5 UTC.
LATE = calendar.timegm((2027, 3, 10, 23, 59, 58)) + 0.5
MIDNIGHT = calendar.timegm((2027, 3, 11, 0, 0, 0))


def test_retry_after_counts_to_the_next_minute_and_utc_midnight() -> None:
    assert seconds_to_utc_midnight(LATE) == 2  # 1.5 s, rounded up
    assert seconds_to_next_minute(LATE) == 2
    assert seconds_to_utc_midnight(MIDNIGHT) == 86_400
    assert seconds_to_next_minute(MIDNIGHT + 0.25) == 60
    assert day_window(MIDNIGHT) == day_window(LATE) + 1


def test_max_sessions_frees_a_slot_on_release() -> None:
    book = LocalQuotaBook()
    quota = KeyQuota(max_sessions=2)
    assert book.admit("a", quota, LATE) is None
    assert book.admit("a", quota, LATE) is None
    refused = book.admit("a", quota, LATE)
    assert refused is not None
    assert (refused.kind, refused.limit) == (QuotaKind.MAX_SESSIONS, 2)
    assert refused.retry_after == MAX_SESSIONS_RETRY_AFTER
    assert book.admit("b", quota, LATE) is None  # another name has its own count
    book.release("a")
    assert book.admit("a", quota, LATE) is None
    assert book.active("a") == 2


def test_sessions_per_minute_is_a_fixed_utc_minute_window() -> None:
    book = LocalQuotaBook()
    quota = KeyQuota(sessions_per_minute=1)
    assert book.admit("a", quota, LATE) is None
    book.release("a")
    refused = book.admit("a", quota, LATE + 1.0)
    assert refused is not None
    assert (refused.kind, refused.retry_after) == (QuotaKind.SESSIONS_PER_MINUTE, 1)
    assert book.admit("a", quota, MIDNIGHT) is None  # a new minute


def test_day_audio_resets_at_utc_midnight_and_refuses_until_then() -> None:
    book = LocalQuotaBook()
    quota = KeyQuota(audio_seconds_per_day=10)
    assert book.charge_audio("a", 6.0, LATE - 3600) == 6.0
    assert book.charge_audio("a", 4.0, LATE) == 10.0
    refused = book.admit("a", quota, LATE)
    assert refused is not None
    assert (refused.kind, refused.retry_after) == (QuotaKind.AUDIO_SECONDS_PER_DAY, 2)
    assert book.audio_used("a", MIDNIGHT) == 0.0
    assert book.admit("a", quota, MIDNIGHT) is None
    assert book.charge_audio("a", 1.0, MIDNIGHT) == 1.0


def test_a_refusal_counts_nothing_and_the_day_is_checked_first() -> None:
    book = LocalQuotaBook()
    quota = KeyQuota(max_sessions=1, sessions_per_minute=5, audio_seconds_per_day=1)
    assert book.admit("a", quota, LATE) is None
    refused = book.admit("a", quota, LATE)
    assert refused is not None and refused.kind is QuotaKind.MAX_SESSIONS
    assert book.sessions_this_minute("a", LATE) == 1  # the refused one was not counted
    book.charge_audio("a", 1.0, LATE)
    refused = book.admit("a", quota, LATE)
    assert refused is not None and refused.kind is QuotaKind.AUDIO_SECONDS_PER_DAY


def test_counts_carry_over_when_the_limits_change() -> None:
    book = LocalQuotaBook()
    assert book.admit("a", KeyQuota(max_sessions=1), LATE) is None
    assert book.admit("a", KeyQuota(max_sessions=1), LATE) is not None
    assert book.admit("a", KeyQuota(max_sessions=2), LATE) is None
    assert book.admit("a", KeyQuota(max_sessions=2), LATE) is not None


@pytest.mark.parametrize("quota", [KeyQuota(), KeyQuota(max_sessions=0)])
def test_zero_is_no_limit(quota: KeyQuota) -> None:
    book = LocalQuotaBook()
    assert not quota.limited
    assert all(book.admit("a", quota, LATE) is None for _ in range(100))
