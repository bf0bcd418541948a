"""The CPU step graph's native call alone (:mod:`stages.execute.step_graph`), per decode step, in
this process: the default model loaded by the model runner in one precision, ``--rows``
sequences prefilled (a 64-token prompt each), then ``--steps`` decode steps of those rows run
as ``StepGraph.run`` calls (each one native call; the K/V of each row written at a fixed
position, so every step does the same work) in blocks of 10 alternating between the step's
two threading forms (one OpenMP region per step, ``native_ms``, and one per op,
``per_op_ms``: ``StepGraph.threaded``), then as many through ``ModelRunner.execute`` (sampler
and bookkeeping included, the positions advancing). Prints one JSON line: ms per step (least
and median) of each, and the weights' MB read per step.

    python -m benchmarks.step_native fp32|bf16|gguf [--rows N] [--steps N] [--threads N]

Meant to be run in a fresh process per variant, alternating (docs/performance.md §4, "The CPU
step graph"): the least time per step is the figure least moved by other work on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["FORMATS", "main"]

#: the weight formats these benchmarks load the default model in, as engine options
FORMATS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "gguf": {"quantization": "gguf"},
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("format", choices=sorted(FORMATS))
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args(argv)

    import torch

    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner
    from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
    from stages.params import SamplingParams

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    config = ExecuteConfig(model=args.model, num_blocks=32 * args.rows + 16, **FORMATS[args.format])
    runner = ModelRunner(config)
    info = runner.load()
    graph = runner.step_graph
    if graph is None:
        raise SystemExit("the step graph does not serve this model here (see the log)")
    prompt = tuple((17 * i + 3) % 49000 + 10 for i in range(64))
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    names = [f"s{row}" for row in range(args.rows)]
    requests = tuple(EngineRequest(name, prompt, params) for name in names)
    chunks = tuple(ScheduledChunk(name, 0, len(prompt)) for name in names)
    runner.execute(SchedulerStep(0, requests, chunks))
    assert runner.allocator is not None
    tables = [runner.allocator.block_table(name) for name in names]
    positions = [len(prompt) - 1] * args.rows
    tokens = [prompt[-1]] * args.rows
    keep = list(range(args.rows))
    forms = [True, False] if graph.threaded else [False]
    native: dict[bool, list[float]] = {form: [] for form in forms}
    block = 10
    for index in range(0, args.steps * len(forms), block):
        form = forms[index // block % len(forms)]
        graph.threaded = form
        for _ in range(block):
            began = time.perf_counter()
            graph.run(tokens, positions, tables, keep)
            native[form].append(time.perf_counter() - began)
    graph.threaded = forms[0]
    full = []
    for step in range(args.steps):
        decode = tuple(ScheduledChunk(name, len(prompt) + step, 1) for name in names)
        began = time.perf_counter()
        runner.execute(SchedulerStep(step + 1, chunks=decode))
        full.append(time.perf_counter() - began)

    def ms(values: list[float]) -> dict[str, float]:
        return {
            "min": round(min(values) * 1e3, 3),
            "median": round(statistics.median(values) * 1e3, 3),
        }

    print(
        json.dumps(
            {
                "format": args.format,
                "rows": args.rows,
                "threads": torch.get_num_threads(),
                "native_ms": ms(native[forms[0]]),
                "per_op_ms": ms(native[False]),
                "execute_ms": ms(full),
                "weight_mb": round(info.weight_bytes / 1e6, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
