"""The bf16 GEMM's three paths at the default model's shapes (docs/performance.md §12.2): AMX
tiles over the packed panels, VDPBF16PS over the same panels, and torch's bf16 matmul over the
weight unpacked from them for the call (what :class:`~stages.execute.bf16.BF16Linear` ran from
128 rows on before the tiles); best of N, the paths alternating in one process, ms per call and
each path's time over the tiles'. For the fused gate/up projection also its SiLU-and-mul: the
GEMM followed by ``kernels/fused_cpu.c``'s pass (what ran before the epilogue) against the
GEMM with its epilogue (:meth:`~stages.execute.bf16.BF16GemmKernel.silu_mul`, half the columns
stored), each on the kernel's path for the row count (tiles from ``amx_rows``).
With one thread the clock is the process's CPU time (a call
preempted on a loaded machine is not charged the time others ran), else wall time.

    python -m benchmarks.bf16_gemm [--threads 1] [--rows 1,8,16,64,128,512]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from stages.execute.bf16 import BF16GemmKernel, bf16_gemm_kernel
from stages.execute.native import GEMM_PANEL, fused_ops_kernel

__all__ = ["main"]

#: SmolLM2-135M's linears [N, K] (gate and up packed as one)
SHAPES = {"gate/up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def _best(run: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        began = clock()
        run()
        best = min(best, clock() - began)
    return best


def _unpacked_torch(x: torch.Tensor, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    weight = packed.transpose(1, 2).reshape(n, -1)[:, :k]  # the copy BF16Linear made
    return F.linear(x.bfloat16(), weight).float()


def _then_silu(
    kernel: BF16GemmKernel, fused: Any, x: torch.Tensor, packed: torch.Tensor, k: int
) -> torch.Tensor:
    return fused.silu_mul(kernel(x, packed, k, None))  # the pass before the epilogue


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,16,64,128,512")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel, plain = bf16_gemm_kernel(), bf16_gemm_kernel(amx=False)
    if kernel is None or plain is None or not kernel.native:
        raise SystemExit("the native bf16 kernel does not build on VDPBF16PS here")
    fused = fused_ops_kernel()
    clock = time.process_time if args.threads == 1 else time.perf_counter
    print(
        f"AMX tiles: {kernel.amx} (from {kernel.amx_rows} rows in the linears); "
        f"{args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time"
    )
    generator = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        packed = BF16GemmKernel.pack(torch.randn(n, k, generator=generator) * 0.05)
        assert packed.shape[0] * GEMM_PANEL == n
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=generator)
            repeats = max(3, min(100, int(1e9 / (rows * n * k + n * k * 8))))
            runs: dict[str, Callable[[], object]] = {}
            if kernel.amx:
                runs["amx"] = functools.partial(kernel.tiles, x, packed, k, None)
            runs["vdpbf16ps"] = functools.partial(plain, x, packed, k, None)
            runs["unpack+torch"] = functools.partial(_unpacked_torch, x, packed, n, k)
            if name == "gate/up" and fused is not None:
                runs["gemm,silu"] = functools.partial(_then_silu, kernel, fused, x, packed, k)
                runs["epilogue"] = functools.partial(kernel.silu_mul, x, packed, k, None)
            times: dict[str, float] = {}
            for _ in range(args.rounds):
                for key, run in runs.items():
                    times[key] = min(times.get(key, float("inf")), _best(run, repeats, clock))
            base = times.get("amx")
            cells = " | ".join(
                f"{key} {value * 1e3:8.3f} ms" + (f" ({value / base:5.2f}x)" if base else "")
                for key, value in times.items()
            )
            print(f"{name:7s} [{n}x{k}] rows {rows:4d}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
