"""bf16 weights end to end on CPU, one source tree against another (docs/performance.md §12.2):
``--batch`` requests of ``--prompt`` random tokens prefilled in one step, then ``--decode``
steps of one token per request, through ``ModelRunner.execute`` on the default model in bf16.
Each run is a fresh process importing the actorline of one ``--tree`` (this file's code does the
measuring for every tree, so only the library under test differs); the trees alternate, best of
``--rounds``; tokens/s by wall time and per CPU second of the process (with
``OMP_NUM_THREADS=1`` the CPU figure does not charge a run for the time a loaded machine gave
to others).

    OMP_NUM_THREADS=1 python -m benchmarks.bf16_batch --tree ../before --tree . --batch 64
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def run_one(batch: int, prompt: int, decode: int, model: str) -> tuple[float, ...]:
    """In this process: prefill and decode tokens/s, each by wall and by CPU time."""
    import torch

    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner
    from stages.messages import EngineRequest, SamplingParams, ScheduledChunk, SchedulerStep

    blocks = max(128, batch * (prompt + decode + 2) // 16 + batch + 16)
    runner = ModelRunner(ExecuteConfig(model=model, num_blocks=blocks, dtype="bfloat16"))
    vocab = runner.load().vocab_size
    generator = torch.Generator().manual_seed(0)

    def run(tag: str, rows: int, length: int, steps: int) -> tuple[float, ...]:
        params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        requests = [
            EngineRequest(
                f"{tag}{index}",
                tuple(torch.randint(3, vocab, (length,), generator=generator).tolist()),
                params,
            )
            for index in range(rows)
        ]
        chunks = tuple(ScheduledChunk(r.request_id, 0, length) for r in requests)
        wall, cpu = time.perf_counter(), time.process_time()
        runner.execute(SchedulerStep(0, tuple(requests), chunks))
        prefill = (time.perf_counter() - wall, time.process_time() - cpu)
        wall, cpu = time.perf_counter(), time.process_time()
        for step in range(steps):
            chunks = tuple(ScheduledChunk(r.request_id, length + step, 1) for r in requests)
            runner.execute(SchedulerStep(step + 1, (), chunks))
        decoded = (time.perf_counter() - wall, time.process_time() - cpu)
        finished = tuple(r.request_id for r in requests)
        runner.execute(SchedulerStep(steps + 1, finished=finished))
        tokens = rows * length
        return (
            tokens / prefill[0],
            tokens / prefill[1],
            rows * steps / max(decoded[0], 1e-9),
            rows * steps / max(decoded[1], 1e-9),
        )

    run("warm", 2, 16, 2)
    return run("r", batch, prompt, decode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", help="a source tree (repeatable; default .)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="requests")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--decode", type=int, default=16, help="decode steps")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        result = run_one(args.batch, args.prompt, args.decode, args.model)
        print(" ".join(f"{value:.2f}" for value in result))
        return 0
    trees = [Path(tree).resolve() for tree in args.tree or ["."]]
    shape = ["--batch", str(args.batch), "--prompt", str(args.prompt)]
    shape += ["--decode", str(args.decode), "--model", args.model]
    best: dict[Path, list[float]] = {}
    for round_index in range(args.rounds):
        for tree in trees:
            command = [sys.executable, str(Path(__file__).resolve()), "--one", *shape]
            environment = dict(os.environ, PYTHONPATH=str(tree))
            output = subprocess.run(
                command, capture_output=True, text=True, check=True, cwd=tree, env=environment
            ).stdout.split()
            figures = [float(value) for value in output[-4:]]
            print(
                f"round {round_index} {tree}: prefill {figures[0]:.1f} tok/s "
                f"({figures[1]:.1f} per CPU s), decode {figures[2]:.1f} tok/s "
                f"({figures[3]:.1f} per CPU s)",
                flush=True,
            )
            old = best.get(tree, [0.0] * 4)
            best[tree] = [max(a, b) for a, b in zip(old, figures, strict=True)]
    for tree, figures in best.items():
        print(
            f"best {tree}: prefill {figures[0]:.1f} tok/s ({figures[1]:.1f} per CPU s), "
            f"decode {figures[2]:.1f} tok/s ({figures[3]:.1f} per CPU s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
