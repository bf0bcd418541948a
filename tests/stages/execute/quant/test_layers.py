"""Tests of stages/execute/quant/layers.py and kernel.py: llama.cpp's blocks packed and
dequantized bit for bit as the gguf package dequantizes them, the quantized GEMM against
``F.linear`` over the dequantized weight (both kernel paths), embeddings, int8 quantization
equal to llama.cpp's Q8_0, and refusals."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from stages.execute.native import NativeKernelError
from stages.execute.quant.kernel import QUANT_SOURCE, QuantGemmKernel, quant_gemm_kernel
from stages.execute.quant.layers import (
    QuantEmbedding,
    QuantLinear,
    dequantize,
    pack_gguf,
    q8_0_activations,
    quantize_int8,
)

TYPES = {"Q8_0": "q8", "Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4f"}


@pytest.fixture(scope="module")
def kernel() -> QuantGemmKernel:
    built = quant_gemm_kernel()
    assert built is not None, "the C compiler on this machine should build the kernel"
    return built


def gguf_rows(name: str, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """``out_features`` rows of llama.cpp blocks of type ``name``, quantized by the gguf
    package from random weights (with outliers and an all-zero group, as real weights have);
    Q4_K, which the gguf package cannot quantize, as random super-blocks."""
    generator = np.random.default_rng(seed)
    if name == "Q4_K":
        count = out_features * in_features // 256
        scales = (generator.random((count, 2)) * 0.01).astype(np.float16).view(np.uint8)
        rest = generator.integers(0, 256, (count, 140), dtype=np.uint8)  # 6-bit scales, quants
        raw = np.concatenate([scales, rest], axis=1).reshape(out_features, -1)
        return torch.from_numpy(np.ascontiguousarray(raw))
    weights = generator.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    weights[0, :32] = 0.0
    weights[1, 5] = 3.0
    raw = gguf_quantize(weights, GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(raw))


def reference(name: str, raw: torch.Tensor, in_features: int) -> torch.Tensor:
    values = gguf_dequantize(raw.numpy(), GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(raw.shape[0], in_features)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 256), (40, 512), (7, 256)])
def test_packed_blocks_dequantize_as_llama_cpp(
    kernel: QuantGemmKernel, name: str, out_features: int, in_features: int
) -> None:
    raw = gguf_rows(name, out_features, in_features, seed=out_features)
    weight = pack_gguf(raw, int(GGMLQuantizationType[name]), in_features, kernel)
    assert weight.format == TYPES[name]
    assert (weight.out_features, weight.in_features) == (out_features, in_features)
    assert torch.equal(dequantize(weight, kernel), reference(name, raw, in_features))


@pytest.mark.parametrize("name", list(TYPES))
def test_gemm_matches_linear_over_the_dequantized_weight(
    kernel: QuantGemmKernel, name: str
) -> None:
    out_features, in_features = 72, 512  # 72: the last panel of 16 columns is padding
    raw = gguf_rows(name, out_features, in_features, seed=3)
    weight = pack_gguf(raw, int(GGMLQuantizationType[name]), in_features, kernel)
    dense = reference(name, raw, in_features).double()
    generator = torch.Generator().manual_seed(0)
    bias = torch.randn(out_features, generator=generator)
    for with_bias in (False, True):
        linear = QuantLinear(weight, bias if with_bias else None, kernel)
        # 1..20 rows: the direct path in blocks of 4 or 8 and its tails; 40, 800: dequantized
        # panels (800 rows: two row blocks).
        for rows in (*range(1, 21), 40, 800):
            x = torch.randn(2, rows, in_features, generator=generator)  # [..., K] inputs
            expected = F.linear(x.double(), dense, bias.double() if with_bias else None)
            got = linear(x)
            assert got.shape == (2, rows, out_features)
            error = (got.double() - expected).abs().max().item()
            assert error <= 1e-5 * max(expected.abs().max().item(), 1.0), (rows, error)


@pytest.mark.parametrize("name", list(TYPES))
def test_int8_activations_match_linear_over_q8_0_rounded_inputs(
    kernel: QuantGemmKernel, name: str
) -> None:
    """The int8-activation path (VNNI where compiled in) against ``F.linear`` over the inputs
    rounded to llama.cpp's Q8_0 (the gguf package's quantizer) and the dequantized weight:
    integer dot products are exact, so only fp32 scaling and summing differ."""
    out_features, in_features = 72, 512
    raw = gguf_rows(name, out_features, in_features, seed=5)
    weight = pack_gguf(raw, int(GGMLQuantizationType[name]), in_features, kernel)
    dense = reference(name, raw, in_features).double()
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=generator)
    for with_bias in (False, True):
        linear = QuantLinear(weight, bias if with_bias else None, kernel, int8_activations=True)
        # 1..17 rows: blocks of 4 or 8 rows and their tails; 300: two blocks of 256 rows
        for rows in (*range(1, 18), 300):
            x = torch.randn(rows, in_features, generator=generator) * 3
            x[0, :32] = 0.0  # an all-zero group: scale 0
            x[-1, 40] = 100.0  # an outlier: its group's other inputs round to few levels
            rounded = q8_0_activations(x)
            theirs = gguf_quantize(x.numpy(), GGMLQuantizationType.Q8_0)
            as_gguf = reference("Q8_0", torch.from_numpy(theirs), in_features)
            assert torch.equal(rounded, as_gguf)
            expected = F.linear(rounded.double(), dense, bias.double() if with_bias else None)
            got = linear(x)
            error = (got.double() - expected).abs().max().item()
            assert error <= 1e-5 * max(expected.abs().max().item(), 1.0), (rows, error)


def integer_blocks(name: str, quants: np.ndarray) -> torch.Tensor:
    """Rows of llama.cpp blocks of ``name`` (Q8_0, Q4_0 or Q4_1) holding ``quants [N, K]``
    with scale 1 and offset 0 (Q4_0: its fixed -8), so the weights are those integers."""
    rows, columns = quants.shape
    one = np.full((rows, columns // 32, 1), 1.0, np.float16).view(np.uint8)  # [N, G, 2]
    grouped = quants.reshape(rows, columns // 32, 32)
    if name == "Q8_0":
        parts = [one, grouped.astype(np.int8).view(np.uint8)]
    else:
        nibbles = grouped.astype(np.uint8)  # element j low nibble, j + 16 high
        packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)
        zero = np.zeros((rows, columns // 32, 1), np.float16).view(np.uint8)
        parts = [one, packed] if name == "Q4_0" else [one, zero, packed]
    raw = np.concatenate(parts, axis=2).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(raw))


# The kernel's ISA branches: (flags, the /proc/cpuinfo flags a CPU needs to run the build)
BUILDS = {
    "portable": ((), ()),
    "avx2": (("-mavx2", "-mfma"), ("avx2", "fma")),
    "avx-vnni": (("-mavx2", "-mfma", "-mavxvnni"), ("avx2", "fma", "avx_vnni")),
    "avx512": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"), ("avx512f", "avx512bw")),
    "avx512-vnni": (
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"),
        ("avx512f", "avx512bw", "avx512_vnni"),
    ),
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_every_isa_branch_builds_and_runs_where_the_cpu_can(build: str, tmp_path: Path) -> None:
    """The source built for each of its ISA branches (whatever this CPU is: the AVX-512 paths
    must keep compiling on an AVX2 machine and the AVX2 ones on an AVX-512 machine); where the
    CPU runs that build, its integer sums are exact too (the same checks as the native build)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the ISA branches are x86's (NEON builds the portable code)")
    compiler = shutil.which(os.environ.get("CC") or "cc")
    assert compiler is not None, "the kernel tests need the C compiler the kernels build with"
    flags, needs = BUILDS[build]
    library = tmp_path / f"quant_gemm-{build}.so"
    command = [compiler, "-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", *flags]
    result = subprocess.run(
        [*command, "-o", str(library), str(QUANT_SOURCE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    cpu = next(
        (
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        "",
    ).split()
    if not set(needs) <= set(cpu):
        return  # compiled; this CPU cannot run it
    built = QuantGemmKernel(library)
    assert built.int8_dot == {"portable": "plain", "avx2": "avx2"}.get(build, "vnni")
    for name in ("Q8_0", "Q4_0", "Q4_1"):
        test_integer_dot_products_are_exact(built, name)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_integer_dot_products_are_exact(kernel: QuantGemmKernel, name: str) -> None:
    """Integer weights (scale 1) against integer inputs whose Q8_0 scale is 1 (each group's
    largest magnitude 127, so the int8 path keeps them as they are): both paths give the exact
    integer sums (below 2^24, so fp32 holds them), on whichever instructions this CPU runs them
    (VNNI, AVX2's byte multiply-adds, plain vectors). Extremes included: a Q4 group of 15s
    against 127s (AVX2 sums a group's 16 products per int16 lane: 30480) and Q8 weights of -128
    (AVX2 multiplies |w| by the activation carrying w's sign)."""
    out_features, in_features = 40, 512
    generator = np.random.default_rng(11)
    low, high = (-128, 128) if name == "Q8_0" else (0, 16)
    quants = generator.integers(low, high, (out_features, in_features))
    quants[0] = high - 1  # the largest products in every group
    quants[1] = low  # Q8: -128; Q4: zeros (Q4_0's -8)
    raw = integer_blocks(name, quants)
    weight = pack_gguf(raw, int(GGMLQuantizationType[name]), in_features, kernel)
    values = quants - 8 if name == "Q4_0" else quants
    assert torch.equal(dequantize(weight, kernel), torch.from_numpy(values).float())
    for rows in (*range(1, 10), 17, 300):  # the row blocks, their tails, two blocks of 256
        x = generator.integers(-127, 128, (rows, in_features))
        x[:, ::32] = 127 * generator.choice([-1, 1], (rows, in_features // 32))  # scale 1
        x[0] = 127  # with row 0 of the weights: a group's largest sums
        if rows > 1:
            x[1] = -127 * np.sign(values[1] + 0.5)  # with row 1: the most negative
        exact = torch.from_numpy(x @ values.T)  # int64
        assert exact.abs().max() < 2**24
        inputs = torch.from_numpy(x).float()
        assert torch.equal(q8_0_activations(inputs), inputs)
        for int8 in (True, False):
            got = QuantLinear(weight, None, kernel, int8_activations=int8)(inputs)
            assert torch.equal(got.double(), exact.double()), (rows, int8, kernel.int8_dot)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K"])
def test_embedding_rows_are_the_dequantized_rows(kernel: QuantGemmKernel, name: str) -> None:
    raw = gguf_rows(name, 40, 256, seed=9)
    weight = pack_gguf(raw, int(GGMLQuantizationType[name]), 256, kernel)
    dense = reference(name, raw, 256)
    ids = torch.tensor([[0, 39, 17], [5, 5, 1]])
    assert torch.equal(QuantEmbedding(weight, kernel)(ids), dense[ids])
    scale = torch.tensor(3.0)
    assert torch.equal(QuantEmbedding(weight, kernel, scale)(ids), dense[ids] * scale)
    with pytest.raises(NativeKernelError, match="outside"):
        QuantEmbedding(weight, kernel)(torch.tensor([40]))


def test_int8_quantization_is_llama_cpps_q8_0(kernel: QuantGemmKernel) -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 96, generator=generator) * 0.05
    weight[3, :32] = 0.0  # an all-zero group: scale 0, quants 0
    weight[4, 7] = 0.5 * weight[4].abs().max()  # ties of x / d at .5 round away from zero
    quantized = quantize_int8(weight, kernel)
    assert quantized.format == "q8"
    ours = dequantize(quantized, kernel)
    theirs = reference("Q8_0", torch.from_numpy(gguf_quantize(weight.numpy(), 8)), 96)
    assert torch.equal(ours, theirs)
    assert (ours - weight).abs().max() <= weight.abs().max() / 127  # half a step, and rounding
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_int8(torch.zeros(4, 40), kernel)


def test_memory_is_what_the_format_says(kernel: QuantGemmKernel) -> None:
    raw = gguf_rows("Q4_1", 64, 512, seed=1)
    q4 = pack_gguf(raw, 3, 512, kernel)
    assert q4.nbytes * 8 == 64 * 512 * 5  # 5 bits a weight, as Q4_1
    q8 = quantize_int8(torch.randn(64, 512), kernel)
    assert q8.nbytes * 8 == 64 * 512 * 8.5  # 8.5 bits, as Q8_0


def test_the_kernel_refuses_what_it_cannot_serve(kernel: QuantGemmKernel) -> None:
    raw = gguf_rows("Q8_0", 16, 64, seed=0)
    with pytest.raises(NativeKernelError, match="not served"):
        kernel.pack(raw, int(GGMLQuantizationType.Q6_K), 64)
    with pytest.raises(NativeKernelError, match="are not rows"):
        kernel.pack(raw[:, :-1].contiguous(), 8, 64)  # a truncated row
    with pytest.raises(NativeKernelError, match="are not rows"):
        kernel.pack(raw, 8, 96)  # rows of another length
    weight = pack_gguf(raw, 8, 64, kernel)
    with pytest.raises(NativeKernelError, match="cannot serve"):
        kernel.gemm(torch.zeros(1, 32), weight.blocks, "q8", None)  # inputs do not match
