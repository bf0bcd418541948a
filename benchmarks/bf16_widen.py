"""bf16 weights without AVX512-BF16: the bf16 GEMM's portable widen-and-FMA path against the fp32
packed GEMM (``kernels/packed_gemm.c``) over a forward pass's linears at the default model's
shapes (docs/performance.md §12.3): every layer's q, k, v, o, fused gate/up and down projections
with weights of their own (read from memory, as a decode step reads them) and the LM head, at a
few row counts (1: one stream's decode step; hundreds: a prefill chunk). The two alternate round
by round in one process, best round kept; with one thread the clock is the process's CPU time (a
call preempted on a loaded machine is not charged the time others ran), else wall time.
``--baseline`` also times a bf16 kernel built from another source (an earlier
``bf16_gemm.c``, e.g. ``git show HEAD~1:stages/execute/kernels/bf16_gemm.c > /tmp/old.c``).

    python -m benchmarks.bf16_widen [--threads 1] [--rows 1,4,16,256] [--layers 30]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from stages.execute.bf16 import BF16GemmKernel, bf16_gemm_kernel
from stages.execute.native import build_library, packed_gemm_kernel

__all__ = ["main"]

#: SmolLM2-135M's linears per layer [N, K] (gate and up packed as one), and its LM head
LAYER_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (3072, 576), (576, 1536))
HEAD_SHAPE = (49152, 576)


def _library_gemm(library: Path) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """``actorline_bf16_gemm_f32`` of a built library (any version of the source), as a call."""
    gemm = ctypes.CDLL(str(library)).actorline_bf16_gemm_f32
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    gemm.argtypes = [pointer, i64, i64, pointer, pointer, i64, pointer, ctypes.c_int]
    gemm.restype = ctypes.c_int

    def call(x: torch.Tensor, packed: torch.Tensor, k: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], packed.shape[0] * 16)
        status = gemm(x.data_ptr(), x.shape[0], k, packed.data_ptr(), None, out.shape[1],
                      out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise SystemExit(f"{library}: the bf16 GEMM failed ({status})")
        return out

    return call


def _pass(
    call: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    weights: list[tuple[torch.Tensor, int]],
    inputs: dict[int, torch.Tensor],
) -> None:
    for packed, k in weights:
        call(inputs[k], packed, k)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,16,256")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--no-head", action="store_true", help="leave the LM head out")
    parser.add_argument("--baseline", type=Path, help="also a bf16 kernel built from this source")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    portable, fp32 = bf16_gemm_kernel(portable=True), packed_gemm_kernel()
    if portable is None or fp32 is None:
        raise SystemExit("the native kernels do not build here")
    calls = {"bf16": _library_gemm(portable.path)}
    if args.baseline is not None:
        calls["bf16 baseline"] = _library_gemm(build_library(args.baseline))
    shapes = [shape for _ in range(args.layers) for shape in LAYER_SHAPES]
    if not args.no_head:
        shapes.append(HEAD_SHAPE)
    generator = torch.Generator().manual_seed(0)
    raw = [torch.randn(n, k, generator=generator) * 0.05 for n, k in shapes]
    bf16 = [(BF16GemmKernel.pack(weight), weight.shape[1]) for weight in raw]
    packed32 = [(fp32.pack(weight), weight.shape[1]) for weight in raw]
    del raw
    clock = time.process_time if args.threads == 1 else time.perf_counter
    weight_mb = {
        "fp32": sum(p.numel() * 4 for p, _ in packed32) / 1e6,
        "bf16": sum(p.numel() * 2 for p, _ in bf16) / 1e6,
    }
    print(
        f"{args.layers} layers{'' if args.no_head else ' + head'}: fp32 {weight_mb['fp32']:.0f} "
        f"MB, bf16 {weight_mb['bf16']:.0f} MB; {args.threads} thread(s); portable build: "
        f"{portable.lanes} floats per vector, {portable.tile_rows} rows per micro-tile"
    )

    def fp32_call(x: torch.Tensor, packed: torch.Tensor, k: int) -> torch.Tensor:
        return fp32(x, packed, None)

    for rows in (int(value) for value in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in bf16}}
        runs: dict[str, Callable[[], None]] = {
            "fp32": functools.partial(_pass, fp32_call, packed32, inputs),
        }
        for name, call in calls.items():
            runs[name] = functools.partial(_pass, call, bf16, inputs)
        best = dict.fromkeys(runs, float("inf"))
        for run in runs.values():
            run()  # warm up: the kernels' buffers, the pages
        for _ in range(args.rounds):
            for name, run in runs.items():
                began = clock()
                run()
                best[name] = min(best[name], clock() - began)
        cells = ", ".join(
            f"{name} {best[name] * 1e3:.1f} ms ({best['fp32'] / best[name]:.2f}x fp32)"
            for name in runs
        )
        print(f"rows {rows:4d}: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
