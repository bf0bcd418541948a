"""Native linears called from C through :class:`~stages.execute.native.NativeGemm` (the
calling convention the CPU step graph uses) compute what their modules' forward computes."""

from __future__ import annotations

import ctypes

import torch

from stages.execute.bf16 import BF16Linear, bf16_gemm_kernel
from stages.execute.cpu import PackedLinear
from stages.execute.native import NativeGemm, packed_gemm_kernel
from stages.execute.quant.kernel import quant_gemm_kernel
from stages.execute.quant.layers import QuantLinear, quantize_int8

_GEMM = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int,
)


def call(gemm: NativeGemm, x: torch.Tensor) -> torch.Tensor:
    out = torch.full((x.shape[0], gemm.n), float("nan"))
    function = _GEMM(gemm.function)
    status = function(
        x.data_ptr(), x.shape[0], gemm.k, gemm.weights, gemm.format, gemm.bias or None,
        gemm.n, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    assert status == 0
    return out


def test_packed_and_quantized_linears_called_from_c_match_their_forward() -> None:
    packed_kernel, quant_kernel = packed_gemm_kernel(), quant_gemm_kernel()
    bf16_kernel = bf16_gemm_kernel()
    assert packed_kernel is not None and quant_kernel is not None, "the C compiler should work"
    assert bf16_kernel is not None
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 64, generator=generator) * 0.1)
        linear.bias.copy_(torch.randn(40, generator=generator))
    modules: list[PackedLinear | QuantLinear | BF16Linear] = [
        PackedLinear.from_linear(torch.nn.Linear(64, 48), packed_kernel),
        QuantLinear(quantize_int8(linear.weight.detach(), quant_kernel), linear.bias, quant_kernel),
        BF16Linear.from_linear(torch.nn.Linear(63, 48), bf16_kernel),
    ]
    for module in modules:
        gemm = module.native_gemm()
        for rows in (1, 3, 17):
            x = torch.randn(rows, gemm.k, generator=generator)
            with torch.inference_mode():
                expected = module(x)
            got = call(gemm, x)[:, : expected.shape[1]]
            assert torch.equal(got, expected), (type(module).__name__, rows)


_PART = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int,
)


def test_column_ranges_compute_the_whole_calls_columns_bit_for_bit() -> None:
    """NativeGemm.part over ranges that tile the columns writes what the whole call writes
    (the CPU step graph's threads each call it for their share), and no column outside its
    range, whether it derives the rows' int8 blocks or bf16 pairs again or keeps the last
    call's (same_x); a range not starting at a multiple of 32 columns is refused by the fp32
    GEMM, whose pairs of panels it would split. (The bf16 whole call without AMX tiles: from
    their rows on it sums on the tile unit, in another order than the column ranges.)"""
    packed_kernel, quant_kernel = packed_gemm_kernel(), quant_gemm_kernel()
    bf16_kernel = bf16_gemm_kernel(amx=False)
    assert packed_kernel is not None and quant_kernel is not None and bf16_kernel is not None
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(80, 96, generator=generator) * 0.1
    bias = torch.randn(80, generator=generator)
    linear = torch.nn.Linear(96, 80)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    modules: list[PackedLinear | QuantLinear | BF16Linear] = [
        PackedLinear.from_linear(linear, packed_kernel),
        QuantLinear(quantize_int8(weight, quant_kernel), bias, quant_kernel),
        BF16Linear.from_linear(linear, bf16_kernel),
    ]
    for module in modules:
        gemm = module.native_gemm()
        assert gemm.part, type(module).__name__
        part = _PART(gemm.part)
        for rows in (1, 5, 16):
            x = torch.randn(rows, gemm.k, generator=generator)
            whole = call(gemm, x)
            out = torch.full((rows, gemm.n), float("nan"))
            for index, (first, last) in enumerate(((0, 32), (32, 64), (64, gemm.n))):
                status = part(
                    x.data_ptr(), rows, gemm.k, gemm.weights, gemm.format, gemm.bias or None,
                    gemm.n, out.data_ptr(), first, last, index > 0,
                )  # fmt: skip
                assert status == 0
                assert out[:, last:].isnan().all()  # nothing past the range written yet
            assert torch.equal(out, whole), (type(module).__name__, rows)
    gemm = modules[0].native_gemm()
    x = torch.randn(2, gemm.k, generator=generator)
    out = torch.empty(2, gemm.n)
    refused = _PART(gemm.part)(
        x.data_ptr(), 2, gemm.k, gemm.weights, gemm.format, None, gemm.n, out.data_ptr(), 16, 48, 0
    )
    assert refused == 2
