"""Speculative decoding with tensor and data parallelism, real processes (docs/speculative.md):

- TP=2 (two gloo ranks), the n-gram proposer or a draft model (beside rank 0 or on a host of
  its own, unsharded): rank 0 samples and verifies, both ranks run the drafted rows of every
  step and the same block tables (rank 0 truncates them after a rejection, the next step's
  ShardStep carries the truncated ones), so greedy outputs equal those without speculation,
  also through preemptions, and a seeded sampled run equals TP=1's speculative one; the
  counters equal TP=1's;
- DP=2: each replica's scheduler drafts for its own requests; greedy outputs equal those
  without speculation and the engine's counters are the sum over both replicas (equal to
  one engine's over the same requests: a greedy request's drafts do not depend on its
  neighbours).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pipeline import AsyncEngine, SamplingParams
from tests.pipeline.engine.test_speculative import PROMPTS
from tests.pipeline.engine.test_speculative import SPEC as DRAFT_4

T = TypeVar("T")

# k 3: the four prompts' drafted steps stay within one step graph pass (16 rows) at TP=1 and
# are not cut there, as TP=2 (no step graph) does not cut them, so both draft alike
# (docs/speculative.md, "Within one step graph pass")
SPEC = {**DRAFT_4, "num_speculative_tokens": 3}

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
#: seeded temperature > 0: the drafts are verified by rejection sampling on rank 0
SEEDED = [
    SamplingParams(max_tokens=24, temperature=0.8, top_k=3, seed=seed, ignore_eos=True)
    for seed in (11, 12, 13, 14)
]


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 600) -> T:
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def batches_of(
    model: Path, batches: list[list[SamplingParams]], **options: Any
) -> tuple[list[tuple[list[tuple[int, ...]], Any]], list[str]]:
    """On one engine, for each batch of params, one after the other: each of PROMPTS with its
    params, all at once. Each batch's token ids and the engine's stats after it (cumulative),
    and (data parallelism) the replica each request was routed to."""
    options.setdefault("num_blocks", 256)
    async with AsyncEngine(str(model), **options) as engine:

        async def one(batch: int, params: SamplingParams, index: int) -> tuple[int, ...]:
            last = None
            async for output in engine.generate(
                {"prompt_token_ids": PROMPTS[index]},
                params,
                request_id=f"r{index}" if batch == 0 else f"b{batch}r{index}",
            ):
                last = output
            assert last is not None and last.finish_reason == "length"
            return tuple(last.token_ids)

        results = []
        for number, params in enumerate(batches):
            outputs = list(
                await asyncio.gather(*(one(number, params[i], i) for i in range(len(PROMPTS))))
            )
            results.append((outputs, engine.stats))
        replicas: list[str] = []
        if options.get("data_parallel_size", 1) > 1:
            router = engine.running.stage("router")
            replicas = [str(replica) for _, replica in router.recent]
        return results, replicas


async def outputs_of(
    model: Path, params: list[SamplingParams], **options: Any
) -> tuple[list[tuple[int, ...]], Any, list[str]]:
    """Each of PROMPTS with its params, all at once: the token ids, the engine's stats and
    (data parallelism) the replica each request was routed to."""
    ((outputs, stats),), replicas = await batches_of(model, [params], **options)
    return outputs, stats, replicas


@pytest.fixture(scope="module")
def tp2_plain(tiny_model_dir: Path) -> list[tuple[int, ...]]:
    """TP=2 greedy without speculation: the reference both TP=2 tests compare with (one
    engine start for the module instead of one per test)."""
    plain, _, _ = run(outputs_of(tiny_model_dir, [GREEDY] * len(PROMPTS), tensor_parallel_size=2))
    return plain


@pytest.fixture(scope="module")
def tp1_spec(tiny_model_dir: Path) -> tuple[list[tuple[int, ...]], Any, list[tuple[int, ...]]]:
    """TP=1 (memory) with SPEC, one engine: greedy (outputs and stats, shared by the TP=2 and
    DP=2 tests), then SEEDED (outputs)."""
    ((greedy, stats), (seeded, _)), _ = run(
        batches_of(
            tiny_model_dir,
            [[GREEDY] * len(PROMPTS), SEEDED],
            transport="memory",
            speculative_config=SPEC,
        )
    )
    return greedy, stats, seeded


def _counters(stats: Any) -> tuple[int, int, int, tuple[int, ...]]:
    return (
        stats.spec_num_drafts,
        stats.spec_num_draft_tokens,
        stats.spec_num_accepted_tokens,
        tuple(stats.spec_accepted_per_position),
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_verifies_drafts_together_greedy_and_seeded(
    tiny_model_dir: Path,
    tp2_plain: list[tuple[int, ...]],
    tp1_spec: tuple[list[tuple[int, ...]], Any, list[tuple[int, ...]]],
) -> None:
    greedy = [GREEDY] * len(PROMPTS)
    plain = tp2_plain
    # one engine: greedy, then seeded (temperature > 0) on the same engine
    ((spec, stats), (sampled, sampled_stats)), _ = run(
        batches_of(
            tiny_model_dir, [greedy, SEEDED], tensor_parallel_size=2, speculative_config=SPEC
        )
    )
    assert spec == plain
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # roll-backs too
    assert stats.communication_seconds > 0
    one_rank, one_stats, expected = tp1_spec
    assert one_rank == spec
    assert _counters(one_stats) == _counters(stats)
    # temperature > 0, seeded: rank 0 draws from each request's own generator, as at TP=1
    # (both engines ran the greedy batch first)
    assert sampled == expected
    assert sampled_stats.spec_num_drafts > stats.spec_num_drafts
    # 8 blocks of 16 tokens do not hold the four at once: preempted mid-run and recomputed
    tight, tight_stats, _ = run(
        outputs_of(
            tiny_model_dir, greedy, tensor_parallel_size=2, speculative_config=SPEC,
            num_blocks=8, block_size=16,
        )
    )  # fmt: skip
    assert tight == plain
    assert tight_stats.num_preemptions > 0
    assert tight_stats.spec_num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_verifies_a_draft_models_drafts_together_in_either_placement(
    tiny_model_dir: Path, tp2_plain: list[tuple[int, ...]]
) -> None:
    # the draft model (the tiny model drafting for itself) runs unsharded, beside rank 0 or on
    # a host of its own; the ranks verify its drafted rows together
    greedy = [GREEDY] * len(PROMPTS)
    plain = tp2_plain
    for placement in ("engine", "host"):
        draft = {
            "method": "draft_model",
            "model": str(tiny_model_dir),
            "num_speculative_tokens": 3,
            "disable_by_batch_size": 256,
            "placement": placement,
        }
        if placement == "host":
            draft["draft_timeout"] = 60  # a bound a loaded machine always meets
        spec, stats, _ = run(
            outputs_of(tiny_model_dir, greedy, tensor_parallel_size=2, speculative_config=draft)
        )
        assert spec == plain, placement
        assert stats.spec_num_drafts > 0, placement
        assert stats.spec_num_accepted_tokens > 0, placement
        assert stats.spec_num_drafts_dropped == 0, placement


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp2_drafts_on_each_replica_and_sums_the_counters(
    tiny_model_dir: Path, tp1_spec: tuple[list[tuple[int, ...]], Any, list[tuple[int, ...]]]
) -> None:
    greedy = [GREEDY] * len(PROMPTS)
    plain, _, _ = run(outputs_of(tiny_model_dir, greedy, transport="memory"))
    one, one_stats, _ = tp1_spec
    spec, stats, replicas = run(
        outputs_of(tiny_model_dir, greedy, data_parallel_size=2, speculative_config=SPEC)
    )
    assert sorted(set(replicas)) == ["0", "1"], replicas  # both replicas served requests
    assert spec == plain == one
    assert stats.spec_num_drafts > 0
    assert _counters(stats) == _counters(one_stats)
