"""Tests of stages/execute/prompt_scores.py through the model runner: prompt logprobs equal
HF's log-softmax of the same model over the prompt, whole, chunked (down to one-token chunks,
which take the decode path), after a prefix-cache fill of the same prompt, and across
preemption; requests that did not ask get nothing and cost no extra row."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from stages.execute.prompt_scores import PromptScores, prompt_rows
from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest, Logprobs, StepResult
from stages.params import SamplingParams
from tests.stages.execute.driving import DriveReport, drive
from tests.stages.execute.test_runner import load_runner, random_prompts

TOP = 3
SCORED = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP)
PLAIN = SamplingParams(max_tokens=3, temperature=0.0)


class HFScores:
    """HF's log-softmax over a prompt's positions, of the plain HF model."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def __call__(self, prompt: Sequence[int]) -> torch.Tensor:
        """``[len(prompt) - 1, V]``: row i is the distribution of token i + 1."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([list(prompt)])).logits[0].float()
        return logits[:-1].log_softmax(dim=-1)


@pytest.fixture(scope="module")
def hf_scores(tiny_model_dir: Path) -> HFScores:
    return HFScores(tiny_model_dir)


def emitted(results: Sequence[StepResult]) -> dict[str, list[tuple[Logprobs, ...]]]:
    """Every request's prompt logprobs as the steps sent them (each emission kept)."""
    sent: dict[str, list[tuple[Logprobs, ...]]] = {}
    for result in results:
        for request_id, entries in result.prompt_logprobs.items():
            sent.setdefault(request_id, []).append(entries)
    return sent


def assert_matches_hf(entries: Sequence[Logprobs], prompt: list[int], hf: HFScores) -> None:
    expected = hf(prompt)  # [P - 1, V]
    assert [entry.token_id for entry in entries] == prompt[1:]
    for position, entry in enumerate(entries):
        row = expected[position]
        token_logprob = row[prompt[position + 1]]
        assert entry.logprob == pytest.approx(token_logprob.item(), abs=1e-4)
        # the rank counts the tokens at least as likely: exact up to float noise between two
        # correct implementations, where other tokens lie within it of this one
        above = int((row > token_logprob + 1e-4).sum())
        assert above + 1 <= entry.rank <= int((row >= token_logprob - 1e-4).sum())
        top = row.topk(TOP)
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        # ids agree where the values are apart by more than float noise
        values = top.values.tolist()
        for index in range(TOP):
            apart = all(abs(values[index] - values[j]) > 1e-4 for j in range(TOP) if j != index)
            if apart:
                assert entry.top_token_ids[index] == top.indices[index].item()


def run(runner: ModelRunner, requests: list[EngineRequest], **how: object) -> DriveReport:
    return drive(runner, requests, **how)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk_size", [1 << 20, 7, 1])
def test_prompt_logprobs_match_hf(
    tiny_model_dir: Path, hf_scores: HFScores, chunk_size: int
) -> None:
    """Whole prefill, chunks of 7 (a prompt over several steps) and chunks of 1 (every prompt
    row a one-token chunk, the decode path's shape), batched with a request that asked for
    nothing."""
    prompts = random_prompts((1, 2, 9, 40), seed=11)
    requests = [EngineRequest(f"s{i}", tuple(p), SCORED) for i, p in enumerate(prompts)]
    requests.append(EngineRequest("plain", tuple(prompts[3]), PLAIN))
    runner = load_runner(tiny_model_dir, num_blocks=64, enable_prefix_caching=False)
    report = run(runner, requests, chunk_size=chunk_size)
    sent = emitted(report.results)
    assert "plain" not in sent
    for index, prompt in enumerate(prompts):
        (entries,) = sent[f"s{index}"]  # once, with the first token
        assert_matches_hf(entries, prompt, hf_scores)
    if chunk_size == 7:
        assert any(c.start > 0 for step in report.steps for c in step.chunks if c.num_tokens > 1)
    # the request that asked for nothing still generates what it would alone
    alone = run(
        load_runner(tiny_model_dir, num_blocks=64, enable_prefix_caching=False),
        [EngineRequest("plain", tuple(prompts[3]), PLAIN)],
    )
    assert report.outputs["plain"] == alone.outputs["plain"]


def test_a_cached_prompt_is_scored_whole(tiny_model_dir: Path, hf_scores: HFScores) -> None:
    """The same prompt twice: the second, asking for prompt logprobs, takes no prefix-cache
    hit (as vLLM v1) and scores every token; a third, asking for nothing, hits the cache its
    blocks are in."""
    prompt = random_prompts((70,), seed=12)[0]
    runner = load_runner(tiny_model_dir, num_blocks=64)
    first = run(runner, [EngineRequest("fill", tuple(prompt), PLAIN)])
    assert first.cached_tokens == {"fill": 0}
    scored = run(runner, [EngineRequest("scored", tuple(prompt), SCORED)], chunk_size=16)
    assert scored.cached_tokens.get("scored", 0) == 0
    (entries,) = emitted(scored.results)["scored"]
    assert_matches_hf(entries, prompt, hf_scores)
    again = run(runner, [EngineRequest("again", tuple(prompt), PLAIN)])
    assert again.cached_tokens == {"again": 64}


def test_preempted_request_sends_its_scores_once(tiny_model_dir: Path, hf_scores: HFScores) -> None:
    prompts = random_prompts((30, 41), seed=13)
    requests = [
        EngineRequest(f"s{i}", tuple(p), SCORED.replace(max_tokens=5))
        for i, p in enumerate(prompts)
    ]
    runner = load_runner(tiny_model_dir, num_blocks=64)
    report = run(runner, requests, chunk_size=8, preempt_after={"s0": 2})
    sent = emitted(report.results)
    for index, prompt in enumerate(prompts):
        (entries,) = sent[f"s{index}"]
        assert_matches_hf(entries, prompt, hf_scores)
    assert len(report.outputs["s0"]) == 5


def test_rows_only_for_owed_positions() -> None:
    """The extra rows of a step: a chunk's positions below the prompt's last that are not
    scored yet, at their packed index; nothing for requests that asked for nothing."""
    scores = PromptScores(tuple(range(10)), num_top=0)
    rows = prompt_rows([(None, 0, 4, 4), (scores, 0, 4, 8)])
    assert rows.packed_rows == (4, 5, 6, 7)
    scores.scored = 4
    rows = prompt_rows([(scores, 4, 10, 6)])  # the last chunk: row 9 samples
    assert rows.packed_rows == (0, 1, 2, 3, 4)
    scores.scored = 9
    assert prompt_rows([(scores, 0, 10, 10)]).packed_rows == ()  # a recompute after preemption
    assert scores.take() == ()
    assert scores.take() is None  # sent once
