"""Tests of pipeline/server/lora_modules.py: ``--lora-modules`` as vLLM takes it."""

from __future__ import annotations

import pytest

from pipeline.server.lora_modules import LoRAModules
from stages.lora import LoRARequest


def test_name_path_and_json_entries_get_ids_in_order() -> None:
    modules = LoRAModules.parse(["a=/adapters/a", '{"name": "b", "path": "/adapters/b"}'])
    assert modules.get("a") == LoRARequest("a", 1, "/adapters/a")
    assert modules.get("b") == LoRARequest("b", 2, "/adapters/b")
    assert modules.get("c") is None and modules.get(None) is None
    assert not LoRAModules.parse([])


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        (["a"], "expected name=path"),
        (["=/x"], "expected name=path"),
        (["a=/x", "a=/y"], "given twice"),
        (['{"name": "a"}'], "string name and path"),
        (['{"name": "a", "path": "/x", "base_model_name": "m"}'], "nothing else"),
        (["{oops"], "not JSON"),
    ],
)
def test_bad_values_are_refused(values: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        LoRAModules.parse(values)
