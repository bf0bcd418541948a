"""Fixtures shared by the engine's test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import LLM


@pytest.fixture(scope="package")
def tiny_llm(tiny_model_dir: Path) -> Iterator[LLM]:
    """The tiny model over the memory transport with default options, one engine for the
    package: a test that takes it leaves it as it found it (no request running, no observer
    attached); one that needs other options, or closes it, starts its own."""
    with LLM(str(tiny_model_dir), transport="memory") as made:
        yield made
