"""What the process split buys or costs: the same workloads single-process (transport
"memory": every stage in the calling process) and split (transport "zmq": admit, schedule and
execute in an engine process), side by side with the split/single ratio:

- a smaller offline workload on the real model (throughput, ``LLM.generate``);
- the null-model ceiling (streaming tokens/s delivered to callers).

On a machine with few cores the split trades a second process (the frontend's work overlaps
the model's) against serialization and socket hops.

    python -m benchmarks.split [--quick] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from pipeline.bench.ceiling import CeilingConfig, run_ceiling
from pipeline.bench.offline import (
    ACTORLINE_MEMORY,
    ACTORLINE_ZMQ,
    OfflineConfig,
    run_offline,
)
from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main
from pipeline.bench.workload import WorkloadSpec

__all__ = [
    "SplitConfig",
    "SplitResult",
    "SplitRow",
    "add_arguments",
    "format_split",
    "main",
    "run_from_args",
    "run_split",
]


@dataclasses.dataclass(frozen=True, slots=True)
class SplitConfig:
    """The two workloads: an offline one (``offline``) on ``model`` and a null-model ceiling
    of ``ceiling_requests`` x ``ceiling_tokens`` (best of ``ceiling_repeats``)."""

    model: str = "smollm2-135m"
    offline: WorkloadSpec = dataclasses.field(
        default_factory=lambda: WorkloadSpec(
            num_requests=16, min_filler=5, max_filler=60, max_tokens_choices=(16, 32, 64)
        )
    )
    ceiling_requests: int = 256
    ceiling_tokens: int = 128
    ceiling_repeats: int = 2

    @classmethod
    def quick(cls, **overrides: object) -> SplitConfig:
        """A small configuration for smoke tests."""
        values: dict[str, object] = {
            "offline": WorkloadSpec(
                num_requests=4, min_filler=5, max_filler=20, max_tokens_choices=(8,)
            ),
            "ceiling_requests": 32,
            "ceiling_tokens": 32,
            "ceiling_repeats": 1,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class SplitRow:
    """One workload: tokens/s single-process and split, and split / single."""

    workload: str
    memory_tokens_per_second: float
    zmq_tokens_per_second: float
    zmq_over_memory: float


@dataclasses.dataclass(frozen=True, slots=True)
class SplitResult:
    """One row per workload."""

    model: str
    rows: tuple[SplitRow, ...]


def run_split(config: SplitConfig) -> SplitResult:
    """Run both workloads in both topologies."""
    offline = run_offline(
        OfflineConfig(
            model=config.model,
            workload=config.offline,
            systems=(ACTORLINE_MEMORY, ACTORLINE_ZMQ),
            check_requests=0,
            roof=False,  # only the two topologies' tokens/s are kept
            measure_default_budget=False,
        )
    )
    rate = {system.name: system.tokens_per_second for system in offline.systems}
    rows = [
        _row(
            f"offline, {config.offline.num_requests} requests ({config.model})",
            rate[ACTORLINE_MEMORY],
            rate[ACTORLINE_ZMQ],
        )
    ]
    ceilings = {
        transport: run_ceiling(
            CeilingConfig(
                model=config.model,
                num_requests=config.ceiling_requests,
                max_tokens=config.ceiling_tokens,
                transport=transport,
                repeats=config.ceiling_repeats,
            )
        ).best_tokens_per_second
        for transport in ("memory", "zmq")
    }
    rows.append(
        _row(
            f"null-model ceiling, {config.ceiling_requests} x {config.ceiling_tokens} tokens",
            ceilings["memory"],
            ceilings["zmq"],
        )
    )
    return SplitResult(config.model, tuple(rows))


def _row(name: str, memory: float, zmq: float) -> SplitRow:
    return SplitRow(name, memory, zmq, zmq / memory if memory > 0 else float("nan"))


def format_split(result: SplitResult) -> str:
    """The readable report."""
    return format_table(
        ["workload", "single process tok/s", "zmq split tok/s", "split / single"],
        [
            [
                row.workload,
                row.memory_tokens_per_second,
                row.zmq_tokens_per_second,
                f"{row.zmq_over_memory:.2f}x",
            ]
            for row in result.rows
        ],
        title="process split: transport='memory' (one process) vs 'zmq' (engine process)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The split benchmark's command-line options."""
    add_common_arguments(parser, profile=False)


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    config = SplitConfig.quick(model=args.model) if args.quick else SplitConfig(model=args.model)
    result = run_split(config)
    print_result(result, format_split(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.split``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
