"""Where §1's offline time goes by kind of step, and the step graph's row bound A/B
(docs/performance.md §12.2, "The step graph at 64 rows"): §1's workload (64 chat-templated
requests, ``max_tokens`` from {16, 32, 64, 128}, greedy, ``ignore_eos``) through ``LLM`` in the
memory topology, one fresh process per variant, the variants alternating, best of
``--rounds``. A variant is a ``cuda_graph_max_batch_size`` (the step graph's bound on CPU where
the weights are bf16 panels: ``stages.execute.step_graph.plan_rows``); each run times every
``ModelRunner.execute`` call and sorts it into prefill or mixed steps, decode steps on the step
graph, and decode steps on the module path (wall time and the process's CPU time).

    python -m benchmarks.offline_steps --limits 16,128 --rounds 2 --dtype bfloat16
    python -m benchmarks.offline_steps --limits 128 --tree ../before --tree . --rounds 3
    python -m benchmarks.offline_steps --limits 16 --dtype float32 --lora 4 --torch-delta

``--tree`` (repeatable): each run imports the actorline of that source tree (this file's code
measures every tree, so only the library under test differs).

``--lora N`` runs each limit with N random adapters too (``bench offline --lora N``'s: request
``i`` under adapter ``i mod N``), ``--torch-delta`` also with the module path's delta in torch
(:mod:`stages.execute.lora_segments`) rather than native code (:mod:`stages.execute.lora_native`).

The engine's OpenMP wait policy is set as an engine process sets it (``auto``) before torch
loads, so the one-process run waits between regions as ``bench offline``'s engine does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "run_one"]

KINDS = ("prefill or mixed", "decode, step graph", "decode, module path")


def run_one(
    limit: int, requests: int, dtype: str, model: str, lora: int = 0, torch_delta: bool = False
) -> dict[str, Any]:
    """In this process: §1's workload at ``cuda_graph_max_batch_size=limit``; tokens/s and,
    per kind of step, the steps, rows, wall and CPU seconds. ``lora``: with that many random
    adapters (``bench offline --lora``'s, rank 8), request ``i`` under adapter ``i mod lora``;
    ``torch_delta``: the module path's delta in torch's three calls, not the native one
    (:mod:`stages.execute.lora_native`)."""
    from pipeline.runtime.omp_policy import apply_omp_policy

    apply_omp_policy("auto")  # before torch loads, as host_main does for an engine process
    from pipeline.bench.workload import WorkloadSpec, blocks_to_hold, make_workload, prompt_ids
    from pipeline.engine.llm import LLM
    from stages.execute.runner import ModelRunner
    from stages.messages import SchedulerStep, StepResult
    from stages.params import SamplingParams
    from stages.tokenize import load_tokenizer

    tokenizer = load_tokenizer(model)
    workload = make_workload(WorkloadSpec(num_requests=requests))
    prompts = [prompt_ids(tokenizer, request.prompt) for request in workload]
    max_tokens = [request.max_tokens for request in workload]
    totals = {kind: [0, 0, 0.0, 0.0] for kind in KINDS}  # steps, rows, wall, cpu
    timing = [False]
    prompt_lengths: dict[str, int] = {}
    original = ModelRunner.execute

    def timed(runner: ModelRunner, step: SchedulerStep) -> StepResult:
        for request in step.new_requests:
            prompt_lengths[request.request_id] = len(request.prompt_token_ids)
        if not timing[0] or not step.chunks:
            return original(runner, step)
        graph = runner.step_graph
        before = graph.steps if graph is not None else 0
        wall, cpu = time.perf_counter(), time.process_time()
        result = original(runner, step)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        rows = sum(chunk.num_tokens for chunk in step.chunks)
        if graph is not None and graph.steps > before:
            kind = KINDS[1]
        elif rows != len(step.chunks) or any(
            chunk.start < prompt_lengths.get(chunk.request_id, 0) for chunk in step.chunks
        ):
            kind = KINDS[0]
        else:
            kind = KINDS[2]
        entry = totals[kind]
        entry[0] += 1
        entry[1] += rows
        entry[2] += wall
        entry[3] += cpu
        return result

    ModelRunner.execute = timed  # type: ignore[method-assign,assignment]  # measuring
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    options: dict[str, Any] = {}
    per_request = None
    if lora:
        import tempfile
        from pathlib import Path

        from pipeline.bench.lora import make_random_adapters
        from stages.lora import LoRARequest

        directory = tempfile.mkdtemp(prefix="actorline-offline-steps-")
        paths = make_random_adapters(model, lora, 8, Path(directory))
        loras = [LoRARequest(f"adapter{i + 1}", i + 1, str(p)) for i, p in enumerate(paths)]
        per_request = [loras[i % lora] for i in range(len(prompts))]
        options.update(enable_lora=True, max_loras=lora)
        if torch_delta:
            import stages.execute.lora as lora_module

            lora_module.native_lora_delta = lambda: None  # type: ignore[assignment]  # measuring
    with LLM(
        model,
        transport="memory",
        dtype=dtype,
        num_blocks=blocks_to_hold(prompts, max_tokens, 16) + 1,
        max_num_seqs=len(prompts),
        cuda_graph_max_batch_size=limit,
        **options,
    ) as llm:
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0]], warm, use_tqdm=False)
        timing[0] = True
        began, window = time.perf_counter(), [time.monotonic()]
        cpu = time.process_time()
        results = llm.generate(list(prompts), params, use_tqdm=False, lora_request=per_request)
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
        window.append(time.monotonic())
    generated = sum(len(result.token_ids) for result in results)
    # NOTE: the timed window on CLOCK_MONOTONIC, to cut a `perf record -k CLOCK_MONOTONIC`
    return {
        "limit": limit,
        "lora": lora,
        "torch_delta": torch_delta,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "tokens_per_cpu_s": generated / cpu,
        "kinds": totals,
        "monotonic_window": window,
    }


def _name(lora: int, torch_delta: bool) -> str:
    if not lora:
        return "base model"
    return f"{lora} adapters{' (torch delta)' if torch_delta else ''}"


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", default="16,128", help="cuda_graph_max_batch_size values")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tree", action="append", help="a source tree (repeatable; default .)")
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        help="also run each limit with this many adapters (bench offline --lora)",
    )
    parser.add_argument(
        "--torch-delta",
        action="store_true",
        help="with --lora, also run the adapters with torch's delta",
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        result = run_one(args.one, args.requests, args.dtype, args.model, args.lora,
                         args.torch_delta)  # fmt: skip
        print(json.dumps(result))
        return 0
    limits = [int(value) for value in args.limits.split(",")]
    trees = [Path(tree).resolve() for tree in args.tree or ["."]]
    kinds = [(0, False)]
    if args.lora:
        kinds.append((args.lora, False))
        if args.torch_delta:
            kinds.append((args.lora, True))
    Variant = tuple[Path, int, int, bool]  # tree, limit, adapters, torch's delta
    variants: list[Variant] = [
        (tree, limit, lora, torch_delta)
        for tree in trees
        for limit in limits
        for lora, torch_delta in kinds
    ]

    def name(variant: Variant) -> str:
        tree, limit, lora, torch_delta = variant
        where = f"{tree.name} " if len(trees) > 1 else ""
        return f"{where}limit {limit}, {_name(lora, torch_delta)}"

    best: dict[Variant, dict[str, Any]] = {}
    best_cpu: dict[Variant, float] = {}
    print(f"load average {_load()} at start")
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for variant in order:
            tree, limit, lora, torch_delta = variant
            # this file's code measures every tree; only the library imported differs
            command = [sys.executable, str(Path(__file__).resolve()), "--one", str(limit),
                       "--requests", str(args.requests), "--dtype", args.dtype,
                       "--model", args.model, "--lora", str(lora),
                       *(["--torch-delta"] if torch_delta else [])]  # fmt: skip
            environment = dict(os.environ, PYTHONPATH=str(tree))
            done = subprocess.run(
                command, capture_output=True, text=True, check=True, cwd=tree, env=environment
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            cpu = ", ".join(f"{kind} {entry[3]:.2f}" for kind, entry in result["kinds"].items()
                            if entry[0])  # fmt: skip
            print(f"round {round_index + 1}, {name(variant)}: {result['tokens_per_s']:.1f} "
                  f"tok/s, {result['tokens_per_cpu_s']:.1f} per CPU second; CPU s: {cpu} "
                  f"(load {_load()})", flush=True)  # fmt: skip
            if variant not in best or result["tokens_per_s"] > best[variant]["tokens_per_s"]:
                best[variant] = result
            best_cpu[variant] = max(best_cpu.get(variant, 0.0), result["tokens_per_cpu_s"])
    print(f"load average {_load()} at the end; best of {args.rounds} per variant:")
    for variant, result in best.items():
        wall = sum(entry[2] for entry in result["kinds"].values()) or 1.0
        print(f"{name(variant)}: {result['tokens_per_s']:.1f} tok/s, {result['seconds']:.2f} s "
              f"(best per CPU second: {best_cpu[variant]:.1f})")  # fmt: skip
        for kind, (steps, rows, seconds, cpu) in result["kinds"].items():
            print(f"  {kind:22} {steps:5d} steps {rows:6d} rows {seconds:7.2f} s wall "
                  f"({100 * seconds / wall:4.1f}% of execute) {cpu:7.2f} s CPU")  # fmt: skip
    if len(best) == 2 and not args.lora:
        first, second = variants
        print(
            f"{name(second)} / {name(first)}: "
            f"{best[second]['tokens_per_s'] / best[first]['tokens_per_s']:.2f}x wall, "
            f"{best_cpu[second] / best_cpu[first]:.2f}x per CPU second"
        )
    if args.lora:
        for tree, limit, (lora, torch_delta) in itertools.product(trees, limits, kinds[1:]):
            base = (tree, limit, 0, False)
            variant = (tree, limit, lora, torch_delta)
            print(
                f"{name(variant)} / base: "
                f"{best[variant]['tokens_per_s'] / best[base]['tokens_per_s']:.2f}x wall, "
                f"{best_cpu[variant] / best_cpu[base]:.2f}x per CPU second"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
