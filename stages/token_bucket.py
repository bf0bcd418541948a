"""A token bucket: a rate limit that allows short bursts (pure logic, no IO).

The admit stage keeps one bucket per tenant and limit (requests/s, prompt+max tokens/s): a
request passes when every bucket can pay for it, otherwise it is rejected with a
:class:`~stages.errors.RateLimitedError` carrying :meth:`TokenBucket.retry_after`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_amount(amount: float) -> float:
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise TypeError(f"amount must be a number, got {type(amount).__name__}")
    if not math.isfinite(amount) or amount < 0:
        raise ValueError(f"amount must be a finite number >= 0, got {amount!r}")
    return float(amount)


class TokenBucket:
    """Holds up to ``burst`` tokens, refilled continuously at ``rate`` tokens per second.

    It starts full. ``clock`` returns seconds (monotonic); a clock that steps backwards is
    treated as no time passing.

    Raises:
        TypeError, ValueError: ``rate`` or ``burst`` is not a finite number > 0.
    """

    __slots__ = ("_burst", "_clock", "_last", "_rate", "_tokens")

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rate = _check_positive("rate", rate)
        self._burst = _check_positive("burst", burst)
        self._clock = clock
        self._tokens = self._burst
        self._last = clock()

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    @property
    def full(self) -> bool:
        """Whether the bucket holds ``burst`` tokens (as a new one does)."""
        self._refill()
        return self._tokens >= self._burst

    @property
    def available(self) -> float:
        """Tokens in the bucket now."""
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        if elapsed > 0:
            self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
            self._last = now

    def try_take(self, amount: float = 1.0) -> bool:
        """Take ``amount`` tokens if the bucket holds that many; take nothing otherwise.

        Returns:
            True when the tokens were taken.
        Raises:
            TypeError, ValueError: ``amount`` is not a finite number >= 0.
        """
        amount = _check_amount(amount)
        self._refill()
        if amount <= self._tokens:
            self._tokens -= amount
            return True
        return False

    def retry_after(self, amount: float = 1.0) -> float:
        """Seconds until :meth:`try_take` of ``amount`` can succeed (0.0 when it can now).

        Returns:
            ``math.inf`` when ``amount`` exceeds ``burst``: the bucket can never hold it.
        Raises:
            TypeError, ValueError: ``amount`` is not a finite number >= 0.
        """
        amount = _check_amount(amount)
        if amount > self._burst:
            return math.inf
        self._refill()
        missing = amount - self._tokens
        return 0.0 if missing <= 0 else missing / self._rate
