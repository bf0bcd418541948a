"""Paged attention through PyTorch's FlexAttention, reading the KV cache's block tables in
place (``attention_backend="flex"``; docs/architecture.md §6.4).

The gather + SDPA path of :mod:`stages.execute.attention` copies every block a batch reads
into a padded tensor first: memory traffic proportional to the longest context in the batch.
Here the whole cache layer ``[num_slots, Hkv, D]`` is viewed, without a copy, as one KV
sequence ``[1, Hkv, num_slots, D]`` and a :class:`~torch.nn.attention.flex_attention.BlockMask`
lists, for each attended row, the cache blocks it reads (its block table), so a fused kernel
visits only those blocks. The mask function maps a physical slot back to its logical position
in the row's sequence through a per-row inverse block table (``logical``), so it states the
exact mask (causal, the context's end, a sliding window) whatever the kernel visits: FlexAttention's
eager implementation ignores the block lists and applies the mask to every slot, the
compiled kernels skip unlisted blocks; both give the same result, which is how the CPU tests
check the block lists.

Follows vLLM's FlexAttention backend (``vllm/v1/attention/backends/flex_attention.py``: the
inverse block table ``physical_to_logical_mapping``, a block mask built directly from the
block table with ``BlockMask.from_kv_blocks``, the KV block size equal to the cache's), here
with one batch row per attended sequence instead of one packed row, so a decode batch keeps
static shapes for CUDA graphs.

Variants (docs/architecture.md §6.1): a window is part of the mask and the block lists start
at the window's first block; soft-capped scores are a ``score_mod``; sinks rescale the output
by the log-sum-exp FlexAttention returns (``out * sigmoid(lse - sink)``, exactly the softmax
with one more logit and no value).

Every tensor op here has static shapes and no host synchronisation, so a decode batch's
masks can be built inside a captured CUDA graph (the captured path is checked on a GPU only).
On CUDA the kernel is ``torch.compile``'d; on CPU it runs eagerly (the reference
implementation, which materializes the scores over every cache slot: a correctness path for
tests, never chosen by ``auto``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "FLEX_Q_BLOCK",
    "FlexRows",
    "flex_available",
    "flex_paged_attention",
    "logical_blocks",
    "use_flex",
]

logger = logging.getLogger("actorline.execute")

FLEX_Q_BLOCK = 16
"""Queries per row tile of the block mask (as vLLM's direct build); decode rows have one."""


def flex_available() -> bool:
    """Whether this torch has FlexAttention with ``BlockMask.from_kv_blocks(...,
    compute_q_blocks=...)`` (torch >= 2.9)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    build = getattr(BlockMask, "from_kv_blocks", None)
    return build is not None and "compute_q_blocks" in inspect.signature(build).parameters


def use_flex(attention_backend: str, device: torch.device, block_size: int) -> bool:
    """Resolve ``ExecuteConfig.attention_backend``: whether steps attend through FlexAttention.
    ``auto`` is ``gather_sdpa`` on every device: flex has no GPU measurement behind it yet
    (``.ci/cuda-check`` takes one; docs/architecture.md §6.4).

    Raises:
        ExecuteConfigError: ``flex`` asked for where this torch has no FlexAttention, or on
            CUDA with a block size that is not a multiple of 16 (a Triton tile is a cache
            block, and a tile is at least 16 keys).
    """
    from stages.execute.config import ExecuteConfigError

    if attention_backend != "flex":
        return False
    if device.type == "cuda" and block_size % 16:
        raise ExecuteConfigError(
            "attention_backend",
            f"'flex' on CUDA needs block_size a multiple of 16, got {block_size}",
        )
    if not flex_available():
        raise ExecuteConfigError(
            "attention_backend",
            f"'flex' needs torch >= 2.9 (FlexAttention's BlockMask.from_kv_blocks); this is "
            f"torch {torch.__version__}",
        )
    if device.type != "cuda":
        logger.warning(
            "execute: attention_backend 'flex' on %s runs FlexAttention eagerly, scoring every "
            "slot of the KV cache: a correctness path, slow beside gather + SDPA",
            device,
        )
    return True


def logical_blocks(
    tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_blocks: int
) -> torch.Tensor:
    """The inverse of each row's block table: ``[R, num_blocks + 1]`` int32, entry ``[r, p]``
    the logical block index physical block ``p`` holds in row ``r``'s sequence, -1 where row
    ``r`` does not use ``p``. Only the first ``ceil(context_lens[r] / block_size)`` entries
    of a table count (the rest is padding); the reserved block 0 (padding and blocks freed
    behind a window) maps to -1. Column ``num_blocks`` takes the padding entries' writes.

    ``tables [R, W]`` int64 block ids, ``context_lens [R]`` int64. Static shapes.
    """
    rows, width = tables.shape
    device = tables.device
    logical = torch.full((rows, num_blocks + 1), -1, dtype=torch.int32, device=device)
    columns = torch.arange(width, device=device)
    used = columns.unsqueeze(0) < (context_lens.unsqueeze(1) + block_size - 1) // block_size
    targets = torch.where(used, tables, num_blocks)
    logical.scatter_(1, targets, columns.to(torch.int32).expand(rows, width).contiguous())
    logical[:, 0] = -1
    logical[:, num_blocks] = -1
    return logical


@dataclasses.dataclass(slots=True)
class FlexRows:
    """Rows attended by FlexAttention in one call: row ``r`` has queries at positions
    ``query_starts[r] + i`` for ``i < num_queries`` and reads the cache blocks of
    ``tables[r]`` (its block table, padded with block 0). A decode batch is ``R`` rows of one
    query; a prefill chunk with a cached prefix is one row of ``n`` queries.

    The block masks (one per sliding window) are built on first use and shared by the layers
    with that window (the first layer that asks builds it, as the gather path's masks).
    """

    tables: torch.Tensor  # [R, W] int64, on the attention's device
    query_starts: torch.Tensor  # [R] int64: position of each row's first query
    num_queries: int
    block_size: int
    num_blocks: int  # blocks in the cache (slots // block_size), the reserved block included
    logical: torch.Tensor  # [R, num_blocks + 1] int32, see logical_blocks()
    compiled: bool
    masks: dict[int | None, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(
        cls,
        tables: torch.Tensor,
        query_starts: torch.Tensor,
        num_queries: int,
        *,
        block_size: int,
        num_slots: int,
        compiled: bool,
    ) -> FlexRows:
        """Rows over ``tables [R, W]`` whose last query is at ``query_starts + num_queries - 1``
        (the context is every position up to it). Static shapes: usable inside a CUDA graph."""
        num_blocks = num_slots // block_size
        context_lens = query_starts + num_queries
        logical = logical_blocks(tables, context_lens, block_size, num_blocks)
        return cls(tables, query_starts, num_queries, block_size, num_blocks, logical, compiled)

    def block_mask(self, window: int | None) -> Any:
        """The :class:`BlockMask` of a layer with this window (None: full causal)."""
        mask = self.masks.get(window)
        if mask is None:
            mask = self.masks[window] = self._build_mask(window)
        return mask

    def _build_mask(self, window: int | None) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        rows, width = self.tables.shape
        device = self.tables.device
        block_size, count = self.block_size, self.num_queries
        tiles = -(-count // FLEX_Q_BLOCK)
        tile_first = torch.arange(tiles, device=device) * FLEX_Q_BLOCK  # [tiles]
        tile_last = torch.clamp(tile_first + FLEX_Q_BLOCK, max=count) - 1
        first_pos = self.query_starts.unsqueeze(1) + tile_first  # [R, tiles]
        last_pos = self.query_starts.unsqueeze(1) + tile_last
        end_block = last_pos // block_size + 1  # blocks [first, end) hold the tile's keys
        if window is None:
            first_block = torch.zeros_like(end_block)
        else:
            first_block = torch.clamp(first_pos - window + 1, min=0) // block_size
        # The kernel on CPU wants the lists as wide as the cache's blocks; CUDA's the table.
        span = self.num_blocks if self.tables.device.type == "cpu" else width
        offsets = torch.arange(span, device=device)
        columns = torch.clamp(first_block.unsqueeze(-1) + offsets, max=width - 1)  # [R,t,span]
        indices = torch.gather(self.tables.unsqueeze(1).expand(rows, tiles, width), 2, columns).to(
            torch.int32
        )
        counts = (end_block - first_block).to(torch.int32)
        mask_mod = _paged_mask(self.logical, self.query_starts, block_size, window)
        return BlockMask.from_kv_blocks(
            counts.unsqueeze(1),  # [R, 1, tiles]
            indices.unsqueeze(1),  # [R, 1, tiles, span]
            BLOCK_SIZE=(FLEX_Q_BLOCK, block_size),
            mask_mod=mask_mod,
            seq_lengths=(count, self.num_blocks * block_size),
            compute_q_blocks=False,
        )


def _paged_mask(
    logical: torch.Tensor, query_starts: torch.Tensor, block_size: int, window: int | None
) -> Callable[..., torch.Tensor]:
    """The exact mask over physical slots: slot ``kv`` is visible to query ``q`` of row ``b``
    when row ``b`` uses its block and its logical position is causal to (and within the
    window of) the query's position."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = logical[b, kv_idx // block_size]
        position = block * block_size + kv_idx % block_size
        query_position = query_starts[b] + q_idx
        visible = (block >= 0) & (position <= query_position)
        if window is not None:
            visible = visible & (position > query_position - window)
        return visible

    return mask_mod


def _softcap_score(softcap: float) -> Callable[..., torch.Tensor]:
    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return torch.tanh(score / softcap) * softcap

    return score_mod


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """``flex_attention`` compiled once per process. Shapes vary: decode batches by rows and
    table width (each captured graph has its own), prefill chunks by length; the compile
    turns dynamic after the first recompile (dynamo's automatic dynamic shapes), so a few
    compiles serve them all instead of one per shape (seconds each, and a graph capture per
    batch size and context bucket would pay each). The main kernel needs no static batch (the
    flex-decoding kernel would; it is not used, see ``flex_paged_attention``)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # NOTE: each window and soft cap is a constant of its own mask or score function, so a
    # model with both kinds of layers compiles more than once; past dynamo's default
    # recompile limit (8) the call would fall back to the eager implementation, which
    # materializes scores over the whole cache. vLLM raises it too.
    limit = int(getattr(torch._dynamo.config, "recompile_limit", 8))
    torch._dynamo.config.recompile_limit = max(limit, 64)
    return torch.compile(flex_attention, fullgraph=True)


@functools.cache
def _eager_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    # The eager path is chosen on purpose here (CPU, tests); its warning says to compile.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return flex_attention


def flex_paged_attention(
    query: torch.Tensor,  # [R, Hq, n, D]
    key_cache: torch.Tensor,  # [num_slots, Hkv, D]
    value_cache: torch.Tensor,  # [num_slots, Hkv, D]
    rows: FlexRows,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:
    """Attend ``rows``' queries over the paged cache in place.

    Returns:
        ``[R, Hq, n, D]``; a query that sees no key (a CUDA graph's padding row) gives zeros.
    """
    keys = key_cache.unsqueeze(0).transpose(1, 2)  # [1, Hkv, num_slots, D], a view
    values = value_cache.unsqueeze(0).transpose(1, 2)
    kernel = _compiled_flex() if rows.compiled else _eager_flex()
    score_mod = _softcap_score(softcap) if softcap is not None else None
    options: dict[str, Any] = {"enable_gqa": query.shape[1] != keys.shape[1]}
    if query.device.type == "cuda":
        # As vLLM's direct build: the main kernel, tiles the block mask's (a tile of
        # FLEX_Q_BLOCK queries by one cache block).
        options["kernel_options"] = {
            "FORCE_USE_FLEX_ATTENTION": True,
            "BLOCK_M": FLEX_Q_BLOCK,
            "BLOCK_N": rows.block_size,
        }
    block_mask = rows.block_mask(window)
    if sinks is None:
        output: torch.Tensor = kernel(query, keys, values, score_mod, block_mask, scale, **options)
        return output
    output, lse = _with_lse(kernel, query, keys, values, score_mod, block_mask, scale, options)
    # A sink is one more logit in the softmax's denominator: out * Z / (Z + e^sink).
    weight = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # [R, Hq, n]
    return output * weight.unsqueeze(-1).to(output.dtype)


def _with_lse(kernel: Callable[..., Any], *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and natural-log log-sum-exp ``[R, Hq, n]``."""
    *positional, options = args
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9 spelled it return_lse
        output, lse = kernel(*positional, return_lse=True, **options)
        return output, lse
    output, aux = kernel(*positional, return_aux=AuxRequest(lse=True), **options)
    return output, aux.lse
