"""One quantization variant's batch-1 decode and prefill through the model runner, in this
process (docs/performance.md §12.1): run it in a fresh process per variant, alternating.

    python -m benchmarks.quant_step gguf int8   # SYSTEM (fp32/gguf/int8) ACTIVATIONS (-)

Prints one JSON line: decode tok/s (64-token prompt, 64 steps, best of 2), one 512-token
prefill chunk in ms (best of 2) and the weights' MB. One thread (``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from stages.execute.config import ExecuteConfig
from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
from stages.params import SamplingParams

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    system, activations = (sys.argv[1:] if argv is None else list(argv)) or ("gguf", "-")
    torch.set_num_threads(1)
    options: dict[str, Any] = {} if system == "fp32" else {"quantization": system}
    if activations != "-":
        options["quant_activations"] = activations
    config = ExecuteConfig(model="smollm2-135m", num_blocks=160, max_model_len=2304, **options)
    runner = ModelRunner(config)
    info = runner.load()
    step = 0

    def execute(scheduled: SchedulerStep) -> None:
        nonlocal step
        runner.execute(scheduled)
        step += 1

    prompt = tuple((17 * i + 3) % 49000 + 10 for i in range(64))
    rates = []
    for attempt in range(2):
        rid = f"d{attempt}"
        params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        first = (EngineRequest(rid, prompt, params),)
        execute(SchedulerStep(step, first, (ScheduledChunk(rid, 0, 64),)))
        began = time.perf_counter()
        for position in range(64, 128):
            execute(SchedulerStep(step, chunks=(ScheduledChunk(rid, position, 1),)))
        rates.append(64 / (time.perf_counter() - began))
        execute(SchedulerStep(step, finished=(rid,)))
    best = float("inf")
    for attempt in range(2):
        rid = f"p{attempt}"
        ids = tuple((31 * i + 7 + attempt) % 49000 + 10 for i in range(512))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        began = time.perf_counter()
        request = (EngineRequest(rid, ids, params),)
        execute(SchedulerStep(step, request, (ScheduledChunk(rid, 0, 512),)))
        best = min(best, time.perf_counter() - began)
        execute(SchedulerStep(step, finished=(rid,)))
    figures = {"decode_tok_s": max(rates), "prefill_512_ms": best * 1e3}
    print(json.dumps({**figures, "weight_mb": info.weight_bytes / 1e6}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
