"""Pipeline x tensor parallelism with real processes: each pipeline shard a tensor-parallel
group of spawned ranks (gloo all-reduces inside a shard, the hidden state over ZeroMQ between
shards), docs/parallelism.md.

- the graph: every shard's rank 0 feeds its own ranks;
- a 6-layer tiny Llama at PP=2 x TP=2 gives the greedy tokens of one engine (prefix caching
  and preemption at work);
- a killed rank of shard 1, and a hung one (after ``tensor_parallel_timeout``), fail every
  pending request with EngineDeadError in bounded time and leave no process behind;
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pipeline import AsyncEngine, EngineDeadError
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline
from tests.processes import process_alive
from tests.stages.execute.test_pipeline_parallel import (
    PROMPTLY,
    PROMPTS,
    SILENCE,
    generate_all,
    run,
)
from tests.stages.execute.test_tensor_parallel import fails_every_request

T = TypeVar("T")

#: how soon every request must fail once a rank is SIGKILLed (the runtime sees its process
#: exit at once; the rest is the teardown of 4 processes on a loaded 2-core machine)
KILLED_RANK_SECONDS = 30.0
#: tensor_parallel_timeout of the hung-rank test, and how long past it the requests may take
HANG_TIMEOUT = 2.0
HANG_MARGIN = 15.0


async def outputs_of(
    model: str, prompts: list[str] = PROMPTS, **options: Any
) -> tuple[list[tuple[int, ...]], Any]:
    """Greedy outputs of ``prompts`` (the first alone first, so the rest hit its prefix)."""
    async with AsyncEngine(model, **SILENCE, **options) as engine:
        first = await generate_all(engine, prompts[:1])
        rest = await generate_all(engine, prompts[1:])
        return first + rest, engine.stats


def test_the_graph_gives_every_shard_its_own_tensor_parallel_ranks() -> None:
    text = llm_pipeline(EngineOptions(pipeline_parallel_size=2, tensor_parallel_size=3)).describe()
    for rank in (1, 2):
        assert f"stage execute_tp{rank} [TensorParallelRankStage] on engine_tp{rank}" in text
        assert (
            f"stage execute_pp1_tp{rank} [TensorParallelRankStage] on engine_pp1_tp{rank}" in text
        )
        assert f"execute.ranks -> execute_tp{rank}.in" in text
        assert f"execute_pp1.ranks -> execute_pp1_tp{rank}.in" in text
    assert "execute_pp1.out -> execute.in" in text


@pytest.mark.slow
@pytest.mark.timeout(900)  # 1 + 4 processes, twice, on the shared 2-core machine
def test_pp2_by_tp2_gives_the_greedy_tokens_of_one_engine_and_a_killed_rank_fails_all(
    tiny6_model_dir: Path, tiny6_one_engine: Callable[[str | None], list[tuple[int, ...]]]
) -> None:
    """Two PP=2 x TP=2 engine starts for three checks: with several steps in flight (the
    default micro-batches) every rank of each shard runs them and the tokens are one engine's;
    then on that engine a SIGKILLed rank of shard 1 fails every pending request (the runtime
    sees the host exit at once; formerly test_a_killed_or_hung_rank_of_shard_1_fails_every_
    pending_request[killed]); and one step at a time with a cache too small for all of them at
    once, requests are preempted and recomputed and the tokens are still one engine's."""
    model = str(tiny6_model_dir)
    expected = tiny6_one_engine(None)  # PROMPTS on one engine, as outputs_of computes them

    async def in_flight(engine: AsyncEngine) -> None:
        first = await generate_all(engine, PROMPTS[:1])
        rest = await generate_all(engine, PROMPTS[1:])
        assert first + rest == expected
        assert engine.stats is not None and engine.stats.communication_seconds > 0

    run(a_rank_of_shard_1_fails_all(model, "SIGKILL", first=in_flight))
    # one step at a time and a cache too small for all of them at once: requests are
    # preempted and recomputed (with steps in flight a request that does not fit waits)
    got, stats = run(
        outputs_of(
            model,
            num_blocks=14,
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
            pipeline_parallel_micro_batches=1,
        )
    )
    assert got == expected
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.communication_seconds > 0


async def a_rank_of_shard_1_fails_all(
    model: str,
    signal_name: str,
    first: Callable[[AsyncEngine], Awaitable[None]] | None = None,
    **options: Any,
) -> None:
    """Start a PP=2 x TP=2 engine of ``model`` (a cache of 512 blocks, ``options`` besides),
    run ``first`` on it, then signal shard 1's rank 1.
    SIGKILL: the runtime sees the host exit at once. SIGSTOP (the engine's
    ``tensor_parallel_timeout`` HANG_TIMEOUT): the shard's rank 0 waits in an all-reduce until
    the timeout, then its stage fails the engine. Either way every pending request fails with
    EngineDeadError in bounded time, closing is prompt and leaves no process behind."""
    engine = AsyncEngine(
        model,
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        num_blocks=512,
        **SILENCE,
        **options,
    )
    await engine.start()
    pids = dict(engine.running.pids)
    try:
        if first is not None:
            await first(engine)
        assert set(pids) >= {"engine", "engine_tp1", "engine_pp1", "engine_pp1_tp1"}, pids
        pid = pids["engine_pp1_tp1"]
        assert pid is not None
        took = await fails_every_request(
            engine, lambda: os.kill(pid, getattr(signal, signal_name)), streams=3
        )
        assert isinstance(engine.failure, EngineDeadError)
        if signal_name == "SIGSTOP":
            assert "tensor-parallel all-reduce failed" in str(engine.failure)
            assert took <= HANG_TIMEOUT + HANG_MARGIN, took
        else:
            assert took < KILLED_RANK_SECONDS, took
        closing = time.monotonic()
    finally:
        await engine.close()
    assert time.monotonic() - closing < PROMPTLY
    assert not any(process_alive(pid) for pid in pids.values() if pid is not None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hung_rank_of_shard_1_fails_every_pending_request(tiny6_model_dir: Path) -> None:
    """SIGSTOP: the shard's rank 0 waits in an all-reduce until ``tensor_parallel_timeout``,
    then its stage fails the engine; closing is prompt and leaves no process behind. (The
    killed rank: test_pp2_by_tp2_gives_the_greedy_tokens_of_one_engine_and_a_killed_rank_...)"""
    run(
        a_rank_of_shard_1_fails_all(
            str(tiny6_model_dir), "SIGSTOP", tensor_parallel_timeout=HANG_TIMEOUT
        )
    )
