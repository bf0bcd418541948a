"""Parallelism against its peer in the same run (``docs/parallelism.md``):

- **tensor parallelism** (``actorline bench offline --tensor-parallel-size N``; with
  ``--pipeline-parallel-size M`` too, M shards of N ranks each, PP x TP): the offline
  workload of :mod:`pipeline.bench.offline` on the engine with N ranks against one rank, each
  run in a fresh process, alternating; generated tokens/s, their ratio, whether the greedy
  outputs are identical, and rank 0's communication: seconds in all-reduces per engine step (the
  wait for the slowest rank included) and their share of the run's wall time. On a 2-core CPU
  N ranks share the two cores, so TP is not expected to be faster there: the figure says what it
  costs.
- **data parallelism** (``actorline bench ceiling --data-parallel-size N``): the null-model
  load of :mod:`pipeline.bench.ceiling` (:mod:`pipeline.bench.null_load`) on N engine
  replicas behind the router against one engine, both started once and measured in
  alternation; tokens/s delivered to the callers and the ratio. With ``--profile``, where the
  replicated pipeline's time goes (per stage and per host: a frontend host near 100% CPU is
  what caps it).
- **Ray** (``actorline bench ceiling --ray`` / ``offline --ray``): the same workload with the
  engine's hosts as Ray actors (a local cluster, or ``--ray ADDRESS``) against local processes,
  both engines started once and measured in alternation: what Ray costs per token (the data
  path is the same transports). Ray gives an actor as many OpenMP threads as CPUs it reserves
  (``OMP_NUM_THREADS``), so each engine host on Ray reserves the CPUs the local engine computes
  on (``os.cpu_count()``, at most a node's CPUs): with Ray's default of one CPU the model
  would run on one thread and the comparison would measure that instead.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING, Any

from pipeline.bench.null_load import CeilingConfig, null_engine_blocks, stream_all
from pipeline.bench.profile import Profile, build_profile, format_profile, take_snapshot
from pipeline.bench.report import format_rate, format_table, print_result
from pipeline.bench.workload import blocks_to_hold

if TYPE_CHECKING:
    from pipeline.engine.async_engine import AsyncEngine
    from stages.params import SamplingParams

__all__ = [
    "DataParallelResult",
    "OfflineTiming",
    "ParallelRun",
    "PlacementRun",
    "RayResult",
    "TensorParallelConfig",
    "TensorParallelResult",
    "format_data_parallel",
    "format_ray",
    "format_tensor_parallel",
    "generate_all",
    "measure_ray",
    "run_data_parallel",
    "run_ray",
    "run_ray_from_args",
    "run_tensor_parallel",
    "time_offline",
]

_WARMUP_TOKENS = 4


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallelConfig:
    """A workload on ``size`` ranks against one, ``repeats`` times each.

    Raises:
        ValueError: ``size`` below 2 or ``repeats`` below 1.
    """

    model: str = "smollm2-135m"
    size: int = 2
    repeats: int = 1
    dtype: str = "float32"
    max_num_batched_tokens: int = 2048
    #: pipeline shards (``pipeline_parallel_size``) instead of tensor-parallel ranks
    pipeline: bool = False
    #: with ``pipeline``: tensor-parallel ranks per shard (PP x TP, against one engine)
    tensor: int = 1

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"size must be >= 2 (compared with 1 rank), got {self.size}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.tensor < 1 or (self.tensor > 1 and not self.pipeline):
            raise ValueError(
                f"tensor ({self.tensor}) gives each pipeline shard's ranks: >= 1, and > 1 only "
                "with pipeline"
            )

    def engine_options(self, size: int) -> dict[str, int]:
        """The parallelism options of the run at ``size`` (1: one engine)."""
        if not self.pipeline:
            return {"tensor_parallel_size": size}
        if size == 1:
            return {"pipeline_parallel_size": 1}
        return {"pipeline_parallel_size": size, "tensor_parallel_size": self.tensor}


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelRun:
    """One measured run of one configuration (``size`` ranks or replicas)."""

    size: int
    tokens: int
    seconds: float
    tokens_per_second: float
    engine_steps: int
    communication_seconds: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallelResult:
    """Every run of both configurations; the best of each, their ratio, rank 0's
    communication per step and share of wall time (best TP run), and how many requests
    gave the same greedy tokens at N ranks as at one."""

    model: str
    size: int
    num_requests: int
    runs: tuple[ParallelRun, ...]
    best_single: float
    best_parallel: float
    ratio: float
    communication_ms_per_step: float
    communication_share: float
    identical_outputs: int
    load_average: tuple[float, float, float]
    cpu_count: int
    pipeline: bool = False
    tensor: int = 1  # tensor-parallel ranks per pipeline shard


def run_tensor_parallel(
    config: TensorParallelConfig, prompts: list[list[int]], max_tokens: list[int]
) -> TensorParallelResult:
    """Run the comparison on ``prompts`` (token ids), each generating exactly its
    ``max_tokens`` (see the module docstring)."""
    load_average = os.getloadavg()
    runs: list[ParallelRun] = []
    outputs: dict[int, tuple[tuple[int, ...], ...]] = {}
    for _ in range(config.repeats):
        for size in (1, config.size):
            run, tokens = _fresh(config, size, prompts, max_tokens)
            runs.append(run)
            outputs[size] = tokens
    single = max((r for r in runs if r.size == 1), key=lambda r: r.tokens_per_second)
    parallel = max((r for r in runs if r.size > 1), key=lambda r: r.tokens_per_second)
    steps = max(parallel.engine_steps, 1)
    identical = sum(a == b for a, b in zip(outputs[1], outputs[config.size]))
    return TensorParallelResult(
        model=config.model,
        size=config.size,
        num_requests=len(prompts),
        runs=tuple(runs),
        best_single=single.tokens_per_second,
        best_parallel=parallel.tokens_per_second,
        ratio=parallel.tokens_per_second / single.tokens_per_second,
        communication_ms_per_step=parallel.communication_seconds / steps * 1e3,
        communication_share=parallel.communication_seconds / parallel.seconds,
        identical_outputs=identical,
        load_average=load_average,
        cpu_count=os.cpu_count() or 0,
        pipeline=config.pipeline,
        tensor=config.tensor,
    )


def _fresh(
    config: TensorParallelConfig, size: int, prompts: list[list[int]], max_tokens: list[int]
) -> tuple[ParallelRun, tuple[tuple[int, ...], ...]]:
    """:func:`_offline_run` in a freshly spawned process (no run inherits another's
    process state; results come back pickled between the benchmark's own processes)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_offline_run, config, size, prompts, max_tokens).result()


def _offline_run(
    config: TensorParallelConfig, size: int, prompts: list[list[int]], max_tokens: list[int]
) -> tuple[ParallelRun, tuple[tuple[int, ...], ...]]:
    timing = time_offline(
        config.model,
        config.dtype,
        prompts,
        max_tokens,
        config.max_num_batched_tokens,
        **config.engine_options(size),
    )
    tokens, seconds = timing.tokens, timing.seconds
    steps, communication = int(timing.change("num_steps")), timing.change("communication_seconds")
    run = ParallelRun(size, tokens, seconds, tokens / seconds, steps, communication)
    return run, timing.outputs


@dataclasses.dataclass(frozen=True)
class OfflineTiming:
    """One timed greedy run of the offline workload (:func:`time_offline`): the outputs, the
    seconds they took, and the engine's statistics before and after (``EngineStats``)."""

    outputs: tuple[tuple[int, ...], ...]
    seconds: float
    before: Any
    after: Any

    @property
    def tokens(self) -> int:
        return sum(len(output) for output in self.outputs)

    def change(self, field: str) -> float:
        """How much the statistic ``field`` grew over the run (0 where there were none)."""
        after = getattr(self.after, field) if self.after is not None else 0
        return float(after - (getattr(self.before, field) if self.before is not None else 0))


def time_offline(
    model: str,
    dtype: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    max_num_batched_tokens: int | None,
    **engine: Any,
) -> OfflineTiming:
    """Run ``prompts`` greedily (``max_tokens`` each, EOS ignored) on a fresh ``LLM`` with
    ``engine``'s options and room for them all, after a warm-up request; what the parallel
    benchmarks time in each of their fresh processes."""
    from pipeline.engine.llm import LLM
    from stages.params import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    with LLM(
        model,
        dtype=dtype,
        num_blocks=blocks_to_hold(prompts, max_tokens, 16) + 1,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=max_num_batched_tokens,
        **engine,
    ) as llm:
        warmup = SamplingParams(max_tokens=_WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0]], warmup, use_tqdm=False)
        before = llm.engine.stats
        began = time.perf_counter()
        results = llm.generate(list(prompts), params, use_tqdm=False)
        seconds = time.perf_counter() - began
        after = llm.engine.stats
    outputs = tuple(tuple(result.token_ids) for result in results)
    return OfflineTiming(outputs, seconds, before, after)


def format_tensor_parallel(result: TensorParallelResult) -> str:
    """The readable report."""
    name = "PP" if result.pipeline else "TP"

    def label(size: int) -> str:
        return f"{name}={size}" + (f"xTP={result.tensor}" if size > 1 and result.tensor > 1 else "")

    rows = [
        [
            label(run.size),
            run.tokens,
            run.seconds,
            run.tokens_per_second,
            run.engine_steps,
            run.communication_seconds / max(run.engine_steps, 1) * 1e3,
        ]
        for run in result.runs
    ]
    return "\n".join(
        [
            format_table(
                [
                    "shards" if result.pipeline else "ranks",
                    "tokens",
                    "seconds",
                    "tokens/s",
                    "engine steps",
                    "comm ms/step",
                ],
                rows,
                title=f"{'pipeline' if result.pipeline else 'tensor'} parallelism: "
                f"{result.model}, {result.num_requests} requests "
                f"(the offline workload, greedy); {result.cpu_count} CPUs, load average "
                f"{result.load_average[0]:.2f} at start",
            ),
            f"best {label(result.size)} {format_rate(result.best_parallel)} against {name}=1 "
            f"{format_rate(result.best_single)}: {result.ratio:.2f}x",
            (
                "hidden states and logits between the shards (the round trip less the other "
                "shards' compute: transfer and queueing): "
                if result.pipeline
                else "rank 0 in all-reduces (the slowest rank's wait included): "
            )
            + f"{result.communication_ms_per_step:.2f} ms per engine step, "
            f"{result.communication_share:.0%} of the run's wall time",
            f"greedy outputs identical to {name}=1: "
            f"{result.identical_outputs}/{result.num_requests}",
        ]
    )


# -- data parallelism -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DataParallelResult:
    """Every repeat of both engines; best and median of each, the ratio of the bests, the
    requests each replica took, and (``--profile``) the replicated engine's best repeat."""

    model: str
    size: int
    num_requests: int
    max_tokens: int
    runs: tuple[ParallelRun, ...]
    best_single: float
    best_parallel: float
    median_single: float
    median_parallel: float
    ratio: float
    routed: dict[str, int]
    load_average: tuple[float, float, float]
    cpu_count: int
    profile: Profile | None = None


async def measure_data_parallel(
    config: CeilingConfig, size: int, prompts: Sequence[str]
) -> DataParallelResult:
    """Run the comparison on ``prompts`` on the running event loop (see the module
    docstring)."""
    from pipeline.engine.async_engine import AsyncEngine
    from stages.params import SamplingParams
    from stages.route import RouterStage

    if size < 2:
        raise ValueError(f"size must be >= 2 (compared with one engine), got {size}")
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)

    def engine(replicas: int) -> AsyncEngine:
        return AsyncEngine(
            config.model,
            null_model=True,
            transport=config.transport,
            max_num_seqs=config.num_requests,
            num_blocks=null_engine_blocks(config),
            tune_gc=config.tune_gc,
            data_parallel_size=replicas,
        )

    load_average = os.getloadavg()
    runs: list[ParallelRun] = []
    profiles: list[Profile | None] = []
    single, replicated = engine(1), engine(size)
    async with single, replicated:
        warmup = SamplingParams(max_tokens=_WARMUP_TOKENS, ignore_eos=True)
        for each in (single, replicated):
            await stream_all(each, prompts[:16], warmup)
        for _ in range(config.repeats):
            for replicas, each in ((1, single), (size, replicated)):
                profiled = config.profile and replicas > 1
                before = await take_snapshot(each.running) if profiled else None
                steps = each.stats.num_steps if each.stats else 0
                began = time.perf_counter()
                tokens = await stream_all(each, prompts, params)
                seconds = time.perf_counter() - began
                steps = (each.stats.num_steps if each.stats else 0) - steps
                runs.append(ParallelRun(replicas, tokens, seconds, tokens / seconds, steps))
                if before is not None:
                    after = await take_snapshot(each.running)
                    profiles.append(build_profile(before, after, seconds, tokens))
                elif replicas > 1:
                    profiles.append(None)
        router = replicated.running.stage("router")
        routed = dict(router.routed) if isinstance(router, RouterStage) else {}
    rates = {n: [r.tokens_per_second for r in runs if r.size == n] for n in (1, size)}
    best = max(range(len(rates[size])), key=lambda index: rates[size][index])
    return DataParallelResult(
        model=config.model,
        size=size,
        num_requests=config.num_requests,
        max_tokens=config.max_tokens,
        runs=tuple(runs),
        best_single=max(rates[1]),
        best_parallel=max(rates[size]),
        median_single=statistics.median(rates[1]),
        median_parallel=statistics.median(rates[size]),
        ratio=max(rates[size]) / max(rates[1]),
        routed=routed,
        load_average=load_average,
        cpu_count=os.cpu_count() or 0,
        profile=profiles[best],
    )


def run_data_parallel(
    config: CeilingConfig, size: int, prompts: Sequence[str]
) -> DataParallelResult:
    """Run the comparison in a fresh event loop."""
    return asyncio.run(measure_data_parallel(config, size, prompts))


def format_data_parallel(result: DataParallelResult) -> str:
    """The readable report."""
    rows: list[list[Any]] = [
        [f"DP={run.size}", run.tokens, run.seconds, run.tokens_per_second, run.engine_steps]
        for run in result.runs
    ]
    routed = ", ".join(f"replica {name}: {count}" for name, count in sorted(result.routed.items()))
    text = [
        format_table(
            ["replicas", "tokens", "seconds", "tokens/s", "engine steps"],
            rows,
            title=f"data parallelism: null model, {result.num_requests} streaming requests x "
            f"{result.max_tokens} tokens, DP={result.size} against one engine, alternating; "
            f"{result.cpu_count} CPUs, load average {result.load_average[0]:.2f} at start",
        ),
        f"best DP={result.size} {format_rate(result.best_parallel)} against DP=1 "
        f"{format_rate(result.best_single)}: {result.ratio:.2f}x (medians "
        f"{format_rate(result.median_parallel)} / {format_rate(result.median_single)})",
        f"requests routed, warm-up included: {routed}",
    ]
    if result.profile is not None:
        text += ["", format_profile(result.profile, title=f"DP={result.size}, best repeat")]
    return "\n".join(text)


# -- Ray against local processes --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementRun:
    """One measured run with the engine on ``placement`` ("local" processes or "ray")."""

    placement: str
    tokens: int
    seconds: float
    tokens_per_second: float


@dataclasses.dataclass(frozen=True, slots=True)
class RayResult:
    """``benchmark``'s workload with the engine's hosts on Ray against local processes, both
    engines started once and measured in alternation: every run, the best of each, their
    ratio, and whether both gave the same outputs (greedy workloads)."""

    benchmark: str
    model: str
    num_requests: int
    runs: tuple[PlacementRun, ...]
    best_local: float
    best_ray: float
    ratio: float
    identical_outputs: int
    load_average: tuple[float, float, float]
    cpu_count: int
    ray_num_cpus: float


async def measure_ray(
    benchmark: str,
    model: str,
    options: dict[str, Any],
    prompts: Sequence[Any],
    params: Sequence[SamplingParams],
    *,
    repeats: int = 2,
    ray_address: str | None = None,
    ray_auth_token_file: str | None = None,
) -> RayResult:
    """Run ``prompts`` (strings or token ids, each with its ``params``) on an engine with
    ``options`` on local processes and on one whose hosts are Ray actors (on the cluster at
    ``ray_address``, joined with ``ray_auth_token_file``'s token where it wants one),
    alternating, ``repeats`` times each (see the module docstring).

    Raises:
        RayConnectionError: the cluster cannot be reached or refuses this process.
    """
    from pipeline.engine.async_engine import AsyncEngine

    load_average = os.getloadavg()
    ray_num_cpus = _local_cpus_on_ray()
    local = AsyncEngine(model, **options)
    on_ray = AsyncEngine(
        model,
        **options,
        ray=True,
        ray_address=ray_address,
        ray_auth_token_file=ray_auth_token_file,
        ray_num_cpus=ray_num_cpus,
    )
    runs: list[PlacementRun] = []
    outputs: dict[str, list[tuple[int, ...]]] = {}
    async with on_ray, local:  # (on Ray first: a cluster that refuses, before any work)
        warmup = [params[0]]
        for engine in (local, on_ray):
            await generate_all(engine, prompts[:1], warmup)
        for _ in range(repeats):
            for placement, engine in (("local", local), ("ray", on_ray)):
                began = time.perf_counter()
                results = await generate_all(engine, prompts, params)
                seconds = time.perf_counter() - began
                tokens = sum(len(tokens) for tokens in results)
                runs.append(PlacementRun(placement, tokens, seconds, tokens / seconds))
                outputs[placement] = results
    best = {p: max(r.tokens_per_second for r in runs if r.placement == p) for p in ("local", "ray")}
    identical = sum(a == b for a, b in zip(outputs["local"], outputs["ray"]))
    return RayResult(
        benchmark=benchmark,
        model=model,
        num_requests=len(prompts),
        runs=tuple(runs),
        best_local=best["local"],
        best_ray=best["ray"],
        ratio=best["ray"] / best["local"],
        identical_outputs=identical,
        load_average=load_average,
        cpu_count=os.cpu_count() or 0,
        ray_num_cpus=ray_num_cpus,
    )


def _local_cpus_on_ray() -> float:
    """The CPUs a local engine computes on (``os.cpu_count()``), or fewer where this process
    is connected to a Ray cluster none of whose nodes has that many (a test's small cluster)."""
    cpus = float(os.cpu_count() or 1)
    try:
        import ray
    except ImportError:
        return cpus
    if ray.is_initialized():
        from pipeline.runtime.ray_hosts import largest_node_cpus

        cpus = min(cpus, largest_node_cpus() or cpus)
    return cpus


async def generate_all(
    engine: AsyncEngine, prompts: Sequence[Any], params: Sequence[SamplingParams]
) -> list[tuple[int, ...]]:
    """Stream every prompt concurrently; each one's generated token ids."""

    async def one(prompt: Any, sampling: SamplingParams) -> tuple[int, ...]:
        tokens: tuple[int, ...] = ()
        async for output in engine.generate(prompt, sampling):
            tokens = output.token_ids
        return tokens

    return list(
        await asyncio.gather(
            *(one(prompt, params[index % len(params)]) for index, prompt in enumerate(prompts))
        )
    )


def run_ray(*args: Any, **kwargs: Any) -> RayResult:
    """:func:`measure_ray` in a fresh event loop."""
    return asyncio.run(measure_ray(*args, **kwargs))


def run_ray_from_args(
    args: argparse.Namespace,
    benchmark: str,
    model: str,
    options: dict[str, Any],
    prompts: Sequence[Any],
    params: Sequence[SamplingParams],
    *,
    repeats: int,
) -> int:
    """:func:`run_ray` on the cluster the options of
    :func:`~pipeline.bench.report.add_ray_arguments` name, its result printed (``--json``
    or readable); the exit status.

    Raises:
        RayConnectionError: the cluster refuses this process.
    """
    result = run_ray(
        benchmark,
        model,
        options,
        prompts,
        params,
        repeats=repeats,
        ray_address=args.ray or None,
        ray_auth_token_file=args.ray_auth_token_file,
    )
    print_result(result, format_ray(result), args.json)
    return 0


def format_ray(result: RayResult) -> str:
    """The readable report."""
    rows = [[run.placement, run.tokens, run.seconds, run.tokens_per_second] for run in result.runs]
    return "\n".join(
        [
            format_table(
                ["engine hosts", "tokens", "seconds", "tokens/s"],
                rows,
                title=f"{result.benchmark} on Ray against local processes: {result.model}, "
                f"{result.num_requests} requests, alternating; {result.cpu_count} CPUs "
                f"(each Ray host reserves {result.ray_num_cpus:g}), load average "
                f"{result.load_average[0]:.2f} at start",
            ),
            f"best on Ray {format_rate(result.best_ray)} against local "
            f"{format_rate(result.best_local)}: {result.ratio:.2f}x",
        ]
        + (  # the null model's tokens are random: only a real model's can agree
            [f"greedy outputs identical: {result.identical_outputs}/{result.num_requests}"]
            if result.benchmark == "offline"
            else []
        )
    )
