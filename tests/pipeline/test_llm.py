"""The synchronous LLM wrapper, on the real default model and on the tiny one."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import LLM, InvalidRequestError, SamplingParams


@pytest.mark.slow
@pytest.mark.model
def test_default_model_knows_the_capital_of_france() -> None:
    with LLM("smollm2-135m") as llm:
        (output,) = llm.generate(
            [[{"role": "user", "content": "What is the capital of France?"}]],
            SamplingParams(max_tokens=24, temperature=0.0),
        )
    assert "Paris" in output.text, output.text
    assert output.finish_reason in ("stop", "length")


def test_outputs_in_order_with_per_prompt_params(tiny_model_dir: Path) -> None:
    prompts = [f"prompt number {i}" for i in range(10)]
    params = [SamplingParams(max_tokens=i + 1, temperature=0.0, ignore_eos=True) for i in range(10)]
    with LLM(str(tiny_model_dir), transport="memory") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.token_ids) for o in outputs] == list(range(1, 11))
        assert all(o.finish_reason == "length" for o in outputs)
        # one SamplingParams for all; a single prompt string gives a list of one
        (single,) = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0.0))
        assert single.finish_reason in ("stop", "length")
        with pytest.raises(InvalidRequestError, match="3 SamplingParams for 10 prompts"):
            llm.generate(prompts, params[:3])
        with pytest.raises(InvalidRequestError):
            llm.generate(["fine", ""], SamplingParams(max_tokens=2))
        # still serving after bad input
        assert len(llm.generate(["again"], SamplingParams(max_tokens=2))[0].token_ids) <= 2
