"""The bf16 GEMM's SiLU-and-mul epilogue and its column ranges (``kernels/bf16_gemm.c``,
:meth:`stages.execute.bf16.BF16GemmKernel.silu_mul`): against torch on bf16-rounded operands,
against the GEMM followed by the fused SiLU-and-mul bit for bit, M/K/N tails, on AMX tiles and
on VDPBF16PS; the column-range entries the step graph's threads call against the whole calls."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from stages.execute.bf16 import (
    AMX_FEATURES,
    TORCH_ROWS,
    BF16GemmKernel,
    BF16Linear,
    bf16_gemm_kernel,
    cpu_flags,
)
from stages.execute.fused import FusedGatedMLP
from stages.execute.native import FusedOpsKernel, NativeKernelError, fused_ops_kernel

# (inter, K): one gate panel, odd panel counts, K tails (under one tile, over one, odd) and
# the default model's K; rows: M tails around amx_rows, the 16-row tiles and 32-row blocks.
SHAPES = ((16, 1), (16, 7), (48, 33), (80, 64), (32, 577), (48, 1536))
ROWS = (1, 3, 7, 8, 15, 17, 33, 100)

_i64, _p = ctypes.c_int64, ctypes.c_void_p
_PART = ctypes.CFUNCTYPE(ctypes.c_int, _p, _i64, _i64, _p, ctypes.c_int, _p, _i64, _p, _i64,
                         _i64, ctypes.c_int)  # fmt: skip


def kernels() -> list[BF16GemmKernel]:
    """The kernel (on AMX tiles where the CPU has them), VDPBF16PS alone, and the portable
    path."""
    found = [bf16_gemm_kernel(), bf16_gemm_kernel(amx=False), bf16_gemm_kernel(portable=True)]
    assert all(kernel is not None for kernel in found), "the C compiler should work"
    if set(AMX_FEATURES) <= cpu_flags():
        assert found[0] is not None and found[0].amx, "the CPU has AMX-BF16: tiles expected"
    return [kernel for kernel in found if kernel is not None]


def fused() -> FusedOpsKernel:
    kernel = fused_ops_kernel()
    assert kernel is not None
    return kernel


@pytest.mark.slow  # three kernels x six shapes x row tails: ~19 s on the loaded 2-core machine
def test_the_epilogue_is_the_gemm_then_silu_and_mul() -> None:
    """silu(x Wg^T + bg) * (x Wu^T + bu) within rounding of torch on bf16-rounded operands,
    and bit for bit the kernel's own GEMM followed by fused_cpu.c's SiLU-and-mul."""
    generator = torch.Generator().manual_seed(0)
    for kernel in kernels():
        for inter, k in SHAPES:
            gate, up = (torch.randn(inter, k, generator=generator) for _ in range(2))
            bias = torch.randn(2 * inter, generator=generator)
            packed = kernel.pack(gate, up)
            for rows in ROWS:
                if rows > 17 and k > 64:
                    continue  # the long K at few rows: the M tails are covered by the others
                x = torch.randn(rows, k, generator=generator) * 2
                for b in (None, bias):
                    got = kernel.silu_mul(x, packed, k, b)
                    assert got.shape == (rows, inter)
                    assert torch.equal(got, fused().silu_mul(kernel(x, packed, k, b)))
                    xb = x.bfloat16().float()
                    g = F.linear(xb, gate.bfloat16().float(), None if b is None else b[:inter])
                    u = F.linear(xb, up.bfloat16().float(), None if b is None else b[inter:])
                    want = F.silu(g) * u
                    scale = max(want.abs().max().item(), 1.0)
                    error = (got - want).abs().max().item()
                    tolerance = 1e-5 * scale * max(1.0, k**0.5 / 8)
                    assert error <= tolerance, (kernel.native, kernel.amx, inter, k, rows, error)


def test_the_epilogue_on_row_blocks_outside_is_the_gemm_then_silu_and_mul() -> None:
    """From ``amx_block_rows_first`` rows the tiles walk 32-row blocks outside and chunks of
    panels inside: the epilogue there (an M tail, odd panel counts, a chunk boundary at K 577)
    is still its GEMM then SiLU-and-mul bit for bit, and within rounding of torch."""
    kernel = kernels()[0]
    if not kernel.amx:
        pytest.skip("no AMX tiles here")
    generator = torch.Generator().manual_seed(4)
    first = kernel.amx_block_rows_first
    # 400 gate panels at K 577: 200 units of ~37 KB, several 512 KiB chunks of panels
    for inter, k in ((48, 33), (80, 64), (6400, 577)):
        gate, up = (torch.randn(inter, k, generator=generator) for _ in range(2))
        bias = torch.randn(2 * inter, generator=generator)
        packed = kernel.pack(gate, up)
        for rows in (first, first + 17):
            x = torch.randn(rows, k, generator=generator) * 2
            got = kernel.silu_mul(x, packed, k, bias)
            assert torch.equal(got, fused().silu_mul(kernel(x, packed, k, bias)))
            xb = x.bfloat16().float()
            g = F.linear(xb, gate.bfloat16().float(), bias[:inter])
            u = F.linear(xb, up.bfloat16().float(), bias[inter:])
            want = F.silu(g) * u
            scale = max(want.abs().max().item(), 1.0)
            error = (got - want).abs().max().item()
            assert error <= 1e-5 * scale * max(1.0, k**0.5 / 8), (inter, k, rows, error)


def test_the_epilogue_never_reads_past_the_panels() -> None:
    """K tails: the up half's last panel is the weight's last; past it lies NaN here."""
    generator = torch.Generator().manual_seed(1)
    for kernel in kernels():
        for k in (7, 33, 63):
            gate, up = (torch.randn(32, k, generator=generator) for _ in range(2))
            packed = kernel.pack(gate, up)
            room = torch.full((packed.numel() + 64 * 32,), float("nan"), dtype=torch.bfloat16)
            room[: packed.numel()] = packed.flatten()
            poisoned = room[: packed.numel()].view(packed.shape)
            x = torch.randn(40, k, generator=generator)
            got = kernel.silu_mul(x, poisoned, k, None)
            assert torch.isfinite(got).all(), (kernel.amx, k)
            assert torch.equal(got, kernel.silu_mul(x, packed, k, None))


def test_a_projection_that_does_not_split_in_halves_of_panels_is_refused() -> None:
    kernel = kernels()[0]
    packed = kernel.pack(torch.randn(48, 8))  # 3 panels: no gate/up halves of whole panels
    with pytest.raises(NativeKernelError, match="bf16 GEMM kernel failed"):
        kernel.silu_mul(torch.randn(4, 8), packed, 8, None)


def _part(address: int, x: torch.Tensor, packed: torch.Tensor, k: int, bias: torch.Tensor | None,
          n: int, y: torch.Tensor, cols: tuple[int, int], same_x: bool) -> int:  # fmt: skip
    function = _PART(address)
    bias_pointer = None if bias is None else bias.data_ptr()
    arguments = (x.data_ptr(), x.shape[0], k, packed.data_ptr(), 0, bias_pointer, n)
    return int(function(*arguments, y.data_ptr(), cols[0], cols[1], int(same_x)))


def test_column_ranges_give_the_whole_calls_bit_for_bit() -> None:
    """The entries the step graph's threads call (NativeGemm.part): the GEMM's and the
    epilogue's, a range at a time (odd panel counts, a lone last panel, rows reused with
    same_x), on the tiles from amx_rows rows where the kernel has them."""
    generator = torch.Generator().manual_seed(2)
    inter, k = 80, 577
    gate, up = (torch.randn(inter, k, generator=generator) for _ in range(2))
    bias = torch.randn(2 * inter, generator=generator)
    for kernel in kernels():
        packed = kernel.pack(gate, up)
        for rows in (1, 7, 8, 16, 17, 40):
            x = torch.randn(rows, k, generator=generator)
            whole = kernel(x, packed, k, bias)
            if kernel.amx and rows >= kernel.amx_rows:
                assert torch.equal(whole, kernel.tiles(x, packed, k, bias))
            y = torch.full_like(whole, float("nan"))
            for index, cols in enumerate(((0, 16), (16, 64), (64, 112), (112, 160))):
                status = _part(kernel.gemm_part_address, x, packed, k, bias, 2 * inter, y, cols,
                               same_x=index > 0)  # fmt: skip
                assert status == 0
            assert torch.equal(y, whole), (kernel.amx, rows)
            act = torch.full((rows, inter), float("nan"))
            for index, cols in enumerate(((0, 16), (16, 48), (48, 80))):
                status = _part(kernel.silu_part_address, x, packed, k, bias, 2 * inter, act,
                               cols, same_x=index > 0)  # fmt: skip
                assert status == 0
            assert torch.equal(act, kernel.silu_mul(x, packed, k, bias)), (kernel.amx, rows)
        y = torch.empty(4, 2 * inter)
        for bad in ((8, 32), (0, 176)):
            assert _part(kernel.gemm_part_address, x[:4], packed, k, None, 2 * inter, y, bad,
                         same_x=False) == 2  # fmt: skip
        assert _part(kernel.silu_part_address, x[:4], packed, k, None, 2 * inter, y, (0, 96),
                     same_x=False) == 2  # fmt: skip


def test_the_fused_mlp_takes_the_epilogue_where_the_kernel_multiplies() -> None:
    """FusedGatedMLP over bf16 panels: the epilogue where the native kernel serves the rows
    (every count on AMX tiles and on the portable path, below TORCH_ROWS on VDPBF16PS alone),
    the same bits as the GEMM followed by the fused SiLU-and-mul; torch's matmul, then the
    fused SiLU-and-mul, from TORCH_ROWS rows on VDPBF16PS without tiles."""
    generator = torch.Generator().manual_seed(3)
    hidden, inter = 64, 96
    weights = torch.randn(2 * inter, hidden, generator=generator)
    down_weight = torch.randn(hidden, inter, generator=generator)
    for kernel in kernels()[:2]:
        gate_up = BF16Linear(kernel.pack(weights), hidden, None, kernel)
        down = BF16Linear(kernel.pack(down_weight), inter, None, kernel)
        mlp = FusedGatedMLP(gate_up, down, fused())
        for rows in (1, 9, TORCH_ROWS + 3):
            x = torch.randn(1, rows, hidden, generator=generator)
            served = rows < TORCH_ROWS or kernel.amx or not kernel.native
            assert gate_up.fuses_silu_mul(rows) == served
            with torch.inference_mode():
                got = mlp(x)
                want = down(fused().silu_mul(gate_up(x)))
            assert torch.equal(got, want), (kernel.amx, rows)
