"""What the CPU step graph (:mod:`stages.execute.step_graph`) is worth at one stream: the model
runner alone decodes one request (a 64-token prompt, then ``--tokens`` tokens, greedy,
``ignore_eos``) with ``use_cuda_graphs`` on (decode steps in one native call) and off (module by
module), each run in a fresh process, the variants alternating ``--repeats`` times, each keeping
its best; for fp32 and the default model's GGUF weights. Prints decode tokens/s and the ratio.

    python -m benchmarks.step_graph [--repeats N] [--tokens N] [--threads N] [--formats ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

__all__ = ["decode_rate", "main"]

_PROMPT = tuple(range(100, 164))


def decode_rate(
    model: str, quantization: str | None, graph: bool, tokens: int, threads: int
) -> float:
    """Decode tokens/s of one stream in this process (see the module docstring)."""
    import torch

    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner
    from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
    from stages.params import SamplingParams

    if threads > 0:
        torch.set_num_threads(threads)
    runner = ModelRunner(
        ExecuteConfig(model=model, num_blocks=64, quantization=quantization, use_cuda_graphs=graph)
    )
    runner.load()
    if graph and runner.step_graph is None:
        raise RuntimeError("the step graph does not serve this model here (see the log)")
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    request = EngineRequest("stream", _PROMPT, params)
    runner.execute(SchedulerStep(0, (request,), (ScheduledChunk("stream", 0, len(_PROMPT)),)))
    computed = len(_PROMPT)
    began = time.perf_counter()
    for step in range(1, tokens + 1):
        runner.execute(SchedulerStep(step, (), (ScheduledChunk("stream", computed, 1),)))
        computed += 1
    return tokens / (time.perf_counter() - began)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=255)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    parser.add_argument("--formats", nargs="+", default=["fp32", "gguf"], choices=["fp32", "gguf"])
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    best: dict[tuple[str, bool], float] = {}
    for _ in range(args.repeats):
        for fmt in args.formats:
            for graph in (True, False):
                quantization = None if fmt == "fp32" else fmt
                with ProcessPoolExecutor(1, mp_context=context) as pool:
                    rate = pool.submit(
                        decode_rate, args.model, quantization, graph, args.tokens, args.threads
                    ).result()
                best[fmt, graph] = max(best.get((fmt, graph), 0.0), rate)
    for fmt in args.formats:
        on, off = best[fmt, True], best[fmt, False]
        print(
            json.dumps(
                {
                    "format": fmt,
                    "graph_tok_s": round(on, 1),
                    "modules_tok_s": round(off, 1),
                    "ratio": round(on / off, 3),
                }
            )
        )


if __name__ == "__main__":
    main()
