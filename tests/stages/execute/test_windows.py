"""Tests of stages/execute/windows.py: which blocks lie behind a sliding window, and a real
windowed model whose generation runs past its window and past what the KV cache could hold
whole, with the real scheduler: bounded blocks, an exact mirror, tokens identical to HF."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.execute.config import ExecuteConfig
from stages.execute.runner import ModelRunner
from stages.execute.windows import (
    blocks_behind_window,
    config_layer_windows,
    kv_window,
    window_blocks_needed,
)
from stages.messages import EngineRequest, StepResult
from stages.params import SamplingParams
from stages.policies import FcfsPolicy
from stages.scheduler import Scheduler, SchedulerConfig
from tests.stages.execute.driving import HFReference
from tests.stages.execute.test_model_table import SERVED, build


def test_blocks_behind_window() -> None:
    # The next query (position c) sees positions c - W + 1 .. c.
    assert blocks_behind_window(10, None, 4) == 0
    assert blocks_behind_window(7, 8, 4) == 0
    assert blocks_behind_window(11, 8, 4) == 1  # sees 4..11: block 0 (0..3) is behind
    assert blocks_behind_window(12, 8, 4) == 1  # sees 5..12: block 1 (4..7) still read
    assert blocks_behind_window(15, 8, 4) == 2
    assert blocks_behind_window(100, 1, 1) == 100  # a window of one: only itself
    assert window_blocks_needed(8, 4) == 4  # ceil(7 / 4) + 2


def test_kv_window_bounds_every_layer_or_none() -> None:
    assert kv_window([8, 8], 256) == 8
    assert kv_window([4, 8], 256) == 8  # the widest window bounds what any layer reads
    assert kv_window([8, None], 256) is None  # a full-attention layer reads everything
    assert kv_window([], 256) is None
    assert kv_window([256, 256], 256) is None  # no shorter than the model: full attention


def test_config_layer_windows() -> None:
    assert config_layer_windows({"num_hidden_layers": 2, "sliding_window": 8}) == [8, 8]
    assert config_layer_windows({"num_hidden_layers": 2, "sliding_window": None}) == [None] * 2
    qwen2 = {"num_hidden_layers": 2, "sliding_window": 8, "use_sliding_window": False}
    assert config_layer_windows(qwen2) == [None, None]
    gemma2 = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    assert config_layer_windows(gemma2) == [8, None]


def run_with_scheduler(
    runner: ModelRunner, requests: list[EngineRequest], config: SchedulerConfig
) -> tuple[dict[str, list[int]], list[StepResult]]:
    """Drive ``runner`` with the real scheduler until every request finished, checking the
    scheduler's mirror against the allocator after every step."""
    assert runner.info is not None and runner.allocator is not None
    scheduler = Scheduler(config, FcfsPolicy())
    scheduler.set_engine_info(runner.info)
    for item in requests:
        scheduler.add_request(item)
    outputs: dict[str, list[int]] = {item.request_id: [] for item in requests}
    results: list[StepResult] = []
    for _ in range(2000):
        step = scheduler.schedule()
        if step is None:
            break
        result = runner.execute(step)
        assert result.preempted == (), "the plan needed more blocks than were free"
        results.append(result)
        update = scheduler.update(result)
        for request_id, tokens in zip(update.request_ids, update.new_token_ids, strict=True):
            outputs[request_id].extend(tokens)
        for request_id, state in scheduler._running.items():
            assert state.num_blocks == runner.allocator.num_held_blocks(request_id)
    else:
        raise AssertionError("the requests did not finish")
    return outputs, results


def test_windowed_generation_holds_bounded_blocks(tmp_path: Path) -> None:
    """Mistral with an 8-token window on every layer, 4-token blocks and a cache of 12 blocks
    (48 tokens): two requests generate to 70 and 60 tokens each, with the blocks behind the
    window given back as they advance."""
    model_type, fields = SERVED["mistral (sliding window)"]
    directory = build(model_type, fields, tmp_path)
    runner = ModelRunner(ExecuteConfig(model=str(directory), num_blocks=12, block_size=4))
    info = runner.load()
    window = 8
    assert info.sliding_window == window
    assert info.max_model_len == 256  # the cache no longer caps it: only the window's blocks
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (10, 21)]
    requests = [
        EngineRequest(
            f"r{i}",
            tuple(prompt),
            SamplingParams(max_tokens=60 - 10 * i, temperature=0.0, ignore_eos=True),
        )
        for i, prompt in enumerate(prompts)
    ]
    outputs, results = run_with_scheduler(
        runner, requests, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)
    )
    reference = HFReference(directory)
    assert outputs == {
        item.request_id: reference.greedy(item.prompt_token_ids, item.params.max_tokens or 0)
        for item in requests
    }
    bound = len(requests) * window_blocks_needed(window, 4)
    used = [result.total_blocks - result.free_blocks for result in results]
    assert max(used) <= bound, used
    assert results[-1].free_blocks == results[-1].total_blocks


def test_a_full_attention_layer_keeps_every_block(tmp_path: Path) -> None:
    """Gemma 2 alternates windowed and full layers: the full ones read every position, so no
    block is freed early and the cache caps the model length as usual."""
    model_type, fields = SERVED["gemma2"]
    runner = ModelRunner(
        ExecuteConfig(model=str(build(model_type, fields, tmp_path)), num_blocks=12, block_size=4)
    )
    info = runner.load()
    assert info.sliding_window is None
    assert info.max_model_len == 48


def test_a_cache_too_small_for_the_window_caps_the_length(tmp_path: Path) -> None:
    model_type, fields = SERVED["mistral (sliding window)"]
    directory = build(model_type, fields, tmp_path)
    # 3 blocks of 4: fewer than the window's 4 (window_blocks_needed), so a request must fit
    # the cache whole; blocks behind its window are given back all the same.
    info = ModelRunner(ExecuteConfig(model=str(directory), num_blocks=3, block_size=4)).load()
    assert (info.sliding_window, info.max_model_len) == (8, 12)
