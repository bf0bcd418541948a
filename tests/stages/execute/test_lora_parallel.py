"""LoRA adapters under tensor parallelism (stages/execute/lora_shard.py, docs/lora.md): each
rank's share of an adapter adds up to the whole delta (B's rows on column-parallel
projections, A's columns on row-parallel ones, the partial sums riding the base linear's
all-reduce); a TP=2 engine (gloo, rank processes) gives the greedy tokens of TP=1 on a mixed
batch of base and adapter requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import LLM, LoRARequest, SamplingParams
from stages.execute.lora_shard import (
    LoRAShard,
    full_shape,
    shard_lora_fields,
    shard_weights,
)
from stages.execute.rank_messages import ShardStep
from tests.stages.execute.driving import HFReference
from tests.stages.execute.lora_adapters import make_adapter
from transports.codec import Codec

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[101, 2045, 3077, 517, 9000], [12, 77, 4242, 31, 5, 8, 19, 4000, 222, 7, 7, 8]]
STYLES = {"q_proj": "colwise", "o_proj": "rowwise", "gate_proj": "colwise"}


def test_rank_shares_add_up_to_the_whole_delta() -> None:
    """Column-parallel: the ranks' deltas are the whole delta's column slices, in rank order;
    row-parallel: over the matching input slices they are partial sums of it."""
    generator = torch.Generator().manual_seed(0)
    a_col, b_col = torch.randn(4, 16, generator=generator), torch.randn(12, 4, generator=generator)
    a_row, b_row = torch.randn(4, 12, generator=generator), torch.randn(16, 4, generator=generator)
    x_col, x_row = torch.randn(3, 16, generator=generator), torch.randn(3, 12, generator=generator)
    whole = {(0, "q_proj"): (a_col, b_col), (0, "o_proj"): (a_row, b_row)}
    shares = [shard_weights(LoRAShard(rank, 2, STYLES), whole) for rank in range(2)]
    column = torch.cat([x_col @ s[0, "q_proj"][0].t() @ s[0, "q_proj"][1].t() for s in shares], 1)
    torch.testing.assert_close(column, x_col @ a_col.t() @ b_col.t())
    row = sum(
        x_row[:, rank * 6 : (rank + 1) * 6] @ s[0, "o_proj"][0].t() @ s[0, "o_proj"][1].t()
        for rank, s in enumerate(shares)
    )
    torch.testing.assert_close(row, x_row @ a_row.t() @ b_row.t())
    assert shard_weights(None, whole) == whole
    # an adapter's files are checked against the whole model's shapes
    shard = LoRAShard(1, 2, STYLES)
    assert full_shape(shard, "q_proj", 16, 6) == (16, 12)
    assert full_shape(shard, "o_proj", 6, 16) == (12, 16)
    assert full_shape(shard, "gate_up", 16, 8) == (16, 16)
    assert full_shape(None, "o_proj", 6, 16) == (6, 16)


def test_shard_step_names_each_row_groups_adapter_on_the_wire() -> None:
    a1, a2 = LoRARequest("a1", 1, "/a1"), LoRARequest("a2", 2, "/a2")
    fields = shard_lora_fields([None, a2, a1, a2])
    assert fields == {"lora_adapters": (a2, a1), "lora_index": (-1, 0, 1, 0)}
    assert shard_lora_fields([None, None]) == {}
    step = ShardStep(
        step_id=3,
        token_ids=np.arange(4, dtype=np.int64),
        query_starts=np.zeros(4, dtype=np.int64),
        query_lens=np.ones(4, dtype=np.int64),
        num_decode=4,
        block_tables=np.zeros((4, 1), dtype=np.int64),
        **fields,
    )
    codec = Codec()
    payload, buffers = codec.encode(step)
    decoded = codec.decode(payload, buffers)
    assert decoded.lora_adapters == (a2, a1) and decoded.lora_index == (-1, 0, 1, 0)


@pytest.mark.slow
def test_tp2_with_adapters_gives_the_greedy_tokens_of_tp1(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Base requests and requests of two adapters (one on every projection, one on k/o/up
    only: half the fused gate/up delta zero) in one batch: TP=2 as TP=1, as HF merged."""
    a1 = LoRARequest("a1", 1, str(make_adapter(tiny_model_dir, tmp_path / "a1", seed=31)))
    path = make_adapter(
        tiny_model_dir, tmp_path / "a2", seed=32, rank=4, targets=("k_proj", "o_proj", "up_proj")
    )
    a2 = LoRARequest("a2", 2, str(path))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(3)]
    loras = [None, a1, a2] * len(PROMPTS)
    outputs = {}
    for size in (1, 2):
        with LLM(
            str(tiny_model_dir),
            enable_lora=True,
            max_loras=2,
            num_blocks=64,
            tensor_parallel_size=size,
        ) as llm:
            results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
            outputs[size] = [list(result.token_ids) for result in results]
    assert outputs[2] == outputs[1]
    references = {
        None: HFReference(tiny_model_dir),
        "a1": HFReference(Path(f"{a1.lora_path}-merged")),
        "a2": HFReference(Path(f"{a2.lora_path}-merged")),
    }
    for prompt, lora, got in zip(prompts, loras, outputs[2], strict=True):
        name = lora.lora_name if lora is not None else None
        assert got == references[name].greedy(prompt["prompt_token_ids"], 12), name
    assert outputs[2][1] != outputs[2][0] and outputs[2][2] != outputs[2][0]
