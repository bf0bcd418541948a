"""The garbage-collector policy of running pipelines (pipeline/runtime/gc_policy.py): the young
threshold is raised while any pipeline runs and put back after the last, unless someone else
changed it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from pipeline.runtime.gc_policy import YOUNG_THRESHOLD, raise_young_threshold, restore_threshold


@pytest.fixture(autouse=True)
def default_threshold() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_the_threshold_is_raised_while_any_pipeline_runs() -> None:
    raise_young_threshold()
    raise_young_threshold()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    restore_threshold()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)  # one still runs
    restore_threshold()
    assert gc.get_threshold() == (700, 10, 10)
    restore_threshold()  # one restore too many changes nothing
    assert gc.get_threshold() == (700, 10, 10)


def test_a_threshold_changed_meanwhile_is_left_alone() -> None:
    raise_young_threshold()
    gc.set_threshold(50_000, 5, 5)
    restore_threshold()
    assert gc.get_threshold() == (50_000, 5, 5)


def test_a_higher_threshold_is_not_lowered() -> None:
    gc.set_threshold(100_000, 10, 10)
    raise_young_threshold()
    assert gc.get_threshold() == (100_000, 10, 10)
    restore_threshold()
    assert gc.get_threshold() == (100_000, 10, 10)
