"""Speculative decoding end to end on the tiny random model (docs/speculative.md): the n-gram
proposer drafts, execute verifies in one pass, the scheduler rolls back; greedy outputs are
token-identical to decoding without it, sampling keeps the target's distribution."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import chi2_contingency

from pipeline import LLM
from pipeline.engine.async_engine import AsyncEngine
from stages.params import SamplingParams

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": 256,
}
# prompts that repeat themselves, so drafts get proposed (and the random model's own loops
# make many of them accepted)
PROMPTS = [
    [100, 200, 300, 400, 500, 100, 200, 300, 400, 500, 100, 200],
    [7, 8, 9, 7, 8, 9, 7, 8],
    list(range(1000, 1030)) + list(range(1000, 1010)),
    [42] * 20,
]


def generate_with(
    model: Path, params: list[SamplingParams], **options: Any
) -> tuple[list[Any], Any]:
    with LLM(str(model), transport="memory", **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return outputs, llm.engine.stats


def test_greedy_outputs_identical_with_and_without_speculation(
    tiny_model_dir: Path, plain_outputs: Callable[..., list[Any]]
) -> None:
    # max_tokens cut runs mid-draft (7, 13), the others run long
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 7, 13, 64)
    ]
    plain = plain_outputs(PROMPTS, params, num_blocks=256)  # shared with test_draft_model
    spec, stats = generate_with(tiny_model_dir, params, num_blocks=256, speculative_config=SPEC)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [len(o.token_ids) for o in spec] == [40, 7, 13, 64]
    assert [o.text for o in spec] == [o.text for o in plain]
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stop_strings_cut_a_drafted_run_exactly(tiny_model_dir: Path) -> None:
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(tiny_model_dir), transport="memory", num_blocks=256) as llm:
        plain = llm.generate(prompts, [greedy] * len(PROMPTS))
        # a stop string from the middle of each plain output: the run ends there, tokens
        # after it (maybe accepted in the same step) are dropped
        stops = [o.text[len(o.text) // 2 : len(o.text) // 2 + 3] or "\x00" for o in plain]
        params = [
            SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop])
            for stop in stops
        ]
        expected = llm.generate(prompts, params)
    spec, stats = generate_with(tiny_model_dir, params, num_blocks=256, speculative_config=SPEC)
    assert [(o.text, o.finish_reason) for o in spec] == [
        (o.text, o.finish_reason) for o in expected
    ]
    assert [o.token_ids for o in spec] == [o.token_ids for o in expected]
    assert stats.spec_num_accepted_tokens > 0


@pytest.mark.slow
def test_preemption_mid_run_keeps_greedy_identity(
    tiny_model_dir: Path, plain_outputs: Callable[..., list[Any]]
) -> None:
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    plain = plain_outputs(PROMPTS, params, num_blocks=256)  # shared with test_draft_model
    # 12 blocks of 16 tokens cannot hold the four requests at once: some are preempted
    spec, stats = generate_with(
        tiny_model_dir, params, num_blocks=12, block_size=16, speculative_config=SPEC
    )
    assert stats.num_preemptions > 0
    assert stats.spec_num_accepted_tokens > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_prefix_cache_after_speculation_serves_only_accepted_tokens(tiny_model_dir: Path) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(
        str(tiny_model_dir), transport="memory", num_blocks=256, block_size=4,
        speculative_config=SPEC,
    ) as llm:  # fmt: skip
        first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy)[0]
        # the first answer as the prompt: its blocks were published while drafting
        again = [*PROMPTS[0], *first.token_ids]
        second = llm.generate([{"prompt_token_ids": again}], greedy)[0]
    with LLM(str(tiny_model_dir), transport="memory", num_blocks=256, block_size=4) as llm:
        expected = llm.generate([{"prompt_token_ids": again}], greedy)[0]
    assert second.num_cached_tokens >= 4 * ((len(again) - 1) // 4) - 4
    assert second.token_ids == expected.token_ids


def test_an_abort_mid_run_leaves_the_others_exact(
    tiny_model_dir: Path, plain_outputs: Callable[..., list[Any]]
) -> None:
    check_an_abort_mid_draft(tiny_model_dir, SPEC, PROMPTS[3], PROMPTS[0], plain_outputs)


def check_an_abort_mid_draft(
    model: Path,
    spec: dict[str, Any],
    aborted_prompt: list[int],
    kept_prompt: list[int],
    plain_outputs: Callable[..., list[Any]],
) -> None:
    """A request aborted after 5 tokens, mid-draft, beside one that runs on: the kept one and
    the aborted prompt run again give the greedy tokens of an engine without ``spec``
    (``plain_outputs``, the session's reference: the tiny model, which ``model`` is)."""
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[list[int], list[int]]:
        async with AsyncEngine(
            str(model), transport="memory", num_blocks=64, speculative_config=spec
        ) as engine:

            async def run(prompt: list[int], request_id: str, stop_after: int | None) -> list[int]:
                tokens: list[int] = []
                async for output in engine.generate(
                    {"prompt_token_ids": prompt}, greedy, request_id=request_id
                ):
                    tokens = list(output.token_ids)
                    if stop_after is not None and len(tokens) >= stop_after:
                        await engine.abort(request_id)
                        break
                return tokens

            aborted, kept = await asyncio.gather(
                run(aborted_prompt, "a", 5), run(kept_prompt, "b", None)
            )
            after = await run(aborted_prompt, "c", None)
            assert len(aborted) >= 5
            return kept, after

    kept, after = asyncio.run(main())
    expected = plain_outputs([kept_prompt, aborted_prompt], greedy, num_blocks=64)
    assert kept == list(expected[0].token_ids)
    assert after == list(expected[1].token_ids)


def sampled(model: Path, prompt: list[int], count: int, **options: Any) -> tuple[list[Any], Any]:
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    with LLM(str(model), transport="memory", num_blocks=1024, max_num_seqs=64, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": prompt}] * count, params)
        return [tuple(o.token_ids) for o in outputs], llm.engine.stats


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sampling_keeps_the_target_distribution(tiny_model_dir: Path) -> None:
    # The prompt is the model's own greedy loop, so its sampled tokens mostly occur earlier:
    # drafts are proposed, some accepted, some rejected (the residual distribution sampled).
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model_dir), transport="memory", num_blocks=256) as llm:
        loop = list(llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy)[0].token_ids)
    prompt = [*PROMPTS[1], *loop]
    count = 500
    plain, _ = sampled(tiny_model_dir, prompt, count)
    spec, stats = sampled(tiny_model_dir, prompt, count, speculative_config=SPEC)
    check_same_distribution(plain, spec, stats)


def check_same_distribution(plain: list[Any], spec: list[Any], stats: Any) -> None:
    """Drafts were made, some accepted and some rejected, and at each of the drafted
    positions (2nd to 4th token) the two samples' token counts agree (chi-square)."""
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    for position in (1, 2, 3):
        a = collections.Counter(run[position] for run in plain)
        b = collections.Counter(run[position] for run in spec)
        tokens = sorted(set(a) | set(b))
        table = [[a[t] + 0.5 for t in tokens], [b[t] + 0.5 for t in tokens]]
        if len(tokens) > 1:
            assert chi2_contingency(table).pvalue > 1e-4, (position, a, b)


def test_seeded_sampling_is_reproducible_with_speculation(tiny_model_dir: Path) -> None:
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, top_k=2, seed=seed, ignore_eos=True)
        for seed in (1, 2, 3, 4)
    ]
    first, stats = generate_with(tiny_model_dir, params, num_blocks=256, speculative_config=SPEC)
    second, _ = generate_with(tiny_model_dir, params, num_blocks=256, speculative_config=SPEC)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert stats.spec_num_drafts > 0


def test_requests_the_verifier_cannot_treat_like_decode_rows_do_not_draft(
    tiny_model_dir: Path,
) -> None:
    # logprobs, penalties: decoded one token a step, exactly as without speculation
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, min_tokens=16, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=0.5, ignore_eos=True),
    ]
    plain, _ = generate_with(tiny_model_dir, params, num_blocks=256)
    spec, stats = generate_with(tiny_model_dir, params, num_blocks=256, speculative_config=SPEC)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].logprobs == plain[0].logprobs
    assert stats.spec_num_drafts == 0
