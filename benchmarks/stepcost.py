"""One stream's step cost: a single streaming request (``max_tokens`` tokens, ``ignore_eos``,
greedy) through :class:`~pipeline.engine.async_engine.AsyncEngine` as a user runs it, and for
every decode step the time the model's forward pass took against the gap between one forward
pass's end and the next one's start: the sampler, the KV bookkeeping, the step metadata, the
hops between the engine loop and execute's worker thread, the scheduler, and whatever of the
output handling (detokenize, stop-check, the zmq link) still runs between two steps.

``--sleep-forward-ms MS`` is a measuring device: after two real calls the model's forward
sleeps ``MS`` (releasing the GIL, as torch's kernels do) and returns its last real logits, so
everything but the forward pass runs for real at a forward time of choice (the issue 36
targets put a decode step at 8-10 ms), and the figures do not depend on how the machine's
load slows the model. Without it the real model runs. Each figure is the best of
``--repeats`` streams on one engine (docs/performance.md §5, "One stream's step cost")::

    python -m benchmarks.stepcost [--transport zmq] [--sleep-forward-ms 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import statistics
import time
from collections.abc import Sequence
from typing import Any

from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main

__all__ = [
    "StepCostConfig",
    "StepCostResult",
    "add_arguments",
    "format_stepcost",
    "main",
    "run_from_args",
    "run_stepcost",
]

_PROMPT = "Write about the sea and the ships that cross it."
_MICRO = 1e3  # seconds to ms


@dataclasses.dataclass(frozen=True, slots=True)
class StepCostConfig:
    """``repeats`` streams of ``max_tokens`` tokens on one engine over ``transport``;
    ``sleep_forward_ms`` > 0 puts a sleeping forward pass in place of the model's (see the
    module docstring).

    Raises:
        ValueError: a count is not positive, or the sleep is negative.
    """

    model: str = "smollm2-135m"
    transport: str = "memory"
    max_tokens: int = 256
    repeats: int = 3
    sleep_forward_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 3:  # two decode steps make one gap
            raise ValueError(f"max_tokens must be >= 3, got {self.max_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.sleep_forward_ms < 0:
            raise ValueError(f"sleep_forward_ms must be >= 0, got {self.sleep_forward_ms}")

    @classmethod
    def quick(cls, **overrides: Any) -> StepCostConfig:
        """A small configuration for smoke tests."""
        values: dict[str, Any] = {"max_tokens": 16, "repeats": 3}
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class StepCostResult:
    """The best stream's figures: ms per token between its first and last token, and the
    median forward pass and median gap between forward passes of its decode steps (0 where
    the model runs in the engine process, ``transport="zmq"``)."""

    model: str
    transport: str
    max_tokens: int
    sleep_forward_ms: float
    tokens_per_second: float
    ms_per_token: float
    forward_ms: float
    gap_ms: float
    min_gap_ms: float


class _ForwardClock:
    """Wraps a loaded runner's forward pass (``ModelRunner._forward``: the module path and
    the CPU step graph alike): records each call's start and end, and with ``sleep`` > 0
    sleeps instead of computing once two real calls gave logits to return."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep
        self.marks: list[tuple[float, float]] = []

    def wrap(self, runner: Any) -> None:
        real = runner._forward
        last: list[Any] = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            if self.sleep and len(last) >= 2:
                time.sleep(self.sleep)
                output = last[-1]
            else:
                output = real(*args, **kwargs)
                last.append(output)
            self.marks.append((began, time.perf_counter()))
            return output

        runner._forward = forward


async def _measure(config: StepCostConfig, clock: _ForwardClock) -> StepCostResult:
    from pipeline.engine.async_engine import AsyncEngine
    from stages.params import SamplingParams

    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True, temperature=0.0)
    warmup = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    runs: list[tuple[float, float, float, float, float]] = []
    async with AsyncEngine(config.model, transport=config.transport) as engine:
        async for _ in engine.generate(_PROMPT, warmup):
            pass
        for _ in range(config.repeats):
            clock.marks.clear()
            began = time.perf_counter()
            arrivals: list[float] = []
            async for _ in engine.generate(_PROMPT, params):
                arrivals.append(time.perf_counter())
            seconds = time.perf_counter() - began
            decode = clock.marks[1:]  # the prompt's step first; none: another process's
            gaps = [after[0] - before[1] for before, after in itertools.pairwise(decode)] or [0.0]
            forwards = [end - start for start, end in decode] or [0.0]
            runs.append(
                (
                    config.max_tokens / seconds,
                    (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * _MICRO,
                    statistics.median(forwards) * _MICRO,
                    statistics.median(gaps) * _MICRO,
                    min(gaps) * _MICRO,
                )
            )
    best = max(runs)
    return StepCostResult(
        config.model, config.transport, config.max_tokens, config.sleep_forward_ms, *best
    )


def run_stepcost(config: StepCostConfig) -> StepCostResult:
    """Measure (see the module docstring). The runner's loading is wrapped for the run only
    where the engine runs in this process (``transport="memory"``); other transports load
    it in the engine process, where the forward pass is measured only through the stream.

    Raises:
        ValueError: ``sleep_forward_ms`` with a transport other than memory.
    """
    import stages.execute.runner as runner_module

    if config.transport != "memory" and config.sleep_forward_ms:
        raise ValueError("--sleep-forward-ms needs --transport memory (the model in this process)")
    clock = _ForwardClock(config.sleep_forward_ms / _MICRO)
    load = runner_module.ModelRunner.load

    def timed_load(runner: Any) -> Any:
        info = load(runner)
        clock.wrap(runner)
        return info

    runner_module.ModelRunner.load = timed_load  # type: ignore[method-assign,assignment]
    try:
        return asyncio.run(_measure(config, clock))
    finally:
        runner_module.ModelRunner.load = load  # type: ignore[method-assign]


def format_stepcost(result: StepCostResult) -> str:
    """The result as a small table."""
    forward = f"sleeping {result.sleep_forward_ms:.1f} ms" if result.sleep_forward_ms else "real"
    rows = [
        ["tokens/s", f"{result.tokens_per_second:.2f}"],
        ["ms per token (first to last)", f"{result.ms_per_token:.3f}"],
        ["forward pass, median ms", f"{result.forward_ms:.3f}"],
        ["gap between forward passes, median ms", f"{result.gap_ms:.3f}"],
        ["gap between forward passes, least ms", f"{result.min_gap_ms:.3f}"],
    ]
    title = (
        f"one stream: {result.model}, {result.transport}, {result.max_tokens} tokens, "
        f"forward {forward}"
    )
    return format_table(["figure", "value"], rows, title=title)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, profile=False)
    parser.add_argument("--transport", choices=("memory", "zmq"), default="memory")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens of the stream (256)")
    parser.add_argument("--repeats", type=int, default=3, help="streams on one engine (3)")
    parser.add_argument(
        "--sleep-forward-ms",
        type=float,
        default=0.0,
        help="the forward pass sleeps this long instead of computing (memory transport)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    values: dict[str, Any] = {"model": args.model or "smollm2-135m", "transport": args.transport}
    values["sleep_forward_ms"] = args.sleep_forward_ms
    if args.quick:
        config = StepCostConfig.quick(**values)
    else:
        config = StepCostConfig(max_tokens=args.max_tokens, repeats=args.repeats, **values)
    result = run_stepcost(config)
    print_result(result, format_stepcost(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(__doc__, add_arguments, run_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
