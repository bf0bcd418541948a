"""The ``actorline bench`` subcommand (offline, online, latency, ceiling, coldstart, roof,
transports, quantization); each runs the benchmark of the same name in :mod:`pipeline.bench`. The
experiments and records (ablations, the grammar-engine comparison, kernel studies, the soak)
are not installed: they run from a checkout as ``python -m benchmarks.NAME``
(``benchmarks/README.md``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["HELP", "add_commands", "add_placeholder"]

#: the ``bench`` command's one-line help (the full command and its placeholder share it)
HELP = "run a benchmark (figures and how to read them: docs/performance.md)"


def _usage_errors(
    parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """``run``, with a value its configuration refuses (``--rounds 0``: the config's
    ``ValueError``, raised before anything runs) answered as argparse answers a bad argument:
    one line on stderr and exit status 2, not a traceback."""

    def checked(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ValueError as error:
            parser.error(str(error))

    return checked


def add_placeholder(commands: Any) -> None:
    """Add ``bench`` by name and help only, for a command line that runs another command:
    building the benchmarks' parsers imports every benchmark module (46 modules, a fifth of
    the CLI's start-up), which ``generate`` and ``serve`` never use."""
    commands.add_parser("bench", help=HELP)


def add_commands(commands: Any) -> None:
    """Add ``bench`` with one subcommand per benchmark to the CLI's subparsers."""
    from pipeline.bench import (
        ceiling,
        coldstart,
        latency,
        offline,
        online,
        quantization,
        roof,
        transports,
    )

    benchmarks = (
        ("offline", offline, "throughput against HF generate and HF continuous batching"),
        ("online", online, "TTFT and inter-token latency under Poisson arrivals"),
        ("latency", latency, "one stream and a few, over HTTP against llama.cpp, per format"),
        ("ceiling", ceiling, "framework overhead: null model, 256 streaming requests"),
        ("coldstart", coldstart, "a whole process to its first token, against plain HF"),
        ("roof", roof, "the GEMM roof: FMA peak, GEMM rates at the model's shapes, workload FLOPs"),
        ("transports", transports, "links against raw pyzmq and raw grpc.aio, same bytes"),
        ("quantization", quantization, "4/8-bit weights against fp32: memory, speed, accuracy"),
    )
    bench = commands.add_parser("bench", help=HELP)
    names = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module, help_text in benchmarks:
        parser = names.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(parser)
        parser.set_defaults(run=_usage_errors(parser, module.run_from_args))
