"""benchmarks/spec_replay.py: the scheduler's speculator replayed over greedy answers counts
the steps a drafted decode takes (exact, no timing), and a quick run answers real prompts with
the tiny model; benchmarks/spec_miss_cost.py: drafts that all miss, on real tiny-model steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.spec_replay import ReplayConfig, format_replay, replay, run_replay
from stages.speculative import SpeculativeConfig

K2 = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2)


def test_a_copied_answer_takes_fewer_steps_and_every_token_is_counted() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    # the answer copies the prompt from 3 on; the first token comes from the prompt's pass
    answer = [3, 4, 5, 6, 7, 8]
    result = replay(K2, prompt, answer)
    # step 1: tokens ...8, 3 -> the 2-gram (8, 3) occurred nowhere: 1 token (4)
    # step 2: suffix (3, 4) matched -> draft (5, 6), both accepted, + 7
    # step 3: one token left: no draft (max_tokens left - 1 = 0), 8
    assert (result.tokens, result.steps, result.drafted_steps) == (5, 3, 1)
    assert (result.draft_tokens, result.accepted_tokens) == (2, 2)
    assert result.bound == pytest.approx(5 / 3)
    assert result.estimate(0.0) == pytest.approx(5 / 3)
    assert result.estimate(1.0) == pytest.approx(1.0)  # a drafted row as dear as a step


def test_misses_back_off_as_the_scheduler_does() -> None:
    prompt = [9, 1, 2, 7] * 4
    # (1, 2) is followed by a new token every time: every draft misses
    answer = [token for index in range(12) for token in (1, 2, 100 + index)]
    result = replay(K2, prompt, answer)
    assert result.accepted_tokens == 0 and result.tokens == len(answer) - 1
    assert result.steps == result.tokens  # nothing gained
    # (1, 2) recurs every third token: drafts there, then one free miss and skips 1, 3, ...
    assert 0 < result.drafted_steps < result.tokens // 3


def test_the_config_refuses_what_it_cannot_replay() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ReplayConfig(())
    with pytest.raises(ValueError, match="not draft_model"):
        ReplayConfig(('{"model": "smollm2-135m", "num_speculative_tokens": 2}',))
    with pytest.raises(ValueError, match="prompts"):
        ReplayConfig(('{"num_speculative_tokens": 2}',), prompts="poems")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ReplayConfig(("{}",))


@pytest.mark.slow
def test_quick_run_answers_the_latency_benchs_copy_prompts(tiny_model_dir: Path) -> None:
    config = ReplayConfig(
        ('{"num_speculative_tokens": 3}', '{"num_speculative_tokens": 3, "prompt_lookup_min": 5}'),
        count=2,
        tokens=24,
        model=str(tiny_model_dir),
    )
    result = run_replay(config)
    assert result["count"] == 2 and len(result["rows"]) == 2
    for row in result["rows"]:
        assert row["tokens"] == 2 * 23 and 0 < row["steps"] <= row["tokens"]
        assert row["bound"] == pytest.approx(row["tokens"] / row["steps"])
        assert len(row["per_prompt"]) == 2
    assert "steps for 46 tokens" in format_replay(result)


@pytest.mark.slow
def test_the_miss_cost_quick_run_drafts_where_the_back_off_lets_and_accepts_nothing(
    tiny_model_dir: Path,
) -> None:
    """benchmarks/spec_miss_cost.py on the tiny model: its drafts are all rejected, the
    back-off lets the first two of every round through (one free miss, then a skip of 1), and
    both variants' rounds are timed."""
    from benchmarks.spec_miss_cost import MissCostConfig, format_miss_cost, run_miss_cost

    result = run_miss_cost(
        MissCostConfig(model=str(tiny_model_dir), dtype="float32", steps=10, rounds=2, k=3)
    )
    assert result["accepted_tokens"] == 0
    # steps 1, 2, 4 and 8 of each round draft (free miss, then skips of 1 and 3)
    assert result["drafted_steps"] == 2 * 4
    assert all(len(rounds) == 2 and min(rounds) > 0 for rounds in result["seconds"].values())
    assert result["ratio_best"] > 0 and "drafted steps" in format_miss_cost(result)
    assert result["one_row_step_ms"] > 0 and result["drafted_step_ms"] > 0
    assert result["ratio_from_steps"] > 0
    with pytest.raises(ValueError, match="must be >= 1"):
        MissCostConfig(steps=0)
