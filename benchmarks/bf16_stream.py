"""fp32 against bf16 weights on CPU (docs/performance.md §12.2): for each variant, a fresh
process loads the default model, prefills a 1,000-token prompt, then runs one stream's decode
steps through ``ModelRunner.execute`` after a ``--context``-token prompt; the variants
alternate, best of ``--rounds``.

    python -m benchmarks.bf16_stream --rounds 3 --decode 256
    python -m benchmarks.bf16_stream --variants bf16-native,bf16-fp32kv --context 2000

Variants: ``fp32``; ``bf16-torch`` (dtype bfloat16 on torch's kernels, as before the native
bf16 GEMM: ``native_linears`` off); ``bf16-native`` (dtype bfloat16, its KV cache bf16:
``kv_cache_dtype`` auto); ``bf16-fp32kv`` (dtype bfloat16 over an fp32 KV cache, as before the
bf16 cache). Prints one line per run and the best per variant: prefill and decode tokens/s,
and decode tokens per CPU-second of the process (``time.process_time``: on a machine shared
with other work, what the stream costs its own cores, which waiting for them does not inflate;
``--threads 1`` keeps OpenMP's barriers from waiting on a descheduled thread there).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

VARIANTS: dict[str, dict[str, object]] = {
    "fp32": {},
    "bf16-torch": {"dtype": "bfloat16", "native_linears": False},
    "bf16-native": {"dtype": "bfloat16"},
    "bf16-fp32kv": {"dtype": "bfloat16", "kv_cache_dtype": "float32"},
}
PROMPT_TOKENS = 1000


def run_one(variant: str, decode: int, context: int = 16) -> tuple[float, float, float]:
    """In this process: prefill tokens/s, decode tokens/s and decode tokens per CPU-second of
    ``variant`` (the stream's prompt ``context`` tokens long)."""
    import torch

    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner
    from stages.messages import EngineRequest, SamplingParams, ScheduledChunk, SchedulerStep

    longest = max(PROMPT_TOKENS, context + decode + 1)
    blocks = max(128, -(-longest // 16) + 8)
    config = ExecuteConfig(model="smollm2-135m", num_blocks=blocks, **VARIANTS[variant])  # type: ignore[arg-type]
    runner = ModelRunner(config)
    runner.load()
    length = max(PROMPT_TOKENS, context)
    prompt = torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(0))
    step = 0

    def timed(request_id: str, tokens: list[int], steps: int) -> tuple[float, float, float]:
        nonlocal step
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0)
        request = EngineRequest(request_id, tuple(tokens), params)
        start = time.perf_counter()
        chunk = ScheduledChunk(request_id, 0, len(tokens))
        runner.execute(SchedulerStep(step, (request,), (chunk,)))
        prefill = time.perf_counter() - start
        start, cpu_start = time.perf_counter(), time.process_time()
        for index in range(steps):
            step += 1
            chunk = ScheduledChunk(request_id, len(tokens) + index, 1)
            runner.execute(SchedulerStep(step, (), (chunk,)))
        step += 1
        runner.execute(SchedulerStep(step, finished=(request_id,)))
        step += 1
        return prefill, time.perf_counter() - start, time.process_time() - cpu_start

    timed("warm", prompt[:16].tolist(), 8)
    prefill, _, _ = timed("prefill", prompt[:PROMPT_TOKENS].tolist(), 0)
    _, decode_s, decode_cpu = timed("decode", prompt[:context].tolist(), decode)
    return PROMPT_TOKENS / prefill, decode / decode_s, decode / decode_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", type=int, default=256, help="decode steps of the stream")
    parser.add_argument("--context", type=int, default=16, help="the stream's prompt tokens")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        prefill, decode, decode_cpu = run_one(args.one, args.decode, args.context)
        print(f"{prefill:.2f} {decode:.2f} {decode_cpu:.2f}")
        return
    variants = args.variants.split(",")
    best: dict[str, tuple[float, float, float]] = {}
    for round_index in range(args.rounds):
        for variant in variants:
            command = [sys.executable, "-m", "benchmarks.bf16_stream", "--one", variant]
            command += ["--decode", str(args.decode), "--context", str(args.context)]
            if args.threads is not None:
                command += ["--threads", str(args.threads)]
            output = subprocess.run(
                command, capture_output=True, text=True, check=True, env=os.environ.copy()
            ).stdout.split()
            prefill, decode, decode_cpu = (float(value) for value in output[-3:])
            print(f"round {round_index} {variant}: prefill {prefill:.1f} tok/s, decode "
                  f"{decode:.1f} tok/s, {decode_cpu:.1f} per CPU-s", flush=True)  # fmt: skip
            old = best.get(variant, (0.0, 0.0, 0.0))
            best[variant] = (max(old[0], prefill), max(old[1], decode), max(old[2], decode_cpu))
    for variant, (prefill, decode, decode_cpu) in best.items():
        print(f"best {variant}: prefill {prefill:.1f} tok/s, decode {decode:.1f} tok/s, "
              f"{decode_cpu:.1f} per CPU-s")  # fmt: skip


if __name__ == "__main__":
    main()
