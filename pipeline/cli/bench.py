"""The ``actorline bench`` subcommand (offline, online, ceiling, split, ablation, coldstart,
roof, transports, http-body, grammars, soak, quantization, micro); each runs the benchmark of
the same name in :mod:`pipeline.bench`."""

from __future__ import annotations

from typing import Any

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    """Add ``bench`` with one subcommand per benchmark to the CLI's subparsers."""
    from pipeline.bench import (
        ablation,
        ceiling,
        coldstart,
        grammars,
        http_body,
        micro,
        offline,
        online,
        quantization,
        roof,
        soak,
        split,
        transports,
    )

    benchmarks = (
        ("offline", offline, "throughput against HF generate and HF continuous batching"),
        ("online", online, "TTFT and inter-token latency under Poisson arrivals"),
        ("ceiling", ceiling, "framework overhead: null model, 256 streaming requests"),
        ("split", split, "single process against the zmq process split"),
        ("ablation", ablation, "each execute-stage optimization switched off in turn"),
        ("coldstart", coldstart, "a whole process to its first token, against plain HF"),
        ("roof", roof, "the GEMM roof: FMA peak, GEMM rates at the model's shapes, workload FLOPs"),
        ("transports", transports, "links against raw pyzmq and raw grpc.aio, same bytes"),
        ("http-body", http_body, "hostile request bodies, with and without the HTTP body cap"),
        ("grammars", grammars, "structured-output grammar engines: llguidance against xgrammar"),
        ("soak", soak, "many requests: the frontend's memory, and what the cycle collector finds"),
        ("quantization", quantization, "4/8-bit weights against fp32: memory, speed, accuracy"),
        ("micro", micro, "the CPU kernels alone at the model's shapes, cold against warm"),
    )
    bench = commands.add_parser(
        "bench", help="run a benchmark (figures and how to read them: docs/performance.md)"
    )
    names = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module, help_text in benchmarks:
        parser = names.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(parser)
        parser.set_defaults(run=module.run_from_args)
