"""Tests of stages/execute/native.py: the compiled paged decode kernel against attention in
float64 over gathered keys (over an fp32 and a bf16 cache), its build cache, and the fallback
when it cannot be built."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.native import (
    KERNEL_SOURCE,
    PORTABLE_DEFINE,
    NativeKernelError,
    PagedDecodeKernel,
    build_library,
    paged_decode_kernel,
)
from stages.execute.runner import ModelRunner


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    built = paged_decode_kernel()
    assert built is not None, "the C compiler on this machine should build the kernel"
    return built


@pytest.fixture(scope="module")
def portable_kernel() -> PagedDecodeKernel:
    """The kernel built without its AVX512-BF16 path (a bf16 cache widened to fp32 as read),
    as a CPU without AVX512-BF16 runs it."""
    built = PagedDecodeKernel(build_library(KERNEL_SOURCE, defines=(PORTABLE_DEFINE,)))
    assert not built.bf16_dot
    return built


@pytest.fixture(params=["native", "portable"])
def any_kernel(
    request: pytest.FixtureRequest, kernel: PagedDecodeKernel, portable_kernel: PagedDecodeKernel
) -> PagedDecodeKernel:
    """Each build of the kernel: this CPU's (VDPBF16PS over a bf16 cache where it has
    AVX512-BF16) and the portable one."""
    return kernel if request.param == "native" else portable_kernel


def kernel_query(
    kernel: PagedDecodeKernel, query: torch.Tensor, kv_dtype: torch.dtype
) -> torch.Tensor:
    """The query as ``kernel`` multiplies it over a ``kv_dtype`` cache: rounded to bf16 where
    it takes VDPBF16PS dot products, else as it is."""
    if kv_dtype == torch.bfloat16 and kernel.bf16_dot:
        return query.bfloat16().float()
    return query


def reference_attention(
    query: torch.Tensor,  # [Hq, B, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in float64 over each row's gathered keys (its last ``window`` only), with
    capped scores and a sink logit per head as transformers' eager attention has them."""
    num_heads, rows, _ = query.shape
    group = num_heads // key_cache.shape[1]
    outputs = []
    for row in range(rows):
        length = int(lens[row])
        slots = torch.cat(
            [torch.arange(b * block_size, (b + 1) * block_size) for b in tables[row].tolist()]
        )[:length]
        if window is not None:
            slots = slots[max(0, length - window) :]
        keys = key_cache[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = value_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[:, row].double(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().unsqueeze(1)], dim=1)
        probs = scores.softmax(-1)[:, : len(slots)]  # the sink column dropped
        outputs.append(torch.einsum("hl,lhd->hd", probs, values))
    return torch.stack(outputs)  # [B, Hq, D]


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The kernel picks its work split by rows per thread: pin the count both tests assume."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


KV_DTYPES = pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"]
)


@pytest.mark.usefixtures("two_threads")
@KV_DTYPES
@pytest.mark.parametrize("repeat", [1, 6], ids=["per-head-items", "whole-sequence-items"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 8, 4), (8, 2, 128, 16), (16, 1, 32, 8), (4, 2, 16, 7)],
)
def test_kernel_matches_attention_over_gathered_keys(
    any_kernel: PagedDecodeKernel,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    repeat: int,
    kv_dtype: torch.dtype,
) -> None:
    """A bf16 cache is read exactly (widened, or multiplied by VDPBF16PS with the query
    rounded to bf16): the reference attends the same bf16 values (and the query as the kernel
    rounds it) in float64, to fp32's tolerance. Head sizes 8-128 cover the bf16 path's masked
    tails (D not a multiple of 32), lengths its 16-row groups and their remainders."""
    kernel = any_kernel
    generator = torch.Generator().manual_seed(num_heads * head_dim + block_size)
    # 7 rows (fewer than 4 per thread: one item per KV head) or 42 (one item per sequence).
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 50, 97, 2] * repeat)
    width = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * width + 1
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(kv_dtype)
    value_cache = torch.randn(shape, generator=generator).to(kv_dtype)
    # Blocks in shuffled order, as an allocator hands them out; block 0 is never used.
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: len(lens) * width]
    tables = tables.view(len(lens), width)
    # The query as attention receives it: a strided view of a packed [1, Hq, T, D] tensor
    # holding more tokens than the decode rows.
    packed = torch.randn(len(lens) + 3, num_heads, head_dim, generator=generator)
    query = packed.transpose(0, 1)[:, : len(lens)]  # [Hq, B, D], non-contiguous
    out = torch.full((len(lens) + 3, num_heads, head_dim), float("nan"))
    scale = head_dim**-0.5

    kernel(query, key_cache, value_cache, tables, lens, out[: len(lens)], block_size, scale)

    expected = reference_attention(
        kernel_query(kernel, query, kv_dtype), key_cache, value_cache, tables, lens, block_size,
        scale,
    )  # fmt: skip
    torch.testing.assert_close(out[: len(lens)].double(), expected, atol=2e-6, rtol=1e-5)
    assert out[len(lens) :].isnan().all(), "the kernel wrote outside its rows"


@pytest.mark.usefixtures("two_threads")
def test_value_rows_shared_by_a_group_give_the_per_head_sums_bit_for_bit(
    kernel: PagedDecodeKernel,
) -> None:
    """Over a bf16 cache the AVX512-BF16 path sums the value rows of a KV head for its query
    heads together (groups of up to 4, head sizes up to 64): the same outputs bit for bit as
    the build that sums them one head at a time (``ACTORLINE_PV_PER_HEAD``), across masked
    tails, 1-5 heads a group (5: the per-head loop in both) and both kinds of work items."""
    if not kernel.bf16_dot:
        pytest.skip("no AVX512-BF16 path in this build")
    per_head = PagedDecodeKernel(build_library(KERNEL_SOURCE, defines=("ACTORLINE_PV_PER_HEAD",)))
    generator = torch.Generator().manual_seed(7)
    for group, num_kv_heads, head_dim in ((1, 4, 64), (2, 2, 16), (3, 3, 64), (4, 2, 40),
                                          (5, 1, 64)):  # fmt: skip
        num_heads, block_size = group * num_kv_heads, 16
        for repeat in (1, 6):
            lens = torch.tensor([1, 16, 17, 47, 50, 97, 2] * repeat)
            width = -(-int(lens.max()) // block_size)
            num_blocks = len(lens) * width + 1
            shape = (num_blocks * block_size, num_kv_heads, head_dim)
            key_cache = torch.randn(shape, generator=generator).bfloat16()
            value_cache = torch.randn(shape, generator=generator).bfloat16()
            tables = (torch.randperm(num_blocks - 1, generator=generator) + 1)[
                : len(lens) * width
            ].view(len(lens), width)
            query = torch.randn(num_heads, len(lens), head_dim, generator=generator)
            outs = [torch.empty(len(lens), num_heads, head_dim) for _ in range(2)]
            for built, out in zip((kernel, per_head), outs, strict=True):
                built(query, key_cache, value_cache, tables, lens, out, block_size, 0.125)
            assert torch.equal(outs[0], outs[1]), (group, head_dim, repeat)


@pytest.mark.usefixtures("two_threads")
@KV_DTYPES
@pytest.mark.parametrize("repeat", [1, 6], ids=["per-head-items", "whole-sequence-items"])
@pytest.mark.parametrize(
    ("window", "softcap", "with_sinks"),
    [(5, None, False), (16, 3.0, False), (7, None, True), (None, 2.5, True), (1, 3.0, True)],
)
def test_kernel_attention_variants(
    any_kernel: PagedDecodeKernel,
    window: int | None,
    softcap: float | None,
    with_sinks: bool,
    repeat: int,
    kv_dtype: torch.dtype,
) -> None:
    """Windows (whose out-of-window blocks hold NaN, as a freed and reused block might:
    the kernel must never read them), capped scores and sinks, against the reference."""
    kernel = any_kernel
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 4
    generator = torch.Generator().manual_seed(17)
    lens = torch.tensor([1, 3, 4, 5, 9, 16, 33] * repeat)
    width = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * width + 1
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(kv_dtype)
    value_cache = torch.randn(shape, generator=generator).to(kv_dtype)
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: len(lens) * width]
    tables = tables.view(len(lens), width).clone()
    if window is not None:
        for row, length in enumerate(lens.tolist()):
            for block in tables[row, : max(0, length - window) // block_size].tolist():
                key_cache[block * block_size : (block + 1) * block_size] = float("nan")
                value_cache[block * block_size : (block + 1) * block_size] = float("nan")
    query = torch.randn(num_heads, len(lens), head_dim, generator=generator) * 3
    sinks = torch.randn(num_heads, generator=generator) * 2 if with_sinks else None
    out = torch.empty(len(lens), num_heads, head_dim)
    scale = head_dim**-0.5

    kernel(
        query, key_cache, value_cache, tables, lens, out, block_size, scale,
        window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip

    expected = reference_attention(
        kernel_query(kernel, query, kv_dtype), key_cache, value_cache, tables, lens, block_size,
        scale, window, softcap, sinks,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


def test_kernel_refuses_unsupported_layouts(kernel: PagedDecodeKernel) -> None:
    cache = torch.zeros(32, 2, 8)
    query = torch.zeros(4, 1, 8)
    out = torch.zeros(1, 4, 8)
    tables = torch.tensor([[1]])
    with pytest.raises(NativeKernelError, match="layout or dtype"):
        kernel(query, cache, cache, tables.int(), torch.tensor([3]), out, 16, 1.0)
    with pytest.raises(NativeKernelError, match="layout or dtype"):
        kernel(query, cache.transpose(0, 1), cache, tables, torch.tensor([3]), out, 16, 1.0)
    with pytest.raises(NativeKernelError, match="cannot serve"):
        kernel(query, cache, cache, tables, torch.tensor([0]), out, 16, 1.0)
    # Keys and values of two dtypes, an fp16 cache, bf16 queries: refused.
    with pytest.raises(NativeKernelError, match="layout or dtype"):
        kernel(query, cache.bfloat16(), cache, tables, torch.tensor([3]), out, 16, 1.0)
    with pytest.raises(NativeKernelError, match="layout or dtype"):
        kernel(query, cache.half(), cache.half(), tables, torch.tensor([3]), out, 16, 1.0)
    bf16 = cache.bfloat16()
    with pytest.raises(NativeKernelError, match="layout or dtype"):
        kernel(query.bfloat16(), bf16, bf16, tables, torch.tensor([3]), out, 16, 1.0)
    # Block ids outside the cache, or a table too short for the context: refused, not read.
    with pytest.raises(NativeKernelError, match="cannot serve"):
        kernel(query, cache, cache, torch.tensor([[2]]), torch.tensor([3]), out, 16, 1.0)
    with pytest.raises(NativeKernelError, match="cannot serve"):
        kernel(query, cache, cache, torch.tensor([[-1]]), torch.tensor([3]), out, 16, 1.0)
    with pytest.raises(NativeKernelError, match="cannot serve"):
        kernel(query, cache, cache, tables, torch.tensor([17]), out, 16, 1.0)
    with pytest.raises(NativeKernelError, match="layout or dtype"):
        kernel(query, cache, cache, tables, torch.tensor([3]), torch.zeros(2, 4, 8), 16, 1.0)
    with pytest.raises(NativeKernelError, match="layout or dtype"):
        kernel(query, cache, cache, tables, torch.tensor([3]), out, 16, 1.0, sinks=torch.zeros(2))
    with pytest.raises(NativeKernelError, match="must be positive"):
        kernel(query, cache, cache, tables, torch.tensor([3]), out, 16, 1.0, window=0)
    assert not PagedDecodeKernel.supports(
        dtype=torch.bfloat16, device=torch.device("cpu"), num_heads=4, num_kv_heads=2, head_dim=8
    )
    assert not PagedDecodeKernel.supports(
        dtype=torch.float32, device=torch.device("cpu"), num_heads=4, num_kv_heads=2, head_dim=12
    )


def test_kernel_shares_torchs_openmp_runtime(kernel: PagedDecodeKernel) -> None:
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, f"two OpenMP runtimes loaded: {runtimes}"


def test_build_is_cached_and_reports_compiler_errors(tmp_path: Path) -> None:
    first = build_library(KERNEL_SOURCE, cache=tmp_path)
    built_at = first.stat().st_mtime_ns
    assert build_library(KERNEL_SOURCE, cache=tmp_path) == first
    assert first.stat().st_mtime_ns == built_at
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]  # no temporaries

    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return undefined_name; }\n")
    with pytest.raises(NativeKernelError, match="undefined_name"):
        build_library(broken, cache=tmp_path)
    with pytest.raises(NativeKernelError, match="no C compiler"):
        build_library(KERNEL_SOURCE, cache=tmp_path, compiler="/nonexistent/cc")


@pytest.mark.usefixtures("no_c_compiler")
def test_runner_falls_back_when_the_kernel_cannot_be_built(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), num_blocks=16))
    runner.load()
    assert runner._decode_mode == "grouped"
    assert "native paged_decode unavailable, using gather + SDPA" in caplog.text
    explicit = ModelRunner(
        ExecuteConfig(model=str(tiny_model_dir), num_blocks=16, decode_attention="native")
    )
    with pytest.raises(ExecuteConfigError, match=r"decode_attention.*could not be built"):
        explicit.load()


def test_runner_uses_the_kernel_by_default_and_refuses_it_where_it_cannot_run(
    tiny_model_dir: Path,
) -> None:
    runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), num_blocks=16))
    runner.load()
    assert runner._decode_mode == "native"
    # bf16 weights on the native bf16 GEMM keep fp32 activations: the kernel serves them
    native_bf16 = ModelRunner(
        ExecuteConfig(
            model=str(tiny_model_dir), num_blocks=16, dtype="bfloat16", decode_attention="native"
        )
    )
    native_bf16.load()
    assert native_bf16._decode_mode == "native"
    bf16 = ModelRunner(
        ExecuteConfig(
            model=str(tiny_model_dir),
            num_blocks=16,
            dtype="bfloat16",
            decode_attention="native",
            native_linears=False,  # torch's bf16 path: bf16 activations and KV cache
        )
    )
    with pytest.raises(ExecuteConfigError, match=r"decode_attention.*fp32 models on CPU"):
        bf16.load()
