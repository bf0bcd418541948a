"""The LoRA delta of a step with several adapters: the concatenated two-GEMM path
(:mod:`stages.execute.lora_segments`), the same in native code (``native``,
:mod:`stages.execute.lora_native`) and the loop over row groups, by alternation in one
process (best of ``--rounds``), on the default model's wrapped projections (every q/k/v/o and
fused gate/up/down of its 30 layers): ``--adapters`` random adapters of rank ``--rank`` on
every projection, ``--rows`` packed rows spread evenly over them (decode rows of one step:
each adapter's rows contiguous, or with ``--interleaved`` row ``i`` under adapter ``i mod N``
as ``bench offline --lora N`` packs them), and the base model's own linears alone for scale.

    python -m benchmarks.lora_segments [--adapters 4] [--rank 8] [--rows 64] [--rounds 7]
        [--interleaved]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5, help="passes timed per round")
    parser.add_argument("--interleaved", action="store_true", help="row i under adapter i mod N")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the process's CPU seconds, not wall time (a loaded machine)",
    )
    args = parser.parse_args(argv)

    import torch

    from stages.execute.config import ExecuteConfig
    from stages.execute.lora import LoRALinear
    from stages.execute.runner import ModelRunner

    runner = ModelRunner(ExecuteConfig(model=args.model, num_blocks=16, enable_lora=True))
    runner.load()
    bank = runner.lora
    assert bank is not None
    wrapped = [m for m in runner.model.modules() if isinstance(m, LoRALinear)]
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
    share = args.rows // args.adapters
    if args.interleaved:
        spans = [(adapters[i % len(adapters)], i, i + 1) for i in range(share * len(adapters))]
    else:
        spans = [(adapter, i * share, (i + 1) * share) for i, adapter in enumerate(adapters)]
    inputs = {m.in_features: torch.randn(1, share * args.adapters, m.in_features) for m in wrapped}

    def one_pass(mode: str) -> float:
        began = time.process_time() if args.cpu_time else time.perf_counter()
        with torch.inference_mode():
            for _ in range(args.repeat):
                if mode == "base":
                    for module in wrapped:
                        module.base(inputs[module.in_features])
                    continue
                bank.segmented = mode != "loop"
                bank.native = mode == "native"
                with bank.rows(spans):
                    for module in wrapped:
                        module(inputs[module.in_features])
        ended = time.process_time() if args.cpu_time else time.perf_counter()
        return (ended - began) / args.repeat * 1e3

    best = dict.fromkeys(("base", "loop", "concatenated", "native"), float("inf"))
    for mode in best:
        one_pass(mode)  # warm-up (the concatenated weights built once)
    for _ in range(args.rounds):
        for mode in best:
            best[mode] = min(best[mode], one_pass(mode))
    print(
        f"{args.model}: {len(wrapped)} wrapped projections, {args.adapters} adapters of rank "
        f"{args.rank}, {share * args.adapters} rows"
        f"{' interleaved' if args.interleaved else ''}, {torch.get_num_threads()} threads, load "
        f"average {os.getloadavg()[0]:.2f}"
    )
    for mode, milliseconds in best.items():
        print(
            f"  {mode:>12}: {milliseconds:8.2f} ms{' CPU' if args.cpu_time else ''} per step's "
            f"projections (best of {args.rounds})"
        )
    loop, concatenated, base = best["loop"], best["concatenated"], best["base"]
    native = best["native"]
    print(
        f"  delta over the base linears: loop {loop - base:.2f} ms, concatenated "
        f"{concatenated - base:.2f} ms, native {native - base:.2f} ms; whole step's "
        f"projections loop/concatenated {loop / concatenated:.2f}x, concatenated/native "
        f"{concatenated / native:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
