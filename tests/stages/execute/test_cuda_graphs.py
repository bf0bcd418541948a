"""Tests of stages/execute/cuda_graphs.py. The static decode path runs eagerly on CPU (the
runner-level equality test is test_runner.py::test_static_padded_decode_path_matches); the
captured path runs on CUDA only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.execute.attention import build_step_metadata, forward_context
from stages.execute.config import ExecuteConfig
from stages.execute.cuda_graphs import DecodeGraphs, graph_batch_sizes, graph_context_buckets
from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
from stages.params import SamplingParams


def test_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_context_buckets_cover_the_model_length_in_whole_blocks() -> None:
    assert graph_context_buckets(8192, 16) == [256, 1024, 4096, 8192]
    assert graph_context_buckets(100, 16) == [112]
    buckets = graph_context_buckets(5000, 48)
    assert all(bucket % 48 == 0 for bucket in buckets)
    assert buckets[-1] >= 5000 and buckets == sorted(buckets)


def prefilled_runner(model_dir: Path, device: str) -> tuple[ModelRunner, dict[str, int]]:
    """A runner with five requests of different lengths prefilled (one output each)."""
    runner = ModelRunner(ExecuteConfig(model=str(model_dir), device=device, num_blocks=64))
    runner.load()
    generator = torch.Generator().manual_seed(0)
    lengths = {f"r{i}": n for i, n in enumerate((3, 17, 40, 9, 70))}
    requests = tuple(
        EngineRequest(
            request_id,
            tuple(torch.randint(3, 49152, (n,), generator=generator).tolist()),
            SamplingParams(max_tokens=4, temperature=0.0),
        )
        for request_id, n in lengths.items()
    )
    chunks = tuple(ScheduledChunk(request_id, 0, n) for request_id, n in lengths.items())
    runner.execute(SchedulerStep(0, requests, chunks))
    return runner, lengths


def decode_logits_both_ways(runner: ModelRunner, lengths: dict[str, int], capture: bool) -> None:
    """One decode step's logits through DecodeGraphs and through the eager packed path."""
    assert runner.allocator is not None and runner.kv_cache is not None
    order = sorted(lengths, key=lengths.__getitem__)
    tables = [runner.allocator.block_table(request_id) for request_id in order]
    tokens = [runner.output_token_ids(request_id)[-1] for request_id in order]
    positions = [lengths[request_id] for request_id in order]
    graphs = DecodeGraphs(
        runner.model,
        runner.kv_cache,
        max_batch_size=8,
        max_model_len=runner.max_model_len,
        device=runner.device,
    )
    graphs.capture(enabled=capture)
    static = graphs.run(
        token_ids=tokens,
        positions=positions,
        block_tables=tables,
        context_lens=[p + 1 for p in positions],
    ).clone()  # [5, V]; padded to a batch of 8 inside
    metadata, position_ids = build_step_metadata(
        kv_cache=runner.kv_cache,
        block_tables=tables,
        query_starts=positions,
        query_lens=[1] * len(order),
        num_decode=len(order),
        decode_mode="per_sequence",
        max_model_len=runner.max_model_len,
        device=runner.device,
    )
    with torch.inference_mode(), forward_context(metadata):
        eager = runner.model(
            input_ids=torch.tensor([tokens], device=runner.device),
            position_ids=position_ids.unsqueeze(0),
            use_cache=False,
        ).logits[0]
    assert static.shape == eager.shape
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)


def test_static_decode_matches_the_eager_path_on_cpu(tiny_model_dir: Path) -> None:
    runner, lengths = prefilled_runner(tiny_model_dir, "cpu")
    decode_logits_both_ways(runner, lengths, capture=False)


@pytest.mark.cuda
def test_captured_decode_matches_the_eager_path(tiny_model_dir: Path) -> None:
    runner, lengths = prefilled_runner(tiny_model_dir, "cuda")
    decode_logits_both_ways(runner, lengths, capture=True)
