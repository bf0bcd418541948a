"""Fixtures shared by the engine's test modules."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import LLM


@pytest.fixture(scope="package")
def tiny_llm(tiny_model_dir: Path) -> Iterator[LLM]:
    """The tiny model over the memory transport with default options, one engine for the
    package: a test that takes it leaves it as it found it (no request running, no observer
    attached); one that needs other options, or closes it, starts its own."""
    with LLM(str(tiny_model_dir), transport="memory") as made:
        yield made


@pytest.fixture(scope="session")
def plain_outputs(tiny_model_dir: Path) -> Callable[..., list[Any]]:
    """Outputs of the tiny model over the memory transport without speculation, per prompts
    (token ids), params and engine options: each computed once per session (worker), the
    reference of test_speculative's and test_draft_model's identity checks that ask the same
    (``plain(prompts, params, num_blocks=256)``)."""
    computed: dict[str, list[Any]] = {}

    def plain(prompts: list[list[int]], params: Any, **options: Any) -> list[Any]:
        key = repr((prompts, params, sorted(options.items())))
        if key not in computed:
            with LLM(str(tiny_model_dir), transport="memory", **options) as llm:
                computed[key] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return computed[key]

    return plain
