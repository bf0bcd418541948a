"""Data parallelism on the tiny Llama: two engine replicas, each a real process, behind the
router stage. The same greedy outputs as one engine, both replicas take work, requests that
share their first KV blocks go to the same replica (prefix caching holds across replicas), an
abort reaches the replica holding the request, and a SIGKILLed replica fails only its own
requests while the other serves on (the engine stays up, and reports the lost replica), the
requests it had not started go to the other; and replicas of two tensor-parallel ranks each
serve like one engine. The router is a stage like any: a user's own replaces it, and the
built-in round-robin policy, chosen by name, sends the replicas turns."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pipeline import AsyncEngine, EngineDeadError, SamplingParams, Stage
from pipeline.engine.metrics import EngineMetrics
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline
from pipeline.runtime.control import HostStatistics
from pipeline.runtime.stage import handles
from stages.messages import (
    AbortRequests,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    RequestRejected,
)
from stages.route import RouterStage
from stages.router import RoundRobinPolicy
from tests.processes import process_alive

pytestmark = pytest.mark.slow

T = TypeVar("T")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
#: two families of prompts, each sharing its first three KV blocks (48 tokens)
FAMILIES = {
    "a": " ".join(["alpha beta gamma delta"] * 12),
    "b": " ".join(["one two three four"] * 12),
}
PROMPTS = {
    f"{family}{index}": f"{prefix} question {index}: {topic}?"
    for family, prefix in FAMILIES.items()
    for index, topic in enumerate(["rivers", "trains", "bridges"])
}
PROMPTLY = 60.0


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 600) -> T:
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def complete(engine: AsyncEngine, request_id: str, prompt: str) -> tuple[int, ...]:
    last = None
    async for output in engine.generate(prompt, GREEDY, request_id=request_id):
        last = output
    assert last is not None and last.finish_reason == "length"
    return last.token_ids


async def outputs_of(engine: AsyncEngine) -> dict[str, tuple[int, ...]]:
    """Each family's first prompt alone (so the family has an owner), then the rest at once."""
    names = sorted(PROMPTS)
    firsts = [name for name in names if name.endswith("0")]
    rest = [name for name in names if name not in firsts]
    done: dict[str, tuple[int, ...]] = {}
    for batch in (firsts, rest):
        tokens = await asyncio.gather(*(complete(engine, name, PROMPTS[name]) for name in batch))
        done.update(zip(batch, tokens))
    return done


async def one_engine_outputs(model: str) -> dict[str, tuple[int, ...]]:
    """:func:`outputs_of` one engine, no replicas: what the replicated ones must give."""
    async with AsyncEngine(model, num_blocks=256) as engine:
        return await outputs_of(engine)


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> dict[str, tuple[int, ...]]:
    """What one engine (no replicas) gives for :func:`outputs_of`: what replicas must give."""
    return run(one_engine_outputs(str(tiny_model_dir)))


def steps_of(snapshots: list[HostStatistics]) -> dict[str, int]:
    """Steps each replica's execute stage ran, from the runtime's statistics, by replica."""
    counts = {s.name: s.handled for host in snapshots for s in host.stages}
    return {"0": counts["execute"], "1": counts["execute_1"]}


def test_two_replicas_serve_like_one_and_a_killed_one_fails_only_its_own_requests(
    tiny_model_dir: Path, expected: dict[str, tuple[int, ...]]
) -> None:
    """One DP=2 engine start for two checks: the replicas serve like one engine (both take
    work, each family stays on one replica, an abort reaches the replica holding the
    request); then replica 1 is SIGKILLed mid-stream and fails only its own requests while
    replica 0 serves on (formerly test_a_killed_replica_fails_only_its_own_requests)."""
    model = str(tiny_model_dir)

    async def replicated() -> None:
        engine = AsyncEngine(model, num_blocks=256, data_parallel_size=2)
        await engine.start()
        metrics = EngineMetrics(engine)
        pids = dict(engine.running.pids)
        try:
            await serves_like_one(engine, expected)
            await a_killed_replica_fails_only_its_own_requests(engine, metrics, pids)
        finally:
            await metrics.aclose()
            await engine.close()
        assert not any(process_alive(pid) for pid in pids.values() if pid is not None)

    run(replicated())


async def serves_like_one(engine: AsyncEngine, expected: dict[str, tuple[int, ...]]) -> None:
    assert set(engine.running.pids) == {"engine", "engine_1"}
    assert engine.info is not None and engine.info.num_blocks == 256
    assert await outputs_of(engine) == expected
    router = engine.running.stage("router")
    assert isinstance(router, RouterStage)
    placed = {request_id.partition("#")[0]: replica for request_id, replica in router.recent}
    # both take work; each family stays on one replica, the two families on two
    assert set(router.routed) == {"0", "1"}
    owners = {family: {placed[name] for name in PROMPTS if name[0] == family}
              for family in FAMILIES}  # fmt: skip
    assert all(len(replicas) == 1 for replicas in owners.values()), owners
    assert owners["a"] != owners["b"]
    # so each replica's prefix cache served its family's later prompts
    assert all(stats.prefix_cache_hits > 0 for stats in engine.replica_stats.values())
    assert engine.stats is not None
    assert engine.stats.num_steps == sum(stats.num_steps for stats in engine.replica_stats.values())
    # an abort reaches the replica that holds the request, which frees its blocks
    long = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    stream = engine.generate(PROMPTS["a1"], long, request_id="long")
    async for _ in stream:
        break
    await stream.aclose()  # leaving the stream aborts the request
    holder = placed_of(router, "long")
    # a request of the same family runs there after it: once it is done, nothing runs
    await complete(engine, "probe", PROMPTS["a2"])
    assert placed_of(router, "probe") == holder
    assert engine.replica_stats[holder].num_running == 0
    assert router.load(holder).num_requests == 0


def test_replicas_of_tensor_parallel_ranks_serve_like_one(
    tiny_model_dir: Path, expected: dict[str, tuple[int, ...]]
) -> None:
    """DP=2 x TP=2: two replicas, each an engine host driving two ranks joined by gloo (the
    tiny Llama's 4 query / 2 KV heads split in two), give one engine's greedy tokens, and
    every host and rank process is gone after close."""
    model = str(tiny_model_dir)

    async def replicated() -> None:
        engine = AsyncEngine(model, num_blocks=256, data_parallel_size=2, tensor_parallel_size=2)
        await engine.start()
        pids = dict(engine.running.pids)
        try:
            assert set(pids) == {"engine", "engine_tp1", "engine_1", "engine_1_tp1"}, pids
            assert await outputs_of(engine) == expected
            router = engine.running.stage("router")
            assert isinstance(router, RouterStage)
            assert set(router.routed) == {"0", "1"}
        finally:
            await engine.close()
        assert not any(process_alive(pid) for pid in pids.values() if pid is not None)

    run(replicated())


class EverythingToReplicaOne(Stage):
    """A user's own router stage, with the ports of :class:`RouterStage`: every request goes to
    engine replica 1 (its admit stage ``admit_1``) and every abort to its schedule stage;
    what the replicas send back passes on to detokenize, their EngineInfo once both loaded.
    Its config is the number of replicas."""

    inputs = ("in", "abort", "outputs", "info")
    outputs = ("requests", "aborts", "out", "info")

    def __init__(self, config: int) -> None:
        super().__init__(config)
        self._infos = 0
        #: the ids of the requests it routed, in order
        self.routed: list[str] = []

    @handles(EngineInfo)
    async def on_info(self, info: EngineInfo) -> None:
        self._infos += 1
        if self._infos == self.config:
            await self.emit("info", info)

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        self.routed.append(request.request_id)
        await self.emit("requests", request, to="admit_1")

    @handles(EngineOutputs, RequestRejected)
    async def on_output(self, message: EngineOutputs | RequestRejected) -> None:
        await self.emit("out", message)

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        await self.emit("aborts", abort, to="schedule_1")


def test_a_users_own_router_stage_replaces_the_router(
    tiny_model_dir: Path, expected: dict[str, tuple[int, ...]]
) -> None:
    """``pipeline.replace("router", ...)`` on the DP=2 LLM pipeline (docs/parallelism.md,
    "The router stage"): the user's stage does the routing, all to replica 1, so replica 0
    runs no step at all, and the outputs are one engine's."""
    options = EngineOptions(model=str(tiny_model_dir), num_blocks=256, data_parallel_size=2)
    pipeline = llm_pipeline(options).replace("router", EverythingToReplicaOne, 2)

    async def body() -> None:
        async with AsyncEngine(pipeline=pipeline) as engine:
            assert await outputs_of(engine) == expected
            router = engine.running.stage("router")
            assert isinstance(router, EverythingToReplicaOne)
            assert sorted(rid.partition("#")[0] for rid in router.routed) == sorted(PROMPTS)
            assert await engine.running.wait_idle(PROMPTLY)
            steps = steps_of(await engine.running.statistics())
            assert steps["0"] == 0 and steps["1"] > 0, steps
            assert set(engine.replica_stats) == {"1"}  # replica 0 never sent an output

    run(body())


def test_round_robin_by_name_gives_both_replicas_turns(tiny_model_dir: Path) -> None:
    """``router="round-robin"`` (a built-in of ``actorline.routers``) with DP=2, on the null
    model: the requests alternate between the replicas, and both run steps."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def body() -> None:
        async with AsyncEngine(
            str(tiny_model_dir), null_model=True, data_parallel_size=2, router="round-robin"
        ) as engine:
            router = engine.running.stage("router")
            assert isinstance(router, RouterStage)
            assert isinstance(router.policy, RoundRobinPolicy)
            for index, name in enumerate(sorted(PROMPTS)):  # one at a time: a known order
                last = None
                async for output in engine.generate(PROMPTS[name], params, request_id=name):
                    last = output
                assert last is not None and last.finish_reason == "length"
                assert len(last.token_ids) == params.max_tokens
                assert placed_of(router, name) == str(index % 2)
            assert router.routed == {"0": len(PROMPTS) // 2, "1": len(PROMPTS) // 2}
            assert await engine.running.wait_idle(PROMPTLY)
            steps = steps_of(await engine.running.statistics())
            assert steps["0"] > 0 and steps["1"] > 0, steps
            assert set(engine.replica_stats) == {"0", "1"}

    run(body())


def placed_of(router: RouterStage, request_id: str) -> str:
    return next(replica for rid, replica in router.recent if rid.partition("#")[0] == request_id)


async def a_killed_replica_fails_only_its_own_requests(
    engine: AsyncEngine, metrics: EngineMetrics, pids: dict[str, int | None]
) -> None:
    """Replica 1 SIGKILLed while every prompt streams: its requests fail, the others finish,
    the engine stays up and reports the lost replica, new requests go to replica 0."""
    router = engine.running.stage("router")
    assert isinstance(router, RouterStage)
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    progress: dict[str, int] = {}

    async def stream(name: str) -> BaseException | int:
        try:
            # its own request id (the prompts' names already ran on this engine)
            async for output in engine.generate(PROMPTS[name], params, request_id=f"k-{name}"):
                progress[name] = len(output.token_ids)
        except EngineDeadError as error:
            return error
        return len(output.token_ids)

    tasks = {name: asyncio.create_task(stream(name)) for name in PROMPTS}
    deadline = time.monotonic() + PROMPTLY
    while len(progress) < len(PROMPTS):  # every stream is running
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    placed = {name: placed_of(router, f"k-{name}") for name in PROMPTS}
    victims = {name for name, replica in placed.items() if replica == "1"}
    assert victims and len(victims) < len(PROMPTS)
    victim_pid = pids["engine_1"]
    assert victim_pid is not None
    os.kill(victim_pid, signal.SIGKILL)
    ended = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 300)))
    for name, result in ended.items():
        if name in victims:
            assert isinstance(result, EngineDeadError), (name, result)
            assert "engine replica 1 failed" in str(result)
            assert "killed by signal 9" in str(result)
        else:
            assert result == params.max_tokens, (name, result)
    assert engine.failure is None
    assert [(s.replica, s.alive) for s in engine.replicas] == [("0", True), ("1", False)]
    assert router.live_replicas == ("0",)
    assert not process_alive(victim_pid)
    # new requests go to the replica that lives
    assert len(await complete(engine, "after", PROMPTS["b2"])) == GREEDY.max_tokens
    assert placed_of(router, "after") == "0"
    scraped = _scrape(metrics)
    assert 'actorline_replica_up{replica="0"} 1.0' in scraped
    assert 'actorline_replica_up{replica="1"} 0.0' in scraped


def test_requests_a_lost_replica_had_not_started_go_to_another(tiny_model_dir: Path) -> None:
    """Replica 1 is frozen (SIGSTOP), so the request routed to it does not start; then it is
    killed. That request, which had streamed nothing, finishes on replica 0 with the tokens it
    gets there, and no caller sees an error."""
    prompts = {"x": "rivers and lakes of the north", "y": "seven old bridges over a canal"}

    async def body() -> None:
        engine = AsyncEngine(str(tiny_model_dir), num_blocks=256, data_parallel_size=2)
        await engine.start()
        pids = dict(engine.running.pids)
        try:
            router = engine.running.stage("router")
            assert isinstance(router, RouterStage)
            frozen = pids["engine_1"]
            assert frozen is not None
            os.kill(frozen, signal.SIGSTOP)
            try:
                tasks = {}
                for name, prompt in prompts.items():  # least-loaded: one on each replica
                    tasks[name] = asyncio.create_task(complete(engine, name, prompt))
                    deadline = time.monotonic() + PROMPTLY
                    while not any(rid.partition("#")[0] == name for rid, _ in router.recent):
                        assert time.monotonic() < deadline, router.recent
                        await asyncio.sleep(0.01)
                assert {placed_of(router, name) for name in prompts} == {"0", "1"}
            finally:
                os.kill(frozen, signal.SIGKILL)
            done = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 300)))
            assert router.rerouted == 1 and router.live_replicas == ("0",)
            last = {rid.partition("#")[0]: replica for rid, replica in router.recent}
            assert all(last[name] == "0" for name in prompts)  # the moved one, routed again
            for name, prompt in prompts.items():  # greedy: what replica 0 gives it again
                assert done[name] == await complete(engine, f"again-{name}", prompt)
        finally:
            await engine.close()
        assert not any(process_alive(pid) for pid in pids.values() if pid is not None)

    run(body())


def _scrape(metrics: EngineMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()
