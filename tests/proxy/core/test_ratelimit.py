"""``TokenBucket`` (proxy/core/ratelimit.py): an average rate with a burst, time passed in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.ratelimit import BYTES_PER_SAMPLE, TokenBucket


def test_a_full_bucket_allows_the_whole_burst_at_once_then_refuses() -> None:
    bucket = TokenBucket(rate=1.0, capacity=3.0)
    assert [bucket.take(1.0, 0.0) for _ in range(4)] == [True, True, True, False]


def test_it_refills_at_the_rate_up_to_the_capacity() -> None:
    bucket = TokenBucket(rate=2.0, capacity=4.0)
    assert bucket.take(4.0, 0.0)
    assert not bucket.take(1.5, 0.5)  # one token back after 0.5 s
    assert bucket.take(1.0, 0.5)
    assert bucket.take(4.0, 100.0), "refilled, but never above the capacity"
    assert not bucket.take(0.1, 100.0)


def test_a_refused_take_takes_nothing() -> None:
    bucket = TokenBucket(rate=1.0, capacity=2.0)
    assert not bucket.take(3.0, 0.0)
    assert bucket.tokens == 2.0
    assert bucket.take(2.0, 0.0)


def test_a_clock_that_goes_back_adds_nothing() -> None:
    bucket = TokenBucket(rate=10.0, capacity=10.0)
    assert bucket.take(10.0, 5.0)
    assert not bucket.take(1.0, 4.0), "an earlier now must not refill"
    assert bucket.take(1.0, 5.5), "refilled from 5.0, the latest time seen"
    assert not bucket.take(5.0, 5.5)


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_a_rate_of_zero_or_less_is_off(rate: float) -> None:
    bucket = TokenBucket(rate=rate, capacity=0.0)
    assert all(bucket.take(1e9, float(t)) for t in range(10))


@given(
    takes=st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 2.0)), min_size=1, max_size=40),
    rate=st.floats(0.1, 10.0),
    capacity=st.floats(0.0, 20.0),
)
def test_what_is_taken_never_exceeds_the_burst_plus_the_rate_times_the_time(
    takes: list[tuple[float, float]], rate: float, capacity: float
) -> None:
    bucket = TokenBucket(rate=rate, capacity=capacity)
    now = 0.0
    taken = 0.0
    for amount, step in takes:
        now += step
        if bucket.take(amount, now):
            taken += amount
        assert 0.0 <= bucket.tokens <= capacity + 1e-9
    assert taken <= capacity + rate * now + 1e-6


def test_every_pcm_and_g711_spelling_has_its_sample_width() -> None:
    assert BYTES_PER_SAMPLE["pcm16"] == BYTES_PER_SAMPLE["audio/pcm"] == 2
    assert BYTES_PER_SAMPLE["pcm_f32le"] == 4
    assert {BYTES_PER_SAMPLE[name] for name in ("g711_ulaw", "audio/pcmu", "ulaw", "alaw")} == {1}
