"""LoRA adapters through ``LLM.generate`` (docs/lora.md): one LoRARequest per prompt, the
engine's own process and transport, each prompt's greedy tokens those of HF with its
adapter merged; refusals name the adapter and leave the engine serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import LLM, LoRAAdapterError, LoRARequest, SamplingParams
from stages.errors import InvalidRequestError
from tests.stages.execute.driving import HFReference
from tests.stages.execute.lora_adapters import make_adapter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[101, 2045, 3077, 517, 9000], [12, 77, 4242, 31, 5, 8, 19, 4000, 222]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-lora")
    return {
        "a1": make_adapter(tiny_model_dir, root / "a1", seed=21),
        "a2": make_adapter(
            tiny_model_dir, root / "a2", seed=22, rank=4, targets=("k_proj", "o_proj", "up_proj")
        ),
    }


@pytest.mark.slow
def test_llm_generate_takes_one_adapter_per_prompt(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    a1 = LoRARequest("a1", 1, str(adapters["a1"]))
    a2 = LoRARequest("a2", 2, str(adapters["a2"]))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(3)]
    loras = [None, a1, a2] * len(PROMPTS)
    with LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, num_blocks=64) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        references = {
            None: HFReference(tiny_model_dir),
            "a1": HFReference(Path(f"{adapters['a1']}-merged")),
            "a2": HFReference(Path(f"{adapters['a2']}-merged")),
        }
        for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
            name = lora.lora_name if lora is not None else None
            expected = references[name].greedy(prompt["prompt_token_ids"], 8)
            assert list(output.token_ids) == expected, name
        with pytest.raises(LoRAAdapterError, match=r"LoRA adapter 'gone'.*not a directory"):
            llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("gone", 3, "/no/such"))
        with pytest.raises(InvalidRequestError, match="got 1 LoRA requests for 2 prompts"):
            llm.generate(PROMPTS, GREEDY, lora_request=[a1])
        # one adapter for every prompt; the engine served on
        again = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=a1)
        assert list(again[0].token_ids) == references["a1"].greedy(PROMPTS[0], 8)


def test_lora_needs_enable_lora(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    with (
        LLM(str(tiny_model_dir), transport="memory", num_blocks=16) as llm,
        pytest.raises(LoRAAdapterError, match="enable_lora"),
    ):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("a1", 1, "/x"))


def test_lora_options_are_checked() -> None:
    from pipeline.engine.options import EngineOptions

    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        EngineOptions(max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineOptions(max_loras=3, max_cpu_loras=2)
    # sharded over ranks, routed over replicas (tests/stages/execute/test_lora_parallel.py)
    EngineOptions(enable_lora=True, tensor_parallel_size=2, data_parallel_size=2)
