"""Fixtures shared by the runtime's test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.processes import child_processes


@pytest.fixture
def no_child_left() -> Iterator[None]:
    """Fail the test if it leaves a child process behind (modules opt in with
    ``pytestmark = pytest.mark.usefixtures("no_child_left")``)."""
    before = set(child_processes())
    yield
    assert set(child_processes()) - before == set()
