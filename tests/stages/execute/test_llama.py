"""Tests of stages/execute/llama.py and model_impl.py: actorline's own Llama computes
transformers' logits exactly, loads what transformers saves (tied or not, one file or shards),
serves through the runner without importing transformers, and declines what it does not
implement (which then loads through transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from stages.execute.attention import UnsupportedModelError
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.llama import NativeLlamaForCausalLM, load_native_llama
from stages.execute.model_impl import native_config
from stages.execute.runner import ModelRunner
from tests.conftest import TINY_LLAMA, imported_after
from tests.stages.execute.driving import drive
from tests.stages.execute.test_runner import GREEDY, make_requests, random_prompts

IDS = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2, 77, 88, 99, 1000, 30000, 17, 5]])


def _hf_logits(model_dir: Path, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False, **kwargs).logits


def _native_logits(model_dir: Path, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    config = native_config(model_dir)
    assert config is not None
    model = load_native_llama(model_dir, config, torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=ids, **kwargs).logits  # type: ignore[arg-type]


def _save_tiny(out: Path, **overrides: object) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).save_pretrained(out)
    return out


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_logits_are_transformers_logits(
    which: str, tiny_model_dir: Path, default_model_dir: Path
) -> None:
    model_dir = tiny_model_dir if which == "tiny" else default_model_dir
    assert torch.equal(_native_logits(model_dir, IDS), _hf_logits(model_dir, IDS))
    rows = torch.tensor([3, 11])
    assert torch.equal(
        _native_logits(model_dir, IDS, logits_to_keep=rows),
        _hf_logits(model_dir, IDS, logits_to_keep=rows),
    )


def test_a_bfloat16_checkpoint_keeps_its_dtype_and_transformers_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.bfloat16).save_pretrained(tmp_path)
    config = native_config(tmp_path)
    assert config is not None
    ours = load_native_llama(tmp_path, config, torch.bfloat16).eval()
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        assert torch.equal(
            ours(input_ids=IDS).logits, theirs(input_ids=IDS, use_cache=False).logits
        )


def test_untied_head_with_biases_and_shards(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    config = LlamaConfig(
        **{**TINY_LLAMA, "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    native = native_config(tmp_path)
    assert native is not None
    model = load_native_llama(tmp_path, native, torch.float32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(_native_logits(tmp_path, IDS), _hf_logits(tmp_path, IDS))


def test_qwen2_is_served_with_its_query_key_value_biases(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "head_dim"}
    Qwen2ForCausalLM(Qwen2Config(**fields)).save_pretrained(tmp_path / "full")
    config = native_config(tmp_path / "full")
    assert config is not None and config.qkv_bias and not config.o_bias
    assert torch.equal(_native_logits(tmp_path / "full", IDS), _hf_logits(tmp_path / "full", IDS))
    windowed = Qwen2Config(**fields, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    Qwen2ForCausalLM(windowed).save_pretrained(tmp_path / "windowed")
    assert native_config(tmp_path / "windowed") is None  # transformers' class serves windows


def test_llama3_rope_bands_are_transformers(tmp_path: Path) -> None:
    """Llama 3.1's RoPE scaling (the ``llama3`` type): long wavelengths stretched, short kept,
    those between interpolated, with positions past the original context."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model_dir = _save_tiny(tmp_path, rope_parameters=rope)
    config = native_config(model_dir)
    assert config is not None and config.rope_llama3 == (8.0, 1.0, 4.0, 64.0)
    ids = torch.randint(3, 49152, (1, 200), generator=torch.Generator().manual_seed(3))
    ours, theirs = _native_logits(model_dir, ids), _hf_logits(model_dir, ids)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "RoPE"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
    ],
)
def test_what_it_does_not_implement_loads_through_transformers(
    tmp_path: Path, overrides: dict[str, object], reason: str
) -> None:
    model_dir = _save_tiny(tmp_path, **overrides)
    assert native_config(model_dir) is None
    with pytest.raises(UnsupportedModelError, match="model_impl 'native'"):
        ModelRunner(ExecuteConfig(model=str(model_dir), model_impl="native")).load()
    runner = ModelRunner(ExecuteConfig(model=str(model_dir)))  # auto: transformers' class
    runner.load()
    assert not isinstance(runner.model, NativeLlamaForCausalLM)


def test_other_architectures_and_missing_weights_are_declined(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({**raw, "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    )
    shutil.copy(tiny_model_dir / "model.safetensors", other / "model.safetensors")
    assert native_config(other) is None
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "config.json", bare / "config.json")
    assert native_config(bare) is None  # no safetensors: transformers reads what there is


def test_a_checkpoint_that_disagrees_with_its_config_is_refused(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "intermediate_size": 96}))
    config = native_config(tmp_path)
    assert config is not None
    with pytest.raises(
        ValueError, match=r"mlp\.\w+_proj\.weight. has shape \(\d+, \d+\), the config makes it"
    ):
        load_native_llama(tmp_path, config, torch.float32)


def test_runner_greedy_tokens_match_across_model_impls(tiny_model_dir: Path) -> None:
    prompts = random_prompts((3, 17, 40, 9), seed=5)
    outputs = {}
    for impl in ("native", "transformers"):
        runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), model_impl=impl))
        runner.load()
        assert isinstance(runner.model, NativeLlamaForCausalLM) == (impl == "native")
        outputs[impl] = drive(runner, make_requests(prompts, GREEDY)).outputs
    assert outputs["native"] == outputs["transformers"]


def test_model_impl_is_checked() -> None:
    with pytest.raises(ExecuteConfigError, match="model_impl"):
        ExecuteConfig(model_impl="vllm")


def test_serving_the_default_model_never_imports_transformers() -> None:
    """The engine's side of a cold start (docs/performance.md §3): its modules and a load of
    the default model, in a fresh interpreter, leave transformers unimported."""
    script = (
        "from stages.execute.runner import ModelRunner\n"
        "from stages.execute.config import ExecuteConfig\n"
        "runner = ModelRunner(ExecuteConfig(num_blocks=64))\n"
        "runner.load()\n"
        "assert type(runner.model).__name__ == 'NativeLlamaForCausalLM'\n"
    )
    assert imported_after(script, ["transformers"]) == []


def test_the_frontends_stage_classes_do_not_import_torch() -> None:
    """Building the default pipeline's graph (the frontend imports every stage class) imports
    neither torch nor transformers' modeling code."""
    script = (
        "from pipeline.engine.options import EngineOptions\n"
        "from pipeline.engine.presets import llm_pipeline, engine_preload\n"
        "llm_pipeline(EngineOptions())\n"
        "assert 'transformers' not in ' '.join(engine_preload('smollm2-135m'))\n"
    )
    assert imported_after(script, ["torch", "transformers"]) == []
