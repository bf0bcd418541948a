"""End to end through the memory pipeline (real tokenize, admit, scheduler, execute, stop
check): inputs vLLM accepts are served, and the finish of a request reads as vLLM's."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import LLM, InvalidRequestError, SamplingParams


def test_whitespace_prompts_run_and_vllm_defaults_are_accepted(tiny_llm: LLM) -> None:
    llm = tiny_llm
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([" ", "\n", "\n\n"], greedy, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [3, 3, 3]
    assert all(o.finish_reason == "length" and o.num_prompt_tokens >= 1 for o in outputs)
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate([""], greedy, use_tqdm=False)
    assert caught.value.field == "prompt"
    vllm_defaults = SamplingParams(
        max_tokens=2,
        temperature=0.0,
        stop=None,
        stop_token_ids=None,  # type: ignore[arg-type]
    )
    (output,) = llm.generate(["hello"], vllm_defaults, use_tqdm=False)
    assert len(output.token_ids) <= 2


def test_stop_reason_is_the_stop_token_only_for_stop_token_ids(
    tiny_llm: LLM, tiny_model_dir: Path
) -> None:
    llm = tiny_llm
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (free,) = llm.generate(["Once upon a time"], greedy, use_tqdm=False)
    second = free.token_ids[1]
    # The same run, ended by its second token: once as a stop token id, once as EOS.
    by_id = greedy.replace(stop_token_ids=(second,))
    (stopped,) = llm.generate(["Once upon a time"], by_id, use_tqdm=False)
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", second)
    assert stopped.token_ids == free.token_ids[:2]
    eos_dir_outputs = _with_eos(tiny_model_dir, second)
    assert eos_dir_outputs == ("stop", None, free.token_ids[:2])


def _with_eos(model_dir: Path, eos: int) -> tuple[str | None, object, tuple[int, ...]]:
    """Generate with ``eos`` as the model's EOS id (a copy of the model directory)."""
    import json
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "model"
        shutil.copytree(model_dir, copy)
        for name in ("config.json", "generation_config.json"):
            path = copy / name
            if path.exists():
                data = json.loads(path.read_text())
                data["eos_token_id"] = eos
                path.write_text(json.dumps(data))
        with LLM(str(copy), transport="memory") as llm:
            (output,) = llm.generate(
                ["Once upon a time"], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False
            )
    return output.finish_reason, output.stop_reason, tuple(output.token_ids)
