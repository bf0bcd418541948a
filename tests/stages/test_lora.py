"""Tests of stages/lora.py (pure): a PEFT adapter directory checked from its config and its
safetensors header (every refusal names the adapter and what is wrong, nothing is read
past a problem), the request's fields, the frontend checker, the prefix-cache key, and the
scheduler's max_loras bound."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from stages.lora import (
    LoRAAdapterError,
    LoRAChecker,
    LoRARequest,
    LoRATarget,
    check_lora_request,
    lora_cache_key,
    read_adapter,
)
from stages.messages import EngineRequest, SchedulerStep
from stages.params import SamplingParams
from stages.policies import FcfsPolicy
from stages.scheduler import Scheduler, SchedulerConfig
from tests.stages.test_scheduler import FakeClock, engine_info, request

TARGETS = {
    "q_proj": LoRATarget("q_proj", 64, 64),
    "k_proj": LoRATarget("k_proj", 64, 32),
    "down_proj": LoRATarget("down_proj", 128, 64),
}
SHAPES = tuple((t.name, t.in_features, t.out_features) for t in TARGETS.values())
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def write_adapter(
    path: Path,
    tensors: dict[str, list[int]],
    config: dict[str, object] | None = None,
    dtype: str = "F32",
) -> Path:
    """A PEFT directory whose safetensors file holds zero tensors of these shapes."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(CONFIG if config is None else config))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 4 * shape[0] * shape[1]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + bytes(offset)
    (path / "adapter_model.safetensors").write_bytes(data)
    return path


def q_proj(layer: int = 0, rank: int = 4, width: int = 64) -> dict[str, list[int]]:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": [rank, width], f"{prefix}.lora_B.weight": [64, rank]}


def test_a_good_adapter_is_read_with_its_scale(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {**q_proj(0), **q_proj(1)})
    spec = read_adapter(str(path), TARGETS, 2, 8)
    assert spec.rank == 4 and spec.scale == 2.0
    assert sorted(spec.tensors) == [(0, "q_proj"), (1, "q_proj")]
    rslora = write_adapter(tmp_path / "b", q_proj(), {**CONFIG, "use_rslora": True})
    assert read_adapter(str(rslora), TARGETS, 2, 8).scale == 4.0  # alpha / sqrt(r)
    assert read_adapter(str(rslora), TARGETS, 2, 8).digest != spec.digest


@pytest.mark.parametrize(
    ("tensors", "config", "dtype", "problem"),
    [
        (q_proj(rank=4), {**CONFIG, "r": 32}, "F32", "rank 32 is above max_lora_rank 8"),
        (q_proj(width=65), None, "F32", "has shape [4, 65], the model's q_proj needs [4, 64]"),
        (q_proj(layer=5), None, "F32", "layer 5"),
        (
            {"base_model.model.lm_head.lora_A.weight": [4, 64]},
            None, "F32", "is not a LoRA A/B weight",
        ),
        (
            {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": [4, 64]},
            None, "F32", "module up_proj",
        ),
        (dict(list(q_proj().items())[:1]), None, "F32", "has no lora_B weight"),
        (q_proj(), {**CONFIG, "use_dora": True}, "F32", "use_dora True is not supported"),
        (q_proj(), {**CONFIG, "peft_type": "IA3"}, "F32", "is not LORA"),
        (q_proj(), {**CONFIG, "r": "8"}, "F32", "r must be an integer"),
        (q_proj(), None, "I64", "not a float"),
        ({}, None, "F32", "holds no LoRA weights"),
    ],
)  # fmt: skip
def test_bad_adapters_are_refused_naming_the_problem(
    tmp_path: Path,
    tensors: dict[str, list[int]],
    config: dict[str, object] | None,
    dtype: str,
    problem: str,
) -> None:
    path = write_adapter(tmp_path / "bad", tensors, config, dtype)
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'mine'") as caught:
        read_adapter(str(path), TARGETS, 2, 8, name="mine")
    assert problem in str(caught.value)
    assert caught.value.field == "lora_request"


def test_missing_and_malformed_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        read_adapter(str(tmp_path / "nowhere"), TARGETS, 2, 8)
    path = write_adapter(tmp_path / "a", q_proj())
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match=r"adapter_model\.safetensors is missing"):
        read_adapter(str(path), TARGETS, 2, 8)
    (path / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(LoRAAdapterError, match="not a safetensors file"):
        read_adapter(str(path), TARGETS, 2, 8)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="not readable JSON"):
        read_adapter(str(path), TARGETS, 2, 8)


@pytest.mark.parametrize(
    "lora",
    [
        "a1",
        LoRARequest("", 1, "/x"),
        LoRARequest("a", 0, "/x"),
        LoRARequest("a", True, "/x"),  # type: ignore[arg-type]
        LoRARequest("a", 1, ""),
    ],
)
def test_request_fields_are_checked(lora: object) -> None:
    with pytest.raises(LoRAAdapterError, match="lora_request"):
        check_lora_request(lora)


def test_checker_refuses_when_off_and_one_id_for_two_adapters(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", q_proj())
    lora = LoRARequest("a", 1, str(path))
    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        LoRAChecker(False, 8).check(lora, SHAPES, 2)
    checker = LoRAChecker(True, 8)
    assert checker.check(lora, SHAPES, 2) is lora
    other = write_adapter(tmp_path / "b", q_proj())
    with pytest.raises(LoRAAdapterError, match="lora_int_id 1 is adapter 'a'"):
        checker.check(LoRARequest("b", 1, str(other)), SHAPES, 2)
    # a changed file is read again
    write_adapter(path, q_proj(), {**CONFIG, "r": 64})
    with pytest.raises(LoRAAdapterError, match="rank 64"):
        checker.check(lora, SHAPES, 2)


def test_cache_keys_differ_per_adapter_and_base_has_none() -> None:
    a, b = LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y")
    assert lora_cache_key(None) == b""
    assert len({lora_cache_key(a), lora_cache_key(b), b""}) == 3


def test_scheduler_runs_at_most_max_loras_adapters_at_once() -> None:
    """A request of a third adapter waits while two others run; base requests do not."""
    scheduler = Scheduler(SchedulerConfig(max_loras=2), FcfsPolicy(), clock=FakeClock())
    scheduler.set_engine_info(engine_info())
    loras = [LoRARequest(f"a{i}", i, f"/a{i}") for i in (1, 2, 3)]
    for index, lora in enumerate([*loras, None]):
        base = request(f"r{index}", 4)
        scheduler.add_request(EngineRequest(base.request_id, base.prompt_token_ids,
                                            SamplingParams(max_tokens=8), lora=lora))  # fmt: skip
    step = scheduler.schedule()
    assert isinstance(step, SchedulerStep)
    assert [r.request_id for r in step.new_requests] == ["r0", "r1", "r3"]
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_loras=0)
