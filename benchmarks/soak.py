"""A soak of the frontend: many short requests through the null-model engine (zmq topology,
the engine in its own process), and what they leave behind in the calling process.

Reported: the frontend's resident memory after a warm-up and after the soak, and how many
objects a ``gc.collect()`` right after it finds. The frontend raises the garbage collector's
young-generation threshold while the engine runs (``tune_gc``), so whatever a request leaves
in a reference cycle piles up between the rare collections: a request must be freed by
reference counting alone, and after the soak the collector should find nothing
(docs/architecture.md §7). Its peer is the code before that held (a build of it, run the same
way), not something this run can start.

    python -m benchmarks.soak [--requests N] [--concurrency C] [--quick] [--json] [--model M]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import time
from collections.abc import Sequence

from pipeline.bench.process import rss_bytes
from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main

__all__ = ["SoakConfig", "SoakResult", "add_arguments", "format_soak", "main", "run_soak"]

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class SoakConfig:
    """``requests`` requests of ``max_tokens`` tokens each (after ``warmup`` ones), at most
    ``concurrency`` at once, against the null model with ``model``'s tokenizer."""

    model: str = "smollm2-135m"
    requests: int = 20_000
    concurrency: int = 64
    max_tokens: int = 16
    warmup: int = 500

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "max_tokens", "warmup"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class SoakResult:
    """The frontend's resident memory (MiB) before and after the soak and after a final
    ``gc.collect()``, the objects that collection found, and how long the soak took."""

    config: SoakConfig
    seconds: float
    rss_before_mib: float
    rss_after_mib: float
    gc_found: int
    rss_after_gc_mib: float


def _rss_mib() -> float:
    value = rss_bytes(os.getpid())
    return float("nan") if value is None else value / _MIB


async def _soak(config: SoakConfig) -> SoakResult:
    from pipeline.engine.async_engine import AsyncEngine
    from stages.params import SamplingParams

    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    async with AsyncEngine(config.model, null_model=True) as engine:

        async def send(count: int) -> None:
            # NOTE: ``concurrency`` workers, each sending one request after another: a task
            # per request would hold every request not sent yet, which measures that pile.
            numbers = iter(range(count))

            async def worker() -> None:
                for index in numbers:
                    async for _ in engine.generate(f"soak request {index}", params):
                        pass

            await asyncio.gather(*(worker() for _ in range(config.concurrency)))

        await send(config.warmup)
        gc.collect()  # whatever was there before: only what the soak leaves is counted
        before = _rss_mib()
        started = time.perf_counter()
        await send(config.requests)
        seconds = time.perf_counter() - started
        after = _rss_mib()
        found = gc.collect()
        return SoakResult(config, seconds, before, after, found, _rss_mib())


def run_soak(config: SoakConfig) -> SoakResult:
    """Run the soak (in a fresh event loop)."""
    return asyncio.run(_soak(config))


def format_soak(result: SoakResult) -> str:
    config = result.config
    rows = [
        ("resident MiB after the warm-up", result.rss_before_mib),
        ("resident MiB after the soak", result.rss_after_mib),
        ("objects a gc.collect() then found", result.gc_found),
        ("resident MiB after it", result.rss_after_gc_mib),
        ("requests per second", config.requests / result.seconds),
    ]
    title = (
        f"soak: {config.requests:,} requests of {config.max_tokens} tokens, "
        f"{config.concurrency} at once, null model"
    )
    return format_table(("frontend", "value"), rows, title=title)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, profile=False)
    defaults = SoakConfig()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)


def run_from_args(args: argparse.Namespace) -> int:
    config = SoakConfig(model=args.model, concurrency=args.concurrency, requests=args.requests)
    if args.quick:
        config = dataclasses.replace(config, requests=min(args.requests, 400), warmup=50)
    result = run_soak(config)
    print_result(result, format_soak(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.soak``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
