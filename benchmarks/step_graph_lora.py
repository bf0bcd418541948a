"""One decode step with LoRA adapter rows: the CPU step graph (its native deltas,
:mod:`stages.execute.step_graph_lora`) against the module path (``LoRALinear``, the
concatenated deltas of :mod:`stages.execute.lora_segments`), and each without adapters for
scale, alternated in one process (best of ``--rounds``): ``--rows`` decode rows of the
default model (contexts 32 + row), row ``i`` under random adapter ``i mod --adapters`` of rank
``--rank`` on every projection, as ``bench offline --lora N`` packs them.

    python -m benchmarks.step_graph_lora [--rows 16] [--adapters 4] [--rank 8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3, help="steps timed per round")
    args = parser.parse_args(argv)

    from pipeline.runtime.omp_policy import apply_omp_policy

    apply_omp_policy()  # the engine's OpenMP wait policy (auto), before torch loads the runtime
    import torch

    from stages.execute.attention import build_step_metadata, forward_context
    from stages.execute.config import ExecuteConfig
    from stages.execute.lora import lora_rows
    from stages.execute.runner import ModelRunner
    from stages.execute.step_graph_lora import StepGraphLoRA, step_lora
    from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
    from stages.params import SamplingParams

    config = ExecuteConfig(model=args.model, num_blocks=256, enable_lora=True,
                           max_loras=args.adapters)  # fmt: skip
    runner = ModelRunner(config)
    runner.load()
    graph, bank, cache = runner.step_graph, runner.lora, runner.kv_cache
    assert graph is not None and bank is not None and cache is not None
    assert runner.allocator is not None
    generator = torch.Generator().manual_seed(0)
    adapters = []
    for _ in range(args.adapters):
        weights = {}
        for layer in range(bank.num_layers):
            for name, target in bank.targets.items():
                a = torch.randn(args.rank, target.in_features, generator=generator) * 0.02
                b = torch.randn(target.out_features, args.rank, generator=generator) * 0.02
                weights[layer, name] = (a, b)
        adapters.append(bank.adapter_of_weights(weights, 2.0))
    per_row = [adapters[i % len(adapters)] for i in range(args.rows)]
    prompts = [
        [(7 * i + 13 * row) % 40000 + 3 for i in range(32 + row)] for row in range(args.rows)
    ]
    names = [f"p{row}" for row in range(args.rows)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runner.execute(
        SchedulerStep(
            0,
            tuple(EngineRequest(n, tuple(p), params) for n, p in zip(names, prompts, strict=True)),
            tuple(ScheduledChunk(n, 0, len(p) - 1) for n, p in zip(names, prompts, strict=True)),
        )
    )
    for name, prompt in zip(names, prompts, strict=True):
        runner.allocator.allocate(name, len(prompt))
    tables = [runner.allocator.block_table(name) for name in names]
    positions = [len(p) - 1 for p in prompts]
    tokens = [p[-1] for p in prompts]
    lora = step_lora(StepGraphLoRA(bank, graph), [(a, 1) for a in per_row])

    def module_path(with_lora: bool) -> None:
        metadata, position_ids = build_step_metadata(
            kv_cache=cache, block_tables=tables, query_starts=positions,
            query_lens=[1] * args.rows, num_decode=args.rows, decode_mode="grouped",
            max_model_len=runner.max_model_len, device=torch.device("cpu"),
        )  # fmt: skip
        spans = [(a if with_lora else None, row, row + 1) for row, a in enumerate(per_row)]
        with torch.inference_mode(), forward_context(metadata), lora_rows(bank, spans):
            runner.model(
                input_ids=torch.tensor([tokens]),
                position_ids=position_ids.unsqueeze(0),
                use_cache=False,
                logits_to_keep=torch.arange(args.rows),
            )

    variants: dict[str, Callable[[], object]] = {
        "step graph, base": lambda: graph.run(tokens, positions, tables, range(args.rows)),
        "step graph, LoRA": lambda: graph.run(tokens, positions, tables, range(args.rows), lora),
        "module path, base": lambda: module_path(False),
        "module path, LoRA": lambda: module_path(True),
    }
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):
        for name, run in variants.items():
            run()  # warm
            began = time.perf_counter()
            for _ in range(args.repeat):
                run()
            best[name] = min(best[name], (time.perf_counter() - began) / args.repeat)
    print(
        f"{args.model}: {args.rows} decode rows, {args.adapters} adapters of rank {args.rank} "
        f"on every projection; {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    for name, seconds in best.items():
        print(f"  {name:18s} {seconds * 1e3:8.2f} ms per step (best of {args.rounds})")
    base = best["step graph, base"]
    print(
        f"  LoRA on the step graph / base step graph: {best['step graph, LoRA'] / base:.2f}x; "
        f"module path LoRA / step graph LoRA: "
        f"{best['module path, LoRA'] / best['step graph, LoRA']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
