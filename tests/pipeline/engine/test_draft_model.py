"""Speculative decoding with a draft model end to end (docs/speculative.md): the execute
stage's drafter proposes, the target verifies; outputs are token-identical to decoding
without it (a tiny model drafting for itself, another tiny model drafting for it, and the
default model's Q4_1 GGUF drafting for its fp32 self), sampling keeps the target's
distribution, and aborts, max_tokens and preemption stay exact mid-draft."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline import LLM
from stages.params import SamplingParams
from tests.conftest import TINY_LLAMA
from tests.pipeline.engine.test_speculative import (
    PROMPTS,
    check_an_abort_mid_draft,
    check_same_distribution,
    generate_with,
    sampled,
)


def _spec(model: Path | str, k: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "method": "draft_model",
        "model": str(model),
        "num_speculative_tokens": k,
        "disable_by_batch_size": 256,
        **extra,
    }


@pytest.fixture(scope="module")
def other_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Another tiny random Llama (one layer, another seed) on the same tokenizer: a draft
    model that mostly disagrees with the target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-draft")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 1})).save_pretrained(out)
    for name in tiny_model_dir.iterdir():
        if not name.name.startswith(("model", "config", "generation_config")):
            shutil.copy(name, out / name.name)
    return out


@pytest.mark.slow
def test_greedy_outputs_identical_with_a_draft_model(
    tiny_model_dir: Path, other_tiny_model_dir: Path, plain_outputs: Callable[..., list[Any]]
) -> None:
    # max_tokens cut runs mid-draft (7, 13), the others run long
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 7, 13, 64)
    ]
    plain = plain_outputs(PROMPTS, params, num_blocks=256)  # shared with test_speculative
    spec = _spec(tiny_model_dir)
    with LLM(
        str(tiny_model_dir), transport="memory", num_blocks=256, speculative_config=spec
    ) as llm:
        itself = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        stats, info = llm.engine.stats, llm.engine.info
    # the engine's info reports the draft model's own KV cache, beside the target's (on the
    # engine's host: with transport memory every stage runs on the main host)
    assert info.draft_model == str(tiny_model_dir) and info.draft_host == "main"
    assert info.draft_num_blocks == info.num_blocks == 256
    assert info.draft_kv_cache_bytes == info.kv_cache_bytes > 0
    assert [o.token_ids for o in itself] == [o.token_ids for o in plain]
    assert [o.text for o in itself] == [o.text for o in plain]
    assert [len(o.token_ids) for o in itself] == [40, 7, 13, 64]
    # the model drafting for itself: every draft token is accepted
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    other, stats = generate_with(
        tiny_model_dir, params, num_blocks=256, speculative_config=_spec(other_tiny_model_dir)
    )
    assert [o.token_ids for o in other] == [o.token_ids for o in plain]
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.slow
def test_preemption_and_an_abort_mid_draft_stay_exact(
    tiny_model_dir: Path, plain_outputs: Callable[..., list[Any]]
) -> None:
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    plain = plain_outputs(PROMPTS, params, num_blocks=256)  # shared with test_speculative
    # 12 blocks of 16 tokens cannot hold the four requests at once: some are preempted (their
    # draft blocks freed with the target's), then resumed and drafted for again
    spec, stats = generate_with(
        tiny_model_dir,
        params,
        num_blocks=12,
        block_size=16,
        speculative_config=_spec(tiny_model_dir),
    )
    assert stats.num_preemptions > 0
    assert stats.spec_num_accepted_tokens > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]

    check_an_abort_mid_draft(
        tiny_model_dir, _spec(tiny_model_dir), PROMPTS[3], PROMPTS[0], plain_outputs
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sampling_with_a_draft_model_keeps_the_target_distribution(tiny_model_dir: Path) -> None:
    # The draft is the model's own greedy choice (a point mass): at temperature 1 with top-k 3
    # it is accepted with the target's probability of it, else the residual is sampled.
    prompt = PROMPTS[1]
    count = 400
    plain, _ = sampled(tiny_model_dir, prompt, count)
    spec, stats = sampled(
        tiny_model_dir, prompt, count, speculative_config=_spec(tiny_model_dir, 3)
    )
    check_same_distribution(plain, spec, stats)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_default_models_q4_1_gguf_drafts_for_its_fp32_self() -> None:
    # the default model runs fp32 (dequantized from its GGUF); its own Q4_1 weights, run as
    # they are, draft for it: the outputs are the fp32 model's, most drafts accepted
    messages = [
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
    ]
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    with LLM("smollm2-135m", transport="memory") as llm:
        plain = llm.chat(messages, greedy)
    spec = _spec("smollm2-135m", 4, quantization="gguf")
    with LLM("smollm2-135m", transport="memory", speculative_config=spec) as llm:
        drafted = llm.chat(messages, greedy)
        stats = llm.engine.stats
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.5
