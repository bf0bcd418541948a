"""The bounded memory of aborts that overtook their request (pure logic)."""

from __future__ import annotations

from stages.early_aborts import EarlyAborts


def test_an_early_abort_is_taken_once() -> None:
    aborts = EarlyAborts()
    aborts.add("a")
    assert "a" in aborts and len(aborts) == 1
    assert aborts.take("a") is True
    assert aborts.take("a") is False and len(aborts) == 0
    assert aborts.take("never") is False


def test_the_oldest_ids_are_forgotten_past_capacity() -> None:
    aborts = EarlyAborts(capacity=3)
    for request_id in "abcd":
        aborts.add(request_id)
    assert len(aborts) == 3
    assert not aborts.take("a")
    assert [aborts.take(r) for r in "bcd"] == [True, True, True]
