"""The CPU step graph (stages.execute.step_graph): small decode steps in one native call give the
module path's logits, and whatever it does not serve takes the module path."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import stages.execute.runner as runner_module
from stages.execute.bf16 import bf16_gemm_kernel
from stages.execute.config import ExecuteConfig
from stages.execute.runner import ModelRunner
from stages.execute.step_graph import MAX_ROWS, StepGraph
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
from stages.params import SamplingParams
from tests.stages.execute.driving import DriveReport, drive
from tests.stages.execute.test_runner import make_requests, random_prompts

# Logprobs carry the logits out: equal top-3 logprobs at every step mean equal logits there.
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)


def load(model: Path | str, **fields: object) -> ModelRunner:
    runner = ModelRunner(ExecuteConfig(model=str(model), **fields))  # type: ignore[arg-type]
    runner.load()
    return runner


def logprobs_of(report: DriveReport) -> list[object]:
    return [(r.logprob_request_ids, r.logprobs, r.request_ids, r.token_ids) for r in report.results]


def decode_only_steps(report: DriveReport, bound: int) -> int:
    """Steps whose every chunk computes one token, with at most ``bound`` of them."""
    return sum(
        1
        for step in report.steps
        if step.chunks
        and all(chunk.num_tokens == 1 for chunk in step.chunks)
        and len(step.chunks) <= bound
    )


@pytest.mark.slow
def test_decode_batches_match_the_module_path_bit_for_bit(tiny_model_dir: Path) -> None:
    fields = dict(num_blocks=256, block_size=4)
    on, off = load(tiny_model_dir, **fields), load(tiny_model_dir, use_cuda_graphs=False, **fields)
    assert on.step_graph is not None and off.step_graph is None
    for batch, seed in ((1, 1), (3, 2), (8, 3), (MAX_ROWS, 4)):
        prompts = random_prompts(tuple(3 + 5 * i for i in range(batch)), seed=seed)
        requests = make_requests(prompts, PARAMS, prefix=f"b{batch}-")
        before = on.step_graph.steps
        got, expected = drive(on, requests), drive(off, requests)
        assert logprobs_of(got) == logprobs_of(expected)
        assert on.step_graph.steps - before == decode_only_steps(got, MAX_ROWS) > 0


def test_rows_that_do_not_sample_preemption_and_prefix_hits(tiny_model_dir: Path) -> None:
    """Prompts fed one token a step (decode-shaped rows that sample nothing), a preempted
    request recomputed, and prompts sharing a cached prefix."""
    shared = random_prompts((20,), seed=5)[0]
    prompts = [shared + tail for tail in random_prompts((1, 6, 13), seed=6)]
    requests = make_requests(prompts, PARAMS)
    reports = []
    for use_graph in (True, False):
        runner = load(tiny_model_dir, num_blocks=64, block_size=4, use_cuda_graphs=use_graph)
        first = drive(runner, requests[:1], chunk_size=1)
        rest = drive(runner, requests[1:], chunk_size=3, preempt_after={"r2": 4})
        reports.append((first, rest, runner.step_graph))
    (first, rest, graph), (first_off, rest_off, _) = reports
    assert graph is not None and graph.steps >= len(prompts[0])
    assert max(rest.cached_tokens.values()) >= 16
    assert logprobs_of(first) == logprobs_of(first_off)
    assert logprobs_of(rest) == logprobs_of(rest_off)


@pytest.mark.slow
def test_batches_over_the_bound_take_the_module_path(tiny_model_dir: Path) -> None:
    prompts = random_prompts(tuple(range(3, 3 + MAX_ROWS + 4)), seed=7)
    requests = make_requests(prompts, PARAMS)
    # fp32 panels serve the engine's bound (128 by default): bound them at MAX_ROWS here
    on = load(tiny_model_dir, num_blocks=256, cuda_graph_max_batch_size=MAX_ROWS)
    got = drive(on, requests)
    expected = drive(load(tiny_model_dir, num_blocks=256, use_cuda_graphs=False), requests)
    assert logprobs_of(got) == logprobs_of(expected)
    assert on.step_graph is not None
    assert decode_only_steps(got, 1 << 20) > decode_only_steps(got, MAX_ROWS)
    assert on.step_graph.steps == decode_only_steps(got, MAX_ROWS)


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_quantized_weights_give_the_module_paths_tokens(
    tiny_model_dir: Path, tiny_gguf: Path, quantization: str
) -> None:
    model = tiny_gguf if quantization == "gguf" else tiny_model_dir
    # NOTE: the tiny GGUF model has 512 tokens
    prompts = [[token % 509 + 3 for token in prompt] for prompt in random_prompts((4, 11, 19), 8)]
    requests = make_requests(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    on = load(model, num_blocks=64, quantization=quantization)
    off = load(model, num_blocks=64, quantization=quantization, use_cuda_graphs=False)
    assert on.step_graph is not None and off.step_graph is None
    got, expected = drive(on, requests), drive(off, requests)
    assert got.outputs == expected.outputs
    assert on.step_graph.steps == decode_only_steps(got, MAX_ROWS) > 0


def test_a_disagreeing_plan_is_refused(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    build = StepGraph.build

    def wrong_scale(*args: object, **kwargs: object) -> StepGraph:
        graph = build(*args, **kwargs)  # type: ignore[arg-type]
        graph._plan.scale *= 2.0  # attention scaled otherwise than the model's
        return graph

    monkeypatch.setattr(StepGraph, "build", wrong_scale)
    monkeypatch.setattr(runner_module, "checks_passed", lambda *_: False)
    with caplog.at_level(logging.INFO, logger="actorline.execute"):
        runner = load(tiny_model_dir, num_blocks=64)
    assert runner.step_graph is None
    assert "step graph disagrees with the module path" in caplog.text
    requests = make_requests(random_prompts((5, 9), seed=9), PARAMS)
    monkeypatch.undo()
    expected = drive(load(tiny_model_dir, num_blocks=64, use_cuda_graphs=False), requests)
    assert logprobs_of(drive(runner, requests)) == logprobs_of(expected)


@pytest.mark.parametrize(
    "fields",
    [
        {"use_cuda_graphs": False},
        {"fused_ops": False},
        {"model_impl": "transformers"},
        {"decode_attention": "grouped"},
    ],
)
def test_what_the_plan_does_not_serve_takes_the_module_path(
    tiny_model_dir: Path, fields: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="actorline.execute"):
        runner = load(tiny_model_dir, num_blocks=64, **fields)
    assert runner.step_graph is None
    if fields.get("fused_ops") is False:
        assert "decode steps take the module path (step graph: " in caplog.text
    report = drive(runner, make_requests(random_prompts((4, 7), seed=10), PARAMS))
    assert all(len(tokens) == PARAMS.max_tokens for tokens in report.outputs.values())


@pytest.mark.usefixtures("no_c_compiler")
def test_without_a_c_compiler_the_module_path_serves(tiny_model_dir: Path) -> None:
    runner = load(tiny_model_dir, num_blocks=64)
    assert runner.step_graph is None
    report = drive(runner, make_requests(random_prompts((4,), seed=11), PARAMS))
    assert len(report.outputs["r0"]) == PARAMS.max_tokens


def test_a_small_cache_checks_the_plan_on_fewer_rows(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "checks_passed", lambda *_: False)
    runner = load(tiny_model_dir, num_blocks=2, block_size=16)  # room for one probe row
    assert runner.step_graph is not None
    requests = make_requests(random_prompts((5,), seed=12), PARAMS)
    expected = drive(
        load(tiny_model_dir, num_blocks=2, block_size=16, use_cuda_graphs=False), requests
    )
    assert logprobs_of(drive(runner, requests)) == logprobs_of(expected)
    assert runner.step_graph.steps == PARAMS.max_tokens - 1


def odd_model_dir(tiny_model_dir: Path, out: Path, **shape: int) -> Path:
    """A tiny random Llama of other shapes, the tiny model's tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_LLAMA

    torch.manual_seed(1)
    fields: dict[str, Any] = {**TINY_LLAMA, **shape}
    LlamaForCausalLM(LlamaConfig(**fields)).save_pretrained(out)
    for name in tiny_model_dir.iterdir():
        if name.name.startswith("tokenizer") or name.name == "special_tokens_map.json":
            shutil.copy(name, out / name.name)
    return out


def both_forms(
    runner: ModelRunner, rows: int, context: int, vocab: int = 49152
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of ``rows`` prefilled rows (contexts ``context + row``, across block
    boundaries; tokens below ``vocab``) run by the step graph in one OpenMP region and one
    region per op."""
    graph = runner.step_graph
    assert graph is not None and runner.allocator is not None
    prompts = random_prompts(tuple(context + row for row in range(rows)), seed=rows)
    prompts = [[token % (vocab - 3) + 3 for token in prompt] for prompt in prompts]
    names = [f"t{rows}-{row}" for row in range(rows)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runner.execute(
        SchedulerStep(
            0,
            tuple(EngineRequest(n, tuple(p), params) for n, p in zip(names, prompts, strict=True)),
            tuple(ScheduledChunk(n, 0, len(p) - 1) for n, p in zip(names, prompts, strict=True)),
        )
    )
    for name, prompt in zip(names, prompts, strict=True):
        runner.allocator.allocate(name, len(prompt))  # the decode row's slot
    tables = [runner.allocator.block_table(name) for name in names]
    step = ([p[-1] for p in prompts], [len(p) - 1 for p in prompts], tables, range(rows))
    graph.threaded = True
    threaded = graph.run(*step)  # writes each row's K/V; the per-op run writes the same
    graph.threaded = False
    per_op = graph.run(*step)
    graph.threaded = True
    runner.execute(SchedulerStep(1, finished=tuple(names)))
    return threaded, per_op


@pytest.mark.parametrize(
    "fields",
    [{}, {"dtype": "bfloat16"}, {"quantization": "int8"}, {"quantization": "gguf"}],
    ids=["fp32", "bf16", "int8", "gguf"],
)
def test_one_region_per_step_gives_the_per_op_logits_bit_for_bit(
    tiny_model_dir: Path, tiny_gguf: Path, fields: dict[str, object]
) -> None:
    """Every thread count splits the columns, heads and (row, head) pairs otherwise; each
    element is computed by the same code in the same order, so the logits are equal. In bf16
    the threads' column ranges multiply on AMX tiles at the row counts where the per-op form's
    GEMM does (from ``amx_rows``, where the CPU has them), and the fused gate/up projection
    takes its SiLU-and-mul epilogue in both forms, so those rows are equal too."""
    model = tiny_gguf if fields.get("quantization") == "gguf" else tiny_model_dir
    runner = load(model, num_blocks=128, block_size=4, **fields)
    assert runner.step_graph is not None and runner.step_graph.threaded
    kernel = bf16_gemm_kernel() if fields.get("dtype") == "bfloat16" else None
    layers = len(runner.model.model.layers)
    assert runner.step_graph.silu_epilogues == (layers if kernel is not None else 0)
    row_counts: tuple[int, ...] = (1, 3, MAX_ROWS)
    if kernel is not None and kernel.amx:
        assert kernel.amx_rows <= MAX_ROWS
        row_counts = (1, 3, kernel.amx_rows, MAX_ROWS)  # the tiles from amx_rows
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in row_counts:
                # NOTE: the tiny GGUF model has 512 tokens
                threaded, per_op = both_forms(
                    runner,
                    rows,
                    context=5 if rows > 1 else 9,
                    vocab=512 if model == tiny_gguf else 49152,
                )
                assert torch.equal(threaded, per_op), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_odd_shapes_split_and_unsplittable_ones_run_per_op(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Three query heads on one KV head, a hidden size of three panels (the fp32 GEMM pairs
    two and takes the third alone), two threads: the same logits as per op. A head_dim of 8
    does not split by 16-column heads: that plan keeps the per-op form."""
    odd = odd_model_dir(
        tiny_model_dir, tmp_path / "odd", hidden_size=48, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, intermediate_size=96,
    )  # fmt: skip
    runner = load(odd, num_blocks=64, block_size=4)
    assert runner.step_graph is not None and runner.step_graph.threaded
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for rows in (1, 2, 5):
            threaded, per_op = both_forms(runner, rows, context=6)
            assert torch.equal(threaded, per_op), rows
    finally:
        torch.set_num_threads(threads)
    narrow = odd_model_dir(
        tiny_model_dir, tmp_path / "narrow", hidden_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64,
    )  # fmt: skip
    runner = load(narrow, num_blocks=64, block_size=4)
    graph = runner.step_graph
    assert graph is not None and not graph.threaded
    with pytest.raises(ValueError, match="do not split by columns"):
        graph.threaded = True
    report = drive(runner, make_requests(random_prompts((4, 7), seed=13), PARAMS))
    assert graph.steps > 0
    assert all(len(tokens) == PARAMS.max_tokens for tokens in report.outputs.values())
