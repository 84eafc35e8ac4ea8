"""Restart pacing (engine_launcher/policy.py): ``Backoff`` and ``RestartBudget``.

Properties, not examples, for the backoff: before jitter the delay never
decreases with the attempt number and never passes the cap; with jitter it
stays within ``base × (1 ± jitter)`` (and the cap); the same seed gives the
same delays. Time and randomness are arguments, so nothing here sleeps.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_launcher.policy import Backoff, RestartBudget

initials = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False)
caps = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
jitters = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
attempts = st.integers(min_value=0, max_value=200)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def base(backoff: Backoff, attempt: int) -> float:
    """The delay before jitter: initial·2^attempt, capped."""
    return min(backoff.cap, backoff.initial * 2.0 ** min(attempt, 62))


# -- Backoff ---------------------------------------------------------------------------------


@given(initial=initials, cap=caps, attempt=attempts, seed=seeds)
def test_without_jitter_non_decreasing_up_to_the_cap(
    initial: float, cap: float, attempt: int, seed: int
) -> None:
    backoff = Backoff(initial=initial, cap=cap, jitter=0.0)
    rng = random.Random(seed)
    now, after = backoff.delay(attempt, rng), backoff.delay(attempt + 1, rng)
    assert now <= after <= cap
    assert now == base(backoff, attempt)


@given(initial=initials, cap=caps, attempt=attempts)
def test_reaches_the_cap_and_stays_there(initial: float, cap: float, attempt: int) -> None:
    backoff = Backoff(initial=initial, cap=cap, jitter=0.0)
    rng = random.Random(0)
    assert backoff.delay(attempt + 200, rng) == cap  # the exponent stops at 62: 2^62 · 1e-3 ≫ 1e4
    assert backoff.delay(10**9, rng) == cap  # a huge attempt neither overflows nor drops


@given(initial=initials, cap=caps, jitter=jitters, attempt=attempts, seed=seeds)
def test_jitter_within_bounds(
    initial: float, cap: float, jitter: float, attempt: int, seed: int
) -> None:
    backoff = Backoff(initial=initial, cap=cap, jitter=jitter)
    b = base(backoff, attempt)
    delay = backoff.delay(attempt, random.Random(seed))
    tolerance = 1e-9 * max(1.0, b)
    assert 0.0 <= delay <= cap
    assert b * (1 - jitter) - tolerance <= delay <= b * (1 + jitter) + tolerance


@given(jitter=jitters, seed=seeds)
def test_same_seed_same_delays(jitter: float, seed: int) -> None:
    backoff = Backoff(initial=0.5, cap=30.0, jitter=jitter)
    first = [backoff.delay(n, random.Random(seed)) for n in range(8)]
    rng_a, rng_b = random.Random(seed), random.Random(seed)
    assert [backoff.delay(n, rng_a) for n in range(8)] == [
        backoff.delay(n, rng_b) for n in range(8)
    ]
    assert first == [backoff.delay(n, random.Random(seed)) for n in range(8)]


def test_jitter_actually_varies() -> None:
    backoff = Backoff(initial=1.0, cap=60.0, jitter=0.1)
    rng = random.Random(1234)
    delays = {backoff.delay(3, rng) for _ in range(20)}
    assert len(delays) > 1
    assert all(7.2 <= d <= 8.8 for d in delays)


def test_defaults() -> None:
    backoff = Backoff()
    assert (backoff.initial, backoff.cap, backoff.jitter) == (1.0, 60.0, 0.1)
    rng = random.Random(0)
    assert [round(base(backoff, n), 3) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert 0.9 <= backoff.delay(0, rng) <= 1.1


# -- RestartBudget ----------------------------------------------------------------------------


def test_budget_allows_max_restarts_within_the_window() -> None:
    budget = RestartBudget(max_restarts=3, window=10.0)
    for t in (0.0, 1.0, 2.0):
        assert budget.allows(t)
        budget.record(t)
    assert budget.recent(2.0) == 3
    assert not budget.allows(2.0)
    assert not budget.allows(9.999)


def test_budget_window_boundary_is_exclusive() -> None:
    budget = RestartBudget(max_restarts=1, window=10.0)
    budget.record(5.0)
    assert not budget.allows(14.999)
    assert budget.recent(14.999) == 1
    # Exactly `window` seconds later the old restart no longer counts.
    assert budget.allows(15.0)
    assert budget.recent(15.0) == 0


def test_budget_old_restarts_age_out_one_by_one() -> None:
    budget = RestartBudget(max_restarts=2, window=10.0)
    budget.record(0.0)
    budget.record(4.0)
    assert not budget.allows(9.0)
    assert budget.recent(10.0) == 1  # the one at 0 s left the window
    assert budget.allows(10.0)
    budget.record(10.0)
    assert budget.recent(13.9) == 2
    assert budget.recent(14.0) == 1
    assert budget.recent(100.0) == 0  # a quiet period resets the backoff attempt


def test_budget_zero_restarts_never_allows() -> None:
    budget = RestartBudget(max_restarts=0, window=600.0)
    assert not budget.allows(0.0)
    assert budget.recent(0.0) == 0


@given(
    times=st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), max_size=30),
    window=st.floats(min_value=0.1, max_value=1e3, allow_nan=False),
    limit=st.integers(min_value=0, max_value=10),
)
def test_budget_matches_a_sliding_window_model(
    times: list[float], window: float, limit: int
) -> None:
    budget = RestartBudget(max_restarts=limit, window=window)
    recorded: list[float] = []
    for now in sorted(times):
        inside = [t for t in recorded if now - t < window]
        assert budget.recent(now) == len(inside)
        assert budget.allows(now) is (len(inside) < limit)
        if budget.allows(now):
            budget.record(now)
            recorded.append(now)
    assert all(b >= a for a, b in itertools.pairwise(recorded))


@pytest.mark.parametrize("attempt", [0, 1, 2])
def test_recent_count_is_the_backoff_attempt(attempt: int) -> None:
    budget = RestartBudget(max_restarts=5, window=60.0)
    for n in range(attempt):
        budget.record(float(n))
    backoff = Backoff(initial=1.0, cap=60.0, jitter=0.0)
    assert backoff.delay(budget.recent(float(attempt)), random.Random(0)) == 2.0**attempt
