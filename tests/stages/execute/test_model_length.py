"""Tests of stages/execute/model_length.py: models whose RoPE depends on the sequence length
(Phi-3 LongRoPE, dynamic NTK) are served only below their switch point, where batched greedy
outputs equal HF ``generate`` whatever shares the batch."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.admit import validate_request
from stages.errors import PromptTooLongError
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.model_length import (
    RopeLengthLimit,
    resolve_max_model_len,
    rope_length_limit,
)
from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest
from stages.params import SamplingParams
from tests.stages.execute.driving import HFReference, drive

HEAD_DIM = 16
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 32,
    "short_factor": [1.0] * (HEAD_DIM // 2),
    "long_factor": [8.0 + i for i in range(HEAD_DIM // 2)],
}


# ------------------------------------------------------------------------ the limit


# fmt: off
LIMIT_CASES: list[tuple[dict[str, Any], RopeLengthLimit | None]] = [
    # Phi-3 128k as saved by older transformers: rope_scaling, top-level original length.
    (
        {
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
        },
        RopeLengthLimit("longrope", 4096, "original_max_position_embeddings"),
    ),
    # transformers 5: rope_parameters; the top-level field still wins (as Phi-3's does).
    (
        {
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "longrope",
                "original_max_position_embeddings": 8192,
            },
        },
        RopeLengthLimit("longrope", 4096, "original_max_position_embeddings"),
    ),
    (
        {
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "longrope",
                "original_max_position_embeddings": 8192,
            },
        },
        RopeLengthLimit("longrope", 8192, "original_max_position_embeddings"),
    ),
    (
        {"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "longrope"}},
        RopeLengthLimit("longrope", 2048, "max_position_embeddings"),
    ),
    (
        {"max_position_embeddings": 2048, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        RopeLengthLimit("dynamic", 2048, "max_position_embeddings"),
    ),
    # Per-layer-type RoPE: the strictest layer decides.
    (
        {
            "max_position_embeddings": 8192,
            "rope_parameters": {
                "full_attention": {"rope_type": "dynamic", "factor": 2.0},
                "sliding_attention": {"rope_type": "default"},
            },
        },
        RopeLengthLimit("dynamic", 8192, "max_position_embeddings"),
    ),
    # Frequencies that never change with the length.
    ({"max_position_embeddings": 2048}, None),
    ({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default"}}, None),
    ({"max_position_embeddings": 2048, "rope_scaling": {"type": "linear", "factor": 2}}, None),
    ({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "llama3"}}, None),
    ({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "yarn"}}, None),
]
# fmt: on


@pytest.mark.parametrize(("config", "expected"), LIMIT_CASES)
def test_rope_length_limit_mirrors_transformers(
    config: dict[str, Any], expected: RopeLengthLimit | None
) -> None:
    assert rope_length_limit(config) == expected


def test_hf_config_objects_give_the_same_limit() -> None:
    from transformers import LlamaConfig, Phi3Config

    phi3 = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=32,
        rope_parameters=dict(LONGROPE),
    )
    assert rope_length_limit(phi3) == RopeLengthLimit(
        "longrope", 32, "original_max_position_embeddings"
    )
    llama = LlamaConfig(max_position_embeddings=64, rope_scaling={"type": "dynamic", "factor": 4.0})
    assert rope_length_limit(llama) == RopeLengthLimit("dynamic", 64, "max_position_embeddings")
    assert rope_length_limit(LlamaConfig(max_position_embeddings=64)) is None


def test_the_default_length_is_capped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    config = {"max_position_embeddings": 512, "rope_parameters": dict(LONGROPE)}
    with caplog.at_level(logging.WARNING, logger="actorline.execute"):
        assert resolve_max_model_len(None, config, cache_tokens=1024) == 32
    (record,) = caplog.records
    assert "capped at 32" in record.getMessage() and "longrope" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="actorline.execute"):
        assert resolve_max_model_len(None, config, cache_tokens=16) == 16  # the cache binds
        assert resolve_max_model_len(32, config, cache_tokens=1024) == 32
    assert not caplog.records


def test_a_longer_explicit_length_is_refused() -> None:
    config = {"max_position_embeddings": 512, "rope_parameters": dict(LONGROPE)}
    with pytest.raises(ExecuteConfigError, match="original_max_position_embeddings") as caught:
        resolve_max_model_len(33, config, cache_tokens=1024)
    assert caught.value.field == "max_model_len"
    assert "longrope" in str(caught.value) and "packed batch" in str(caught.value)
    with pytest.raises(ExecuteConfigError, match="max_position_embeddings"):
        resolve_max_model_len(600, {"max_position_embeddings": 512}, cache_tokens=1024)
    with pytest.raises(ExecuteConfigError, match="KV cache"):
        resolve_max_model_len(100, {"max_position_embeddings": 512}, cache_tokens=64)


# ------------------------------------------------------------------------ real models


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Phi-3 with LongRoPE switching at 32 positions (model length 512)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    out = tmp_path_factory.mktemp("phi3-longrope")
    config = Phi3Config(
        vocab_size=600,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        original_max_position_embeddings=32,
        rope_parameters=dict(LONGROPE),
        pad_token_id=0,
        eos_token_id=599,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dynamic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with dynamic NTK RoPE (factor 4, model length 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama-dynamic")
    config = LlamaConfig(
        vocab_size=600,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        eos_token_id=599,
        pad_token_id=0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def prompts_of(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 599, (n,), generator=generator).tolist() for n in lengths]


def load(model_dir: Path, **fields: Any) -> ModelRunner:
    runner = ModelRunner(ExecuteConfig(model=str(model_dir), num_blocks=64, **fields))
    runner.load()
    return runner


@pytest.mark.parametrize(
    ("fixture", "limit", "lengths", "max_tokens"),
    [
        ("longrope_dir", 32, (3, 8, 15, 21), 10),
        ("dynamic_dir", 64, (5, 17, 30, 50), 12),
    ],
)
def test_served_below_the_switch_batched_outputs_equal_generate(
    request: pytest.FixtureRequest,
    fixture: str,
    limit: int,
    lengths: tuple[int, ...],
    max_tokens: int,
) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    runner = load(model_dir)
    assert runner.info is not None and runner.info.max_model_len == limit
    prompts = prompts_of(lengths, seed=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    batch = [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(prompts)]
    # The longest request reaches the last position below the switch; all run together.
    assert limit - 2 <= len(prompts[-1]) + max_tokens <= limit
    together = drive(runner, batch)
    assert together.max_requests_per_step == len(prompts)
    reference = HFReference(model_dir)
    expected = {f"r{i}": reference.greedy(p, max_tokens) for i, p in enumerate(prompts)}
    assert together.outputs == expected
    alone = drive(load(model_dir), batch[:1])
    assert alone.outputs["r0"] == together.outputs["r0"]
    # Admit refuses what would cross the switch.
    with pytest.raises(PromptTooLongError):
        validate_request(EngineRequest("long", (5,) * limit, params), runner.info)


@pytest.mark.parametrize(
    ("fixture", "rope_type"), [("longrope_dir", "longrope"), ("dynamic_dir", "dynamic")]
)
def test_a_max_model_len_past_the_switch_is_refused(
    request: pytest.FixtureRequest, fixture: str, rope_type: str
) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    with pytest.raises(ExecuteConfigError, match=rope_type) as caught:
        load(model_dir, max_model_len=100)
    assert caught.value.field == "max_model_len"


def test_the_null_model_reports_the_same_length(longrope_dir: Path, tiny_model_dir: Path) -> None:
    from stages.execute.null import NullRunner
    from stages.tokenize import load_tokenizer

    null = NullRunner(ExecuteConfig(model=str(longrope_dir), num_blocks=64))
    info = null.load(load_tokenizer(str(tiny_model_dir)))
    assert info.max_model_len == 32


def test_the_module_imports_no_torch() -> None:
    """The null model resolves its length with it and runs without torch."""
    import subprocess
    import sys

    probe = "import sys, stages.execute.model_length; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
