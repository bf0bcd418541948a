"""The framework's ceiling: the full pipeline with the null model (random tokens at once, real
KV bookkeeping, see :mod:`stages.execute.null`) streaming many concurrent requests. Tokens are
counted as they reach the callers (each output's new tokens), so the figure is what the
pipeline can deliver with no model in the way: tokenize, admit, schedule, the null execute,
detokenize, stop-check, the links between them and the API's dispatch. Target: 50,000
tokens/s with 256 streaming requests over the zmq topology.

    actorline bench ceiling [--profile] [--transport memory] [--json]
    actorline bench ceiling --data-parallel-size 2     # N replicas against one, same run

(the data-parallel comparison is :mod:`pipeline.bench.parallel`'s)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from collections.abc import Sequence

from pipeline.bench.null_load import (
    CeilingConfig,
    ceiling_prompts,
    null_engine_blocks,
    stream_all,
)
from pipeline.bench.profile import Profile, build_profile, format_profile, take_snapshot
from pipeline.bench.report import (
    add_common_arguments,
    add_ray_arguments,
    asks_for_ray,
    format_rate,
    format_table,
    print_result,
    run_main,
)
from pipeline.engine.option_fields import add_option_argument
from pipeline.engine.options import EngineOptions

__all__ = [
    "TARGET_TOKENS_PER_SECOND",
    "CeilingConfig",
    "CeilingResult",
    "CeilingRun",
    "add_arguments",
    "ceiling_prompts",
    "format_ceiling",
    "main",
    "measure_ceiling",
    "run_ceiling",
    "run_from_args",
]

TARGET_TOKENS_PER_SECOND = 50_000.0
_WARMUP_REQUESTS = 16
_WARMUP_TOKENS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class CeilingRun:
    """One repeat: tokens delivered to the callers in ``seconds``; engine steps taken."""

    tokens: int
    seconds: float
    tokens_per_second: float
    engine_steps: int


@dataclasses.dataclass(frozen=True, slots=True)
class CeilingResult:
    """Every repeat, the best and median rate, and the profile of the best repeat."""

    model: str
    transport: str
    num_requests: int
    max_tokens: int
    runs: tuple[CeilingRun, ...]
    best_tokens_per_second: float
    median_tokens_per_second: float
    target_tokens_per_second: float
    meets_target: bool
    profile: Profile | None = None


async def measure_ceiling(config: CeilingConfig) -> CeilingResult:
    """Run the ceiling benchmark on the running event loop (see the module docstring)."""
    from pipeline.engine.async_engine import AsyncEngine
    from stages.params import SamplingParams

    prompts = ceiling_prompts(config)
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    # Prompts are a few dozen tokens; give every request room for all of its tokens.
    engine = AsyncEngine(
        config.model,
        null_model=True,
        transport=config.transport,
        max_num_seqs=config.num_requests,
        num_blocks=null_engine_blocks(config),
        tune_gc=config.tune_gc,
    )
    runs: list[CeilingRun] = []
    profiles: list[Profile | None] = []
    async with engine:
        warmup = SamplingParams(max_tokens=_WARMUP_TOKENS, ignore_eos=True)
        await stream_all(engine, prompts[:_WARMUP_REQUESTS], warmup)
        for _ in range(config.repeats):
            before = await take_snapshot(engine.running) if config.profile else None
            steps_before = engine.stats.num_steps if engine.stats else 0
            began = time.perf_counter()
            tokens = await stream_all(engine, prompts, params)
            seconds = time.perf_counter() - began
            steps = (engine.stats.num_steps if engine.stats else 0) - steps_before
            runs.append(CeilingRun(tokens, seconds, tokens / seconds, steps))
            if before is not None:
                after = await take_snapshot(engine.running)
                profiles.append(build_profile(before, after, seconds, tokens))
            else:
                profiles.append(None)
    rates = [run.tokens_per_second for run in runs]
    best = max(range(len(runs)), key=lambda index: rates[index])
    return CeilingResult(
        model=config.model,
        transport=config.transport,
        num_requests=config.num_requests,
        max_tokens=config.max_tokens,
        runs=tuple(runs),
        best_tokens_per_second=rates[best],
        median_tokens_per_second=statistics.median(rates),
        target_tokens_per_second=TARGET_TOKENS_PER_SECOND,
        meets_target=rates[best] >= TARGET_TOKENS_PER_SECOND,
        profile=profiles[best],
    )


def run_ceiling(config: CeilingConfig) -> CeilingResult:
    """Run the ceiling benchmark in a fresh event loop."""
    return asyncio.run(measure_ceiling(config))


def format_ceiling(result: CeilingResult) -> str:
    """The readable report."""
    rows = [
        [f"run {index + 1}", run.tokens, run.seconds, run.tokens_per_second, run.engine_steps]
        for index, run in enumerate(result.runs)
    ]
    verdict = "meets" if result.meets_target else "MISSES"
    text = [
        format_table(
            ["repeat", "tokens", "seconds", "tokens/s", "engine steps"],
            rows,
            title=f"ceiling: null model, {result.transport} topology, {result.num_requests} "
            f"streaming requests x {result.max_tokens} tokens (tokenizer/config of "
            f"{result.model})",
        ),
        f"best {format_rate(result.best_tokens_per_second)}, median "
        f"{format_rate(result.median_tokens_per_second)}: {verdict} the target of "
        f"{format_rate(result.target_tokens_per_second)}",
    ]
    if result.profile is not None:
        text += ["", format_profile(result.profile, title="best repeat")]
    return "\n".join(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ceiling benchmark's command-line options."""
    add_common_arguments(parser)
    parser.add_argument("--requests", type=int, default=None, help="concurrent requests (256)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (256)")
    add_option_argument(parser, EngineOptions, "transport")
    parser.add_argument("--repeats", type=int, default=None, help="runs on one engine (3)")
    add_option_argument(parser, EngineOptions, "tune_gc")
    add_ray_arguments(
        parser, help="also run the engine's hosts on Ray and compare with local processes"
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="also run N engine replicas and compare them with one, in alternation",
    )


def config_from_args(args: argparse.Namespace) -> CeilingConfig:
    """The configuration the options ask for (``--quick`` shrinks the defaults)."""
    overrides: dict[str, object] = {
        "model": args.model,
        "transport": args.transport,
        "profile": args.profile,
        "tune_gc": args.tune_gc,
    }
    for option, field in (
        ("requests", "num_requests"),
        ("max_tokens", "max_tokens"),
        ("repeats", "repeats"),
    ):
        if getattr(args, option) is not None:
            overrides[field] = getattr(args, option)
    if args.quick:
        return CeilingConfig.quick(**overrides)
    return CeilingConfig(**overrides)  # type: ignore[arg-type]


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status.

    Raises:
        ValueError: ``--ray-auth-token-file`` without ``--ray``, or the Ray cluster refuses
            this process (RayConnectionError), among the configuration's own refusals.
    """
    if asks_for_ray(args):
        from pipeline.bench.parallel import run_ray_from_args
        from stages.params import SamplingParams

        config = config_from_args(args)
        options = {
            "null_model": True,
            "max_num_seqs": config.num_requests,
            "num_blocks": null_engine_blocks(config),
            "tune_gc": config.tune_gc,
        }
        params = [SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)]
        return run_ray_from_args(
            args, "ceiling", config.model, options, ceiling_prompts(config), params,
            repeats=config.repeats,
        )  # fmt: skip
    if args.data_parallel_size > 1:
        from pipeline.bench.parallel import format_data_parallel, run_data_parallel

        config = config_from_args(args)
        compared = run_data_parallel(config, args.data_parallel_size, ceiling_prompts(config))
        print_result(compared, format_data_parallel(compared), args.json)
        return 0
    result = run_ceiling(config_from_args(args))
    print_result(result, format_ceiling(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``actorline bench ceiling``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)
