"""Pipeline parallelism against one engine in the same run (``actorline bench offline
--pipeline-parallel-size N``; docs/parallelism.md "Pipeline parallelism").

The offline workload of :mod:`pipeline.bench.offline` (greedy, each request generating
exactly its ``max_tokens``) on three engines, each run in a fresh process, alternating, best
of ``repeats``: one engine (PP=1), N shards with one step in flight
(``pipeline_parallel_micro_batches=1``: the shards compute in turn), and N shards with N
steps in flight (micro-batches, the default: the shards compute at once). For each: generated
tokens/s and the ratio to PP=1, whether the greedy outputs are identical to PP=1's, the
transfer per engine step (over each hop between shards, the seconds its receiver sat
waiting for the message: ``StepResult.communication_seconds``, :func:`~stages.execute.
pp_stage.hop_seconds`), and the **bubble fraction**: the share of the shards'
time they sat idle over the run (one less their busy seconds over shards x wall time; a
shard's busy time is its forward passes, the first shard's bookkeeping and sampling too:
``EngineStats.shard_busy_seconds``), and the bytes the last shard's answers took per engine
step (its sampled tokens: ``EngineStats.pipeline_answer_bytes``; the logits of the sampled
rows came back before, ``[K, V]`` float32). On a loaded machine a shard's compute stretches while
it waits for a core, so the bubble reads low there: the figure is of this machine's load.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from pipeline.bench.parallel import time_offline
from pipeline.bench.report import format_rate, format_table
from stages.steps_in_flight import bubble_fraction

__all__ = [
    "PipelineParallelConfig",
    "PipelineParallelResult",
    "PipelineRun",
    "format_pipeline_parallel",
    "run_pipeline_parallel",
]


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineParallelConfig:
    """The workload on ``size`` shards (one step in flight, then ``size``) against one
    engine, ``repeats`` times each.

    Raises:
        ValueError: ``size`` below 2 or ``repeats`` below 1.
    """

    model: str = "smollm2-135m"
    size: int = 2
    repeats: int = 1
    dtype: str = "float32"
    max_num_batched_tokens: int = 2048
    split: str | None = None

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"size must be >= 2 (compared with one engine), got {self.size}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")

    def variants(self) -> tuple[tuple[int, int], ...]:
        """``(shards, steps in flight)`` of each engine compared, in the order they run."""
        return ((1, 1), (self.size, 1), (self.size, self.size))


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineRun:
    """One measured run of one engine: ``shards`` with ``steps_in_flight``."""

    shards: int
    steps_in_flight: int
    tokens: int
    seconds: float
    tokens_per_second: float
    engine_steps: int
    communication_seconds: float = 0.0
    shard_busy_seconds: tuple[float, ...] = ()
    #: the bytes of the last shard's answers over the run (stages.execute.pp_sampling)
    answer_bytes: float = 0.0

    @property
    def name(self) -> str:
        if self.shards == 1:
            return "PP=1"
        return f"PP={self.shards}, {self.steps_in_flight} in flight"

    @property
    def bubble(self) -> float:
        """The shards' idle share of the run (0 for one engine)."""
        return bubble_fraction(self.shard_busy_seconds, self.seconds)

    @property
    def communication_ms_per_step(self) -> float:
        return self.communication_seconds / max(self.engine_steps, 1) * 1e3

    @property
    def answer_bytes_per_step(self) -> float:
        return self.answer_bytes / max(self.engine_steps, 1)

    @property
    def answer_bytes_per_token(self) -> float:
        return self.answer_bytes / max(self.tokens, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineParallelResult:
    """Every run; the best of each engine (by tokens/s) and its ratio to PP=1's best, and
    how many requests each engine's greedy outputs matched PP=1's in."""

    model: str
    size: int
    num_requests: int
    runs: tuple[PipelineRun, ...]
    best: tuple[PipelineRun, ...]  # one per variant, in the config's order
    ratios: tuple[float, ...]  # each best against PP=1's best
    identical_outputs: tuple[int, ...]  # each variant against PP=1
    load_average: tuple[float, float, float]
    cpu_count: int


def run_pipeline_parallel(
    config: PipelineParallelConfig, prompts: list[list[int]], max_tokens: list[int]
) -> PipelineParallelResult:
    """Run the comparison on ``prompts`` (token ids), each generating exactly its
    ``max_tokens`` (see the module docstring)."""
    load_average = os.getloadavg()
    variants = config.variants()
    runs: list[PipelineRun] = []
    outputs: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
    for _ in range(config.repeats):
        for shards, in_flight in variants:
            run, tokens = _fresh(config, shards, in_flight, prompts, max_tokens)
            runs.append(run)
            outputs[shards, in_flight] = tokens
    best = tuple(
        max(
            (r for r in runs if (r.shards, r.steps_in_flight) == variant),
            key=lambda r: r.tokens_per_second,
        )
        for variant in variants
    )
    single = outputs[variants[0]]
    return PipelineParallelResult(
        model=config.model,
        size=config.size,
        num_requests=len(prompts),
        runs=tuple(runs),
        best=best,
        ratios=tuple(run.tokens_per_second / best[0].tokens_per_second for run in best),
        identical_outputs=tuple(
            sum(a == b for a, b in zip(single, outputs[variant], strict=True))
            for variant in variants
        ),
        load_average=load_average,
        cpu_count=os.cpu_count() or 0,
    )


def _fresh(
    config: PipelineParallelConfig,
    shards: int,
    in_flight: int,
    prompts: list[list[int]],
    max_tokens: list[int],
) -> tuple[PipelineRun, tuple[tuple[int, ...], ...]]:
    """:func:`_offline_run` in a freshly spawned process (no run inherits another's
    process state; results come back pickled between the benchmark's own processes)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_offline_run, config, shards, in_flight, prompts, max_tokens).result()


def _offline_run(
    config: PipelineParallelConfig,
    shards: int,
    in_flight: int,
    prompts: list[list[int]],
    max_tokens: list[int],
) -> tuple[PipelineRun, tuple[tuple[int, ...], ...]]:
    pipeline = {}
    if shards > 1:
        pipeline = dict(
            pipeline_parallel_size=shards,
            pipeline_parallel_split=config.split,
            pipeline_parallel_micro_batches=in_flight,
        )
    timing = time_offline(
        config.model, config.dtype, prompts, max_tokens, config.max_num_batched_tokens, **pipeline
    )
    before, after = timing.before, timing.after
    assert after is not None
    busy_before = before.shard_busy_seconds if before else ()
    busy = tuple(
        total - (busy_before[shard] if shard < len(busy_before) else 0.0)
        for shard, total in enumerate(after.shard_busy_seconds)
    )
    tokens, seconds = timing.tokens, timing.seconds
    steps, communication = int(timing.change("num_steps")), timing.change("communication_seconds")
    run = PipelineRun(
        shards,
        in_flight,
        tokens,
        seconds,
        tokens / seconds,
        steps,
        communication,
        busy,
        timing.change("pipeline_answer_bytes"),
    )
    return run, timing.outputs


def format_pipeline_parallel(result: PipelineParallelResult) -> str:
    """The readable report."""
    rows = [
        [
            run.name,
            run.tokens,
            run.seconds,
            run.tokens_per_second,
            run.engine_steps,
            run.communication_ms_per_step if run.shards > 1 else "-",
            f"{run.answer_bytes_per_step:.0f}" if run.shards > 1 else "-",
            f"{run.bubble:.0%}" if run.shards > 1 else "-",
        ]
        for run in result.runs
    ]
    lines = [
        format_table(
            [
                "engine",
                "tokens",
                "seconds",
                "tokens/s",
                "engine steps",
                "xfer ms/step",
                "back B/step",
                "bubble",
            ],
            rows,
            title=f"pipeline parallelism: {result.model}, {result.num_requests} requests (the "
            f"offline workload, greedy); {result.cpu_count} CPUs, load average "
            f"{result.load_average[0]:.2f} at start",
        )
    ]
    for run, ratio, identical in zip(
        result.best, result.ratios, result.identical_outputs, strict=True
    ):
        if run.shards == 1:
            lines.append(f"best PP=1 {format_rate(run.tokens_per_second)}")
            continue
        busy = ", ".join(f"{seconds:.2f}" for seconds in run.shard_busy_seconds)
        lines.append(
            f"best {run.name} {format_rate(run.tokens_per_second)}: {ratio:.2f}x PP=1; "
            f"transfer {run.communication_ms_per_step:.2f} ms per engine step; back from the "
            f"last shard {run.answer_bytes_per_step:.0f} bytes per engine step "
            f"({run.answer_bytes_per_token:.1f} per sampled token: tokens, not logits); "
            f"bubble {run.bubble:.0%} (shards busy {busy} s of {run.seconds:.2f} s); greedy "
            f"outputs identical to PP=1: {identical}/{result.num_requests}"
        )
    return "\n".join(lines)
