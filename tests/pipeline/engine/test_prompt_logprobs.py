"""vLLM's ``prompt_logprobs`` through the whole engine (the Python API): ``RequestOutput``'s
``prompt_logprobs`` is None first, then HF's log-softmax of the same model at each prompt
position, with a prompt split over several steps (a small ``max_num_batched_tokens``), with
the same prompt already in the prefix cache, and on the default model (slow); a bad value is
refused naming the field."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import LLM, InvalidRequestError, SamplingParams
from stages.messages import Logprobs, RequestOutput

TOP = 2


@functools.lru_cache(maxsize=2)
def _hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(model_dir: Path, prompt: Sequence[int]) -> torch.Tensor:
    """``[len(prompt) - 1, V]``: HF's log-softmax of the distribution of each token after
    the first."""
    model = _hf_model(model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt)])).logits[0].float()
    return logits[:-1].log_softmax(dim=-1)


def check_against(
    output: RequestOutput, expected: torch.Tensor, atol: float = 1e-4
) -> list[Logprobs]:
    prompt = list(output.prompt_token_ids)
    scores = output.prompt_logprobs
    assert scores is not None and len(scores) == len(prompt)
    assert scores[0] is None
    entries = [entry for entry in scores[1:] if entry is not None]
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        row = expected[position]
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=atol)
        assert entry.top_logprobs == pytest.approx(row.topk(TOP).values.tolist(), abs=atol)
    return entries


def test_prompt_logprobs_chunked_and_cached(tiny_model_dir: Path) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 4
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    with LLM(
        str(tiny_model_dir), transport="memory", max_num_batched_tokens=16, num_blocks=64
    ) as llm:
        (plain,) = llm.generate([text], SamplingParams(max_tokens=2, temperature=0.0))
        assert plain.prompt_logprobs is None
        assert len(plain.prompt_token_ids) > 32  # over two steps of 16
        # the same prompt again: its blocks are in the prefix cache, and not taken
        (first,) = llm.generate([text], params)
        (second,) = llm.generate([text], params)
        assert first.num_cached_tokens == second.num_cached_tokens == 0
        expected = hf_logprobs(tiny_model_dir, first.prompt_token_ids)
        assert check_against(first, expected) == check_against(second, expected)
        assert first.token_ids == plain.token_ids  # scoring changes nothing generated
        (after,) = llm.generate([text], SamplingParams(max_tokens=2, temperature=0.0))
        assert after.num_cached_tokens > 0  # the others still hit


def test_prompt_logprobs_refused_out_of_range(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), transport="memory", num_blocks=32) as llm:
        for value, words in ((21, "prompt_logprobs"), (-2, "prompt_logprobs"),
                             (-1, "whole vocabulary")):  # fmt: skip
            with pytest.raises(InvalidRequestError, match=words) as caught:
                llm.generate(["Hi"], SamplingParams(max_tokens=1, prompt_logprobs=value))
            assert caught.value.field == "prompt_logprobs"


@pytest.mark.slow
@pytest.mark.model
def test_prompt_logprobs_of_the_default_model(default_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    with LLM("smollm2-135m", transport="memory", max_num_batched_tokens=8) as llm:
        (output,) = llm.generate(["Paris is the capital of France, and Rome"], params)
    check_against(output, hf_logprobs(default_model_dir, output.prompt_token_ids), atol=2e-3)
