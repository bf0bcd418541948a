"""Tests of stages/token_bucket.py with a fake clock."""

from __future__ import annotations

import math

import pytest

from stages.token_bucket import TokenBucket


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_starts_full_and_allows_a_burst_then_refuses() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=5.0, clock=clock)
    assert [bucket.try_take() for _ in range(6)] == [True] * 5 + [False]
    assert bucket.available == pytest.approx(0.0)


def test_refills_at_rate_up_to_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=5.0, clock=clock)
    assert bucket.try_take(5)
    clock.now += 1.0
    assert bucket.available == pytest.approx(2.0)
    assert not bucket.try_take(3)
    # A refused take takes nothing.
    assert bucket.available == pytest.approx(2.0)
    assert bucket.try_take(2)
    clock.now += 1000.0
    assert bucket.available == pytest.approx(5.0)


def test_retry_after_is_the_time_until_a_take_succeeds() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=4.0, burst=10.0, clock=clock)
    assert bucket.retry_after(10) == 0.0
    assert bucket.try_take(10)
    wait = bucket.retry_after(6)
    assert wait == pytest.approx(1.5)
    clock.now += wait - 0.01
    assert not bucket.try_take(6)
    clock.now += 0.01
    assert bucket.try_take(6)


def test_retry_after_is_infinite_for_more_than_the_burst() -> None:
    bucket = TokenBucket(rate=1.0, burst=3.0, clock=FakeClock())
    assert bucket.retry_after(3.5) == math.inf
    assert not bucket.try_take(3.5)


def test_fractional_amounts_and_zero() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1.0, burst=1.0, clock=clock)
    assert bucket.try_take(0.25)
    assert bucket.try_take(0.75)
    assert bucket.try_take(0)
    assert not bucket.try_take(0.125)
    clock.now += 0.125
    assert bucket.try_take(0.125)


def test_clock_going_backwards_adds_nothing() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, burst=10.0, clock=clock)
    assert bucket.try_take(10)
    clock.now -= 50.0
    assert bucket.available == 0.0
    clock.now += 0.5  # still before the last refill time
    assert bucket.available == 0.0


@pytest.mark.parametrize(
    ("rate", "burst", "error"),
    [
        (0.0, 1.0, ValueError),
        (-1.0, 1.0, ValueError),
        (1.0, 0.0, ValueError),
        (math.inf, 1.0, ValueError),
        (1.0, math.nan, ValueError),
        ("1", 1.0, TypeError),
        (1.0, True, TypeError),
    ],
)
def test_invalid_configuration_is_refused(rate: object, burst: object, error: type) -> None:
    with pytest.raises(error, match=r"rate|burst"):
        TokenBucket(rate=rate, burst=burst, clock=FakeClock())  # type: ignore[arg-type]


@pytest.mark.parametrize("amount", [-1.0, math.nan, math.inf])
def test_invalid_amount_is_refused(amount: float) -> None:
    bucket = TokenBucket(rate=1.0, burst=1.0, clock=FakeClock())
    with pytest.raises(ValueError, match="amount"):
        bucket.try_take(amount)
    with pytest.raises(ValueError, match="amount"):
        bucket.retry_after(amount)
