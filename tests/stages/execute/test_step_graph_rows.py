"""The step graph's row bound (stages.execute.step_graph.plan_rows): with fp32 or bf16 panels a
decode step of up to ``cuda_graph_max_batch_size`` rows is one native call, giving the module
path's logits; 4/8-bit weights keep the bound of 16 rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.execute.bf16 import bf16_gemm_kernel
from stages.execute.config import ExecuteConfigError
from stages.execute.step_graph import MAX_ROWS, plan_rows
from stages.messages import EngineRequest
from stages.params import SamplingParams
from tests.stages.execute.driving import drive
from tests.stages.execute.test_runner import random_prompts
from tests.stages.execute.test_step_graph import (
    both_forms,
    decode_only_steps,
    load,
    logprobs_of,
)

needs_bf16_kernel = pytest.mark.skipif(
    bf16_gemm_kernel() is None, reason="the native bf16 kernel does not build here"
)


@needs_bf16_kernel
def test_bf16_panels_lift_the_bound_to_the_engines(tiny_model_dir: Path) -> None:
    runner = load(tiny_model_dir, num_blocks=64, dtype="bfloat16", cuda_graph_max_batch_size=64)
    assert runner.step_graph is not None and runner.step_graph.max_rows == 64
    assert plan_rows(runner.model, 8) == 8  # a smaller bound is kept
    kernel = bf16_gemm_kernel()
    assert kernel is not None
    # from TORCH_ROWS rows VDPBF16PS without tiles hands the GEMM to torch: the bound stays 16;
    # the tiles and the portable path (no AVX512-BF16) multiply every row count
    assert plan_rows(runner.model, 128) == (128 if kernel.amx or not kernel.native else MAX_ROWS)


def test_fp32_panels_lift_the_bound_to_the_engines(tiny_model_dir: Path) -> None:
    """The packed fp32 GEMM is the module path's kernel at every row count."""
    runner = load(tiny_model_dir, num_blocks=64, cuda_graph_max_batch_size=64)
    assert runner.step_graph is not None and runner.step_graph.max_rows == 64
    assert plan_rows(runner.model, 8) == 8
    assert plan_rows(runner.model, 128) == 128


def test_quantized_weights_keep_sixteen_rows(tiny_model_dir: Path) -> None:
    runner = load(tiny_model_dir, num_blocks=64, cuda_graph_max_batch_size=64, quantization="int8")
    assert runner.step_graph is not None and runner.step_graph.max_rows == MAX_ROWS
    assert plan_rows(runner.model, 4) == 4


def test_the_bound_is_checked() -> None:
    with pytest.raises(ExecuteConfigError, match="cuda_graph_max_batch_size"):
        load("smollm2-135m", cuda_graph_max_batch_size=0)


PANELS = [
    pytest.param("float32", id="fp32"),
    pytest.param("bfloat16", id="bf16", marks=needs_bf16_kernel),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", PANELS)
def test_batches_of_up_to_64_rows_match_the_module_path(tiny_model_dir: Path, dtype: str) -> None:
    """40 and 64 requests decoding together (then fewer as the shorter ones finish): every
    decode-only step is one native call, with the module path's logprobs at every step."""
    fields = dict(num_blocks=512, block_size=4, dtype=dtype, cuda_graph_max_batch_size=64)
    on = load(tiny_model_dir, **fields)
    off = load(tiny_model_dir, use_cuda_graphs=False, **fields)
    assert on.step_graph is not None and off.step_graph is None
    for batch, seed in ((40, 21), (64, 22)):
        prompts = random_prompts(tuple(3 + i % 11 for i in range(batch)), seed=seed)
        requests = [
            EngineRequest(
                f"b{batch}-{i}",
                tuple(prompt),
                SamplingParams(max_tokens=4 + i % 5, temperature=0.0, logprobs=3, ignore_eos=True),
            )
            for i, prompt in enumerate(prompts)
        ]
        before = on.step_graph.steps
        got, expected = drive(on, requests), drive(off, requests)
        assert logprobs_of(got) == logprobs_of(expected)
        assert got.max_requests_per_step == batch
        assert on.step_graph.steps - before == decode_only_steps(got, 64) > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", PANELS)
def test_one_region_per_step_at_32_and_64_rows_gives_the_per_op_logits(
    tiny_model_dir: Path, dtype: str
) -> None:
    """The threads' column ranges at 32 and 64 rows (two 32-row blocks of tiles, where the
    CPU has AMX) and 37 (a partial block) give the per-op form's logits bit for bit."""
    runner = load(
        tiny_model_dir,
        num_blocks=512,
        block_size=16,
        dtype=dtype,
        cuda_graph_max_batch_size=64,
    )
    assert runner.step_graph is not None and runner.step_graph.max_rows == 64
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (32, 37, 64):
                threaded, per_op = both_forms(runner, rows, context=5)
                assert threaded.shape[0] == rows
                assert torch.equal(threaded, per_op), (count, rows)
    finally:
        torch.set_num_threads(threads)
