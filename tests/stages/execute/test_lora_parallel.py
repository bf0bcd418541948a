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


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    """One adapter on every projection, one on k/o/up only (half the fused gate/up delta
    zero)."""
    root = tmp_path_factory.mktemp("lora-parallel")
    a1 = make_adapter(tiny_model_dir, root / "a1", seed=31)
    a2 = make_adapter(
        tiny_model_dir, root / "a2", seed=32, rank=4, targets=("k_proj", "o_proj", "up_proj")
    )
    return [LoRARequest("a1", 1, str(a1)), LoRARequest("a2", 2, str(a2))]


def generate_mixed(
    model_dir: Path, adapters: list[LoRARequest], **options: object
) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Each prompt as the base model and under each adapter, all in one batch."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(3)]
    loras: list[LoRARequest | None] = [None, *adapters] * len(PROMPTS)
    with LLM(str(model_dir), enable_lora=True, max_loras=2, num_blocks=64, **options) as llm:
        results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    return [list(result.token_ids) for result in results], loras


def check_as_merged_hf(
    model_dir: Path, outputs: list[list[int]], loras: list[LoRARequest | None]
) -> None:
    references = {None: HFReference(model_dir)}
    for lora in loras:
        if lora is not None:
            references[lora.lora_name] = HFReference(Path(f"{lora.lora_path}-merged"))
    for index, (got, lora) in enumerate(zip(outputs, loras, strict=True)):
        name = lora.lora_name if lora is not None else None
        assert got == references[name].greedy(PROMPTS[index // 3], 12), name
    assert outputs[1] != outputs[0] and outputs[2] != outputs[0]


@pytest.mark.slow
def test_tp2_with_adapters_gives_the_greedy_tokens_of_tp1(
    tiny_model_dir: Path, adapters: list[LoRARequest]
) -> None:
    """Base requests and requests of two adapters in one batch: TP=2 (gloo, a rank
    process) as TP=1, as HF with each adapter merged."""
    expected, loras = generate_mixed(tiny_model_dir, adapters)
    got, _ = generate_mixed(tiny_model_dir, adapters, tensor_parallel_size=2)
    assert got == expected
    check_as_merged_hf(tiny_model_dir, got, loras)


@pytest.mark.slow
def test_dp2_serves_two_adapters_on_both_replicas(
    tiny_model_dir: Path, adapters: list[LoRARequest]
) -> None:
    """Two replicas behind the router, each loading an adapter when a request of it first
    comes: base and two adapters mixed, each as HF merged."""
    got, loras = generate_mixed(tiny_model_dir, adapters, data_parallel_size=2)
    check_as_merged_hf(tiny_model_dir, got, loras)
