"""Tests of stages/execute/kv_blocks.py, the two ends of disaggregated prefill and decode on
the tiny Llama, in one process: engine A (a prefill engine) computes prompts and exports their
full blocks; the blocks cross the real codec (out-of-band frames, as over ZeroMQ) inside the
request; engine B imports them into its prefix cache, its lookup hits them, it computes only
the tail, and its greedy tokens equal those of an engine that computed everything. Blocks
that are not the request's, or not of B's layout, are not imported (B computes the whole
prompt, and says why)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stages.execute.config import ExecuteConfig
from stages.execute.runner import ModelRunner
from stages.kv_transfer import KvBlocks
from stages.messages import EngineRequest
from stages.params import SamplingParams
from tests.stages.execute.driving import drive
from transports.codec import Codec

BLOCK = 16
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
#: prompts sharing a 40-token prefix, of lengths across block boundaries
LENGTHS = (17, 33, 48, 49, 70, 95)


def prompts() -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(39)
    shared = torch.randint(3, 49152, (40,), generator=generator).tolist()
    return [
        tuple((shared + torch.randint(3, 49152, (n,), generator=generator).tolist())[:n])
        for n in LENGTHS
    ]


def load(model_dir: Path, **fields: object) -> ModelRunner:
    config = ExecuteConfig(model=str(model_dir), num_blocks=64, block_size=BLOCK, **fields)  # type: ignore[arg-type]
    runner = ModelRunner(config)
    runner.load()
    return runner


def over_the_wire(request: EngineRequest) -> EngineRequest:
    """``request`` encoded and decoded by the codec (its K/V as out-of-band buffers)."""
    codec = Codec()
    payload, buffers = codec.encode(request)
    assert buffers, "the K/V should travel as an out-of-band frame"
    decoded = codec.decode(payload, [bytes(buffer) for buffer in buffers])
    assert isinstance(decoded, EngineRequest)
    return decoded


def exported(model_dir: Path, requests: list[EngineRequest], **fields: object) -> list[KvBlocks]:
    prefill = load(model_dir, kv_export=True, **fields)
    drive(prefill, [dataclasses.replace(r, params=PREFILL) for r in requests])
    blocks = prefill.kv_exports
    assert [b.request_id for b in blocks] == [r.request_id for r in requests]
    return blocks


@pytest.mark.parametrize(
    "kv_cache_dtype", ["auto", pytest.param("bfloat16", marks=pytest.mark.slow)]
)
def test_moved_blocks_serve_the_decode_engine_exactly(
    tiny_model_dir: Path, kv_cache_dtype: str
) -> None:
    requests = [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts())]
    blocks = exported(tiny_model_dir, requests, kv_cache_dtype=kv_cache_dtype)
    for request, moved in zip(requests, blocks):
        # every full block before the prompt's last token, and nothing else
        assert moved.num_blocks == (len(request.prompt_token_ids) - 1) // BLOCK
        assert moved.token_ids == request.prompt_token_ids[: moved.num_blocks * BLOCK]
        assert moved.dtype == ("bfloat16" if kv_cache_dtype == "bfloat16" else "float32")
    # the reference: an engine that computes every prompt itself
    whole = drive(load(tiny_model_dir, kv_cache_dtype=kv_cache_dtype), requests)
    # the decode engine, one request at a time so no request's blocks serve another's
    decode = load(tiny_model_dir, kv_cache_dtype=kv_cache_dtype)
    for request, moved in zip(requests, blocks):
        carried = over_the_wire(dataclasses.replace(request, kv_blocks=moved))
        assert carried.kv_blocks is not None and carried.kv_blocks.nbytes == moved.nbytes
        report = drive(decode, [carried])
        assert report.outputs[request.request_id] == whole.outputs[request.request_id]
        assert report.cached_tokens.get(request.request_id, 0) == moved.num_blocks * BLOCK
        decode.allocator.reset_prefix_cache()  # type: ignore[union-attr]


def test_blocks_that_do_not_fit_are_not_imported(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = prompts()[4]  # 70 tokens: 4 blocks move
    request = EngineRequest("r", prompt, GREEDY)
    (moved,) = exported(tiny_model_dir, [request])
    assert moved.num_blocks == 4
    whole = drive(load(tiny_model_dir), [request]).outputs["r"]
    other_prompt = (prompt[0] + 1, *prompt[1:])
    wrong = {
        "their tokens are not a whole-block prefix": dataclasses.replace(
            request, prompt_token_ids=other_prompt
        ),
        "another cache key": dataclasses.replace(
            request, kv_blocks=dataclasses.replace(moved, cache_key=b"adapter")
        ),
        "K/V of shape": dataclasses.replace(
            request,
            kv_blocks=dataclasses.replace(moved, data=np.ascontiguousarray(moved.data[:, :1])),
        ),
        "K/V of dtype": dataclasses.replace(
            request, kv_blocks=dataclasses.replace(moved, dtype="bfloat16")
        ),
    }
    decode = load(tiny_model_dir)
    for why, case in wrong.items():
        if case.kv_blocks is None:
            case = dataclasses.replace(case, kv_blocks=moved)
        decode.allocator.reset_prefix_cache()  # type: ignore[union-attr]
        with caplog.at_level(logging.WARNING, logger="actorline.execute"):
            caplog.clear()
            report = drive(decode, [case])
        assert report.cached_tokens.get("r", 0) == 0, why
        assert any(why in record.getMessage() for record in caplog.records), why
        if case.prompt_token_ids == prompt:
            assert report.outputs["r"] == whole, why


def test_a_prompt_of_one_block_or_less_exports_nothing(tiny_model_dir: Path) -> None:
    request = EngineRequest("short", prompts()[0][:BLOCK], GREEDY)
    (moved,) = exported(tiny_model_dir, [request])
    assert moved.num_blocks == 0 and moved.nbytes == 0


def test_the_scheduler_hands_the_blocks_to_execute_once_and_keeps_none() -> None:
    """The moved K/V (megabytes for a long prompt) goes to execute with the request's first
    step; the scheduler's own record of the request keeps none of it while it runs."""
    from stages.messages import EngineInfo
    from stages.policies import FcfsPolicy
    from stages.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(), FcfsPolicy())
    info = EngineInfo(
        model="fake", vocab_size=50000, max_model_len=256, eos_token_ids=(0,), num_blocks=64,
        block_size=BLOCK, dtype="float32", device="cpu", kv_cache_bytes=0,
        enable_prefix_caching=True,
    )  # fmt: skip
    scheduler.set_engine_info(info)
    prompt = prompts()[4]
    data = np.zeros((2, 2, 4, BLOCK, 2, 16), dtype=np.float32)
    moved = KvBlocks("r", prompt[: 4 * BLOCK], BLOCK, "float32", data)
    scheduler.add_request(EngineRequest("r", prompt, GREEDY, kv_blocks=moved))
    step = scheduler.schedule()
    assert step is not None
    (sent,) = step.new_requests
    assert sent.kv_blocks is moved
    held = [state.request for state in scheduler._running.values()]
    assert [r.request_id for r in held] == ["r"] and held[0].kv_blocks is None


def test_each_tensor_parallel_rank_of_a_decode_engine_keeps_its_heads(
    tiny_model_dir: Path,
) -> None:
    """At TP=2 (the tiny Llama's two KV heads, one per rank): rank 0 imports the moved blocks
    (both heads) keeping head 0, and the step's ShardStep (one of no rows here: the step
    computes nothing), over the real codec, gives rank 1 the blocks and where they went; it
    keeps head 1. Together the ranks' caches hold exactly the moved K/V."""
    from stages.execute.allocator import BlockAllocator
    from stages.execute.attention import KVCache
    from stages.execute.kv_blocks import import_prompt_blocks, import_rank_blocks, with_moved_blocks
    from stages.execute.rank_messages import ShardStep

    prompt = prompts()[4]
    (moved,) = exported(tiny_model_dir, [EngineRequest("r", prompt, GREEDY)])
    assert moved.data.shape[4] == 2 and moved.num_blocks == 4

    def rank_cache() -> KVCache:
        return KVCache.allocate(
            num_layers=2, num_blocks=16, block_size=BLOCK, num_kv_heads=1, head_dim=16,
            dtype=torch.float32, device=torch.device("cpu"),
        )  # fmt: skip

    caches = [rank_cache(), rank_cache()]
    allocator = BlockAllocator(16, BLOCK)  # rank 0's: the one bookkeeping
    written: list[Any] = []
    assert import_prompt_blocks(caches[0], allocator, moved, prompt, b"", (0, 2), written) == 4
    shard = with_moved_blocks(None, 7, written, [])
    assert shard is not None and len(shard.token_ids) == 0 and shard.kv_export_blocks is None
    codec = Codec()
    payload, buffers = codec.encode(shard)
    received = codec.decode(payload, [bytes(buffer) for buffer in buffers])
    assert isinstance(received, ShardStep)
    import_rank_blocks(caches[1], received, (1, 2))
    ((ids, _),) = written
    assert received.kv_import_blocks is not None and received.kv_import_blocks.tolist() == list(ids)
    for rank, cache in enumerate(caches):
        for side, sides in enumerate((cache.key, cache.value)):
            for layer, slots in enumerate(sides):
                held = slots.view(-1, BLOCK, 1, 16)[list(ids)]
                assert torch.equal(
                    held, torch.from_numpy(moved.data[side, layer, :, :, rank : rank + 1])
                )
    # nothing moved in and nothing to export: the step's shard is unchanged
    assert with_moved_blocks(None, 8, [], []) is None
