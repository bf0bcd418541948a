"""Tests of stages/execute/attention.py: packed paged attention against HF's own attention,
for plain causal attention (Llama) and its variants (stages/execute/variants.py): a sliding
window with soft-capped logits and the model's own scaling (Gemma 2), a sliding window with
attention sinks (gpt-oss)."""

from __future__ import annotations

import copy
import gc
import platform
import sys
import threading
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


# Windows shorter than the test's sequences (2..21 tokens), so they exclude keys.
WINDOW = 5
VARIANT_FIELDS: dict[str, dict[str, Any]] = {
    "mistral": dict(head_dim=16, sliding_window=WINDOW),  # every layer windowed
    "gemma2": dict(
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=2.0,  # low enough to cap most scores of this random model
        query_pre_attn_scalar=24,
    ),
    "gpt_oss": dict(
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=2,
        num_experts_per_tok=1,
    ),
}


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(reference with HF's attention, a deep copy switched to paged attention)."""
    return reference_and_paged("llama")


def reference_and_paged(family: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        reference = LlamaForCausalLM(tiny_config()).eval()
    else:
        fields = {key: value for key, value in TINY_LLAMA.items() if key != "head_dim"}
        config = AutoConfig.for_model(family, **{**fields, **VARIANT_FIELDS[family]})
        reference = AutoModelForCausalLM.from_config(config).eval()
        if family == "gpt_oss":  # sinks big enough to matter (they init near 0)
            for layer in reference.model.layers:
                torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
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


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2", "gpt_oss"])
def family_models(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    return reference_and_paged(request.param)


def test_deep_copied_config_keeps_the_reference_on_its_own_attention(
    models: tuple[LlamaForCausalLM, LlamaForCausalLM],
) -> None:
    reference, paged = models
    assert paged.config._attn_implementation == ATTENTION_NAME
    assert reference.config._attn_implementation != ATTENTION_NAME


@pytest.mark.parametrize("decode_mode", ["padded", "per_sequence", "grouped", "native"])
def test_packed_steps_match_per_sequence_reference(
    family_models: tuple[Any, Any], decode_mode: str
) -> None:
    """Three packed steps over four sequences (whole prefills, prefix chunks whose 4..11
    queries sit at the end of up to 20 keys, one-token starts, decodes of uneven lengths),
    every computed position's logits equal to HF's attention over the whole sequence, for
    every variant (windows of 5 keys, capped logits, sinks)."""
    reference, paged = family_models
    generator = torch.Generator().manual_seed(1)
    lengths = {"a": 12, "b": 8, "c": 2, "d": 21}
    sequences = {
        name: torch.randint(3, 40000, (length,), generator=generator).tolist()
        for name, length in lengths.items()
    }
    # The tables' first blocks are never read past a window: block 0 there, as the
    # allocator leaves a request's blocks behind its window once they are freed.
    windowed = getattr(reference.config, "sliding_window", None) is not None
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
    if windowed:  # a freed block's keys, if not masked, would show in the logits
        for layer in range(len(cache.key)):
            cache.key[layer][:BLOCK] = 30.0
            cache.value[layer][:BLOCK] = 1e4
    # (name, start, end) per step; decode rows (one token) first, ascending context.
    steps = [
        [("c", 0, 1), ("a", 0, 7), ("b", 0, 6), ("d", 0, 9)],
        [("b", 6, 7), ("a", 7, 11), ("d", 9, 20)],
        [("c", 1, 2), ("b", 7, 8), ("a", 11, 12), ("d", 20, 21)],
    ]
    for step in steps:
        if windowed and not getattr(reference.config, "layer_types", None):
            for name, start, _ in step:  # free what lies wholly behind every window
                for index in range(max(0, start - WINDOW + 1) // BLOCK):
                    tables[name][index] = 0
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


@pytest.mark.parametrize("decode_mode", ["grouped", "native"])
def test_a_decode_only_step_has_the_slots_and_groups_of_the_general_path(decode_mode: str) -> None:
    """A step of only decode rows takes a shortcut to its positions and slots; they are the
    ones the general path computes for the same rows with a prefill chunk after them."""
    cache = new_cache()
    tables = [[4], [9, 2], [6, 3, 8]]
    starts = [
        BLOCK // 2,
        BLOCK,
        2 * BLOCK + 1,
    ]  # a block's middle, a block's first slot, a third block

    def build(rows: int, with_prefill: bool) -> tuple[Any, torch.Tensor]:
        return build_step_metadata(
            kv_cache=cache,
            block_tables=tables[:rows] + ([[5]] if with_prefill else []),
            query_starts=starts[:rows] + ([0] if with_prefill else []),
            query_lens=[1] * rows + ([3] if with_prefill else []),
            num_decode=rows,
            decode_mode=decode_mode,  # type: ignore[arg-type]
            max_model_len=1024,
            device=torch.device("cpu"),
        )

    for rows in (1, 3):
        fast, fast_positions = build(rows, with_prefill=False)
        general, general_positions = build(rows, with_prefill=True)
        assert fast_positions.tolist() == general_positions[:rows].tolist() == starts[:rows]
        assert fast.slot_mapping.tolist() == general.slot_mapping[:rows].tolist()
        assert fast.slot_mapping.tolist() == [
            table[start // BLOCK] * BLOCK + start % BLOCK
            for table, start in zip(tables[:rows], starts[:rows], strict=True)
        ]
        assert fast.slot_mapping.dtype == fast_positions.dtype == torch.long
        assert len(fast.decode_groups) == len(general.decode_groups)
        for one, other in zip(fast.decode_groups, general.decode_groups, strict=True):
            assert (one.start, one.end, one.key_len) == (other.start, other.end, other.key_len)
            assert one.key_blocks.tolist() == other.key_blocks.tolist()
        assert not fast.prefills


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
        ({"attention_chunk_size": 8}, "attention_chunk_size"),
        ({"position_bias": torch.zeros(1)}, "position_bias"),
        ({"sliding_window": 0}, "sliding_window must be"),
        ({"softcap": -1.0}, "softcap must be"),
        ({"s_aux": torch.zeros(4, 2)}, "one logit per query head"),
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
    # A window at least max_model_len long is full attention; softcap 0 is no capping.
    with forward_context(metadata):
        output, _ = paged_attention_forward(
            module,  # type: ignore[arg-type]
            query,
            key,
            key,
            None,
            sliding_window=64,
            softcap=0.0,
        )
    assert output.shape == (1, 2, 4, 16)


def config_of(**fields: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(model_type="test", max_position_embeddings=1024, **fields)


@pytest.mark.parametrize(
    ("fields", "feature"),
    [
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"layer_types": ["linear_attention", "full_attention"]}, "other than full"),
        ({"attention_chunk_size": 8192}, "chunked attention"),
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
    # Sliding windows, soft-capped logits and mixed layer types are served.
    check_model_config(config_of(sliding_window=128))
    check_model_config(config_of(attn_logit_softcapping=50.0))
    check_model_config(config_of(layer_types=["full_attention", "sliding_attention"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_cache_is_zeros_in_one_lazily_mapped_buffer(dtype: torch.dtype) -> None:
    """Every layer's keys and values are contiguous, disjoint views of one zeroed buffer
    (an anonymous mapping, which outlives the function that made it)."""
    cache = KVCache.allocate(
        num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8,
        dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    gc.collect()
    tensors = [*cache.key, *cache.value]
    assert all(t.shape == (20, 2, 8) and t.is_contiguous() for t in tensors)
    assert all(float(t.abs().sum()) == 0.0 for t in tensors)
    cache.key[1].fill_(1.0)
    assert float(cache.key[0].abs().sum()) == 0.0 and float(cache.value[1].abs().sum()) == 0.0
    assert cache.nbytes == 2 * 3 * 20 * 2 * 8 * cache.key[0].element_size()
    assert all(t.dtype == dtype for t in tensors)


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1])


def _kernel_at_least(major: int, minor: int) -> bool:
    release = platform.release().split("-")[0].split(".")
    return sys.platform == "linux" and (int(release[0]), int(release[1])) >= (major, minor)


@pytest.mark.skipif(not _kernel_at_least(5, 14), reason="MADV_POPULATE_WRITE is Linux 5.14+")
def test_prefault_makes_the_cpu_cache_resident_and_keeps_what_was_written() -> None:
    """Allocation maps nothing in; prefault() faults every page in on its thread, once, and
    leaves the contents as they were (what the first step wrote stays, the rest reads 0)."""
    cache = KVCache.allocate(
        num_layers=4, num_blocks=1024, block_size=16, num_kv_heads=2, head_dim=64,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    size_kib = cache.nbytes // 1024  # 64 MiB
    before = _resident_kib()
    cache.key[2][5].fill_(3.0)
    cache.prefault()
    cache.prefault()  # a second call starts nothing
    for thread in threading.enumerate():
        if thread.name == "actorline-prefault":
            thread.join(timeout=60)
    assert cache.unfaulted is None
    assert _resident_kib() - before >= 0.9 * size_kib
    assert float(cache.key[2][5].sum()) == 3.0 * 2 * 64
    assert float(cache.key[2].abs().sum()) == 3.0 * 2 * 64
    assert float(cache.value[3].abs().sum()) == 0.0
