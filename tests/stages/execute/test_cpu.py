"""The CPU tuning of the model runner: the packed native GEMM (and embeddings tied to a packed
head), the MKL row-count dispatch and oneDNN LM head used without it, the probe that refuses a
disagreeing kernel, and the glibc allocator settings."""

from __future__ import annotations

import ctypes.util
import os
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stages.execute.cpu as cpu
from stages.execute.cpu import (
    PADDED_ROWS,
    SMALL_ROWS,
    TRANSPOSED_ROWS,
    CPULinear,
    CPULMHead,
    PackedEmbedding,
    PackedLinear,
    file_backed_ranges,
    onednn_linear_available,
    release_file_pages,
    release_free_memory,
    tune_allocator,
    use_cpu_linears,
)
from stages.execute.native import packed_gemm_kernel

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _linear(kind: type[torch.nn.Linear], in_features: int, out_features: int, *, bias: bool):
    torch.manual_seed(0)
    module = torch.nn.Linear(in_features, out_features, bias=bias)
    module.__class__ = kind
    return module


# Every dispatch path and its edges: one row (F.linear), 2..SMALL_ROWS (W @ x^T), up to
# PADDED_ROWS (padded), up to TRANSPOSED_ROWS (W @ x^T), past it (F.linear / oneDNN).
ROWS = sorted(
    {1, 2, SMALL_ROWS, SMALL_ROWS + 1, PADDED_ROWS - 1, PADDED_ROWS, PADDED_ROWS + 1, 40}
    | {TRANSPOSED_ROWS, TRANSPOSED_ROWS + 1, 200}
)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_f_linear_at_every_row_count(rows: int, bias: bool) -> None:
    module = _linear(CPULinear, 96, 160, bias=bias)
    inputs = torch.randn(1, rows, 96)  # [1, M, K], as the runner's packed batch
    with torch.inference_mode():
        got = module(inputs)
        expected = F.linear(inputs, module.weight, module.bias)
    assert got.shape == expected.shape == (1, rows, 160)
    assert got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", ROWS)
def test_lm_head_matches_f_linear(rows: int) -> None:
    module = _linear(CPULMHead, 64, 1000, bias=False)
    inputs = torch.randn(rows, 64)
    with torch.inference_mode():
        got = module(inputs)
    torch.testing.assert_close(got, F.linear(inputs, module.weight), rtol=1e-5, atol=1e-5)


@pytest.fixture
def without_native_gemm(no_c_compiler: None) -> None:
    """As on a machine without a C compiler: linears fall back to the MKL dispatch."""
    assert packed_gemm_kernel() is None


@pytest.mark.parametrize("rows", [*ROWS, 700, 1600])  # past the kernel's 1024-row blocks at K 96
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_at_every_row_count(rows: int, bias: bool) -> None:
    kernel = packed_gemm_kernel()
    assert kernel is not None, "the C compiler on this machine should build the kernel"
    module = _linear(torch.nn.Linear, 96, 160, bias=bias)
    packed = PackedLinear.from_linear(module, kernel)
    inputs = torch.randn(96, rows).t().unsqueeze(0)  # [1, M, K], not contiguous
    with torch.inference_mode():
        got = packed(inputs)
        expected = F.linear(inputs, module.weight, module.bias)
    assert got.shape == expected.shape == (1, rows, 160)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [1, 7, 97, 1536])
def test_packed_gemm_matches_f_linear_on_every_tile_tail(k: int, threads: int) -> None:
    """Every row count up to two register tiles and one (each tail has its own micro-kernel),
    odd K (the two-accumulator k loop of few rows has a remainder), and K 1536, whose row
    blocks are a few tiles high, so long inputs cross block edges."""
    kernel = packed_gemm_kernel()
    assert kernel is not None
    assert kernel.lanes in (4, 8, 16) and kernel.tile_rows >= 2
    generator = torch.Generator().manual_seed(1000 * k + threads)
    weight, bias = torch.randn(48, k, generator=generator), torch.randn(48, generator=generator)
    packed = kernel.pack(weight)
    counts = [*range(1, 2 * kernel.tile_rows + 2), 257]
    # NOTE: fp32 sums of k unit products in another order than MKL's differ by up to ~eps * k
    # (the 8-lane AVX2 build missed a fixed 1e-4 by 8% at k 1536 on one element in 12,336)
    atol = max(1e-4, 2.5e-7 * k)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in counts:
            x = torch.randn(rows, k, generator=generator)
            torch.testing.assert_close(
                kernel(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=atol
            )
    finally:
        torch.set_num_threads(previous)


class _TiedModel(torch.nn.Module):
    """Embeddings tied to the LM head, plus one inner linear, like a small causal LM."""

    def __init__(self, vocab: int = 100) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 32)
        self.inner = torch.nn.Linear(32, 32, bias=False)
        self.lm_head = torch.nn.Linear(32, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.embed = value

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.inner(self.embed(ids)))


@pytest.mark.parametrize("native", [False, True], ids=["without-native-gemm", "native-gemm"])
def test_linears_are_packed_or_swapped_and_ties_kept(
    native: bool, request: pytest.FixtureRequest
) -> None:
    if not native:
        request.getfixturevalue("without_native_gemm")
    torch.manual_seed(0)
    model = _TiedModel(vocab=100)  # 100 outputs: not a multiple of 16, the head not packable
    ids = torch.randint(0, 100, (1, 12))
    with torch.inference_mode():
        expected = model(ids)
    assert use_cpu_linears(model) == 2
    assert type(model.inner) is (PackedLinear if native else CPULinear)
    assert type(model.lm_head) is (CPULMHead if onednn_linear_available() else CPULinear)
    assert model.lm_head.weight is model.embed.weight  # the tie survives the swap
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_read_the_packed_head_without_a_second_copy() -> None:
    torch.manual_seed(0)
    model = _TiedModel(vocab=96)
    ids = torch.randint(0, 96, (2, 7))
    with torch.inference_mode():
        expected = model(ids)
        expected_embeddings = model.embed(ids)
    assert use_cpu_linears(model) == 2
    assert type(model.lm_head) is PackedLinear
    assert type(model.embed) is PackedEmbedding
    assert model.embed.head is model.lm_head
    # The [96, 32] weight is gone: the packed head is the only copy.
    assert [tuple(p.shape) for p in model.parameters() if p.numel() == 96 * 32] == [(6, 32, 16)]
    with torch.inference_mode():
        torch.testing.assert_close(model.embed(ids), expected_embeddings, rtol=0, atol=0)
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)


class _WrongLinear(CPULinear):
    """A kernel that is off by far more than rounding: the probe must refuse it."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 1.01


class _WrongPackedLinear(PackedLinear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 1.01


@pytest.mark.usefixtures("without_native_gemm")
def test_a_disagreeing_kernel_is_refused_and_nothing_is_swapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu, "CPULinear", _WrongLinear)
    model = _TiedModel()
    assert use_cpu_linears(model) == 0
    assert type(model.inner) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear


def test_a_disagreeing_packed_kernel_is_refused_for_the_mkl_dispatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu, "PackedLinear", _WrongPackedLinear)
    model = _TiedModel(vocab=96)
    assert use_cpu_linears(model) == 2
    assert type(model.inner) is CPULinear
    assert type(model.embed) is torch.nn.Embedding
    assert model.lm_head.weight is model.embed.weight


def test_a_wide_linear_is_probed_on_its_leading_columns_without_a_copy() -> None:
    wide = _linear(torch.nn.Linear, 64, 5000, bias=True)
    part = cpu._leading_columns(wide, 2048)
    assert (part.in_features, part.out_features) == (64, 2048)
    assert part.weight.data_ptr() == wide.weight.data_ptr()
    probe = torch.randn(3, 64)
    torch.testing.assert_close(part(probe), wide(probe)[:, :2048])
    narrow = _linear(torch.nn.Linear, 64, 32, bias=False)
    assert cpu._leading_columns(narrow, 2048) is narrow


def test_non_fp32_linears_are_left_alone() -> None:
    model = _TiedModel().to(torch.bfloat16)
    assert use_cpu_linears(model) == 0
    assert type(model.inner) is torch.nn.Linear


@pytest.mark.skipif(not GLIBC or ctypes.util.find_library("c") is None, reason="glibc only")
def test_glibc_accepts_the_allocator_settings() -> None:
    """glibc's mallopt accepts both thresholds (tune_allocator says so) and malloc_trim
    runs. Whether later allocations follow them is glibc's part, not checked here."""
    assert tune_allocator() is True
    release_free_memory()  # may or may not find pages to release; must not fail


@pytest.mark.skipif(not GLIBC, reason="Linux/glibc only")
def test_file_pages_are_released_and_read_back_unchanged(tmp_path: Path) -> None:
    values = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    path = tmp_path / "weights.bin"
    values.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.float32)
    view = mapped[1000:-1000]  # not page-aligned: the partial pages at both ends are kept
    assert float(view.sum()) == float(values[1000:-1000].sum())  # fault the pages in
    released = release_file_pages(view, file_backed_ranges())
    page = os.sysconf("SC_PAGE_SIZE")
    assert 0 < released <= view.numel() * 4 and released % page == 0
    torch.testing.assert_close(mapped, values, rtol=0, atol=0)  # read back from the file
    anonymous = values.clone()
    assert release_file_pages(anonymous, file_backed_ranges()) == 0  # would read as zeros
    torch.testing.assert_close(anonymous, values, rtol=0, atol=0)
