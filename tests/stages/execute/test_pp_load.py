"""What a pipeline shard loads (docs/parallelism.md, "What a shard loads"): only the
safetensors tensors of its layer range, the embeddings on the first shard, the norm and the
LM head on the last (tied embeddings: the embedding matrix as the last shard's head).

- a shard's parameter bytes are exactly the bytes of the checkpoint tensors that are its own,
  so at PP=2 of an untied model each holds about half, and the shards together hold the
  checkpoint once; chained, the shards compute the whole model's logits;
- with tied embeddings, the later shards hold no embeddings and the last one's head is the
  embedding matrix;
- through transformers' own class too: the shard built on the meta device holds exactly its
  tensors (its rotary embedding rebuilt from the config), and the chain computes the model;
- a shard's runner loads (its survey runs from hidden states where it has no embeddings) and
  holds no more than its tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from stages.execute.config import ExecuteConfig
from stages.execute.llama import load_native_llama
from stages.execute.model_impl import WEIGHTS_FILE, model_config
from stages.execute.pp_load import (
    ShardPart,
    load_transformers_model,
    shard_part,
    shard_tensor_name,
)
from stages.execute.pp_split import layer_ranges
from stages.execute.runner import ModelRunner
from tests.conftest import TINY_LLAMA

TOKENS = torch.tensor([[5, 17, 301, 4000, 12, 9, 77, 2]])


@pytest.fixture(scope="module")
def untied6_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 6-layer tiny Llama with an LM head of its own (untied)."""
    out = tmp_path_factory.mktemp("untied6-llama")
    torch.manual_seed(1)
    config = LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 6, "tie_word_embeddings": False})
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def checkpoint_bytes(model_dir: Path) -> dict[str, int]:
    """Each stored tensor's bytes, read from the file's header and slices' shapes."""
    sizes = {}
    with safe_open(str(model_dir / WEIGHTS_FILE), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118
            piece = handle.get_slice(name)
            count = 1
            for extent in piece.get_shape():
                count *= extent
            sizes[name] = count * torch.finfo(getattr(torch, _dtype(piece.get_dtype()))).bits // 8
    return sizes


def _dtype(stored: str) -> str:
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[stored]


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def shards_of(model_dir: Path, size: int) -> list[torch.nn.Module]:
    ranges = layer_ranges(6, size)
    shards = []
    for shard in range(size):
        config = model_config(model_dir)  # a fresh one each: a cut renumbers its config
        part = shard_part(ranges, shard)
        shards.append(load_native_llama(model_dir, config, torch.float32, part))
    return shards


def chained_logits(shards: list[torch.nn.Module]) -> torch.Tensor:
    positions = torch.arange(TOKENS.shape[1]).unsqueeze(0)
    hidden = shards[0].get_decoder()(TOKENS, positions)
    for shard in shards[1:-1]:
        hidden = shard.get_decoder()(None, positions, inputs_embeds=hidden)
    return shards[-1](position_ids=positions, inputs_embeds=hidden).logits


def test_tensor_names_map_to_the_shard_that_holds_them() -> None:
    middle = ShardPart(range(2, 4), first=False, last=False)
    last = ShardPart(range(4, 6), first=False, last=True)
    first = ShardPart(range(0, 2), first=True, last=False)
    layer = "model.layers.3.self_attn.q_proj.weight"
    assert shard_tensor_name(layer, middle, tied=True) == "model.layers.1.self_attn.q_proj.weight"
    assert shard_tensor_name(layer, first, tied=True) is None
    assert shard_tensor_name("model.embed_tokens.weight", first, tied=True) == (
        "model.embed_tokens.weight"
    )
    assert shard_tensor_name("model.embed_tokens.weight", middle, tied=True) is None
    assert shard_tensor_name("model.embed_tokens.weight", last, tied=True) == "lm_head.weight"
    assert shard_tensor_name("model.embed_tokens.weight", last, tied=False) is None
    for name in ("model.norm.weight", "lm_head.weight"):
        assert shard_tensor_name(name, last, tied=False) == name
        assert shard_tensor_name(name, middle, tied=False) is None
    # a name no shard knows passes as it is: the loader refuses it as a whole load does
    assert shard_tensor_name("model.vision.weight", middle, tied=False) == "model.vision.weight"
    assert shard_part([range(0, 6)], 0) is None


@pytest.mark.parametrize("size", [2, 3])
def test_a_shard_holds_exactly_its_tensors_and_the_chain_computes_the_model(
    untied6_model_dir: Path, size: int
) -> None:
    stored = checkpoint_bytes(untied6_model_dir)
    whole = load_native_llama(untied6_model_dir, model_config(untied6_model_dir), torch.float32)
    assert parameter_bytes(whole) == sum(stored.values())
    shards = shards_of(untied6_model_dir, size)
    ranges = layer_ranges(6, size)
    for index, shard in enumerate(shards):
        part = shard_part(ranges, index)
        assert part is not None
        own = sum(b for name, b in stored.items() if shard_tensor_name(name, part, False))
        assert parameter_bytes(shard) == own
        assert len(shard.get_decoder().layers) == len(ranges[index])
    # untied: together the shards hold the checkpoint once, each about its share
    assert sum(parameter_bytes(shard) for shard in shards) == sum(stored.values())
    for shard in shards[:1] + shards[-1:]:  # the embeddings or the head, and their layers
        assert 0.8 / size < parameter_bytes(shard) / sum(stored.values()) < 1.2 / size + 0.1
    with torch.inference_mode():
        assert torch.allclose(chained_logits(shards), whole(TOKENS).logits, atol=1e-5)


def test_tied_embeddings_are_the_last_shards_head_and_no_later_shard_embeds(
    tiny6_model_dir: Path,
) -> None:
    whole = load_native_llama(tiny6_model_dir, model_config(tiny6_model_dir), torch.float32)
    first, middle, last = shards_of(tiny6_model_dir, 3)
    embeddings = whole.get_input_embeddings().weight
    assert torch.equal(first.get_input_embeddings().weight, embeddings)
    assert first.lm_head is None and middle.lm_head is None
    assert middle.get_decoder().embed_tokens is None and last.get_decoder().embed_tokens is None
    assert torch.equal(last.lm_head.weight, embeddings)
    assert torch.equal(
        middle.get_decoder().layers[0].mlp.down_proj.weight,
        whole.get_decoder().layers[2].mlp.down_proj.weight,
    )
    with torch.inference_mode():
        assert torch.allclose(
            chained_logits([first, middle, last]), whole(TOKENS).logits, atol=1e-5
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_later_shards_runner_loads_from_hidden_states_and_holds_its_share(
    untied6_model_dir: Path, dtype: str
) -> None:
    stored = checkpoint_bytes(untied6_model_dir)
    # bfloat16: bf16 weights (on a CPU with the native bf16 GEMM, fp32 activations over bf16
    # linears: the survey's hidden states are the activations' dtype, not the weights')
    config = ExecuteConfig(
        model=str(untied6_model_dir), pipeline_parallel_size=2, num_blocks=8, dtype=dtype,
        cpu_linears=dtype == "bfloat16",
    )  # fmt: skip
    runner = ModelRunner(config, shard=1)
    runner.load()
    part = shard_part(layer_ranges(6, 2), 1)
    assert part is not None
    assert runner.model is not None and runner.kv_cache is not None
    assert runner.model.get_decoder().embed_tokens is None
    assert len(runner.model.get_decoder().layers) == 3
    if dtype == "float32":  # the parameters as loaded (bf16 ones are repacked)
        own = sum(b for name, b in stored.items() if shard_tensor_name(name, part, False))
        assert parameter_bytes(runner.model) == own


def test_through_transformers_a_shard_holds_exactly_its_tensors_and_computes_the_model(
    untied6_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoConfig

    caplog.set_level("INFO", "actorline.execute")
    stored = checkpoint_bytes(untied6_model_dir)
    config = AutoConfig.from_pretrained(untied6_model_dir)
    whole = load_transformers_model(untied6_model_dir, config, torch.float32, None)
    ranges = layer_ranges(6, 3)
    shards = []
    for index in range(3):
        part = shard_part(ranges, index)
        assert part is not None
        shard = load_transformers_model(untied6_model_dir, config, torch.float32, part)
        own = sum(b for name, b in stored.items() if shard_tensor_name(name, part, False))
        assert parameter_bytes(shard) == own
        assert not any(t.is_meta for t in [*shard.parameters(), *shard.buffers()])
        shards.append(shard.eval())
    assert config.num_hidden_layers == 6  # each shard cut a copy of it
    assert "loads the whole model" not in caplog.text  # built cut, not loaded whole
    positions = torch.arange(TOKENS.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        hidden = shards[0].get_decoder()(input_ids=TOKENS, position_ids=positions)
        hidden = shards[1].get_decoder()(
            inputs_embeds=hidden.last_hidden_state, position_ids=positions
        )
        logits = shards[2](inputs_embeds=hidden.last_hidden_state, position_ids=positions).logits
        assert torch.allclose(logits, whole.eval()(TOKENS).logits, atol=1e-5)
