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


def test_adapters_added_at_run_time_get_new_ids_never_reused() -> None:
    modules = LoRAModules.parse(["a=/adapters/a"])
    assert modules.add("b", "/adapters/b") == LoRARequest("b", 2, "/adapters/b")
    with pytest.raises(ValueError, match="already been loaded"):
        modules.add("b", "/elsewhere")
    assert modules.remove("b") == LoRARequest("b", 2, "/adapters/b")
    assert modules.remove("b") is None
    # the engine may still hold id 2's weights: the name comes back under a new id
    assert modules.add("b", "/adapters/b2").lora_int_id == 3
    with pytest.raises(ValueError, match="lora_path must be a non-empty string"):
        modules.add("c", "")
    assert modules.add("c", "/c").lora_int_id == 4  # a refused add takes no id


def test_a_bound_key_runs_its_adapter_whatever_base_name_it_sends() -> None:
    from pipeline.server.auth import PermissionDeniedError

    modules = LoRAModules.parse(["a=/adapters/a", "b=/adapters/b"])
    a = modules.get("a")
    for requested in (None, "", "a", "base", "/models/base"):
        assert modules.bound("a", requested, ("base", "/models/base"), "model") == a
    with pytest.raises(PermissionDeniedError, match=r"bound to the LoRA adapter 'a'.*'b'") as no:
        modules.bound("a", "b", ("base",), "model")
    assert no.value.field == "model"
    modules.remove("a")
    assert modules.bound("a", None, ("base",), "model") is None


def test_bindings_are_checked_at_start() -> None:
    modules = LoRAModules.parse(["a=/adapters/a"])
    modules.check_bindings(["a"], enable_lora=True, runtime_updates=False)
    modules.check_bindings(["later"], enable_lora=True, runtime_updates=True)
    with pytest.raises(ValueError, match="'later', which --lora-modules does not serve"):
        modules.check_bindings(["later"], enable_lora=True, runtime_updates=False)
    with pytest.raises(ValueError, match="give --enable-lora"):
        modules.check_bindings(["a"], enable_lora=False, runtime_updates=False)


def test_runtime_updates_need_enable_lora() -> None:
    from pipeline.engine.options import EngineOptions

    assert EngineOptions(enable_lora=True, enable_lora_runtime_updates=True)
    with pytest.raises(ValueError, match=r"enable_lora_runtime_updates .* needs enable_lora"):
        EngineOptions(enable_lora_runtime_updates=True)
