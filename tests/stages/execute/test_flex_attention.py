"""stages/execute/flex.py against gather + SDPA on random paged caches: decode batches and
prefill chunks over a cached prefix, ragged lengths, shuffled block tables, GQA, sliding
windows, soft-capped scores and sinks. The eager FlexAttention applies the mask to every
slot; the compiled kernel (slow: inductor builds it) and the dense view of the block mask
check that the block lists cover every visible key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages.execute.attention import gather_blocks
from stages.execute.flex import FLEX_Q_BLOCK, FlexRows, flex_available, flex_paged_attention
from stages.execute.variants import causal_window_mask, eager_attention

pytestmark = pytest.mark.skipif(not flex_available(), reason="torch without FlexAttention")

BLOCK = 4
NUM_BLOCKS = 48  # the reserved block 0 included
HQ, HKV, D = 6, 2, 16
CUDA_BLOCK = 16  # flex on CUDA tiles by cache block: at least 16 keys


def paged_cache(
    lengths: list[int], device: str = "cpu", seed: int = 0, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """A random cache and one block table per length, blocks drawn in shuffled order (block
    0 never: it is the reserved padding block)."""
    generator = torch.Generator().manual_seed(seed)
    slots = NUM_BLOCKS * block
    key = torch.randn(slots, HKV, D, generator=generator).to(device)
    value = torch.randn(slots, HKV, D, generator=generator).to(device)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    tables = []
    for length in lengths:
        count = -(-length // block)
        tables.append([free.pop() for _ in range(count)])
    return key, value, tables


def padded(tables: list[list[int]], device: str = "cpu") -> torch.Tensor:
    width = max(len(table) for table in tables)
    return torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], device=device)


def reference(
    query: torch.Tensor,  # [Hq, n, D]
    key: torch.Tensor,
    value: torch.Tensor,
    table: list[int],
    first_query: int,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    block: int = BLOCK,
) -> torch.Tensor:
    """Gather + SDPA (eager attention for capped scores and sinks) for one sequence."""
    count = query.shape[1]
    context = first_query + count
    blocks = torch.tensor(table, device=key.device)
    keys = gather_blocks(key, blocks, block)[:context].transpose(0, 1)  # [Hkv, L, D]
    values = gather_blocks(value, blocks, block)[:context].transpose(0, 1)
    mask = causal_window_mask(count, first_query, context, 0, window, key.device)
    group = HQ // HKV
    scale = D**-0.5
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            query.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )[0]
    attended = eager_attention(
        query.reshape(HKV, group, count, D),
        keys.unsqueeze(1),
        values.unsqueeze(1),
        mask,
        scale,
        softcap,
        sinks.reshape(HKV, group, 1, 1) if sinks is not None else None,
    )
    return attended.reshape(HQ, count, D)


VARIANTS = {
    "plain": (None, None, False),
    "window": (6, None, False),
    "softcap": (None, 5.0, False),
    "sinks": (None, None, True),
    "window+softcap+sinks": (5, 3.0, True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_matches_gather_sdpa(variant: str) -> None:
    window, softcap, with_sinks = VARIANTS[variant]
    lengths = [1, 3, 4, 9, 17, 30]  # ragged, one exactly a block, one a single key
    key, value, tables = paged_cache(lengths)
    query = torch.randn(len(lengths), HQ, 1, D, generator=torch.Generator().manual_seed(1))
    sinks = torch.randn(HQ) if with_sinks else None
    rows = FlexRows.build(
        padded(tables),
        torch.tensor(lengths) - 1,
        1,
        block_size=BLOCK,
        num_slots=key.shape[0],
        compiled=False,
    )
    output = flex_paged_attention(
        query, key, value, rows, scale=D**-0.5, window=window, softcap=softcap, sinks=sinks
    )
    for row, (length, table) in enumerate(zip(lengths, tables, strict=True)):
        expected = reference(query[row], key, value, table, length - 1, window, softcap, sinks)
        torch.testing.assert_close(output[row], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(("prefix", "count"), [(8, 5), (13, 20), (0, 7)])
def test_prefill_chunk_over_a_cached_prefix_matches(variant: str, prefix: int, count: int) -> None:
    window, softcap, with_sinks = VARIANTS[variant]
    key, value, tables = paged_cache([prefix + count], seed=prefix + count)
    query = torch.randn(1, HQ, count, D, generator=torch.Generator().manual_seed(2))
    sinks = torch.randn(HQ) if with_sinks else None
    rows = FlexRows.build(
        padded(tables),
        torch.tensor([prefix]),
        count,
        block_size=BLOCK,
        num_slots=key.shape[0],
        compiled=False,
    )
    output = flex_paged_attention(
        query, key, value, rows, scale=D**-0.5, window=window, softcap=softcap, sinks=sinks
    )
    expected = reference(query[0], key, value, tables[0], prefix, window, softcap, sinks)
    torch.testing.assert_close(output[0], expected, atol=2e-5, rtol=2e-5)


def test_blocks_shared_by_rows_and_freed_behind_a_window() -> None:
    """Prefix caching shares a block between rows; a windowed row's table holds block 0
    where blocks behind the window were freed (its stale slots must never be read)."""
    key, value, tables = paged_cache([12, 12, 22])
    tables[1][:2] = tables[0][:2]  # two rows share their first 8 tokens' blocks
    tables[2][:3] = [0, 0, 0]  # freed behind a window of 8 (positions 0..11)
    key[:BLOCK] = 1e4  # the reserved block holds garbage
    query = torch.randn(3, HQ, 1, D, generator=torch.Generator().manual_seed(3))
    rows = FlexRows.build(
        padded(tables),
        torch.tensor([11, 11, 21]),
        1,
        block_size=BLOCK,
        num_slots=key.shape[0],
        compiled=False,
    )
    output = flex_paged_attention(query, key, value, rows, scale=D**-0.5, window=8)
    for row, (start, table) in enumerate(zip((11, 11, 21), tables, strict=True)):
        expected = reference(query[row], key, value, table, start, 8, None, None)
        torch.testing.assert_close(output[row], expected, atol=2e-5, rtol=2e-5)


def test_a_padding_row_that_sees_no_key_gives_zeros() -> None:
    """A CUDA graph's padding rows: all-zero tables; they read nothing and stay finite."""
    key, value, tables = paged_cache([5])
    query = torch.randn(2, HQ, 1, D)
    rows = FlexRows.build(
        torch.tensor([tables[0], [0, 0]]),
        torch.tensor([4, 0]),
        1,
        block_size=BLOCK,
        num_slots=key.shape[0],
        compiled=False,
    )
    output = flex_paged_attention(query, key, value, rows, scale=D**-0.5, sinks=torch.zeros(HQ))
    assert torch.isfinite(output).all() and output[1].abs().max() == 0


@pytest.mark.parametrize("window", [None, 6])
def test_block_lists_cover_every_visible_key(window: int | None) -> None:
    """The compiled kernels visit only the listed blocks: every (query tile, block) pair the
    exact mask leaves a key visible in must be listed."""
    lengths_and_counts = [(7, 1), (30, 1), (5, 20)]
    for first_query, count in lengths_and_counts:
        key, _, tables = paged_cache([first_query + count])
        rows = FlexRows.build(
            padded(tables),
            torch.tensor([first_query]),
            count,
            block_size=BLOCK,
            num_slots=key.shape[0],
            compiled=False,
        )
        mask = rows.block_mask(window)
        listed = mask.to_dense()[0, 0].bool()  # [tiles, blocks]
        slots = torch.arange(key.shape[0])
        queries = torch.arange(count)
        visible = mask.mask_mod(
            torch.zeros((), dtype=torch.long),
            torch.zeros((), dtype=torch.long),
            queries[:, None],
            slots[None, :],
        )  # [count, slots]
        for tile in range(-(-count // FLEX_Q_BLOCK)):
            rows_of_tile = visible[tile * FLEX_Q_BLOCK : (tile + 1) * FLEX_Q_BLOCK]
            needed = rows_of_tile.any(0).view(-1, BLOCK).any(1)  # [blocks]
            assert not (needed & ~listed[tile]).any(), (first_query, count, tile)
            # and nothing beyond the window's first block is listed needlessly
            assert listed[tile].sum() <= len(tables[0])


@pytest.mark.slow
def test_compiled_kernel_on_cpu_matches_gather_sdpa() -> None:
    """The fused kernel inductor builds (C++ on CPU, Triton on CUDA), which skips unlisted
    blocks: a decode batch and a prefill chunk of two query tiles over a cached prefix (its
    compile dynamic, the second shape), with a window and capped scores. Inductor's CPU
    kernel returns no log-sum-exp, so sinks are checked eagerly here and compiled on CUDA."""
    lengths = [2, 9, 17, 30]
    key, value, tables = paged_cache(lengths)
    query = torch.randn(len(lengths), HQ, 1, D, generator=torch.Generator().manual_seed(4))
    rows = FlexRows.build(
        padded(tables),
        torch.tensor(lengths) - 1,
        1,
        block_size=BLOCK,
        num_slots=key.shape[0],
        compiled=True,
    )
    output = flex_paged_attention(query, key, value, rows, scale=D**-0.5, window=7, softcap=4.0)
    for row, (length, table) in enumerate(zip(lengths, tables, strict=True)):
        expected = reference(query[row], key, value, table, length - 1, 7, 4.0, None)
        torch.testing.assert_close(output[row], expected, atol=1e-4, rtol=1e-4)
    prefix, count = 13, 20
    key, value, tables = paged_cache([prefix + count], seed=5)
    query = torch.randn(1, HQ, count, D, generator=torch.Generator().manual_seed(6))
    rows = FlexRows.build(
        padded(tables),
        torch.tensor([prefix]),
        count,
        block_size=BLOCK,
        num_slots=key.shape[0],
        compiled=True,
    )
    output = flex_paged_attention(query, key, value, rows, scale=D**-0.5, window=7, softcap=4.0)
    expected = reference(query[0], key, value, tables[0], prefix, 7, 4.0, None)
    torch.testing.assert_close(output[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_compiled_kernel_on_cuda_matches_gather_sdpa(variant: str) -> None:
    window, softcap, with_sinks = VARIANTS[variant]
    lengths = [1, 5, 16, 33, 70]
    key, value, tables = paged_cache(lengths, device="cuda", block=CUDA_BLOCK)
    sinks = torch.randn(HQ, device="cuda") if with_sinks else None
    query = torch.randn(len(lengths), HQ, 1, D, device="cuda")
    rows = FlexRows.build(
        padded(tables, "cuda"),
        torch.tensor(lengths, device="cuda") - 1,
        1,
        block_size=CUDA_BLOCK,
        num_slots=key.shape[0],
        compiled=True,
    )
    output = flex_paged_attention(
        query, key, value, rows, scale=D**-0.5, window=window, softcap=softcap, sinks=sinks
    )
    for row, (length, table) in enumerate(zip(lengths, tables, strict=True)):
        expected = reference(
            query[row], key, value, table, length - 1, window, softcap, sinks, CUDA_BLOCK
        )
        torch.testing.assert_close(output[row], expected, atol=1e-3, rtol=1e-3)
    prefix, count = 19, 41
    key, value, tables = paged_cache([prefix + count], device="cuda", block=CUDA_BLOCK)
    query = torch.randn(1, HQ, count, D, device="cuda")
    rows = FlexRows.build(
        padded(tables, "cuda"),
        torch.tensor([prefix], device="cuda"),
        count,
        block_size=CUDA_BLOCK,
        num_slots=key.shape[0],
        compiled=True,
    )
    output = flex_paged_attention(
        query, key, value, rows, scale=D**-0.5, window=window, softcap=softcap, sinks=sinks
    )
    expected = reference(
        query[0], key, value, tables[0], prefix, window, softcap, sinks, CUDA_BLOCK
    )
    torch.testing.assert_close(output[0], expected, atol=1e-3, rtol=1e-3)
