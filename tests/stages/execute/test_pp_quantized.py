"""Pipeline parallelism with quantized weights (docs/parallelism.md): each shard quantizes
its own layers after dropping the others (``quantization="int8"``), or runs the GGUF file's
own blocks of its layers, found by the layers' place in the whole model (``"gguf"``).

- a shard's parameter names map to the file's by their place in the whole model;
- shard 1 of a GGUF model at PP=2 runs every one of its linears on the file's blocks (before
  the mapping, its renumbered layers matched the file's first layers, failed the row check and
  stayed fp32);
- int8 (a tiny Llama) and GGUF Q8_0 (a tiny GGUF Llama) at PP=2 give the greedy tokens of
  the same quantization at PP=1, in real shard processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pipeline import AsyncEngine, SamplingParams
from stages.execute.config import ExecuteConfig
from stages.execute.quant.gguf import file_layer_name
from stages.execute.quant.layers import QuantEmbedding, QuantLinear
from stages.execute.runner import ModelRunner
from tests.stages.execute.quant.test_apply import GGUF_LLAMA

T = TypeVar("T")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SILENCE = dict(heartbeat_timeout=60.0)


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 900) -> T:
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def greedy_tokens(model: str, prompts: list[Any], **options: Any) -> list[tuple[int, ...]]:
    async with AsyncEngine(model, num_blocks=128, **SILENCE, **options) as engine:

        async def one(prompt: Any) -> tuple[int, ...]:
            last = None
            async for output in engine.generate(prompt, GREEDY):
                last = output
            assert last is not None and last.finish_reason == "length"
            return last.token_ids

        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


def test_a_shards_gguf_names_are_its_layers_places_in_the_whole_model() -> None:
    assert file_layer_name("model.layers.0.mlp.up_proj.weight", 3) == (
        "model.layers.3.mlp.up_proj.weight"
    )
    assert file_layer_name("model.layers.12.self_attn.q_proj.weight", 15) == (
        "model.layers.27.self_attn.q_proj.weight"
    )
    assert file_layer_name("lm_head.weight", 3) == "lm_head.weight"
    assert file_layer_name("model.layers.2.mlp.up_proj.weight", 0) == (
        "model.layers.2.mlp.up_proj.weight"
    )


def test_the_last_shard_of_a_gguf_model_runs_its_layers_on_the_files_blocks(
    tiny_gguf: Path,
) -> None:
    config = ExecuteConfig(
        model=str(tiny_gguf), num_blocks=16, quantization="gguf", pipeline_parallel_size=2
    )
    runner = ModelRunner(config, shard=1)
    runner.load()
    layers = runner.model.get_decoder().layers
    assert len(layers) == GGUF_LLAMA["num_hidden_layers"] // 2
    linears = [module for module in runner.model.modules() if isinstance(module, QuantLinear)]
    # q, k, v, o, gate, up, down of its one layer, and the (untied) head: none left fp32
    assert len(linears) == 7 + 1
    assert {linear.format for linear in linears} == {"q8"}
    assert runner.model.get_decoder().embed_tokens is None  # dropped: shard 0 embeds
    first = ModelRunner(config, shard=0)
    first.load()
    assert isinstance(first.model.get_input_embeddings(), QuantEmbedding)
    assert first.model.lm_head is None
    assert sum(isinstance(m, QuantLinear) for m in first.model.modules()) == 7


@pytest.mark.slow
@pytest.mark.timeout(900)  # four engines, two of them two processes
def test_int8_and_gguf_weights_at_pp2_give_the_greedy_tokens_of_pp1(
    tiny_model_dir: Path, tiny_gguf: Path
) -> None:
    text = ["The quick brown fox jumps over", "alpha beta gamma delta " * 6, "short one"]
    # the GGUF model has its own 512-token vocabulary: token ids as prompts
    ids = [[5, 17, 300, 42, 7], list(range(40, 80)), [1, 2, 3]]
    for model, prompts, quantization in (
        (str(tiny_model_dir), text, "int8"),
        (str(tiny_gguf), ids, "gguf"),
    ):
        expected = run(greedy_tokens(model, prompts, quantization=quantization))
        got = run(
            greedy_tokens(model, prompts, quantization=quantization, pipeline_parallel_size=2)
        )
        assert got == expected, quantization
