"""The quantized GEMM against the fp32 packed GEMM at the default model's shapes
(docs/performance.md §12.1): Q8_0 and Q4_1 weights, fp32 or int8 activations, best of N, the
variants alternating in one process, µs and the ratio to fp32.

    python -m benchmarks.quant_gemm [--threads 1] [--rows 1,8,128,2048] [--head]
        [--baseline OLD/quant_gemm.c] [--rounds 2]

``--baseline``: also the kernel built from another copy of the source (a tree before a change),
its Q4_1 and Q8_0 int8-activation GEMMs, alternating with this tree's in every round (the
ratio printed against this tree's int8 column).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from stages.execute.native import build_library, packed_gemm_kernel
from stages.execute.quant.kernel import QuantGemmKernel, quant_gemm_kernel
from stages.execute.quant.layers import pack_gguf, quantize_int8

__all__ = ["main"]

#: SmolLM2-135M's linears [N, K]
SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)}
HEAD = (49152, 576)


def _best(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,128,2048")
    parser.add_argument("--head", action="store_true", help="the LM head too (up to 128 rows)")
    parser.add_argument("--baseline", type=Path, help="another quant_gemm.c to alternate with")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds, best kept")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    quant, packed_kernel = quant_gemm_kernel(), packed_gemm_kernel()
    if quant is None or packed_kernel is None:
        raise SystemExit("the native kernels do not build here")
    print(f"int8 dot products on: {quant.int8_dot}")
    old: QuantGemmKernel | None = None
    if args.baseline is not None:
        old = QuantGemmKernel(build_library(args.baseline))
    shapes = dict(SHAPES, **({"head": HEAD} if args.head else {}))
    generator = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, generator=generator) * 0.05
        packed = packed_kernel.pack(weight)
        q4_1 = gguf_quantize(weight.numpy(), GGMLQuantizationType.Q4_1)
        formats = {
            "q8": quantize_int8(weight, quant),
            "q4": pack_gguf(torch.from_numpy(np.ascontiguousarray(q4_1)), 3, k, quant),
        }
        for rows in (int(r) for r in args.rows.split(",")):
            if name == "head" and rows > 128:
                continue
            x = torch.randn(rows, k, generator=generator)
            repeats = max(3, min(200, int(2e8 / (rows * n * k))))
            times: dict[str, float] = {}
            for _ in range(args.rounds):  # alternating rounds
                runs: dict[str, Callable[[], object]] = {
                    "fp32": functools.partial(packed_kernel, x, packed, None)
                }
                for fmt, quantized in formats.items():
                    for int8 in (False, True):
                        key = f"{fmt}{'/i8' if int8 else ''}"
                        runs[key] = functools.partial(
                            quant.gemm, x, quantized.blocks, fmt, None, int8
                        )
                        if old is not None and int8:
                            runs[f"{key}(old)"] = functools.partial(
                                old.gemm, x, quantized.blocks, fmt, None, int8
                            )
                for key, run in runs.items():
                    times[key] = min(times.get(key, float("inf")), _best(run, repeats))
            base = times["fp32"]
            cells = " ".join(
                f"{key} {value * 1e6:9.1f} ({base / value:4.2f}x)"
                for key, value in times.items()
                if key != "fp32"
            )
            if old is not None:
                cells += " | new/old " + " ".join(
                    f"{fmt}/i8 {times[f'{fmt}/i8(old)'] / times[f'{fmt}/i8']:5.2f}x"
                    for fmt in formats
                )
            print(f"{name:7s} [{n}x{k}] rows {rows:5d}: fp32 {base * 1e6:9.1f} us | {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
