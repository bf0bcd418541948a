"""Pipeline parallelism on a Ray cluster against one engine on the same cluster
(``actorline bench offline --pipeline-parallel-size N --ray ADDRESS``; docs/parallelism.md,
"Pipeline parallelism on Ray"): the offline workload on an engine of N shards, each a Ray
actor placed as ``--ray-placement-strategy`` / ``--ray-shard-resources`` say (on a cluster of
several nodes: shards on different nodes), each shard a tensor-parallel group of
``--tensor-parallel-size`` ranks (its ranks on its node: PP x TP), against the same engine
unsplit (PP=1, TP=1) on the cluster, alternating, ``--repeats`` times each, each run a fresh
engine (started, warmed up with one request, measured, closed).

It reports generated tokens/s of each run, the best of each and their ratio, how many requests
gave the same greedy tokens, the first shard's communication per engine step (the hops'
transfer and queueing, :attr:`~pipeline.engine.stats.EngineStats.communication_seconds`), and
the node each host ran on (Ray's node ids: simulated nodes of one machine share an IP). Every
host reserves ``--ray-num-cpus`` CPUs, which Ray also makes its thread count: both engines
compute on as many threads per host. One step runs at a time through the shards, so on the
same cores PP is not expected to be faster: the figure says what the split and its hops cost.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.bench.parallel import generate_all
from pipeline.bench.report import format_rate, format_table, print_result

if TYPE_CHECKING:
    from pipeline.engine.async_engine import AsyncEngine
    from stages.params import SamplingParams

__all__ = [
    "RAY_PIPELINE_OPTIONS",
    "RayPipelineResult",
    "RayPipelineRun",
    "add_ray_pipeline_arguments",
    "check_ray_pipeline_arguments",
    "format_ray_pipeline",
    "measure_ray_pipeline",
    "run_ray_pipeline_from_args",
]

#: the engine options this benchmark takes as flags (each one's flag from its declaration)
RAY_PIPELINE_OPTIONS = ("ray_placement_strategy", "ray_shard_resources", "ray_num_cpus")


@dataclasses.dataclass(frozen=True, slots=True)
class RayPipelineRun:
    """One measured run of the engine with ``shards`` pipeline shards."""

    shards: int
    tokens: int
    seconds: float
    tokens_per_second: float
    engine_steps: int
    communication_seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class RayPipelineResult:
    """Every run of both engines; the best of each and their ratio (PP=N over PP=1); the PP
    engine's communication per step in its best run; greedy agreement; each engine's hosts
    and the Ray node each ran on. ``tensor``: each shard's tensor-parallel ranks."""

    model: str
    size: int
    num_requests: int
    runs: tuple[RayPipelineRun, ...]
    best_single: float
    best_pipeline: float
    ratio: float
    communication_ms_per_step: float
    identical_outputs: int
    nodes: dict[str, str]
    placement_strategy: str
    shard_resources: str | None
    ray_num_cpus: float
    load_average: tuple[float, float, float]
    cpu_count: int
    tensor: int = 1


def add_ray_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of :data:`RAY_PIPELINE_OPTIONS` (used with ``--pipeline-parallel-size N
    --ray``)."""
    from pipeline.engine.option_fields import add_option_argument
    from pipeline.engine.options import EngineOptions

    for name in RAY_PIPELINE_OPTIONS:
        add_option_argument(parser, EngineOptions, name)


def check_ray_pipeline_arguments(args: argparse.Namespace, on_ray: bool) -> None:
    """Refuse the flags of :data:`RAY_PIPELINE_OPTIONS` where the benchmark does not run PP on
    Ray (they would be ignored).

    Raises:
        ValueError: one of them differs from its default without ``--ray`` and
            ``--pipeline-parallel-size`` above 1.
    """
    from pipeline.engine.options import EngineOptions

    defaults = EngineOptions()
    given = [
        name for name in RAY_PIPELINE_OPTIONS if getattr(args, name) != getattr(defaults, name)
    ]
    if given and not (on_ray and args.pipeline_parallel_size > 1):
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(
            f"{flags} place pipeline shards on Ray: give --pipeline-parallel-size N (N > 1) "
            "and --ray too"
        )


async def measure_ray_pipeline(
    model: str,
    options: dict[str, Any],
    prompts: Sequence[Any],
    params: Sequence[SamplingParams],
    *,
    size: int,
    repeats: int = 2,
    ray_address: str | None = None,
    ray_auth_token_file: str | None = None,
    placement_strategy: str = "auto",
    shard_resources: str | None = None,
    ray_num_cpus: float = 1.0,
    tensor: int = 1,
) -> RayPipelineResult:
    """Run ``prompts`` (each with its ``params``) on engines of ``size`` shards (of ``tensor``
    ranks each) and unsplit,
    each with every host a Ray actor of ``ray_num_cpus`` CPUs on the cluster at
    ``ray_address``, alternating, ``repeats`` times each (see the module docstring).

    Raises:
        RayConnectionError: the cluster cannot be reached or refuses this process.
        TimeoutError: the cluster cannot reserve either engine's placement group.
        ValueError: an invalid option.
    """
    from pipeline.engine.async_engine import AsyncEngine

    load_average = os.getloadavg()
    on_ray: dict[str, Any] = dict(
        ray=True,
        ray_address=ray_address,
        ray_auth_token_file=ray_auth_token_file,
        ray_num_cpus=ray_num_cpus,
    )
    split: dict[str, Any] = dict(
        pipeline_parallel_size=size,
        tensor_parallel_size=tensor,
        ray_placement_strategy=placement_strategy,
        ray_shard_resources=shard_resources,
    )
    runs: list[RayPipelineRun] = []
    outputs: dict[int, list[tuple[int, ...]]] = {}
    nodes: dict[str, str] = {}
    for _ in range(repeats):
        for shards in (1, size):
            # NOTE: a fresh engine each run: two engines of one pipeline name in one process
            # cannot hold their placement groups (named after it, in the process's Ray
            # namespace) at once
            extra: dict[str, Any] = split if shards > 1 else {}
            async with AsyncEngine(model, **options, **on_ray, **extra) as engine:
                for host in sorted(engine.running.pids):
                    actor = engine.running.ray_actor(host)
                    nodes[f"pp{shards} {host}"] = str(await actor.node_id.remote())
                await generate_all(engine, prompts[:1], params[:1])  # warm-up
                run, tokens = await _measured(engine, shards, prompts, params)
            runs.append(run)
            outputs[shards] = tokens
    best_single = max((r for r in runs if r.shards == 1), key=lambda r: r.tokens_per_second)
    best = max((r for r in runs if r.shards == size), key=lambda r: r.tokens_per_second)
    return RayPipelineResult(
        model=model,
        size=size,
        num_requests=len(prompts),
        runs=tuple(runs),
        best_single=best_single.tokens_per_second,
        best_pipeline=best.tokens_per_second,
        ratio=best.tokens_per_second / best_single.tokens_per_second,
        communication_ms_per_step=best.communication_seconds / max(best.engine_steps, 1) * 1e3,
        identical_outputs=sum(a == b for a, b in zip(outputs[1], outputs[size])),
        nodes=nodes,
        placement_strategy=placement_strategy,
        shard_resources=shard_resources,
        ray_num_cpus=ray_num_cpus,
        load_average=load_average,
        cpu_count=os.cpu_count() or 0,
        tensor=tensor,
    )


async def _measured(
    engine: AsyncEngine, shards: int, prompts: Sequence[Any], params: Sequence[SamplingParams]
) -> tuple[RayPipelineRun, list[tuple[int, ...]]]:
    before = engine.stats
    began = time.perf_counter()
    outputs = await generate_all(engine, prompts, params)
    seconds = time.perf_counter() - began
    after = engine.stats
    steps = (after.num_steps if after else 0) - (before.num_steps if before else 0)
    communication = (after.communication_seconds if after else 0.0) - (
        before.communication_seconds if before else 0.0
    )
    tokens = sum(len(output) for output in outputs)
    run = RayPipelineRun(shards, tokens, seconds, tokens / seconds, steps, communication)
    return run, outputs


def run_ray_pipeline_from_args(
    args: argparse.Namespace,
    model: str,
    options: dict[str, Any],
    prompts: Sequence[Any],
    params: Sequence[SamplingParams],
) -> int:
    """:func:`measure_ray_pipeline` as the flags say, its result printed (``--json`` or
    readable); the exit status.

    Raises:
        RayConnectionError: the cluster refuses this process.
    """
    result = asyncio.run(
        measure_ray_pipeline(
            model,
            options,
            prompts,
            params,
            size=args.pipeline_parallel_size,
            repeats=args.repeats,
            ray_address=args.ray or None,
            ray_auth_token_file=args.ray_auth_token_file,
            placement_strategy=args.ray_placement_strategy,
            shard_resources=args.ray_shard_resources,
            ray_num_cpus=args.ray_num_cpus,
            tensor=args.tensor_parallel_size,
        )
    )
    print_result(result, format_ray_pipeline(result), args.json)
    return 0


def format_ray_pipeline(result: RayPipelineResult) -> str:
    """The readable report."""
    ranks = f" x TP={result.tensor}" if result.tensor > 1 else ""
    rows = [
        [
            f"PP={run.shards}" + (ranks if run.shards > 1 else ""),
            run.tokens,
            run.seconds,
            run.tokens_per_second,
            run.engine_steps,
        ]
        for run in result.runs
    ]
    order = dict.fromkeys(result.nodes.values())
    distinct = {node: f"node {index}" for index, node in enumerate(order)}
    placed = ", ".join(f"{host} on {distinct[node]}" for host, node in result.nodes.items())
    pins = f", shards pinned to {result.shard_resources}" if result.shard_resources else ""
    return "\n".join(
        [
            format_table(
                ["engine", "tokens", "seconds", "tokens/s", "steps"],
                rows,
                title=f"pipeline parallelism on Ray against PP=1 on Ray: {result.model}, "
                f"{result.num_requests} requests, alternating; {result.cpu_count} CPUs here, "
                f"each host reserves {result.ray_num_cpus:g} (its threads), placement "
                f"{result.placement_strategy}{pins}; load average "
                f"{result.load_average[0]:.2f} at start",
            ),
            f"best PP={result.size}{ranks} {format_rate(result.best_pipeline)} against PP=1 "
            f"{format_rate(result.best_single)}: {result.ratio:.2f}x; the first shard's "
            f"communication {result.communication_ms_per_step:.2f} ms per step",
            f"greedy outputs identical: {result.identical_outputs}/{result.num_requests}",
            f"hosts: {placed} ({len(distinct)} Ray nodes)",
        ]
    )
