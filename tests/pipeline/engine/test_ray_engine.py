"""The LLM engine on a local Ray cluster: two data-parallel replicas whose hosts are Ray
actors (one placement group each) give the greedy tokens of local processes; ``ray.kill`` of
one replica's actor fails only its requests, of the last one every pending request, with
EngineDeadError within 5 s; and once closed the engine leaves no actor and no placement group
in the cluster."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pipeline import AsyncEngine, EngineDeadError, SamplingParams
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import start_options
from stages.router import RouterStage
from tests.pipeline.runtime.test_ray_hosts import pipeline_state
from tests.pipeline.runtime.test_running import run

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [f"Request {index} talks about {topic}" for index, topic in enumerate(
    ["rivers", "trains", "bridges", "towns"]
)]  # fmt: skip
PROMPTLY = 60.0


def test_start_options_place_each_replica_in_a_placement_group() -> None:
    options = start_options(
        EngineOptions(data_parallel_size=2, tensor_parallel_size=3, ray=True, ray_num_cpus=0.5)
    )
    assert sorted(options.hosts) == [
        "engine",
        "engine_1",
        "engine_1_tp1",
        "engine_1_tp2",
        "engine_tp1",
        "engine_tp2",
    ]
    assert options.hosts["engine_1_tp2"].placement_group == "replica1"
    assert options.hosts["engine_1_tp2"].bundle_index == 2
    group = options.placement_groups["replica1"]
    assert group.strategy == "STRICT_PACK" and len(group.bundles) == 3
    assert start_options(EngineOptions()).hosts == {}
    with pytest.raises(ValueError, match="transport 'memory'"):
        EngineOptions(ray=True, transport="memory")


def test_replicas_on_ray_serve_like_local_processes_and_die_typed(
    tiny_model_dir: Path, ray_cluster: object, caplog: pytest.LogCaptureFixture
) -> None:
    model = str(tiny_model_dir)

    async def outputs(engine: AsyncEngine) -> list[tuple[int, ...]]:
        async def one(prompt: str) -> tuple[int, ...]:
            last = None
            async for output in engine.generate(prompt, GREEDY):
                last = output
            assert last is not None
            return last.token_ids

        return list(await asyncio.gather(*(one(prompt) for prompt in PROMPTS)))

    async def local() -> list[tuple[int, ...]]:
        async with AsyncEngine(model, num_blocks=128) as engine:
            return await outputs(engine)

    async def on_ray() -> None:
        engine = AsyncEngine(
            model, num_blocks=128, data_parallel_size=2, ray=True, ray_num_cpus=0.5
        )
        await engine.start()
        try:
            # half a CPU each on a 2-CPU cluster: the engine says its model gets one thread
            assert "the model computes on 1 thread while the cluster's nodes have up to 2" in (
                caplog.text
            )
            assert await outputs(engine) == expected
            actors, groups = pipeline_state(ray_cluster, "llm")
            assert len(actors) == 2 and sorted(groups) == ["actorline:llm:replica0",
                                                          "actorline:llm:replica1"]  # fmt: skip
            router = engine.running.stage("router")
            assert isinstance(router, RouterStage) and set(router.routed) == {"0", "1"}
            long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
            started: dict[str, asyncio.Event] = {p: asyncio.Event() for p in PROMPTS}

            async def stream(prompt: str) -> BaseException | None:
                try:
                    async for _ in engine.generate(prompt, long, request_id=prompt):
                        started[prompt].set()
                except EngineDeadError as error:
                    return error
                return None

            tasks = {p: asyncio.create_task(stream(p)) for p in PROMPTS}
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), PROMPTLY)
            placed = {rid.partition("#")[0]: replica for rid, replica in router.recent}
            ray = ray_cluster
            ray.kill(engine.running.ray_actor("engine_1"))  # type: ignore[attr-defined]
            killed = time.monotonic()
            victims = [p for p in PROMPTS if placed[p] == "1"]
            for prompt in victims:
                assert isinstance(await asyncio.wait_for(tasks[prompt], PROMPTLY), EngineDeadError)
            assert time.monotonic() - killed < 5.0
            assert engine.failure is None
            assert not any(tasks[p].done() for p in PROMPTS if p not in victims)
            ray.kill(engine.running.ray_actor("engine"))  # type: ignore[attr-defined]
            killed = time.monotonic()
            for prompt in PROMPTS:
                assert isinstance(await asyncio.wait_for(tasks[prompt], PROMPTLY), EngineDeadError)
            assert time.monotonic() - killed < 5.0
            assert isinstance(engine.failure, EngineDeadError)
        finally:
            await engine.close()
        deadline = time.monotonic() + PROMPTLY
        while pipeline_state(ray_cluster, "llm") != ([], []):
            assert time.monotonic() < deadline, pipeline_state(ray_cluster, "llm")
            await asyncio.sleep(0.5)

    expected = run(local, timeout=300)
    run(on_ray, timeout=300)
