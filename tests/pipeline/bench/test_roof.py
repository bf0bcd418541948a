"""The roof: the model's linear shapes, the workload's FLOPs and seconds at measured rates
(exact arithmetic on made-up rates), and ``actorline bench roof --quick`` on the tiny model
(it runs and reports positive rates; never a timing threshold)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline.bench.roof import (
    GemmRate,
    LinearShape,
    ModelLinears,
    format_share,
    measure_bandwidth,
    measure_fma_peak,
    model_linears,
    roof_seconds,
    step_weight_bytes,
)
from pipeline.bench.workload import WorkloadWork, workload_work
from tests.conftest import TINY_LLAMA


def test_work_counts_prefix_cache_hits_by_whole_blocks() -> None:
    shared = list(range(100, 132))  # eight blocks of 4
    prompts = [[*shared, 1, 2, 3], [*shared, 4, 5], [*shared[:4], 9], shared]
    work = workload_work(prompts, [3, 2, 1, 4], block_size=4)
    # prompt 2 hits 8 blocks (32 tokens), prompt 3 one (4); prompt 4 is 8 shared blocks but
    # its last one holds its last token, computed for its logits: 7 blocks (28).
    assert work.cached_prompt_tokens == 32 + 4 + 28
    assert work.prompt_tokens == 35 + 34 + 5 + 32
    assert work.generated_tokens == work.head_rows == 10
    # every generated token is fed back but each request's last
    assert work.layer_tokens == work.prompt_tokens - work.cached_prompt_tokens + 10 - 4
    assert work.forward_passes == 4  # the longest request's tokens, one pass each
    # fed-back tokens attend prompt + outputs so far: request 1's two see 36 and 37, ...
    assert work.decode_context_tokens == (36 + 37) + 35 + 0 + (33 + 34 + 35)
    # step by step: step 1 feeds back requests 1, 2 and 4, step 2 requests 1 and 4, step 3 4
    assert work.decode_rows == (3, 2, 1)
    assert work.decode_step_contexts == (36 + 35 + 33, 37 + 34, 35)
    assert sum(work.decode_step_contexts) == work.decode_context_tokens
    with pytest.raises(ValueError, match="max_tokens"):
        workload_work([[1]], [1, 2])
    with pytest.raises(ValueError, match=">= 1"):
        workload_work([[1]], [0])


def test_roof_is_each_shapes_flops_at_its_best_rate() -> None:
    linears = ModelLinears(
        layers=(LinearShape(8, 4, 2, ("q",)), LinearShape(16, 8, 1, ("up",))),
        head=LinearShape(32, 4, 1, ("lm_head",)),
    )
    assert linears.layer_flops_per_token == 2 * (8 * 4 * 2 + 16 * 8)
    rates = (
        GemmRate(8, 4, 64, "mkl", 1.0),
        GemmRate(8, 4, 256, "mkl", 2.0),  # the best M wins
        GemmRate(8, 4, 64, "packed", 1.5),
        GemmRate(16, 8, 64, "mkl", 4.0),
        GemmRate(16, 8, 64, "packed", 8.0),  # the best kernel wins
        GemmRate(32, 4, 16, "mkl", 1.0),
    )
    work = WorkloadWork(prompt_tokens=10, cached_prompt_tokens=0, generated_tokens=5,
                        layer_tokens=1000, head_rows=500)  # fmt: skip
    roof = roof_seconds(linears, rates, work)
    q, up, head = 2 * 8 * 4 * 2 * 1000, 2 * 16 * 8 * 1000, 2 * 32 * 4 * 500
    assert roof.flops == q + up + head
    assert roof.seconds == pytest.approx(q / 2e9 + up / 8e9 + head / 1e9)
    assert roof.mkl_seconds == pytest.approx(q / 2e9 + up / 4e9 + head / 1e9)
    assert format_share(roof, roof.seconds * 2) == "50%"
    assert roof.floor_seconds is None  # no bandwidth measured
    floor = roof_seconds(
        linears, rates, dataclasses.replace(work, forward_passes=3, decode_context_tokens=7),
        bandwidth_gbs=2.0, kv_bytes_per_token=10,
    )  # fmt: skip
    weights = 4 * (8 * 4 * 2 + 16 * 8 + 32 * 4)
    assert floor.weight_bytes == weights
    assert floor.floor_seconds == pytest.approx((3 * weights + 70) / 2e9)
    assert format_share(None, 1.0) == "-"
    assert roof.step_seconds is None  # no bandwidth measured
    with pytest.raises(ValueError, match="16 x 8"):
        roof_seconds(linears, rates[:3] + rates[5:], work)


def test_step_bound_takes_each_decode_step_at_its_compute_or_its_bytes() -> None:
    linears = ModelLinears(
        layers=(LinearShape(8, 4, 1, ("q",)),), head=LinearShape(16, 4, 1, ("lm_head",))
    )
    rates = (GemmRate(8, 4, 64, "mkl", 1.0), GemmRate(16, 4, 16, "mkl", 2.0))
    layer_row, head_row = 2 * 8 * 4 / 1e9, 2 * 16 * 4 / 2e9  # seconds per row
    # two requests: prompts of 3 and 5 tokens (1 cached), 3 and 1 tokens generated
    work = WorkloadWork(prompt_tokens=8, cached_prompt_tokens=1, generated_tokens=4,
                        layer_tokens=8 - 1 + 2, head_rows=4, forward_passes=3,
                        decode_context_tokens=4 + 5, decode_rows=(1, 1),
                        decode_step_contexts=(4, 5))  # fmt: skip
    weights = 4 * (8 * 4 + 16 * 4)
    bandwidth = 1e-6  # GB/s: slow enough that a decode step of 8 tokens' KV is memory-bound
    roof = roof_seconds(linears, rates, work, bandwidth_gbs=bandwidth, kv_bytes_per_token=8)
    prefill = 7 * layer_row + 2 * head_row  # the prompts, and each request's first token
    memory = [(weights + context * 8) / (bandwidth * 1e9) for context in (4, 5)]
    assert roof.step_seconds == pytest.approx(prefill + sum(memory))
    # with fast memory every step is compute-bound and the step bound is the roof
    fast = roof_seconds(linears, rates, work, bandwidth_gbs=1e9, kv_bytes_per_token=8)
    assert fast.step_seconds == pytest.approx(fast.seconds)
    assert roof.step_seconds > roof.seconds


def test_model_linears_reads_the_shapes_without_weights(tiny_model_dir: Path) -> None:
    linears = model_linears(tiny_model_dir)
    hidden, inter = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"]
    layers = TINY_LLAMA["num_hidden_layers"]
    q = TINY_LLAMA["num_attention_heads"] * TINY_LLAMA["head_dim"]
    kv = TINY_LLAMA["num_key_value_heads"] * TINY_LLAMA["head_dim"]
    shapes = {(shape.n, shape.k): shape.count for shape in linears.layers}
    expected: dict[tuple[int, int], int] = {}
    for n, k in [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q),
                 (inter, hidden), (inter, hidden), (hidden, inter)]:  # fmt: skip
        expected[(n, k)] = expected.get((n, k), 0) + layers
    assert shapes == expected
    assert linears.head == LinearShape(TINY_LLAMA["vocab_size"], hidden, 1, ("lm_head",))


def test_a_step_reads_each_formats_weights_once(tiny_model_dir: Path, tiny_gguf: Path) -> None:
    """The one-stream step bound's bytes: every linear once at 4 or 2 bytes a weight, or the
    GGUF file's tensors as it stores them (its data, all of the file but the header)."""
    linears = model_linears(tiny_model_dir)
    assert step_weight_bytes(tiny_model_dir, "fp32") == linears.weight_bytes(4)
    assert step_weight_bytes(tiny_model_dir, "bf16") == linears.weight_bytes(4) // 2
    size = tiny_gguf.stat().st_size
    assert size - 64 * 1024 < step_weight_bytes(tiny_model_dir, "q4_1", tiny_gguf) <= size
    with pytest.raises(ValueError, match="no GGUF file"):
        step_weight_bytes(tiny_model_dir, "q4_1")
    with pytest.raises(ValueError, match="unknown format 'fp16'"):
        step_weight_bytes(tiny_model_dir, "fp16")


def test_read_bandwidth_is_measured() -> None:
    assert measure_bandwidth(rounds=1, megabytes=32) > 0.1  # GB/s


def test_fma_peak_is_measured() -> None:
    peak = measure_fma_peak(threads=1, rounds=1)
    assert peak is not None, "the C compiler on this machine should build the probe"
    gflops, lanes = peak
    assert gflops > 0 and lanes in (4, 8, 16)


@pytest.mark.slow
def test_roof_quick_via_the_cli(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.pipeline.bench.test_bench import bench_parser

    args = bench_parser().parse_args(
        ["bench", "roof", "--quick", "--json", "--model", str(tiny_model_dir)]
    )
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    kernels = {rate["kernel"] for rate in result["rates"]}
    assert kernels == {"mkl", "packed"}
    assert all(rate["gflops"] > 0 for rate in result["rates"])
    roof = result["roof"]
    assert roof["flops"] > 0 and 0 < roof["seconds"] <= roof["mkl_seconds"]
    assert roof["work"]["generated_tokens"] == roof["work"]["head_rows"] > 0
