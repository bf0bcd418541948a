"""The null model: random sampleable tokens, real KV bookkeeping, real EngineInfo."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from stages.execute.allocator import BlockAllocator
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.null import NullRunner, NullStepError, sampleable_token_ids
from stages.messages import (
    EngineInfo,
    EngineRequest,
    EngineStats,
    ScheduledChunk,
    SchedulerStep,
    StepResult,
)
from stages.params import SamplingParams
from stages.policies import load_policy
from stages.scheduler import Scheduler, SchedulerConfig

BLOCK = 16


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> object:
    from stages.tokenize import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def make_runner(model_dir: Path, tokenizer: object, **config: object) -> NullRunner:
    runner = NullRunner(ExecuteConfig(model=str(model_dir), **config))  # type: ignore[arg-type]
    runner.load(tokenizer)
    return runner


def request(request_id: str, prompt: list[int], **params: object) -> EngineRequest:
    return EngineRequest(request_id, tuple(prompt), SamplingParams(**params))  # type: ignore[arg-type]


def run_to_completion(
    runner: NullRunner, requests: list[EngineRequest], **limits: int
) -> tuple[dict[str, list[int]], list[StepResult], EngineStats]:
    """Drive the runner with the real scheduler until every request finished."""
    assert runner.info is not None
    scheduler = Scheduler(SchedulerConfig(**limits), load_policy("fcfs"))
    scheduler.set_engine_info(runner.info)
    for item in requests:
        scheduler.add_request(item)
    outputs: dict[str, list[int]] = {item.request_id: [] for item in requests}
    results: list[StepResult] = []
    for _ in range(10_000):
        step = scheduler.schedule()
        if step is None:
            break
        result = runner.execute(step)
        results.append(result)
        engine_outputs = scheduler.update(result)
        for request_id, tokens in zip(engine_outputs.request_ids, engine_outputs.new_token_ids):
            outputs[request_id].extend(tokens)
    assert not scheduler.has_work()
    return outputs, results, scheduler.stats()


def test_engine_info_matches_the_model_runner(tiny_model_dir: Path, tokenizer: object) -> None:
    from stages.execute.runner import ModelRunner

    config = ExecuteConfig(model=str(tiny_model_dir), kv_cache_memory=4 * 1024 * 1024)
    real = ModelRunner(config).load()
    null = NullRunner(config).load(tokenizer)
    assert isinstance(null, EngineInfo)
    for field in ("model", "vocab_size", "max_model_len", "eos_token_ids", "num_blocks",
                  "block_size", "dtype", "enable_prefix_caching", "sliding_window"):  # fmt: skip
        assert getattr(null, field) == getattr(real, field), field
    assert null.kv_cache_bytes == 0  # nothing is allocated


def test_explicit_num_blocks_and_length_limits(tiny_model_dir: Path, tokenizer: object) -> None:
    runner = make_runner(tiny_model_dir, tokenizer, num_blocks=10)
    assert runner.info is not None
    assert runner.info.num_blocks == 10
    assert runner.info.max_model_len == 10 * BLOCK  # capped by the cache
    assert runner.info.vocab_size == 49152 and runner.info.eos_token_ids == (2,)
    with pytest.raises(ExecuteConfigError, match="max_model_len"):
        make_runner(tiny_model_dir, tokenizer, num_blocks=10, max_model_len=10 * BLOCK + 1)
    with pytest.raises(ExecuteConfigError, match="kv_cache_memory"):
        make_runner(tiny_model_dir, tokenizer, kv_cache_memory=1)


def test_a_windowed_config_frees_blocks_behind_the_window(
    tiny_model_dir: Path, tokenizer: object, tmp_path: Path
) -> None:
    """A config with a sliding window on every layer: the null model frees what falls behind
    it as the real runner does, so a generation runs past what the cache holds whole."""
    import json
    import shutil

    model_dir = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window": 32}))
    runner = make_runner(model_dir, tokenizer, num_blocks=8)
    assert runner.info is not None and runner.info.sliding_window == 32
    assert runner.info.max_model_len == 1024  # the cache (8 x 16 tokens) does not cap it
    requests = [request("long", [5, 6, 7], max_tokens=300, ignore_eos=True)]
    outputs, results, _ = run_to_completion(runner, requests)
    assert len(outputs["long"]) == 300
    assert max(r.total_blocks - r.free_blocks for r in results) <= 4  # ceil(31 / 16) + 2
    assert not any(r.preempted for r in results)


def test_sampleable_ids_exclude_special_tokens(tokenizer: object) -> None:
    ids = sampleable_token_ids(tokenizer)
    special = set(tokenizer.all_special_ids)  # type: ignore[attr-defined]
    assert special and not special & set(ids.tolist())
    assert ids.min() >= 0 and ids.max() < len(tokenizer)  # type: ignore[arg-type]
    assert len(ids) == len(tokenizer) - 17  # type: ignore[arg-type]  # SmolLM2's added specials


def test_tokens_are_random_sampleable_and_seeded(tiny_model_dir: Path, tokenizer: object) -> None:
    allowed = set(sampleable_token_ids(tokenizer).tolist())
    requests = [request(f"r{i}", [5 + i, 6, 7], max_tokens=40, ignore_eos=True) for i in range(6)]

    def outputs_with(seed: int) -> dict[str, list[int]]:
        return run_to_completion(make_runner(tiny_model_dir, tokenizer, seed=seed), requests)[0]

    first, again, other = outputs_with(1), outputs_with(1), outputs_with(2)
    assert first == again  # the same seed gives the same tokens
    assert first != other
    tokens = [token for output in first.values() for token in output]
    assert all(len(output) == 40 for output in first.values())
    assert set(tokens) <= allowed
    assert len(set(tokens)) > 200  # spread over the vocabulary, not a constant


def test_blocks_follow_the_tokens_and_are_freed(tiny_model_dir: Path, tokenizer: object) -> None:
    runner = make_runner(tiny_model_dir, tokenizer, num_blocks=64, enable_prefix_caching=False)
    allocator = runner.allocator
    assert isinstance(allocator, BlockAllocator)
    prompt = list(range(100, 120))  # 20 tokens
    step = SchedulerStep(0, (request("a", prompt, max_tokens=8),), (ScheduledChunk("a", 0, 20),))
    result = runner.execute(step)
    assert result.request_ids == ("a",) and len(result.token_ids) == 1
    assert len(allocator.block_table("a")) == 2  # 20 tokens -> 2 blocks
    assert result.free_blocks == allocator.num_free_blocks == 62
    assert result.num_computed_tokens == 20
    for position in range(20, 33):  # compute up to 33 tokens: a third block
        result = runner.execute(SchedulerStep(position, chunks=(ScheduledChunk("a", position, 1),)))
    assert len(allocator.block_table("a")) == 3 and result.free_blocks == 61
    assert len(runner.output_token_ids("a")) == 14
    result = runner.execute(SchedulerStep(99, finished=("a",)))
    assert result.free_blocks == 64 and not runner.has_request("a")


def test_prefix_cache_serves_a_shared_prompt(tiny_model_dir: Path, tokenizer: object) -> None:
    runner = make_runner(tiny_model_dir, tokenizer, num_blocks=64)
    prompt = list(range(200, 240))  # 40 tokens: two full blocks
    runner.execute(
        SchedulerStep(0, (request("a", prompt, max_tokens=4),), (ScheduledChunk("a", 0, 40),))
    )
    result = runner.execute(
        SchedulerStep(1, (request("b", prompt, max_tokens=4),), (ScheduledChunk("b", 0, 40),))
    )
    assert result.cached_tokens == {"b": 32}
    assert result.num_computed_tokens == 8  # only the uncached tail is "computed"
    assert result.request_ids == ("b",)
    assert result.prefix_cache_hits == 32 and result.prefix_cache_queries == 80
    assert runner.allocator is not None
    shared = runner.allocator.block_table("a")[:2]
    assert runner.allocator.block_table("b")[:2] == shared
    assert all(runner.allocator.ref_count(block) == 2 for block in shared)


def test_preempts_when_blocks_run_out(tiny_model_dir: Path, tokenizer: object) -> None:
    runner = make_runner(tiny_model_dir, tokenizer, num_blocks=4, enable_prefix_caching=False)
    first, second = list(range(300, 340)), list(range(400, 440))  # 3 blocks each, 4 in all
    result = runner.execute(
        SchedulerStep(
            0,
            (request("a", first), request("b", second)),
            (ScheduledChunk("a", 0, 40), ScheduledChunk("b", 0, 40)),
        )
    )
    assert result.request_ids == ("a",)
    assert result.preempted == ("b",)
    assert result.free_blocks == 1
    assert runner.allocator is not None and not runner.allocator.has_request("b")
    assert runner.has_request("b")  # its tokens are kept for the recompute
    runner.execute(SchedulerStep(1, finished=("a",)))
    result = runner.execute(SchedulerStep(2, chunks=(ScheduledChunk("b", 0, 40),)))
    assert result.request_ids == ("b",) and result.preempted == ()


def test_scheduler_drives_it_through_preemptions(tiny_model_dir: Path, tokenizer: object) -> None:
    runner = make_runner(tiny_model_dir, tokenizer, num_blocks=12)
    requests = [
        request(f"r{i}", list(range(500 + 50 * i, 530 + 50 * i)), max_tokens=60, ignore_eos=True)
        for i in range(4)
    ]  # 4 x 90 tokens = 24 blocks wanted, 12 available
    outputs, results, stats = run_to_completion(runner, requests)
    assert stats.num_preemptions > 0
    assert all(len(output) == 60 for output in outputs.values())
    assert results[-1].free_blocks == 12
    assert runner.allocator is not None and runner.allocator.num_free_blocks == 12


def test_logprobs_are_the_uniform_distribution(tiny_model_dir: Path, tokenizer: object) -> None:
    import math

    runner = make_runner(tiny_model_dir, tokenizer, num_blocks=8)
    result = runner.execute(
        SchedulerStep(0, (request("a", [1, 2, 3], logprobs=0),), (ScheduledChunk("a", 0, 3),))
    )
    assert result.logprob_request_ids == ("a",)
    (logprob,) = result.logprobs
    assert logprob.token_id == result.token_ids[0]
    assert logprob.logprob == pytest.approx(-math.log(len(sampleable_token_ids(tokenizer))))


def test_prompt_logprobs_are_uniform_and_skip_the_cache(
    tiny_model_dir: Path, tokenizer: object
) -> None:
    """As the model runner: scores for each prompt token after the first, once with the
    first token, and no prefix-cache read for a request that asked."""
    import math

    runner = make_runner(tiny_model_dir, tokenizer, num_blocks=16)
    prompt = list(range(200, 240))
    runner.execute(SchedulerStep(0, (request("a", prompt),), (ScheduledChunk("a", 0, 40),)))
    scored = request("b", prompt, prompt_logprobs=0)
    result = runner.execute(SchedulerStep(1, (scored,), (ScheduledChunk("b", 0, 40),)))
    assert result.cached_tokens == {} and result.num_computed_tokens == 40
    entries = result.prompt_logprobs["b"]
    assert [entry.token_id for entry in entries] == prompt[1:]
    uniform = -math.log(len(sampleable_token_ids(tokenizer)))
    assert all(entry.logprob == pytest.approx(uniform) for entry in entries)
    result = runner.execute(SchedulerStep(2, chunks=(ScheduledChunk("b", 40, 1),)))
    assert result.request_ids == ("b",) and result.prompt_logprobs == {}


def test_rejects_inconsistent_steps(tiny_model_dir: Path, tokenizer: object) -> None:
    runner = make_runner(tiny_model_dir, tokenizer, num_blocks=8)
    with pytest.raises(NullStepError, match="unknown request"):
        runner.execute(SchedulerStep(0, chunks=(ScheduledChunk("ghost", 0, 1),)))
    runner.execute(SchedulerStep(1, (request("a", [1, 2, 3]),), (ScheduledChunk("a", 0, 2),)))
    with pytest.raises(NullStepError, match="already registered"):
        runner.execute(SchedulerStep(2, (request("a", [1, 2, 3]),)))
    with pytest.raises(NullStepError, match="past the request"):
        runner.execute(SchedulerStep(3, chunks=(ScheduledChunk("a", 2, 5),)))
    with pytest.raises(NullStepError, match="two chunks"):
        runner.execute(
            SchedulerStep(4, chunks=(ScheduledChunk("a", 2, 1), ScheduledChunk("a", 2, 1)))
        )
    with pytest.raises(RuntimeError, match="load"):
        NullRunner(ExecuteConfig(model=str(tiny_model_dir))).execute(SchedulerStep(0))


def test_engine_streams_detokenized_random_tokens(tiny_model_dir: Path) -> None:
    from pipeline.engine.async_engine import AsyncEngine
    from stages.tokenize import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def run() -> list[tuple[str, tuple[int, ...]]]:
        async with AsyncEngine(str(tiny_model_dir), null_model=True, transport="memory") as engine:
            assert engine.info is not None and engine.info.vocab_size == 49152

            async def one(prompt: str) -> tuple[str, tuple[int, ...]]:
                text = ""
                tokens: tuple[int, ...] = ()
                async for output in engine.generate(prompt, params):
                    text += output.delta
                    tokens = output.token_ids
                return text, tokens

            return await asyncio.gather(*(one(f"Write about {n}.") for n in range(8)))

    for text, tokens in asyncio.run(run()):
        assert len(tokens) == 24
        assert text == tokenizer.decode(list(tokens), skip_special_tokens=True)
