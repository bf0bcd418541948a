"""Tensor parallelism with real ranks: spawned processes joined by torch.distributed (gloo).

- a model whose heads do not divide is refused before loading, naming the numbers;
- the tiny Llama (4 query / 2 KV heads) at TP=2 and the default model at TP=3 give greedy
  tokens identical to TP=1, with prefix caching and preemption at work;
- rank 0 sends the other ranks one ShardStep per step that computes (the ranks' all-reduces,
  two per layer, are theirs), and a rank other than 0 never allocates a KV block;
- ranks whose probe caches disagree still agree whether to run the load-time probe;
- a killed rank, and a rank that hangs, fail every pending request with EngineDeadError in
  bounded time and leave no process behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from pipeline import MAIN_HOST, AsyncEngine, EngineDeadError, SamplingParams
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline
from pipeline.runtime.control import HostStatistics
from stages.execute.config import ExecuteConfigError
from stages.execute.rank import TensorParallelRankStage
from stages.execute.tensor_parallel import (
    check_tensor_parallel,
    shard_model,
    valid_tensor_parallel_sizes,
)
from tests.conftest import TINY_LLAMA
from tests.processes import child_processes, process_alive

T = TypeVar("T")

#: prompts sharing a 40-token prefix (two full KV blocks), then each its own words
PREFIX = " ".join(["alpha beta gamma delta"] * 10)
PROMPTS = [f"{PREFIX} request {index} asks about {topic}" for index, topic in enumerate(
    ["rivers", "mountains", "the sea", "old towns", "trains", "bridges"]
)] + ["short one", "The quick brown fox jumps over the lazy dog"]  # fmt: skip
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
#: bound for "promptly" on a loaded 2-core machine: tells failing fast from hanging
PROMPTLY = 60.0
#: how soon every request must fail once a rank is SIGKILLed (the runtime sees its process
#: exit at once; the rest is the engine's teardown on a loaded machine)
KILLED_RANK_SECONDS = 10.0
#: tensor_parallel_timeout of the hung-rank test, and how long past it the requests may take
#: to fail (the step in flight, then the teardown, on a loaded machine)
HANG_TIMEOUT = 2.0
HANG_MARGIN = 8.0


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 600) -> T:
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
    """Greedy outputs of PROMPTS (the first alone first, so the rest hit its prefix)."""
    async with AsyncEngine(model, **options) as engine:
        first = await generate_all(engine, PROMPTS[:1])
        rest = await generate_all(engine, PROMPTS[1:])
        return first + rest, engine.stats


# -- refusals before loading ------------------------------------------------------------------


def test_head_counts_that_do_not_divide_are_refused_naming_the_numbers(
    default_model_dir: Path,
) -> None:
    config = AutoConfig.from_pretrained(default_model_dir)
    assert valid_tensor_parallel_sizes(config) == [1, 3]
    check_tensor_parallel(config, 3, "smollm2-135m")
    with pytest.raises(ExecuteConfigError) as refused:
        check_tensor_parallel(config, 2, "smollm2-135m")
    assert refused.value.field == "tensor_parallel_size"
    message = str(refused.value)
    assert "2 does not divide smollm2-135m's 9 query heads and 3 KV heads" in message
    assert "sizes that work: 1, 3" in message
    tiny = LlamaConfig(**TINY_LLAMA)
    assert valid_tensor_parallel_sizes(tiny) == [1, 2]
    with pytest.raises(ExecuteConfigError, match="4 query heads and 2 KV heads"):
        check_tensor_parallel(tiny, 4)


def test_the_engine_refuses_before_spawning_anything(default_model_dir: Path) -> None:
    engine = AsyncEngine("smollm2-135m", tensor_parallel_size=2)
    children = child_processes()
    began = time.monotonic()
    with pytest.raises(ExecuteConfigError, match="9 query heads and 3 KV heads"):
        run(engine.start())
    assert time.monotonic() - began < PROMPTLY
    # refused from the model's config alone: no engine host or rank process was left running
    assert set(child_processes()) <= set(children), child_processes()
    with pytest.raises(ValueError, match="transport 'memory'"):
        EngineOptions(tensor_parallel_size=2, transport="memory")
    with pytest.raises(ValueError, match="nothing to split"):
        EngineOptions(tensor_parallel_size=2, null_model=True)


def test_shards_are_the_megatron_split() -> None:
    torch.manual_seed(0)
    whole = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    shard = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    shard.load_state_dict(whole.state_dict())
    rowwise = shard_model(shard, rank=1, size=2)
    assert rowwise == [
        f"model.layers.{layer}.{name}"
        for layer in range(2)
        for name in ("self_attn.o_proj", "mlp.down_proj")
    ]
    full, part = whole.model.layers[0], shard.model.layers[0]
    # rank 1 of 2: the second half of q's heads and k/v's heads, of gate/up's columns ...
    assert torch.equal(part.self_attn.q_proj.weight, full.self_attn.q_proj.weight[32:])
    assert torch.equal(part.self_attn.k_proj.weight, full.self_attn.k_proj.weight[16:])
    assert torch.equal(part.mlp.up_proj.weight, full.mlp.up_proj.weight[64:])
    # ... and the matching inputs of o/down, whose outputs the ranks sum
    assert torch.equal(part.self_attn.o_proj.weight, full.self_attn.o_proj.weight[:, 32:])
    assert torch.equal(part.mlp.down_proj.weight, full.mlp.down_proj.weight[:, 64:])
    assert part.self_attn.q_proj.out_features == 32
    assert torch.equal(shard.lm_head.weight, whole.lm_head.weight)  # whole on every rank


# -- exactness --------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_model_at_tp2_gives_the_greedy_tokens_of_tp1_and_a_killed_rank_fails_all(
    tiny_model_dir: Path,
) -> None:
    """One TP=2 engine start for two checks: its greedy tokens are TP=1's, through
    preemptions and prefix hits; then its rank 1 is SIGKILLed mid-stream and every pending
    request fails promptly, leaving no process behind (formerly
    test_a_killed_rank_fails_every_pending_request, see :func:`a_killed_rank_fails_all`)."""
    model = str(tiny_model_dir)
    expected, _ = run(outputs_of(model, num_blocks=512, transport="memory"))  # TP=1, in-process

    async def body() -> None:
        # a cache too small for all of them at once: requests are preempted and recomputed
        engine = AsyncEngine(model, tensor_parallel_size=2, num_blocks=24)
        await engine.start()
        pids = dict(engine.running.pids)
        try:
            first = await generate_all(engine, PROMPTS[:1])
            rest = await generate_all(engine, PROMPTS[1:])
            assert first + rest == expected
            stats = engine.stats
            assert stats is not None
            assert stats.num_preemptions > 0
            assert stats.prefix_cache_hits > 0
            assert stats.communication_seconds > 0
            await a_killed_rank_fails_all(engine, pids)
        finally:
            await engine.close()
        assert not any(process_alive(pid) for pid in pids.values() if pid is not None)

    run(body())


@pytest.mark.slow
def test_a_bf16_kv_cache_at_tp2_gives_the_greedy_tokens_of_tp1(tiny_model_dir: Path) -> None:
    """Each rank holds its KV heads' shard of the cache in bf16 (kv_cache_dtype), through
    preemptions and prefix hits."""
    model = str(tiny_model_dir)
    expected, _ = run(
        outputs_of(model, num_blocks=512, kv_cache_dtype="bfloat16", transport="memory")
    )

    async def tp2() -> tuple[list[tuple[int, ...]], Any, Any]:
        options = dict(tensor_parallel_size=2, num_blocks=24, kv_cache_dtype="bfloat16")
        async with AsyncEngine(model, **options) as engine:
            first = await generate_all(engine, PROMPTS[:1])
            rest = await generate_all(engine, PROMPTS[1:])
            return first + rest, engine.stats, engine.info

    got, stats, info = run(tp2())
    assert info.kv_cache_dtype == "bfloat16"
    assert got == expected
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


@pytest.mark.slow
@pytest.mark.model
def test_default_model_at_tp3_gives_the_greedy_tokens_of_tp1() -> None:
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def outputs(**options: Any) -> list[tuple[int, ...]]:
        async with AsyncEngine("smollm2-135m", num_blocks=256, **options) as engine:
            return await generate_all(engine, prompts, params)

    assert run(outputs(tensor_parallel_size=3)) == run(outputs(transport="memory"))


# -- what rank 0 sends, what the other ranks hold ---------------------------------------------


def _handled(snapshots: list[HostStatistics], stage: str) -> int:
    """Messages the stage ``stage`` has handled, from the runtime's statistics."""
    return next(s.handled for host in snapshots for s in host.stages if s.name == stage)


@pytest.mark.slow
def test_rank_0_sends_one_shard_step_per_step_and_only_it_allocates(tiny_model_dir: Path) -> None:
    """A TP=2 engine whose rank 1 runs in this process (placed on the main host, so its
    runner can be looked at; rank 0 stays in the engine process). The runtime's own counters
    show what rank 0 sent: one ShardStep per step that computes, never one per layer (the
    ranks' all-reduces, two per layer, are what runs per layer). Rank 1's allocator, used by
    nothing but the load-time probe, is untouched by serving: no block handed out or freed,
    nothing looked up or published in its prefix cache (docs/parallelism.md, "One
    allocator")."""
    options = EngineOptions(model=str(tiny_model_dir), tensor_parallel_size=2, num_blocks=64)
    pipeline = llm_pipeline(options).place("execute_tp1", MAIN_HOST)
    layers = TINY_LLAMA["num_hidden_layers"]
    threads = torch.get_num_threads()  # the rank sets its own, in this process

    async def body() -> None:
        async with AsyncEngine(pipeline=pipeline) as engine:
            rank = engine.running.stage("execute_tp1")
            assert isinstance(rank, TensorParallelRankStage)
            # NOTE: the engine is ready once rank 0 has loaded; rank 1 may still be sizing
            # its KV cache after the ranks' last load-time collective (its handler returns,
            # and sets its runner, a moment later; a ShardStep would wait in its inbox)
            deadline = time.monotonic() + 60
            while rank.runner is None and time.monotonic() < deadline:  # noqa: ASYNC110 - the stage's own state, polled
                await asyncio.sleep(0.05)
            runner = rank.runner
            assert runner is not None and runner.group is not None
            allocator = runner.allocator
            assert allocator is not None
            free_order = allocator.free_block_ids()  # any allocation would reorder it
            collectives = runner.group.collectives
            before = await engine.running.statistics()
            assert _handled(before, "execute_tp1") == 1  # the rendezvous
            assert _handled(before, "execute") == 0

            # one request: a prefill that samples, then a decode step per token, then a step
            # that only frees it (it computes nothing, so it sends no ShardStep)
            tokens = 0
            async for output in engine.generate(PROMPTS[0], GREEDY):
                tokens = len(output.token_ids)
                assert allocator.num_free_blocks == allocator.num_usable_blocks
            assert tokens == GREEDY.max_tokens
            assert await engine.running.wait_idle(PROMPTLY)
            after = await engine.running.statistics()
            steps = _handled(after, "execute")
            shards = _handled(after, "execute_tp1") - 1
            assert shards == tokens, (shards, tokens)
            assert steps == tokens + 1, (steps, tokens)
            assert engine.stats is not None and engine.stats.num_steps == steps
            assert runner.group.collectives - collectives == 2 * layers * shards

            # several at once, sharing a prefix: still one ShardStep per step that computed
            # (the last step only frees), and rank 0 alone holds and caches blocks
            await generate_all(engine, PROMPTS[1:4])
            assert await engine.running.wait_idle(PROMPTLY)
            later = await engine.running.statistics()
            more_steps = _handled(later, "execute") - steps
            more_shards = _handled(later, "execute_tp1") - 1 - shards
            assert GREEDY.max_tokens <= more_shards < more_steps, (more_shards, more_steps)
            assert engine.stats.prefix_cache_hits > 0  # rank 0's cache served the prefix
            assert allocator.free_block_ids() == free_order
            assert allocator.num_cached_blocks == 0
            assert allocator.stats.queries == 0 and allocator.stats.hits == 0

    try:
        run(body())
    finally:
        torch.set_num_threads(threads)


# -- a rank that dies or hangs ----------------------------------------------------------------


async def fails_every_request(
    engine: AsyncEngine, hurt: Any, streams: int = 4, max_tokens: int = 400
) -> float:
    """Start ``streams`` streams of ``max_tokens`` tokens, ``hurt`` a process of the engine (a
    rank, a shard) mid-stream; every stream must end in EngineDeadError. Returns how long
    after the hurt the last one ended (the tensor- and pipeline-parallel failure tests share
    it)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = asyncio.Event()

    async def stream(prompt: str) -> BaseException | None:
        try:
            async for _ in engine.generate(prompt, params):
                started.set()
        except EngineDeadError as error:
            return error
        return None

    tasks = [asyncio.create_task(stream(prompt)) for prompt in PROMPTS[:streams]]
    await asyncio.wait_for(started.wait(), PROMPTLY)
    hurt()
    hurt_at = time.monotonic()
    errors = await asyncio.wait_for(asyncio.gather(*tasks), PROMPTLY)
    assert all(isinstance(error, EngineDeadError) for error in errors), errors
    return time.monotonic() - hurt_at


async def a_killed_rank_fails_all(engine: AsyncEngine, pids: dict[str, int | None]) -> None:
    """Rank 1 SIGKILLed mid-stream: every pending request fails with EngineDeadError, and far
    sooner than a collective's timeout."""
    rank = pids["engine_tp1"]
    assert rank is not None
    # 250 tokens: a stream's prompt and tokens (19 blocks) fit the 24-block cache
    kill = lambda: os.kill(rank, signal.SIGKILL)  # noqa: E731
    took = await fails_every_request(engine, kill, max_tokens=250)
    assert isinstance(engine.failure, EngineDeadError)
    # the runtime sees the rank's process exit at once: far less than a collective's
    # timeout (tensor_parallel_timeout, 30 s by default), docs/parallelism.md
    assert took < KILLED_RANK_SECONDS, took


@pytest.mark.slow
def test_a_hung_rank_fails_every_pending_request_after_the_timeout(tiny_model_dir: Path) -> None:
    async def body() -> None:
        engine = AsyncEngine(
            str(tiny_model_dir), tensor_parallel_size=2, tensor_parallel_timeout=HANG_TIMEOUT
        )
        await engine.start()
        pids = dict(engine.running.pids)
        try:
            rank = pids["engine_tp1"]
            assert rank is not None
            took = await fails_every_request(engine, lambda: os.kill(rank, signal.SIGSTOP))
            assert "tensor-parallel all-reduce failed" in str(engine.failure)
            # rank 0's next all-reduce gives up after tensor_parallel_timeout
            # (docs/parallelism.md): the requests fail then, not at some later time
            assert took <= HANG_TIMEOUT + HANG_MARGIN, took
            closing = time.monotonic()
        finally:
            await engine.close()
        assert time.monotonic() - closing < PROMPTLY
        assert not any(process_alive(pid) for pid in pids.values() if pid is not None)

    run(body())


def test_ranks_agree_whether_to_probe_when_their_probe_caches_disagree(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load-time probe runs the model (all-reduces included), so its ranks must run it
    together. Each reads the probe cache by itself, and an engine loading the same model at
    once (data-parallel replicas) can record a pass between two ranks' reads: here rank 0
    finds no pass and rank 1 finds one. Both still load, each probing (before the ranks
    agreed, rank 0 probed alone and its collectives waited for a partner that never came)."""
    import threading

    from stages.execute import runner as runner_module
    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner
    from stages.execute.tensor_parallel import host_rendezvous

    config = ExecuteConfig(model=str(tiny_model_dir), num_blocks=32, tensor_parallel_size=2)
    store, rendezvous = host_rendezvous("127.0.0.1", 2, timeout=60.0)
    runners = [
        ModelRunner(config, rendezvous=rendezvous, store=store),
        ModelRunner(config, rank=1, rendezvous=rendezvous),
    ]
    ranks: dict[int, bool] = {}
    probed: list[int] = []
    monkeypatch.setattr(runner_module, "checks_passed", lambda *_: ranks[threading.get_ident()])
    rank_of: dict[int, int] = {}  # loading thread -> its runner's rank
    original_probe = runner_module.check_paged_attention

    def probe(*args: Any, **kwargs: Any) -> None:
        probed.append(rank_of[threading.get_ident()])
        original_probe(*args, **kwargs)

    monkeypatch.setattr(runner_module, "check_paged_attention", probe)
    # NOTE: the two ranks share this process, and transformers' loading is not thread-safe
    # (its meta-device context is global): one from_pretrained at a time.
    from transformers import AutoModelForCausalLM

    original_load = AutoModelForCausalLM.from_pretrained
    one_at_a_time = threading.Lock()

    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        with one_at_a_time:
            return original_load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    errors: list[BaseException] = []

    def load(runner: ModelRunner) -> None:
        ranks[threading.get_ident()] = runner.rank == 1  # rank 1 "finds a pass"
        rank_of[threading.get_ident()] = runner.rank
        try:
            runner.load()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=load, args=(runner,), daemon=True) for runner in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PROMPTLY)
    assert not any(thread.is_alive() for thread in threads), "a rank's load hung"
    assert not errors, errors
    assert sorted(probed) == [0, 1]


# -- CUDA -------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.slow
def test_tp2_on_two_gpus_over_nccl_gives_the_greedy_tokens_of_tp1(tiny_model_dir: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    model = str(tiny_model_dir)
    expected, _ = run(outputs_of(model, device="cuda", num_blocks=512))
    got, stats = run(outputs_of(model, device="cuda", tensor_parallel_size=2, num_blocks=512))
    assert got == expected
    assert stats.communication_seconds > 0
