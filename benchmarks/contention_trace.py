"""Record what the contention fallback sees (:mod:`stages.execute.contention`): one decode
stream of the default model, stepped through ``ModelRunner.execute`` at a fixed thread count,
for ``--seconds`` in three equal phases — as the machine is, with ``--load`` busy processes
beside it, as it is again — writing one JSON line per window of ``--window`` seconds of
steps: the phase, the steps' seconds, the process's run-queue wait over the window
(``/proc/self/task/*/schedstat``) and the thread count. Replayed by
``tests/stages/execute/test_contention.py`` (its recorded traces are in
``tests/stages/execute/data/``).

    python -m benchmarks.contention_trace gguf --threads 2 --load 2 > trace-2.jsonl
    python -m benchmarks.contention_trace gguf --threads 1 --load 2 > trace-1.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks.step_native import FORMATS

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("format", choices=sorted(FORMATS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--load", type=int, default=2, help="busy processes in the middle phase")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=0.25)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args(argv)

    import torch

    from stages.execute.config import ExecuteConfig
    from stages.execute.contention import run_queue_wait_seconds
    from stages.execute.runner import ModelRunner
    from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
    from stages.params import SamplingParams

    torch.set_num_threads(args.threads)
    runner = ModelRunner(ExecuteConfig(model=args.model, num_blocks=256, **FORMATS[args.format]))
    runner.load()
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    prompt = tuple((17 * i + 3) % 49000 + 10 for i in range(64))
    step_id = 0
    request_id = 0

    def fresh() -> list[int]:
        nonlocal step_id, request_id
        request_id += 1
        request = EngineRequest(f"r{request_id}", prompt, params)
        step_id += 1
        chunk = ScheduledChunk(request.request_id, 0, len(prompt))
        result = runner.execute(SchedulerStep(step_id, (request,), (chunk,)))
        return [len(prompt), result.token_ids[0]]

    position, _ = fresh()
    busy: list[subprocess.Popen[bytes]] = []
    phase_seconds = args.seconds / 3
    started = time.perf_counter()
    stepped, steps = 0.0, 0
    waited = run_queue_wait_seconds() or 0.0
    try:
        while (elapsed := time.perf_counter() - started) < args.seconds:
            phase = min(int(elapsed // phase_seconds), 2)
            if phase == 1 and not busy:
                busy = [
                    subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(args.load)
                ]
            elif phase == 2 and busy:
                for process in busy:
                    process.kill()
                    process.wait()
                busy = []
            if position >= 900:  # a new stream before the KV cache runs out
                runner.execute(SchedulerStep(step_id + 1, finished=(f"r{request_id}",)))
                step_id += 1
                position, _ = fresh()
            step_id += 1
            begin = time.perf_counter()
            runner.execute(
                SchedulerStep(step_id, chunks=(ScheduledChunk(f"r{request_id}", position, 1),))
            )
            stepped += time.perf_counter() - begin
            steps += 1
            position += 1
            if stepped >= args.window:
                now = run_queue_wait_seconds() or 0.0
                record = {
                    "phase": phase, "steps": steps, "step_seconds": round(stepped, 6),
                    "run_queue_wait": round(now - waited, 6), "threads": args.threads,
                    "load": os.getloadavg()[0],
                }  # fmt: skip
                print(json.dumps(record), flush=True)
                stepped, steps, waited = 0.0, 0, now
    finally:
        for process in busy:
            process.kill()
            process.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
