"""Pipeline parallelism with data parallelism (docs/parallelism.md, "Pipeline parallelism"):
each replica its own chain of shards (hosts ``<replica's engine host>_pp<k>``), all of a
replica's hosts one replica of the router's set. The 6-layer tiny Llama at DP=2 x PP=2 gives
the greedy tokens of one engine on both replicas; a killed shard of one replica is a dead
replica: its requests fail with EngineDeadError in bounded time, the other replica's streams
go on, and new requests are served by the survivor; nothing is left behind once closed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import AsyncEngine, EngineDeadError, SamplingParams
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline
from stages.route import RouterStage
from tests.processes import process_alive
from tests.stages.execute.test_pipeline_parallel import (
    KILLED_SHARD_SECONDS,
    PROMPTLY,
    PROMPTS,
    SILENCE,
    generate_all,
    run,
)


def test_each_replica_gets_its_own_chain_of_shards() -> None:
    pipeline = llm_pipeline(EngineOptions(pipeline_parallel_size=3, data_parallel_size=2))
    text = pipeline.describe()
    for replica, host in (("", "engine"), ("_1", "engine_1")):
        assert f"stage execute{replica}_pp1 [PipelineShardStage] on {host}_pp1" in text
        assert f"execute{replica}.pipeline -> execute{replica}_pp1.in" in text
        assert f"execute{replica}_pp2.out -> execute{replica}.in" in text
    # a shard's death is its replica's: the router's set holds every host of the chain
    (engines,) = pipeline.replica_sets.values()
    assert engines.hosts("0") == ("engine", "engine_pp1", "engine_pp2")
    assert engines.hosts("1") == ("engine_1", "engine_1_pp1", "engine_1_pp2")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp2_pp2_gives_one_engines_tokens_and_a_killed_shard_is_a_dead_replica(
    tiny6_model_dir: Path, tiny6_one_engine: Callable[[str | None], list[tuple[int, ...]]]
) -> None:
    model = str(tiny6_model_dir)
    expected = tiny6_one_engine(None)  # PROMPTS' greedy tokens on one engine

    async def body() -> None:
        engine = AsyncEngine(
            model,
            num_blocks=256,
            data_parallel_size=2,
            pipeline_parallel_size=2,
            router="round-robin",  # both replicas get streams, whatever their prefixes
            **SILENCE,
        )
        await engine.start()
        pids = dict(engine.running.pids)
        try:
            assert set(pids) >= {"engine", "engine_pp1", "engine_1", "engine_1_pp1"}
            assert await generate_all(engine, PROMPTS) == expected
            router = engine.running.stage("router")
            assert isinstance(router, RouterStage)
            assert {replica for _, replica in router.recent} == {"0", "1"}

            long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
            prompts = PROMPTS[:4]
            started = {prompt: asyncio.Event() for prompt in prompts}

            async def stream(prompt: str) -> BaseException | None:
                try:
                    async for _ in engine.generate(prompt, long, request_id=prompt):
                        started[prompt].set()
                except EngineDeadError as error:
                    return error
                return None

            tasks = {prompt: asyncio.create_task(stream(prompt)) for prompt in prompts}
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), PROMPTLY)
            placed = {rid.partition("#")[0]: replica for rid, replica in router.recent}
            victims = [prompt for prompt in prompts if placed[prompt] == "1"]
            assert victims and len(victims) < len(prompts), placed
            shard = pids["engine_1_pp1"]
            assert shard is not None
            os.kill(shard, signal.SIGKILL)
            killed = time.monotonic()
            for prompt in victims:
                error = await asyncio.wait_for(tasks[prompt], PROMPTLY)
                assert isinstance(error, EngineDeadError), error
            assert time.monotonic() - killed < KILLED_SHARD_SECONDS
            # the other replica serves on: its streams run, new requests get one engine's tokens
            assert engine.failure is None
            assert not any(tasks[p].done() for p in prompts if p not in victims)
            assert await generate_all(engine, PROMPTS[4:]) == expected[4:]
            for prompt in prompts:
                if prompt not in victims:
                    tasks[prompt].cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        finally:
            await engine.close()
        assert not any(process_alive(pid) for pid in pids.values() if pid is not None)

    run(body())
