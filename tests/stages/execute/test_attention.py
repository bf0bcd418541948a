"""Tests of stages/execute/attention.py: packed paged attention against HF's own attention."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stages.execute.attention import (
    ATTENTION_NAME,
    AUTO_GROUP_MAX_KEYS,
    KVCache,
    UnsupportedModelError,
    build_step_metadata,
    check_model_config,
    enable_paged_attention,
    forward_context,
    gather_blocks,
    key_padding_mask,
    paged_attention_forward,
    plan_decode_groups,
)
from tests.conftest import TINY_LLAMA

BLOCK = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(reference with HF's attention, a deep copy switched to paged attention)."""
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    paged = copy.deepcopy(reference)
    enable_paged_attention(paged)
    return reference, paged


def tiny_config() -> LlamaConfig:
    return LlamaConfig(**TINY_LLAMA)  # type: ignore[arg-type]


def new_cache() -> KVCache:
    return KVCache.allocate(
        num_layers=int(TINY_LLAMA["num_hidden_layers"]),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        num_kv_heads=int(TINY_LLAMA["num_key_value_heads"]),
        head_dim=int(TINY_LLAMA["head_dim"]),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_deep_copied_config_keeps_the_reference_on_its_own_attention(
    models: tuple[LlamaForCausalLM, LlamaForCausalLM],
) -> None:
    reference, paged = models
    assert paged.config._attn_implementation == ATTENTION_NAME
    assert reference.config._attn_implementation != ATTENTION_NAME


@pytest.mark.parametrize("decode_mode", ["padded", "per_sequence", "grouped", "native"])
def test_packed_steps_match_per_sequence_reference(
    models: tuple[LlamaForCausalLM, LlamaForCausalLM], decode_mode: str
) -> None:
    """Three packed steps over four sequences (whole prefills, prefix chunks whose 4..11
    queries sit at the end of up to 20 keys, one-token starts, decodes of uneven lengths),
    every computed position's logits equal to HF's attention over the whole sequence."""
    reference, paged = models
    generator = torch.Generator().manual_seed(1)
    lengths = {"a": 12, "b": 8, "c": 2, "d": 21}
    sequences = {
        name: torch.randint(3, 40000, (length,), generator=generator).tolist()
        for name, length in lengths.items()
    }
    with torch.inference_mode():
        expected = {
            name: reference(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
            for name, tokens in sequences.items()
        }
    # Scattered, non-contiguous blocks so table lookups really matter.
    free_blocks = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    tables = {
        name: [free_blocks.pop() for _ in range(-(-length // BLOCK))]
        for name, length in lengths.items()
    }
    cache = new_cache()
    # (name, start, end) per step; decode rows (one token) first, ascending context.
    steps = [
        [("c", 0, 1), ("a", 0, 7), ("b", 0, 6), ("d", 0, 9)],
        [("b", 6, 7), ("a", 7, 11), ("d", 9, 20)],
        [("c", 1, 2), ("b", 7, 8), ("a", 11, 12), ("d", 20, 21)],
    ]
    for step in steps:
        num_decode = sum(1 for _, start, end in step if end - start == 1)
        metadata, positions = build_step_metadata(
            kv_cache=cache,
            block_tables=[tables[name] for name, _, _ in step],
            query_starts=[start for _, start, _ in step],
            query_lens=[end - start for _, start, end in step],
            num_decode=num_decode,
            decode_mode=decode_mode,  # type: ignore[arg-type]
            max_model_len=1024,
            device=torch.device("cpu"),
        )
        input_ids = [token for name, start, end in step for token in sequences[name][start:end]]
        expected_positions = [p for _, start, end in step for p in range(start, end)]
        assert positions.tolist() == expected_positions
        with torch.inference_mode(), forward_context(metadata):
            logits = paged(
                input_ids=torch.tensor([input_ids]),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
            ).logits[0]
        assert metadata.calls == TINY_LLAMA["num_hidden_layers"]
        row = 0
        for name, start, end in step:
            error = (logits[row : row + end - start] - expected[name][start:end]).abs().max()
            assert error < 1e-4, f"sequence {name} positions {start}..{end - 1}: error {error}"
            row += end - start


def test_logits_to_keep_index_tensor_selects_rows(
    models: tuple[LlamaForCausalLM, LlamaForCausalLM],
) -> None:
    _, paged = models
    cache = new_cache()
    metadata, positions = build_step_metadata(
        kv_cache=cache,
        block_tables=[[1, 2], [3]],
        query_starts=[0, 0],
        query_lens=[5, 3],
        num_decode=0,
        decode_mode="grouped",
        max_model_len=1024,
        device=torch.device("cpu"),
    )
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.inference_mode(), forward_context(metadata):
        full = paged(input_ids=input_ids, position_ids=positions[None], use_cache=False).logits
    with torch.inference_mode(), forward_context(metadata):
        kept = paged(
            input_ids=input_ids,
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=torch.tensor([7, 4]),
        ).logits
    torch.testing.assert_close(kept[0], full[0, [7, 4]])


def test_slot_mapping_writes_each_token_to_its_block() -> None:
    cache = new_cache()
    metadata, positions = build_step_metadata(
        kv_cache=cache,
        block_tables=[[9], [5, 7]],
        query_starts=[2, 3],
        query_lens=[1, 3],
        num_decode=1,
        decode_mode="padded",
        max_model_len=1024,
        device=torch.device("cpu"),
    )
    assert positions.tolist() == [2, 3, 4, 5]
    assert metadata.slot_mapping.tolist() == [
        9 * BLOCK + 2,
        5 * BLOCK + 3,
        7 * BLOCK,
        7 * BLOCK + 1,
    ]
    (group,) = metadata.decode_groups
    assert group.key_blocks.tolist() == [[9]] and group.key_len == 3
    assert group.key_mask is None  # one row: nothing to pad
    (prefill,) = metadata.prefills
    assert (prefill.query_start, prefill.query_end, prefill.context_len) == (1, 4, 6)
    assert prefill.key_blocks is not None and prefill.key_blocks.tolist() == [5, 7]
    assert prefill.causal_mask is not None
    # Lower-right: query 0 is position 3 and sees keys 0..3; the last sees all 6.
    assert prefill.causal_mask.tolist() == [
        [True, True, True, True, False, False],
        [True, True, True, True, True, False],
        [True, True, True, True, True, True],
    ]


def test_gather_blocks_and_padding_mask() -> None:
    cache = torch.arange(8 * BLOCK, dtype=torch.float32).view(8 * BLOCK, 1, 1)
    tables = torch.tensor([[3, 4], [6, 0]])
    gathered = gather_blocks(cache, tables, BLOCK)
    assert gathered.shape == (2, 2 * BLOCK, 1, 1)
    assert gathered[..., 0, 0].tolist() == [
        [12, 13, 14, 15, 16, 17, 18, 19],
        [24, 25, 26, 27, 0, 1, 2, 3],
    ]
    mask = key_padding_mask(torch.tensor([6, 2]), 2 * BLOCK)
    assert mask.shape == (2, 1, 1, 8)
    assert mask[:, 0, 0].sum(dim=1).tolist() == [6, 2]


def test_plan_decode_groups() -> None:
    assert plan_decode_groups([], "grouped") == []
    assert plan_decode_groups([5, 6, 7], "padded") == [(0, 3)]
    assert plan_decode_groups([5, 6, 7], "per_sequence") == [(0, 1), (1, 2), (2, 3)]
    # Similar lengths stay together; a much longer row starts a new group.
    assert plan_decode_groups([100, 110, 120, 1000], "grouped") == [(0, 3), (3, 4)]
    # The padded size of a group stays under the key budget.
    long_rows = [1500] * 32
    groups = plan_decode_groups(long_rows, "grouped")
    assert all((end - start) * 1500 <= AUTO_GROUP_MAX_KEYS for start, end in groups)
    assert groups[0][0] == 0 and groups[-1][1] == 32
    assert plan_decode_groups([20] * 64, "grouped") == [(0, 64)]


def test_build_step_metadata_validates() -> None:
    cache = new_cache()
    common: dict[str, Any] = dict(
        kv_cache=cache, decode_mode="grouped", max_model_len=64, device=torch.device("cpu")
    )
    with pytest.raises(ValueError, match="cannot hold"):
        build_step_metadata(
            block_tables=[[1]], query_starts=[0], query_lens=[5], num_decode=0, **common
        )
    with pytest.raises(ValueError, match="exactly one token"):
        build_step_metadata(
            block_tables=[[1]], query_starts=[0], query_lens=[2], num_decode=1, **common
        )
    with pytest.raises(ValueError, match="equal lengths"):
        build_step_metadata(
            block_tables=[[1]], query_starts=[0, 1], query_lens=[2], num_decode=0, **common
        )


def test_attention_outside_forward_context_fails(
    models: tuple[LlamaForCausalLM, LlamaForCausalLM],
) -> None:
    _, paged = models
    with pytest.raises(RuntimeError, match="forward_context"):
        paged(input_ids=torch.tensor([[1, 2]]), use_cache=False)


@pytest.mark.parametrize(
    ("kwargs", "feature"),
    [
        ({"softcap": 50.0}, "softcap"),
        ({"s_aux": torch.zeros(4)}, "s_aux"),
        ({"sliding_window": 4}, "sliding-window"),
    ],
)
def test_runtime_attention_features_are_refused(kwargs: dict[str, object], feature: str) -> None:
    cache = new_cache()
    metadata, _ = build_step_metadata(
        kv_cache=cache,
        block_tables=[[1]],
        query_starts=[0],
        query_lens=[2],
        num_decode=0,
        decode_mode="grouped",
        max_model_len=64,
        device=torch.device("cpu"),
    )
    module = types.SimpleNamespace(layer_idx=0)
    query, key = torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 2, 16)
    with forward_context(metadata), pytest.raises(UnsupportedModelError, match=feature):
        paged_attention_forward(module, query, key, key, None, **kwargs)  # type: ignore[arg-type]
    # A window at least max_model_len long is full attention: accepted.
    with forward_context(metadata):
        output, _ = paged_attention_forward(
            module,  # type: ignore[arg-type]
            query,
            key,
            key,
            None,
            sliding_window=64,
            softcap=None,
        )
    assert output.shape == (1, 2, 4, 16)


def config_of(**fields: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(model_type="test", max_position_embeddings=1024, **fields)


@pytest.mark.parametrize(
    ("fields", "feature"),
    [
        ({"sliding_window": 128}, "sliding-window"),
        ({"attn_logit_softcapping": 50.0}, "softcapping"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "non-full attention"),
        ({"kv_lora_rank": 512}, "latent attention"),
        ({"position_embedding_type": "alibi"}, "ALiBi"),
        ({"alibi": True}, "ALiBi"),
        ({"is_encoder_decoder": True}, "encoder-decoder"),
    ],
)
def test_unsupported_configs_are_refused(fields: dict[str, object], feature: str) -> None:
    with pytest.raises(UnsupportedModelError, match=feature):
        check_model_config(config_of(**fields))


def test_supported_configs_pass() -> None:
    check_model_config(tiny_config())
    # A sliding window switched off, or no shorter than the longest sequence, is full attention.
    check_model_config(config_of(sliding_window=128, use_sliding_window=False))
    check_model_config(config_of(sliding_window=4096), max_model_len=4096)
    check_model_config(config_of(layer_types=["full_attention"] * 2, attn_logit_softcapping=None))
