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
    python -m benchmarks.bf16_gemm --rows 512,1024,2048 --shapes qkv,gate/up --onednn \
        --define AMX_BLOCK_ROWS_FIRST=1000000     # prefill's shapes (docs/performance.md §12.2)
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from stages.execute.bf16 import BF16_SOURCE, BF16GemmKernel, bf16_gemm_kernel
from stages.execute.native import GEMM_PANEL, build_library, fused_ops_kernel

__all__ = ["main"]

#: SmolLM2-135M's linears [N, K] (gate and up packed as one)
SHAPES = {
    "gate/up": (3072, 576),
    "down": (576, 1536),
    "qkv": (960, 576),
    "o": (576, 576),
    "head": (49152, 576),
}


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


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.bfloat16(), weight).float()  # fp32 in and out, as BF16Linear's calls


def _then_silu(
    kernel: BF16GemmKernel, fused: Any, x: torch.Tensor, packed: torch.Tensor, k: int
) -> torch.Tensor:
    return fused.silu_mul(kernel(x, packed, k, None))  # the pass before the epilogue


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,16,64,128,512")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--cold", type=int, default=1,
                        help="copies of each weight the tiles' runs cycle through (30: a "
                             "forward pass's layers, read from memory); ms per call")  # fmt: skip
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    parser.add_argument("--onednn", action="store_true",
                        help="also torch's bf16 F.linear on a [N, K] weight: fp32 in and out "
                             "(as the linears take them) and bf16 in and out")  # fmt: skip
    parser.add_argument("--define", action="append", default=[],
                        help="also the tiles of a build with this define (NAME or NAME=VALUE, "
                             "e.g. AMX_BLOCK_ROWS_FIRST=1000000: the panels-outside order at "
                             "every row count); repeatable")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel, plain = bf16_gemm_kernel(), bf16_gemm_kernel(amx=False)
    if kernel is None or plain is None or not kernel.native:
        raise SystemExit("the native bf16 kernel does not build on VDPBF16PS here")
    fused = fused_ops_kernel()
    variants = {
        name: BF16GemmKernel(build_library(BF16_SOURCE, defines=(name,))) for name in args.define
    }
    clock = time.process_time if args.threads == 1 else time.perf_counter
    print(
        f"AMX tiles: {kernel.amx} (from {kernel.amx_rows} rows in the linears); "
        f"{args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time"
    )
    generator = torch.Generator().manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weight = torch.randn(n, k, generator=generator) * 0.05
        packed = BF16GemmKernel.pack(weight)
        # --cold: the tiles' runs go through that many copies of the panels, one call each, so
        # the weights come from memory as a forward pass's 30 layers read them
        copies = [packed] + [BF16GemmKernel.pack(weight) for _ in range(args.cold - 1)]

        def over(
            call: Callable[..., object], copies: list[torch.Tensor] = copies
        ) -> Callable[[], object]:
            return lambda: [call(packed=copy) for copy in copies]

        nk_weight = weight.bfloat16()  # [N, K], as oneDNN takes it without a copy
        assert packed.shape[0] * GEMM_PANEL == n
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=generator)
            repeats = max(3, min(100, int(1e9 / (rows * n * k + n * k * 8))))
            runs: dict[str, Callable[[], object]] = {}
            if kernel.amx:
                runs["amx"] = over(functools.partial(kernel.tiles, x, k=k, bias=None))
            for define, variant in variants.items():
                runs[f"amx[{define}]"] = over(functools.partial(variant.tiles, x, k=k, bias=None))
            if args.onednn:
                runs["onednn fp32 io"] = functools.partial(_onednn, x, nk_weight)
                runs["onednn bf16 io"] = functools.partial(F.linear, x.bfloat16(), nk_weight)
            if rows <= 512 or not (args.onednn or variants):
                runs["vdpbf16ps"] = functools.partial(plain, x, packed, k, None)
                runs["unpack+torch"] = functools.partial(_unpacked_torch, x, packed, n, k)
            if name == "gate/up" and fused is not None:
                runs["gemm,silu"] = functools.partial(_then_silu, kernel, fused, x, packed, k)
                runs["epilogue"] = over(functools.partial(kernel.silu_mul, x, k=k, bias=None))
            cold_keys = {key for key in runs if key.startswith("amx") or key == "epilogue"}
            if args.cold > 1:  # the other paths read a hot weight: not comparable
                runs = {key: run for key, run in runs.items() if key in cold_keys}
            times: dict[str, float] = {}
            for _ in range(args.rounds):
                for key, run in runs.items():
                    calls = len(copies) if key in cold_keys else 1
                    best = _best(run, max(3, repeats // calls), clock) / calls
                    times[key] = min(times.get(key, float("inf")), best)
            base = times.get("amx")
            cells = " | ".join(
                f"{key} {value * 1e3:8.3f} ms" + (f" ({value / base:5.2f}x)" if base else "")
                for key, value in times.items()
            )
            print(f"{name:7s} [{n}x{k}] rows {rows:4d}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
