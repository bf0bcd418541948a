"""bf16 weights on a CPU without AVX512-BF16 (AVX2, AVX-512 before Cooper Lake, NEON): the bf16
GEMM's portable widen-and-FMA path serves every linear and the LM head at every row count,
prefill included, never torch's bf16 matmul (emulated on such a CPU: 7-8x slower at 256 rows; docs/
performance.md §12.3). On a CPU with AVX512-BF16 the tests load the portable build in its place
(the build a CPU without it gets), so they check the same path everywhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import stages.execute.loading
import stages.execute.runner
from stages.execute.bf16 import (
    TORCH_ROWS,
    BF16Embedding,
    BF16GemmKernel,
    BF16Linear,
    bf16_gemm_kernel,
    cpu_flags,
)
from stages.execute.config import ExecuteConfig
from stages.execute.runner import ModelRunner
from stages.messages import SamplingParams

from .driving import drive
from .test_bf16 import _BF16_NOISE, emulating_reference, greedy
from .test_runner import make_requests, random_prompts

# aten matrix products and attention: none may take a bf16 tensor on the portable path
_PRODUCTS = {
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "dot",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math",
}  # fmt: skip


class _Bf16Products(TorchDispatchMode):
    """Records each aten matrix product or attention call with a bf16 tensor among its
    arguments (what torch's emulated bf16 kernels would run)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.calls = 0  # every aten call seen (the mode was active where the model ran)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        name = func.overloadpacket.__name__
        if name in _PRODUCTS and any(
            isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bfloat16
            for leaf in tree_leaves((args, kwargs))
        ):
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.fixture
def portable(monkeypatch: pytest.MonkeyPatch) -> Iterator[BF16GemmKernel]:
    """The bf16 kernel a CPU without AVX512-BF16 gets: this CPU's own where it lacks it, else
    the portable build, which the engine then loads in the native one's place."""
    kernel = bf16_gemm_kernel()
    assert kernel is not None, "the C compiler should work"
    if kernel.native:
        kernel = bf16_gemm_kernel(portable=True)
        assert kernel is not None
        for module in (stages.execute.runner, stages.execute.loading):
            monkeypatch.setattr(module, "bf16_gemm_kernel", lambda: kernel)
    assert not kernel.native and not kernel.amx
    yield kernel


def test_the_portable_build_blocks_for_the_vector_unit() -> None:
    """The register blocking is picked per vector unit (kernels/bf16_gemm.c): 16 ymm on AVX2
    hold 6 rows x two 8-float vectors; AVX-512's 32 zmm, 14 rows x one 16-float vector."""
    kernel = bf16_gemm_kernel(portable=True)
    assert kernel is not None and not kernel.native
    flags = cpu_flags()
    if "avx512f" in flags:
        assert (kernel.lanes, kernel.tile_rows) == (16, 14)
    elif "avx" in flags:
        assert (kernel.lanes, kernel.tile_rows) == (8, 6)
    else:
        assert kernel.lanes == 4
    if not {"avx512_bf16", "amx_bf16"} & flags:
        native = bf16_gemm_kernel()
        assert native is not None and not native.native  # this CPU gets the portable path


def test_the_recorder_sees_a_bf16_product() -> None:
    """The check below is not vacuous: torch's bf16 matmul and attention are what it records
    (in inference mode, as the engine runs; fp32 calls are not recorded)."""
    q = torch.randn(1, 2, 5, 8)
    with torch.inference_mode(), _Bf16Products() as recorder:
        F.linear(torch.randn(3, 8).bfloat16(), torch.randn(4, 8).bfloat16())
        F.linear(torch.randn(3, 8), torch.randn(4, 8))
        F.scaled_dot_product_attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
        F.scaled_dot_product_attention(q, q, q)
    assert recorder.seen == ["linear", "scaled_dot_product_attention"]


def test_a_bf16_model_never_runs_torchs_bf16_matmul(
    tiny_model_dir: Path, portable: BF16GemmKernel
) -> None:
    """Every linear (the fused gate/up projection and the LM head included) is a BF16Linear on
    the portable kernel at every row count; prompts longer than TORCH_ROWS prefill and decode
    without one bf16 product in torch, and give the emulating reference's greedy tokens."""
    runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), dtype="bfloat16", num_blocks=64))
    info = runner.load()
    assert (info.dtype, info.kv_cache_dtype) == ("bfloat16", "bfloat16")
    linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear | BF16Linear)]
    assert linears and all(type(m) is BF16Linear for m in linears)
    assert isinstance(runner.model.lm_head, BF16Linear)
    assert isinstance(runner.model.get_input_embeddings(), BF16Embedding)
    for linear in linears:
        assert linear._kernel is portable
        assert all(linear.native_rows(rows) for rows in (1, TORCH_ROWS - 1, TORCH_ROWS, 4096))
    prompts = random_prompts((TORCH_ROWS + 40, 9, 2 * TORCH_ROWS + 3), seed=11)
    with _Bf16Products() as recorder:
        report = drive(
            runner, make_requests(prompts, SamplingParams(max_tokens=6, temperature=0.0))
        )
    assert recorder.calls > 0 and recorder.seen == []
    reference = emulating_reference(tiny_model_dir)
    compared = 0
    for index, prompt in enumerate(prompts):
        tokens, margins = greedy(reference, prompt, 6)
        close = next((step for step, m in enumerate(margins) if m < _BF16_NOISE), len(tokens))
        assert report.outputs[f"r{index}"][:close] == tokens[:close], (index, close)
        compared += close
    assert compared >= len(prompts), compared  # the check is not vacuous
