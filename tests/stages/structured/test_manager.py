"""Tests of stages/structured/manager.py: the compile cache, typed errors for grammars that do
not compile, matchers that follow each request's tokens (rolled back when ahead), bitmasks."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from stages.errors import InvalidRequestError
from stages.structured.manager import GrammarConfig, GrammarManager
from stages.structured.params import StructuredOutputsParams

EOS = 2


@pytest.fixture
def manager(tokenizer: Any) -> GrammarManager:
    grammars = GrammarManager(
        GrammarConfig("smollm2-135m", cache_size=2), tokenizer_loader=lambda model: tokenizer
    )
    grammars.set_engine_info(49152, [EOS])
    return grammars


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="cache_size"):
        GrammarConfig("m", cache_size=0)
    with pytest.raises(ValueError, match="backend"):
        GrammarConfig("m", backend="")


def test_compiles_once_per_constraint_least_recently_used_dropped(manager: GrammarManager) -> None:
    yes_no = StructuredOutputsParams(choice=("yes", "no"))
    digits = StructuredOutputsParams(regex="[0-9]+")
    assert manager.cached(yes_no) is None
    first = manager.compile(yes_no)
    assert manager.compile(StructuredOutputsParams(choice=["yes", "no"])) is first  # type: ignore[arg-type]
    manager.compile(digits)
    assert manager.cached(yes_no) is first  # now the most recent
    manager.compile(StructuredOutputsParams(json_object=True))  # drops digits (cache of 2)
    assert manager.cached(digits) is None and manager.cached(yes_no) is first
    stats = manager.stats()
    assert stats.compiled == 3 and stats.cache_hits == 3 and stats.failures == 0
    assert stats.compile_seconds > 0 and stats.load_seconds > 0


def test_compiling_from_threads_at_once_is_safe(manager: GrammarManager) -> None:
    params = [StructuredOutputsParams(regex=f"x{i}[a-z]*") for i in range(6)]
    results: list[Any] = []

    def compile_all() -> None:
        results.extend(manager.compile(p) for p in params)

    threads = [threading.Thread(target=compile_all) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 18


def test_a_grammar_that_does_not_compile_is_a_typed_error_naming_the_field(
    manager: GrammarManager,
) -> None:
    with pytest.raises(InvalidRequestError, match="uniqueItems") as caught:
        manager.compile(
            StructuredOutputsParams(json='{"type": "array", "uniqueItems": true}'), request_id="r"
        )
    assert caught.value.field == "structured_outputs.json"
    assert caught.value.request_id == "r"
    assert "llguidance" in str(caught.value)
    assert manager.stats().failures == 1


def test_matchers_follow_tokens_roll_back_when_ahead_and_fill_bitmasks(
    manager: GrammarManager, tokenizer: Any
) -> None:
    compiled = manager.compile(StructuredOutputsParams(choice=("cat", "dog")))
    cat = tokenizer.encode("cat")[0]
    manager.start("a", compiled)
    manager.start("b", compiled)
    assert "a" in manager and len(manager) == 2
    assert manager.accept("a", [cat])
    bitmask = manager.bitmask(["a", "b"])
    assert bitmask.shape == (2, 49152 // 32) and bitmask.dtype == np.int32
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    assert np.flatnonzero(bits[0]).tolist() == [EOS]
    assert bits[1, cat] == 1 and bits[1, EOS] == 0
    # the request has no output tokens after all (its token was dropped): back to the start
    manager.sync("a", 0)
    assert np.array_equal(manager.bitmask(["a"])[0], bitmask[1])
    with pytest.raises(ValueError, match="fewer"):
        manager.sync("b", 1)
    manager.finish("a")
    manager.finish("never-started")
    assert "a" not in manager


def test_compile_needs_the_engine_info(tokenizer: Any) -> None:
    grammars = GrammarManager(GrammarConfig("m"), tokenizer_loader=lambda model: tokenizer)
    with pytest.raises(RuntimeError, match="set_engine_info"):
        grammars.compile(StructuredOutputsParams(regex="a"))
    with pytest.raises(RuntimeError, match="compiled"):
        grammars.bitmask([])
