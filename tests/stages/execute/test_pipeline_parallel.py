"""Pipeline parallelism with real shards: each a spawned process holding a contiguous range
of the decoder's layers, the hidden state passed shard to shard over ZeroMQ.

- layer splits: even by default, explicit on request, refused before loading with the numbers
  (and combinations not built yet refused by the options);
- a 6-layer tiny Llama at PP=2, PP=3 and an uneven 1,2,3 split, and the default model at
  PP=2 and PP=3, give greedy tokens identical to one engine, with prefix caching and
  preemption at work; with micro-batches (several steps in flight, the default) and without,
  with the execute stage beside the scheduler (called) and on a host of its own (messages);
- a killed shard, and a shard that hangs, fail every pending request with EngineDeadError in
  bounded time and leave no process behind (with steps in flight).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from transformers import LlamaConfig

from pipeline import AsyncEngine, EngineDeadError, InvalidRequestError, SamplingParams
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.pp_split import check_pipeline_parallel, layer_ranges
from stages.execute.pp_stage import hop_seconds
from tests.conftest import TINY_LLAMA
from tests.processes import child_processes, process_alive
from tests.stages.execute.test_tensor_parallel import fails_every_request

T = TypeVar("T")

PREFIX = " ".join(["alpha beta gamma delta"] * 10)
PROMPTS = [f"{PREFIX} request {index} asks about {topic}" for index, topic in enumerate(
    ["rivers", "mountains", "the sea", "old towns", "trains"]
)] + ["short one", "The quick brown fox jumps over the lazy dog"]  # fmt: skip
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTLY = 60.0
#: how soon every request must fail once a shard is SIGKILLed (the runtime sees its process
#: exit at once; the rest is the engine's teardown on a loaded machine)
KILLED_SHARD_SECONDS = 15.0
HANG_TIMEOUT = 2.0
HANG_MARGIN = 10.0
#: hosts may stay silent this long: on the shared 2-core machine (load ~16) the test process's
#: own loop was seen starved past the default 10 s while engines started
SILENCE = dict(heartbeat_timeout=60.0)


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 900) -> T:
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def generate_all(
    engine: AsyncEngine, prompts: list[str], params: SamplingParams = GREEDY
) -> list[tuple[int, ...]]:
    async def one(prompt: str) -> tuple[int, ...]:
        last = None
        async for output in engine.generate(prompt, params):
            last = output
        assert last is not None and last.finish_reason == "length"
        return last.token_ids

    return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


async def outputs_of(model: str, **options: Any) -> tuple[list[tuple[int, ...]], Any]:
    """Greedy outputs of PROMPTS (the first alone first, so the rest hit its prefix);
    ``pipeline=``: that pipeline instead of the model's and the options."""
    pipeline = options.pop("pipeline", None)
    engine = (
        AsyncEngine(model, **SILENCE, **options)
        if pipeline is None
        else AsyncEngine(pipeline=pipeline)
    )
    async with engine:
        if pipeline is not None or options.get("pipeline_parallel_size", 1) > 1:
            # the last shard passes back tokens, not hidden states: an embedding request is refused
            # on its own, and the engine serves on
            with pytest.raises(InvalidRequestError, match="computes no embeddings"):
                await engine.embed("an embedding request")
        first = await generate_all(engine, PROMPTS[:1])
        rest = await generate_all(engine, PROMPTS[1:])
        return first + rest, engine.stats


# -- splits and refusals ----------------------------------------------------------------------


def test_layer_ranges_split_evenly_or_as_given_and_refuse_with_the_numbers() -> None:
    assert layer_ranges(6, 2) == [range(0, 3), range(3, 6)]
    assert layer_ranges(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert layer_ranges(30, 3, "5,10,15") == [range(0, 5), range(5, 15), range(15, 30)]
    with pytest.raises(ExecuteConfigError) as refused:
        layer_ranges(30, 4)
    message = str(refused.value)
    assert "4 does not divide the model's 30 decoder layers" in message
    assert "sizes that do: 1, 2, 3, 5, 6, 10, 15, 30" in message
    assert "'8,8,7,7'" in message  # an explicit split that would work
    with pytest.raises(ExecuteConfigError, match=r"adds up to 7 layers, but the model has 6"):
        layer_ranges(6, 2, "3,4")
    with pytest.raises(ExecuteConfigError, match="names 3 shards"):
        layer_ranges(6, 2, "2,2,2")
    with pytest.raises(ExecuteConfigError, match="has 6 decoder layers: each shard needs one"):
        layer_ranges(6, 7)
    with pytest.raises(ExecuteConfigError, match="positive layer counts"):
        layer_ranges(6, 2, "3,x")
    gemma = LlamaConfig(**TINY_LLAMA)
    gemma.model_type = "gemma"
    with pytest.raises(ExecuteConfigError, match="model type 'gemma' is not one"):
        check_pipeline_parallel(gemma, 2)


def test_options_refuse_what_pipeline_parallelism_does_not_combine_with_yet() -> None:
    for extra, words in (
        (dict(transport="memory"), "transport 'memory'"),
        (dict(null_model=True), "null_model"),
    ):
        with pytest.raises(ValueError, match=words):
            EngineOptions(pipeline_parallel_size=2, **extra)
    with pytest.raises(ValueError, match="pipeline_parallel_split names 3 shards"):
        EngineOptions(pipeline_parallel_size=2, pipeline_parallel_split="1,2,3")
    with pytest.raises(ValueError, match="comma-separated positive layer counts"):
        EngineOptions(pipeline_parallel_size=2, pipeline_parallel_split="1;2")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        EngineOptions(pipeline_parallel_size=0)
    # built: PP x TP (test_pp_tensor.py), PP with quantized weights (test_pp_quantized.py)
    for extra in (dict(tensor_parallel_size=2), dict(quantization="int8")):
        EngineOptions(pipeline_parallel_size=2, **extra)
        ExecuteConfig(pipeline_parallel_size=2, **extra)
    with pytest.raises(ValueError, match="micro_batches 2 needs pipeline_parallel_size > 1"):
        EngineOptions(pipeline_parallel_micro_batches=2)
    with pytest.raises(ValueError, match="pipeline_parallel_micro_batches must be an integer"):
        EngineOptions(pipeline_parallel_size=2, pipeline_parallel_micro_batches=0)


def test_a_hop_counts_only_the_seconds_its_receiver_waited() -> None:
    assert hop_seconds(10.0, 0.0, 10.5) == pytest.approx(0.5)  # the receiver was idle
    assert hop_seconds(10.0, 10.4, 10.5) == pytest.approx(0.1)  # busy until 10.4
    assert hop_seconds(10.0, 0.0, 9.5) == 0.0  # another host's clock runs ahead
    assert hop_seconds(time.time() - 60, 0.0) >= 60  # now, by default


def test_micro_batches_default_to_the_pipeline_size_in_the_scheduler() -> None:
    def in_flight(**options: Any) -> int:
        schedule = llm_pipeline(EngineOptions(**options))["schedule"].config
        return int(schedule.scheduler.max_steps_in_flight)

    assert in_flight() == 1
    assert in_flight(pipeline_parallel_micro_batches=1) == 1
    assert in_flight(pipeline_parallel_size=3) == 3
    assert in_flight(pipeline_parallel_size=3, pipeline_parallel_micro_batches=1) == 1
    assert in_flight(pipeline_parallel_size=2, pipeline_parallel_micro_batches=4) == 4


def test_the_graph_chains_the_shards_back_to_the_first() -> None:
    pipeline = llm_pipeline(EngineOptions(pipeline_parallel_size=3))
    text = pipeline.describe()
    assert "stage execute_pp1 [PipelineShardStage] on engine_pp1" in text
    assert "stage execute_pp2 [PipelineShardStage] on engine_pp2" in text
    assert "execute.pipeline -> execute_pp1.in" in text
    assert "execute_pp1.out -> execute_pp2.in" in text
    assert "execute_pp2.out -> execute.in" in text


def test_the_engine_refuses_an_indivisible_split_before_spawning_anything(
    tiny6_model_dir: Path,
) -> None:
    engine = AsyncEngine(str(tiny6_model_dir), pipeline_parallel_size=4)
    children = child_processes()
    with pytest.raises(ExecuteConfigError, match="4 does not divide the model's 6 decoder layers"):
        run(engine.start())
    assert set(child_processes()) <= set(children), child_processes()


# -- exactness --------------------------------------------------------------------------------


#: the default model's exactness tests: five requests (three steps in flight at PP=3), greedy
DEFAULT_MODEL_PROMPTS = PROMPTS[:5]
DEFAULT_MODEL_GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def default_model_outputs(**options: Any) -> list[tuple[int, ...]]:
    async with AsyncEngine("smollm2-135m", num_blocks=256, **SILENCE, **options) as engine:
        return await generate_all(engine, DEFAULT_MODEL_PROMPTS, DEFAULT_MODEL_GREEDY)


@pytest.fixture(scope="module")
def default_model_one_engine() -> list[tuple[int, ...]]:
    """SmolLM2-135M's greedy outputs on one engine, computed once for the PP=2 and PP=3 tests."""
    return run(default_model_outputs())


@pytest.mark.slow
@pytest.mark.timeout(900)  # two engines each; on the shared 2-core machine past 300 s was seen
@pytest.mark.parametrize(
    "options",
    [
        dict(pipeline_parallel_size=2),
        dict(pipeline_parallel_size=3),
        # transformers' model class (the others run actorline's own, stages.execute.llama),
        # one step in flight: the shards compute in turn
        dict(
            pipeline_parallel_size=3,
            pipeline_parallel_split="1,2,3",
            model_impl="transformers",
            pipeline_parallel_micro_batches=1,
        ),
    ],
    ids=["pp2", "pp3", "pp3-uneven-transformers-one-step"],
)
def test_tiny_model_gives_the_greedy_tokens_of_one_engine(
    tiny6_model_dir: Path,
    tiny6_one_engine: Callable[[str | None], list[tuple[int, ...]]],
    options: dict[str, Any],
) -> None:
    model = str(tiny6_model_dir)
    expected = tiny6_one_engine(options.get("model_impl"))
    # a cache too small for all of them at once: requests wait for blocks, or (with one
    # step in flight; with several only when none is, stages/steps_in_flight.py) are
    # preempted and recomputed
    got, stats = run(outputs_of(model, num_blocks=14, **options))
    assert got == expected
    if options.get("pipeline_parallel_micro_batches") == 1:
        assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.communication_seconds > 0  # the hops' transfer and queueing, measured
    assert len(stats.shard_busy_seconds) == options["pipeline_parallel_size"]


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(900)
def test_default_model_at_pp2_gives_the_greedy_tokens_of_one_engine(
    default_model_one_engine: list[tuple[int, ...]],
) -> None:
    assert run(default_model_outputs(pipeline_parallel_size=2)) == default_model_one_engine


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_steps_in_flight_over_messages_give_the_greedy_tokens_of_one_engine(
    tiny6_model_dir: Path, tiny6_one_engine: Callable[[str | None], list[tuple[int, ...]]]
) -> None:
    """The execute stage on a host of its own: the steps go out as messages (several at once),
    their results come back as messages, in any order."""
    model = str(tiny6_model_dir)
    expected = tiny6_one_engine(None)
    options = EngineOptions.create(model, pipeline_parallel_size=3, num_blocks=14, **SILENCE)
    pipeline = llm_pipeline(options).place("execute", "model")
    got, stats = run(outputs_of(model, pipeline=pipeline))
    assert got == expected
    assert stats.prefix_cache_hits > 0
    assert len(stats.shard_busy_seconds) == 3 and all(s > 0 for s in stats.shard_busy_seconds)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(900)
def test_default_model_at_pp3_with_micro_batches_gives_the_greedy_tokens_of_one_engine(
    default_model_one_engine: list[tuple[int, ...]],
) -> None:
    """SmolLM2-135M's 30 layers 10 + 10 + 10, three steps in flight over five requests."""
    assert run(default_model_outputs(pipeline_parallel_size=3)) == default_model_one_engine


# -- a shard that dies or hangs ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["engine_pp1", "engine_pp2"])
def test_a_killed_shard_fails_every_pending_request(tiny6_model_dir: Path, shard: str) -> None:
    async def body() -> None:
        engine = AsyncEngine(
            str(tiny6_model_dir), pipeline_parallel_size=3, num_blocks=512, **SILENCE
        )
        await engine.start()
        pids = dict(engine.running.pids)
        try:
            pid = pids[shard]
            assert pid is not None
            took = await fails_every_request(engine, lambda: os.kill(pid, signal.SIGKILL))
            assert isinstance(engine.failure, EngineDeadError)
            assert took < KILLED_SHARD_SECONDS, took
        finally:
            await engine.close()
        assert not any(process_alive(pid) for pid in pids.values() if pid is not None)

    run(body())


@pytest.mark.slow
def test_a_hung_shard_fails_every_pending_request_after_the_timeout(tiny6_model_dir: Path) -> None:
    async def body() -> None:
        engine = AsyncEngine(
            str(tiny6_model_dir),
            pipeline_parallel_size=2,
            pipeline_parallel_timeout=HANG_TIMEOUT,
            heartbeat_timeout=60.0,  # the step's own timeout, not the host's silence, fails it
        )
        await engine.start()
        pids = dict(engine.running.pids)
        try:
            pid = pids["engine_pp1"]
            assert pid is not None
            took = await fails_every_request(engine, lambda: os.kill(pid, signal.SIGSTOP))
            assert "pipeline_parallel_timeout" in str(engine.failure)
            assert took <= HANG_TIMEOUT + HANG_MARGIN, took
            closing = time.monotonic()
        finally:
            await engine.close()
        assert time.monotonic() - closing < PROMPTLY
        assert not any(process_alive(pid) for pid in pids.values() if pid is not None)

    run(body())
