"""The serving process's own CPU per streamed token: ``actorline serve`` in one format
(``--format``: fp32, bf16 or the default model's Q4_1 GGUF), one warm-up request, then for each
``--streams`` count that many concurrent streams of ``--tokens`` tokens (greedy, ``ignore_eos``,
streamed from ``/v1/completions``), and the serve process's CPU time over them (utime + stime,
``/proc/<pid>/stat``) per streamed token, beside the streams' aggregate tokens/s and the CPU of
the engine host's event loop (the main thread of each process serve started: where the schedule
stage plans each step, updates from its result and sends its outputs; the step itself runs on
execute's thread and OpenMP's).

On a machine with as many cores as the engine has threads, every millisecond the serving
process runs preempts one of a step's threads, and the step waits for it: this is the part of a
served token that is neither the step nor the client (docs/performance.md §13, "Where one
stream's time goes"). ``OMP_NUM_THREADS=1`` leaves the serving process a core of its own.

    python -m benchmarks.serve_cpu [--format fp32|bf16|q4_1] [--streams 1 4] [--tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Sequence

from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main

__all__ = ["ServeCpuConfig", "ServeCpuResult", "StreamsRun", "format_serve_cpu", "main"]

_NAME = "served"


@dataclasses.dataclass(frozen=True, slots=True)
class ServeCpuConfig:
    """The model, its format, the concurrent stream counts and each stream's tokens.

    Raises:
        ValueError: an unknown format, or a count that is not positive.
    """

    model: str = "smollm2-135m"
    format: str = "fp32"
    streams: tuple[int, ...] = (1, 4)
    tokens: int = 256

    def __post_init__(self) -> None:
        from pipeline.bench.llamacpp_peer import FORMATS

        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {self.format!r}")
        if not self.streams or min(self.streams) < 1 or self.tokens < 1:
            raise ValueError(
                f"streams and tokens must be positive, got {self.streams} and {self.tokens}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class StreamsRun:
    """``streams`` concurrent streams: the tokens they streamed, in ``seconds``, and the serve
    process's CPU seconds meanwhile, and its engine host's event loop's."""

    streams: int
    tokens: int
    seconds: float
    cpu_seconds: float
    #: the engine host's event-loop thread's CPU seconds meanwhile (see the module docstring)
    host_loop_cpu_seconds: float

    @property
    def cpu_ms_per_token(self) -> float:
        return self.cpu_seconds / self.tokens * 1e3 if self.tokens else 0.0

    @property
    def host_loop_ms_per_token(self) -> float:
        return self.host_loop_cpu_seconds / self.tokens * 1e3 if self.tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class ServeCpuResult:
    model: str
    format: str
    runs: tuple[StreamsRun, ...]
    omp_num_threads: str | None
    cpu_count: int


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """:func:`pipeline.bench.process.cpu_seconds` of the running server, and of the main
    threads of the processes it started.

    Raises:
        RuntimeError: its CPU time cannot be read (no /proc, or the server is gone).
    """
    from pipeline.bench.process import child_pids, cpu_seconds

    seconds = cpu_seconds(pid)
    if seconds is None:
        raise RuntimeError(f"cannot read the CPU time of the server (pid {pid}) from /proc")
    loops = (cpu_seconds(child, thread=child) for child in child_pids(pid))
    return seconds, sum(loop for loop in loops if loop is not None)


def run_serve_cpu(config: ServeCpuConfig) -> ServeCpuResult:
    """Serve, warm up, then each stream count in turn (see the module docstring).

    Raises:
        RuntimeError: the server did not start, or its CPU time cannot be read.
        pipeline.bench.http_load.HttpLoadError: a stream failed.
    """
    from pipeline.bench.http_load import stream_completion
    from pipeline.bench.llamacpp_peer import FORMATS
    from pipeline.bench.servers import started_server

    most = max(config.streams)
    command = [
        sys.executable, "-m", "pipeline.cli", "serve", "--model", config.model,
        "--http-port", "0", "--served-model-name", _NAME, "--max-num-seqs", str(most),
        *FORMATS[config.format].actorline_arguments(),
    ]  # fmt: skip

    def payload(index: int, tokens: int) -> dict[str, object]:
        return {
            "model": _NAME,
            "prompt": f"Story {index}: once upon a time",
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }

    async def measure(port: int, pid: int) -> list[StreamsRun]:
        await stream_completion("127.0.0.1", port, payload(0, 4))
        runs = []
        for count in config.streams:
            cpu, loops = _cpu_seconds(pid)
            began = time.perf_counter()
            traces = await asyncio.gather(
                *(stream_completion("127.0.0.1", port, payload(i, config.tokens))
                  for i in range(count))
            )  # fmt: skip
            seconds = time.perf_counter() - began
            tokens = sum(trace.usage_tokens or len(trace.token_times) for trace in traces)
            cpu_after, loops_after = _cpu_seconds(pid)
            runs.append(StreamsRun(count, tokens, seconds, cpu_after - cpu, loops_after - loops))
        return runs

    with started_server(command, None, None) as (port, process):
        runs = asyncio.run(measure(port, process.pid))
    return ServeCpuResult(
        model=config.model,
        format=config.format,
        runs=tuple(runs),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        cpu_count=os.cpu_count() or 0,
    )


def format_serve_cpu(result: ServeCpuResult) -> str:
    rows = [
        [
            run.streams,
            run.tokens,
            run.tokens_per_second,
            run.cpu_ms_per_token,
            run.host_loop_ms_per_token,
        ]
        for run in result.runs
    ]
    threads = result.omp_num_threads or "the default"
    return format_table(
        ["streams", "tokens", "tokens/s", "serve CPU ms/token", "engine loop CPU ms/token"],
        rows,
        title=f"the serving process's CPU per streamed token: {result.model} in {result.format}; "
        f"{result.cpu_count} CPUs, OMP_NUM_THREADS {threads}",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's command-line options."""
    add_common_arguments(parser, profile=False)
    from pipeline.bench.llamacpp_peer import FORMATS

    parser.add_argument("--format", default="fp32", choices=tuple(FORMATS))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=256, help="each stream's tokens (256)")


def run_from_args(args: argparse.Namespace) -> int:
    config = ServeCpuConfig(
        model=args.model,
        format=args.format,
        streams=(1, 2) if args.quick else tuple(args.streams),
        tokens=8 if args.quick else args.tokens,
    )
    result = run_serve_cpu(config)
    print_result(result, format_serve_cpu(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.serve_cpu``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
