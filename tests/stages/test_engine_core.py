"""The engine step (stages.engine_core, docs/architecture.md §2.7): EngineCore.step drives the
real scheduler and the null model's runner through preemptions to the same outputs as the
scheduler's own loop; in the LLM pipeline a colocated execute stage is called directly (its
mailbox never sees a step, its statistics count every step), and an execute stage placed on
another host gets each step as a message, with the same greedy answers, constrained ones
included."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline import AsyncEngine, SamplingParams, StructuredOutputsParams
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline
from pipeline.runtime.control import HostStatistics, StageStatistics
from stages.engine_core import EngineCore
from stages.execute.config import ExecuteConfig
from stages.execute.null import NullRunner
from stages.messages import EngineRequest, SchedulerStep, StepResult
from stages.policies import load_policy
from stages.scheduler import Scheduler, SchedulerConfig
from stages.tokenize import load_tokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CHOICE = SamplingParams(
    max_tokens=16,
    temperature=0.0,
    structured_outputs=StructuredOutputsParams(choice=("red", "green", "blue")),
)
PROMPTS = ("The engine step", "reads in one place", "schedule, execute, update")


def _engine(model_dir: Path) -> tuple[Scheduler, NullRunner]:
    """A scheduler and a null runner (12 blocks, seeded) holding four requests that want
    24 blocks between them."""
    runner = NullRunner(ExecuteConfig(model=str(model_dir), num_blocks=12, seed=7))
    info = runner.load(load_tokenizer(str(model_dir)))
    scheduler = Scheduler(SchedulerConfig(), load_policy("fcfs"))
    scheduler.set_engine_info(info)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for i in range(4):  # 4 x 90 tokens = 24 blocks wanted, 12 available
        prompt = tuple(range(500 + 50 * i, 530 + 50 * i))
        scheduler.add_request(EngineRequest(f"r{i}", prompt, params))
    return scheduler, runner


def test_step_runs_the_scheduler_and_runner_through_preemptions(tiny_model_dir: Path) -> None:
    scheduler, runner = _engine(tiny_model_dir)
    core = EngineCore(scheduler)
    steps: list[SchedulerStep] = []

    async def execute(step: SchedulerStep) -> StepResult:
        steps.append(step)
        return runner.execute(step)

    async def drive() -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
        finished: dict[str, str | None] = {}
        while (update := await core.step(execute)) is not None:
            outputs = update.outputs
            assert update.rejected == ()
            for request_id, new, finish in zip(
                outputs.request_ids, outputs.new_token_ids, outputs.finish_reasons, strict=True
            ):
                tokens[request_id].extend(new)
                if finish is not None:
                    finished[request_id] = finish
        assert finished == {f"r{i}": "length" for i in range(4)}
        return tokens

    tokens = asyncio.run(drive())
    assert {len(t) for t in tokens.values()} == {60}
    # the same tokens as the scheduler's and runner's own calls, one after the other
    plain_scheduler, plain_runner = _engine(tiny_model_dir)
    plain: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    while (step := plain_scheduler.schedule()) is not None:
        outputs = plain_scheduler.update(plain_runner.execute(step))
        for request_id, new in zip(outputs.request_ids, outputs.new_token_ids, strict=True):
            plain[request_id].extend(new)
    assert tokens == plain
    assert scheduler.stats().num_preemptions > 0
    assert not scheduler.has_work() and not scheduler.in_flight
    assert scheduler.stats().num_steps == len(steps)
    assert runner.allocator is not None and runner.allocator.num_free_blocks == 12


def _stage(snapshots: list[HostStatistics], name: str) -> tuple[str, StageStatistics]:
    return next((host.host, s) for host in snapshots for s in host.stages if s.name == name)


async def _answers(engine: AsyncEngine) -> list[tuple[int, ...]]:
    async def one(prompt: str, params: SamplingParams) -> tuple[int, ...]:
        tokens: tuple[int, ...] = ()
        async for output in engine.generate(prompt, params):
            tokens = output.token_ids
        return tokens

    free = [one(prompt, GREEDY) for prompt in PROMPTS]
    return list(await asyncio.gather(*free, one("a colour", CHOICE)))


@pytest.mark.slow
def test_colocated_execute_is_called_and_a_remote_one_gets_messages(tiny_model_dir: Path) -> None:
    options = EngineOptions.create(str(tiny_model_dir), seed=3)
    colocated = llm_pipeline(options)
    remote = llm_pipeline(options).place("execute", "model")

    async def run(pipeline: object) -> tuple[list[tuple[int, ...]], str, StageStatistics, int]:
        async with AsyncEngine(pipeline=pipeline) as engine:  # type: ignore[arg-type]
            answers = await _answers(engine)
            assert await engine.running.wait_idle(30.0)
            host, execute = _stage(await engine.running.statistics(), "execute")
            assert engine.stats is not None
            return answers, host, execute, engine.stats.num_steps

    direct, direct_host, direct_stats, direct_steps = asyncio.run(run(colocated))
    hop, hop_host, hop_stats, hop_steps = asyncio.run(run(remote))
    assert direct == hop
    assert [len(t) for t in direct[:-1]] == [GREEDY.max_tokens] * len(PROMPTS)
    assert direct[-1], "the constrained request produced nothing"
    assert (direct_host, hop_host) == ("engine", "model")
    # colocated: every step counted as execute's work, none through its mailbox
    assert direct_stats.handled == direct_steps > 0
    assert direct_stats.mailbox.messages_sent == 0
    # on another host: each step arrived as a message
    assert hop_stats.handled == hop_stats.mailbox.messages_received == hop_steps > 0
