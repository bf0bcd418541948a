"""Tests of prefill attention in bf16 (stages/execute/attention.py, ``KVCache.bf16_prefill``):
against attention in float64 over the bf16-rounded query, keys and values, for a whole prompt,
a chunk over a prefix read back from the cache (the gather), a sliding window, GQA and
lengths that are not whole blocks; the soft-capped variant stays on fp32 eager attention; and
when the runner turns it on."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.execute.attention import (
    KVCache,
    build_step_metadata,
    forward_context,
    paged_attention_forward,
    prefill_in_bf16,
)
from stages.execute.bf16 import bf16_gemm_kernel
from stages.execute.config import ExecuteConfig
from stages.execute.runner import ModelRunner

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def new_cache(bf16_prefill: bool) -> KVCache:
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=32,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    cache.bf16_prefill = bf16_prefill
    return cache


def attend(
    cache: KVCache,
    table: list[int],
    start: int,
    query: torch.Tensor,  # [1, Hq, n, D]
    key: torch.Tensor,  # [1, Hkv, n, D]
    value: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """One prefill chunk of one sequence (positions [start, start + n)) through
    :func:`paged_attention_forward`: ``[n, Hq, D]``."""
    metadata, _ = build_step_metadata(
        kv_cache=cache,
        block_tables=[table],
        query_starts=[start],
        query_lens=[query.shape[2]],
        num_decode=0,
        decode_mode="grouped",
        max_model_len=256,
        device=torch.device("cpu"),
    )
    module = types.SimpleNamespace(layer_idx=0)
    with forward_context(metadata):
        output, _ = paged_attention_forward(
            module,  # type: ignore[arg-type]
            query,
            key,
            value,
            None,
            scaling=HEAD_DIM**-0.5,
            **kwargs,
        )
    return output[0]


def reference(
    query: torch.Tensor,  # [1, Hq, n, D]: the chunk's queries, the last n of L positions
    keys: torch.Tensor,  # [1, Hkv, L, D]: the whole context
    values: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    round_query: bool = True,
) -> torch.Tensor:
    """Attention in float64 over bf16-rounded keys and values (and query, where
    ``round_query``), lower-right causal, the last ``window`` positions only: ``[n, Hq, D]``."""
    group = HEADS // KV_HEADS
    q = (query.bfloat16() if round_query else query).double()[0]  # [Hq, n, D]
    k = keys.bfloat16().double()[0].repeat_interleave(group, 0)  # [Hq, L, D]
    v = values.bfloat16().double()[0].repeat_interleave(group, 0)
    count, length = q.shape[1], k.shape[1]
    scores = q @ k.transpose(1, 2) * HEAD_DIM**-0.5  # [Hq, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    position = torch.arange(count).unsqueeze(1) + length - count
    visible = torch.arange(length).unsqueeze(0) <= position
    if window is not None:
        visible &= torch.arange(length).unsqueeze(0) > position - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, Hq, D]


def random_chunk(
    generator: torch.Generator, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query = torch.randn(1, HEADS, length, HEAD_DIM, generator=generator) * 2
    key = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator) * 2
    value = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator)
    return query, key, value


def is_bf16(tensor: torch.Tensor) -> bool:
    """Whether every element is a bf16 value (the output of attention computed in bf16)."""
    return bool(torch.equal(tensor.bfloat16().float(), tensor))


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window"])
@pytest.mark.parametrize("prefix", [0, 13], ids=["whole-prompt", "prefix-cached"])
def test_bf16_prefill_matches_float64_attention(window: int | None, prefix: int) -> None:
    """A chunk of 19 tokens (not whole blocks) after ``prefix`` tokens already in the cache
    (read back through its block table: the gather), GQA 8/2: bf16 attention is within bf16
    rounding of float64 attention over the rounded operands, its output bf16 values; the fp32
    path (``bf16_prefill`` off, as fp32 models have it) attends the fp32 query to float noise."""
    generator = torch.Generator().manual_seed(prefix + (window or 0))
    table = [5, 2, 9, 11, 3, 17, 8, 20]  # shuffled, as an allocator hands blocks out
    context = random_chunk(generator, prefix + 19)
    kwargs: dict[str, Any] = {"sliding_window": window} if window is not None else {}
    outputs = {}
    for bf16 in (True, False):
        cache = new_cache(bf16)
        if prefix:  # the prefix's keys and values written by an earlier step
            attend(cache, table, 0, *(t[:, :, :prefix] for t in context), **kwargs)
        outputs[bf16] = attend(cache, table, prefix, *(t[:, :, prefix:] for t in context), **kwargs)
    query = context[0][:, :, prefix:]
    expected = reference(query, context[1], context[2], window)
    torch.testing.assert_close(outputs[True].double(), expected, atol=1e-2, rtol=1e-2)
    assert is_bf16(outputs[True])
    fp32 = reference(query, context[1], context[2], window, round_query=False)
    torch.testing.assert_close(outputs[False].double(), fp32, atol=1e-5, rtol=1e-4)
    assert not is_bf16(outputs[False])


def test_soft_capped_prefill_stays_fp32() -> None:
    """Variants that need eager attention (a soft cap here) keep fp32 eager attention over
    the widened cache even where bf16 prefill is on."""
    generator = torch.Generator().manual_seed(3)
    chunk = random_chunk(generator, 10)
    output = attend(new_cache(True), [4, 6, 1], 0, *chunk, softcap=2.0)
    expected = reference(*chunk, softcap=2.0, round_query=False)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-4)


def test_prefill_in_bf16_only_for_native_bf16_weights_over_a_bf16_cache() -> None:
    cpu, bf16, fp32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert prefill_in_bf16(kv_dtype=bf16, activations=fp32, device=cpu, native_bf16=True)
    # fp32 weights (even over a bf16 cache), an fp32 cache, no AVX512-BF16, bf16 activations:
    assert not prefill_in_bf16(kv_dtype=bf16, activations=fp32, device=cpu, native_bf16=False)
    assert not prefill_in_bf16(kv_dtype=fp32, activations=fp32, device=cpu, native_bf16=True)
    assert not prefill_in_bf16(kv_dtype=bf16, activations=bf16, device=cpu, native_bf16=True)
    cuda = torch.device("cuda")
    assert not prefill_in_bf16(kv_dtype=bf16, activations=fp32, device=cuda, native_bf16=True)


@pytest.mark.slow
def test_runner_turns_bf16_prefill_on_for_native_bf16_weights(tiny_model_dir: Path) -> None:
    """dtype bfloat16 with the bf16 cache: on where the bf16 GEMM multiplies natively
    (AVX512-BF16), else off; an fp32 cache under bf16 weights and fp32 models: off."""
    kernel = bf16_gemm_kernel()
    native = kernel is not None and kernel.native
    cases: tuple[tuple[dict[str, Any], bool], ...] = (
        ({"dtype": "bfloat16"}, native),
        ({"dtype": "bfloat16", "kv_cache_dtype": "float32"}, False),
        ({"kv_cache_dtype": "bfloat16"}, False),
    )
    for fields, expected in cases:
        runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), num_blocks=16, **fields))
        runner.load()
        assert runner.kv_cache is not None
        assert runner.kv_cache.bf16_prefill is expected, fields
