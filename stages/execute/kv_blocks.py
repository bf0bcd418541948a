"""Reading a prompt's full KV blocks out of one engine's cache and importing them into
another's prefix cache: the two ends of disaggregated prefill and decode (docs/parallelism.md,
"Disaggregated prefill and decode"; the message is :class:`stages.kv_transfer.KvBlocks`).

The prefill engine (``ExecuteConfig.kv_export``) exports, in the step where a request's
prompt is computed, the blocks the decode engine's prefix cache can serve: the prompt's full
blocks before its last token (:meth:`~stages.execute.allocator.BlockAllocator.match_prefix`
always leaves the last token to compute, its logits are needed); its execute stage sends
them straight to the decode engine's (:mod:`stages.execute.kv_links`). The decode engine
imports them when the request is registered, before its first chunk is planned: it allocates blocks
under a name of its own, copies the K/V in, publishes them with its own hashes
(:meth:`~stages.execute.allocator.BlockAllocator.commit`, over the same tokens and the
request's cache key) and lets them go, cached. The request's own prefix-cache lookup then hits
them like any cached prefix, and the engine computes the rest of the prompt (less than one
block) itself. Nothing is trusted that the decode engine cannot check: the tokens must be
the request's own prompt, the layout its cache's; a transfer that does not fit is not
imported, and the request computes its whole prompt (the same tokens, a slower first token).

With tensor parallelism each rank's cache holds its own KV heads (a contiguous range,
:mod:`stages.execute.tensor_parallel`), so what moves is always the whole model's heads: the
prefill engine's rank 0 plans the export when it prepares the step (:func:`plan_exports`),
its :class:`~stages.execute.rank_messages.ShardStep` names the blocks, and after the forward
pass every rank reads its heads of them and one all-gather puts them together on rank 0
(:func:`export_planned`, :func:`export_rank_blocks`). The decode engine's rank 0 imports the
blocks as above, keeping its heads, and sends the other ranks the blocks with the ids it
wrote them to in that step's ShardStep, each of which writes its own heads before the
forward pass (:func:`import_rank_blocks`). So the transfer is the same whatever either
engine's tensor-parallel size, and exact.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from stages.execute.allocator import RESERVED_BLOCK_ID, BlockAllocator, OutOfBlocksError
from stages.execute.attention import KVCache
from stages.execute.rank_messages import ShardStep
from stages.kv_transfer import KV_DTYPES, KvBlocks
from stages.lora import lora_cache_key
from stages.messages import EngineRequest

if TYPE_CHECKING:
    from stages.execute.tensor_parallel import TensorParallelGroup

__all__ = [
    "IMPORT_PREFIX",
    "PlannedExport",
    "export_planned",
    "export_rank_blocks",
    "import_moved_blocks",
    "import_prompt_blocks",
    "import_rank_blocks",
    "plan_exports",
    "with_moved_blocks",
]

logger = logging.getLogger("actorline.execute")

#: the allocator name the decode engine imports a request's blocks under (for a moment)
IMPORT_PREFIX = "kv-import:"

#: (rank, size): the tensor-parallel rank whose KV heads a cache holds, of how many
Heads = tuple[int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedExport:
    """What the prefill engine exports of one request once its step ran: the request's full
    prompt blocks before its last token (``block_ids``, their ``token_ids``)."""

    request_id: str
    token_ids: tuple[int, ...]
    cache_key: bytes
    block_ids: tuple[int, ...]


def plan_export(
    allocator: BlockAllocator,
    block_size: int,
    request_id: str,
    prompt_token_ids: Sequence[int],
    cache_key: bytes = b"",
) -> PlannedExport:
    """Which blocks of ``request_id`` export its prompt: its full prompt blocks before its
    last token, through its block table (once its prompt is computed; possibly none: a prompt
    shorter than a block and a token). A table whose leading blocks were given back (a sliding
    window) exports none. :func:`export_planned` reads them."""
    table = allocator.block_table(request_id)
    count = min(max(0, len(prompt_token_ids) - 1) // block_size, len(table))
    ids = tuple(table[:count])
    if RESERVED_BLOCK_ID in ids:
        count, ids = 0, ()
    return PlannedExport(request_id, tuple(prompt_token_ids[: count * block_size]), cache_key, ids)


def _read_blocks(kv_cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
    """The K/V of blocks ``ids``, ``[2, L, N, block_size, Hkv, D]`` (this cache's heads)."""
    key, value = kv_cache.key, kv_cache.value
    slots = key[0].shape  # [num_slots, Hkv, D]
    index = torch.tensor(list(ids), dtype=torch.long, device=key[0].device)
    shape = (-1, kv_cache.block_size, slots[1], slots[2])
    return torch.stack(
        [
            torch.stack([layer.view(shape).index_select(0, index) for layer in key]),
            torch.stack([layer.view(shape).index_select(0, index) for layer in value]),
        ]
    )


def _cache_dtype(kv_cache: KVCache) -> str:
    dtype = str(kv_cache.key[0].dtype).removeprefix("torch.")
    if dtype not in KV_DTYPES:
        raise ValueError(f"a KV cache of dtype {dtype} cannot be exported")
    return dtype


def _gather_heads(group: TensorParallelGroup, data: torch.Tensor) -> torch.Tensor:
    """Every rank's ``data`` (its heads of the same blocks), joined along the heads in rank
    order: the whole model's heads (a collective: every rank calls it). Moved as bytes, so
    that any cache dtype travels over any backend."""
    shape, dtype = data.shape, data.dtype
    raw = data.contiguous().view(torch.uint8)  # [2, L, N, block_size, Hkv, D * itemsize]
    parts = group.all_gather(raw)
    whole = torch.cat(parts, dim=4).view(dtype)
    return whole.reshape(shape[0], shape[1], shape[2], shape[3], -1, shape[5])


def _as_blocks(plan: PlannedExport, block_size: int, dtype: str, data: torch.Tensor) -> KvBlocks:
    data = data.cpu()
    if dtype == "bfloat16":
        data = data.view(torch.int16)
    return KvBlocks(
        plan.request_id, plan.token_ids, block_size, dtype, data.numpy(), plan.cache_key
    )


def export_planned(
    kv_cache: KVCache | None,
    plans: Sequence[PlannedExport],
    group: TensorParallelGroup | None = None,
) -> list[KvBlocks]:
    """The blocks of ``plans`` (:func:`plan_exports`), read once the step's forward pass wrote
    them; with tensor parallelism (``group``, on rank 0) every rank's heads, gathered while
    the other ranks run :func:`export_rank_blocks` on the step's ShardStep.

    Raises:
        ValueError: the cache's dtype cannot be exported.
        TensorParallelError: the gather failed.
    """
    if not plans:
        return []
    assert kv_cache is not None
    dtype = _cache_dtype(kv_cache)
    ids = [block for plan in plans for block in plan.block_ids]
    data = _read_blocks(kv_cache, ids)
    if group is not None and ids:
        data = _gather_heads(group, data)
    exported, start = [], 0
    for plan in plans:
        end = start + len(plan.block_ids)
        exported.append(_as_blocks(plan, kv_cache.block_size, dtype, data[:, :, start:end]))
        start = end
    return exported


def export_rank_blocks(
    kv_cache: KVCache | None, group: TensorParallelGroup, shard: ShardStep
) -> None:
    """A tensor-parallel rank other than 0 of a prefill engine, after the forward pass of
    ``shard``: its heads of the blocks the step exports, into rank 0's gather
    (:func:`export_planned`; nothing where the step exports no block)."""
    ids = shard.kv_export_blocks
    if ids is None or not len(ids):
        return
    assert kv_cache is not None
    _gather_heads(group, _read_blocks(kv_cache, ids.tolist()))


def import_prompt_blocks(
    kv_cache: KVCache,
    allocator: BlockAllocator,
    blocks: KvBlocks,
    prompt_token_ids: Sequence[int],
    cache_key: bytes,
    heads: Heads = (0, 1),
    written: list[tuple[tuple[int, ...], KvBlocks]] | None = None,
) -> int:
    """Import ``blocks`` into the prefix cache of ``allocator`` / ``kv_cache`` (see the
    module docstring), for the request whose prompt is ``prompt_token_ids`` and cache key
    ``cache_key``. Nothing is imported (and a warning says why) when the blocks are not that
    prompt's, were computed under another cache key, do not have this cache's layout, or
    the cache has too few free blocks; the request then computes its whole prompt.
    ``heads``: the tensor-parallel rank this cache is and how many there are (it keeps its
    heads of the whole model's); ``written`` gets the block ids the K/V went to, with it.

    Returns:
        How many blocks were published (blocks the cache held already are not counted).
    """
    problem = _mismatch(kv_cache, blocks, prompt_token_ids, cache_key, heads[1])
    count = blocks.num_blocks
    if problem is None and count == 0:
        return 0
    name = IMPORT_PREFIX + blocks.request_id
    if problem is None:
        try:
            allocator.allocate(name, count * blocks.block_size)
        except OutOfBlocksError as exc:
            problem = str(exc)
    if problem is not None:
        logger.warning("request %s: moved KV blocks not imported: %s", blocks.request_id, problem)
        return 0
    try:
        ids = tuple(allocator.block_table(name))
        _write_blocks(kv_cache, ids, blocks, heads)
        if written is not None:
            written.append((ids, blocks))
        return allocator.commit(name, blocks.token_ids, count * blocks.block_size, cache_key)
    finally:
        allocator.free(name)


def _write_blocks(kv_cache: KVCache, ids: Sequence[int], blocks: KvBlocks, heads: Heads) -> None:
    """Copy this rank's heads of ``blocks`` (the whole model's) into cache blocks ``ids``."""
    with warnings.catch_warnings():
        # NOTE: a received frame is read-only, and torch warns of it; the K/V is only
        # read from here (copied into the cache), never written
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.ascontiguousarray(blocks.data))
    if blocks.dtype == "bfloat16":
        data = data.view(torch.bfloat16)
    rank, size = heads
    if size > 1:
        local = data.shape[4] // size
        data = data[:, :, :, :, rank * local : (rank + 1) * local]
    data = data.to(kv_cache.key[0].device)
    index = torch.tensor(list(ids), dtype=torch.long)
    block_size = blocks.block_size
    for layer in range(len(kv_cache.key)):
        for side, cache in enumerate((kv_cache.key, kv_cache.value)):
            slots = cache[layer]
            view = slots.view(-1, block_size, slots.shape[1], slots.shape[2])
            view.index_copy_(0, index.to(view.device), data[side, layer].contiguous())


def _mismatch(
    kv_cache: KVCache,
    blocks: KvBlocks,
    prompt_token_ids: Sequence[int],
    cache_key: bytes,
    ranks: int = 1,
) -> str | None:
    """Why ``blocks`` cannot be imported for this prompt into ``kv_cache`` (one of ``ranks``
    tensor-parallel ranks' caches; None: they can)."""
    size = kv_cache.block_size
    if blocks.block_size != size:
        return f"blocks of {blocks.block_size} tokens, this cache's hold {size}"
    if (
        len(blocks.token_ids) % size
        or tuple(prompt_token_ids[: len(blocks.token_ids)]) != tuple(blocks.token_ids)
        or len(blocks.token_ids) >= len(prompt_token_ids)
    ):
        return "their tokens are not a whole-block prefix of the request's prompt"
    if blocks.cache_key != cache_key:
        return "they were computed under another cache key (LoRA adapter)"
    dtype = str(kv_cache.key[0].dtype).removeprefix("torch.")
    if blocks.dtype != dtype or KV_DTYPES.get(blocks.dtype) != blocks.data.dtype.name:
        return f"K/V of dtype {blocks.dtype} ({blocks.data.dtype}), this cache's is {dtype}"
    slots = kv_cache.key[0].shape
    expected = (2, len(kv_cache.key), blocks.num_blocks, size, slots[1] * ranks, slots[2])
    if tuple(blocks.data.shape) != expected:
        return f"K/V of shape {tuple(blocks.data.shape)}, this cache needs {expected}"
    return None


class _Sampling(Protocol):
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...


class _Tracked(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def sampling(self) -> _Sampling: ...
    @property
    def cache_key(self) -> bytes: ...


class _Computed(Protocol):
    @property
    def request(self) -> _Tracked: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


def plan_exports(
    allocator: BlockAllocator, block_size: int, works: Sequence[_Computed]
) -> list[PlannedExport]:
    """:func:`plan_export` of each request whose prompt a step's ``works`` (its chunks,
    ``[start, end)`` each) complete: the prefill engine's side, as it prepares the step (the
    blocks are allocated; their K/V is read once the forward pass wrote it,
    :func:`export_planned`)."""
    plans = []
    for work in works:
        request = work.request
        prompt = request.sampling.prompt_token_ids
        if work.start < len(prompt) <= work.end:
            plans.append(
                plan_export(allocator, block_size, request.request_id, prompt, request.cache_key)
            )
    return plans


def import_moved_blocks(
    kv_cache: KVCache | None,
    allocator: BlockAllocator,
    requests: Sequence[EngineRequest],
    heads: Heads = (0, 1),
    written: list[tuple[tuple[int, ...], KvBlocks]] | None = None,
) -> int:
    """:func:`import_prompt_blocks` of each new request that carries moved blocks
    (``EngineRequest.kv_blocks``): the decode engine's side, before the step's chunks are
    planned, so their prefix-cache lookup finds them (``heads``, ``written``: as there).

    Returns:
        How many blocks were published.
    """
    published = 0
    for request in requests:
        if request.kv_blocks is not None and kv_cache is not None:
            published += import_prompt_blocks(
                kv_cache,
                allocator,
                request.kv_blocks,
                request.prompt_token_ids,
                lora_cache_key(request.lora),
                heads,
                written,
            )
    return published


def with_moved_blocks(
    shard: ShardStep | None,
    step_id: int,
    written: Sequence[tuple[tuple[int, ...], KvBlocks]],
    plans: Sequence[PlannedExport],
) -> ShardStep | None:
    """Rank 0's ``shard`` (None: the step computes nothing) carrying the blocks it imported
    (``written``: where each went) and the ids of the blocks it exports after the forward
    pass, for the other ranks (:func:`import_rank_blocks`, :func:`export_rank_blocks`). A
    step that computes nothing but imported blocks still sends them (a ShardStep of no
    rows), or the other ranks' caches would miss what rank 0's prefix cache now serves."""
    exports = [block for plan in plans for block in plan.block_ids]
    if not written and not exports:
        return shard
    if shard is None:
        empty = np.zeros(0, dtype=np.int64)
        shard = ShardStep(step_id, empty, empty, empty, 0, np.zeros((0, 0), dtype=np.int64))
    return dataclasses.replace(
        shard,
        kv_export_blocks=np.asarray(exports, dtype=np.int64) if exports else None,
        kv_import_blocks=(
            np.asarray([block for ids, _ in written for block in ids], dtype=np.int64)
            if written
            else None
        ),
        kv_imports=tuple(blocks for _, blocks in written),
    )


def import_rank_blocks(kv_cache: KVCache | None, shard: ShardStep, heads: Heads) -> None:
    """A tensor-parallel rank other than 0 of a decode engine, before the forward pass of
    ``shard``: its heads of the blocks rank 0 imported, into the same block ids."""
    if shard.kv_import_blocks is None or kv_cache is None:
        return
    ids = shard.kv_import_blocks.tolist()
    start = 0
    for blocks in shard.kv_imports:
        end = start + blocks.num_blocks
        _write_blocks(kv_cache, ids[start:end], blocks, heads)
        start = end
