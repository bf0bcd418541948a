"""Reading a prompt's full KV blocks out of one engine's cache and importing them into
another's prefix cache: the two ends of disaggregated prefill and decode (docs/parallelism.md,
"Disaggregated prefill and decode"; the message is :class:`stages.kv_transfer.KvBlocks`).

The prefill engine (``ExecuteConfig.kv_export``) exports, in the step where a request's
prompt is computed, the blocks the decode engine's prefix cache can serve: the prompt's full
blocks before its last token (:meth:`~stages.execute.allocator.BlockAllocator.match_prefix`
always leaves the last token to compute, its logits are needed). The decode engine imports
them when the request is registered, before its first chunk is planned: it allocates blocks
under a name of its own, copies the K/V in, publishes them with its own hashes
(:meth:`~stages.execute.allocator.BlockAllocator.commit`, over the same tokens and the
request's cache key) and lets them go, cached. The request's own prefix-cache lookup then hits
them like any cached prefix, and the engine computes the rest of the prompt (less than one
block) itself. Nothing is trusted that the decode engine cannot check: the tokens must be
the request's own prompt, the layout its cache's; a transfer that does not fit is not
imported, and the request computes its whole prompt (the same tokens, a slower first token).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from stages.execute.allocator import RESERVED_BLOCK_ID, BlockAllocator, OutOfBlocksError
from stages.execute.attention import KVCache
from stages.kv_transfer import KV_DTYPES, KvBlocks
from stages.lora import lora_cache_key
from stages.messages import EngineRequest

__all__ = [
    "IMPORT_PREFIX",
    "export_computed_prompts",
    "export_prompt_blocks",
    "import_moved_blocks",
    "import_prompt_blocks",
]

logger = logging.getLogger("actorline.execute")

#: the allocator name the decode engine imports a request's blocks under (for a moment)
IMPORT_PREFIX = "kv-import:"


def export_prompt_blocks(
    kv_cache: KVCache,
    allocator: BlockAllocator,
    request_id: str,
    prompt_token_ids: Sequence[int],
    cache_key: bytes = b"",
) -> KvBlocks:
    """The K/V of ``request_id``'s full prompt blocks before its last token, read out of
    ``kv_cache`` through its block table (once its prompt is computed). A table whose leading
    blocks were given back (a sliding window) exports none.

    Returns:
        The blocks (possibly none: a prompt shorter than a block and a token).
    """
    size = kv_cache.block_size
    table = allocator.block_table(request_id)
    count = min(max(0, len(prompt_token_ids) - 1) // size, len(table))
    ids = table[:count]
    if RESERVED_BLOCK_ID in ids:
        count, ids = 0, []
    key, value = kv_cache.key, kv_cache.value
    slots = key[0].shape  # [num_slots, Hkv, D]
    dtype = str(key[0].dtype).removeprefix("torch.")
    if dtype not in KV_DTYPES:
        raise ValueError(f"a KV cache of dtype {dtype} cannot be exported")
    index = torch.tensor(ids, dtype=torch.long, device=key[0].device)
    shape = (-1, size, slots[1], slots[2])
    # [2, L, N, block_size, Hkv, D]
    data = torch.stack(
        [
            torch.stack([layer.view(shape).index_select(0, index) for layer in key]),
            torch.stack([layer.view(shape).index_select(0, index) for layer in value]),
        ]
    ).cpu()
    if dtype == "bfloat16":
        data = data.view(torch.int16)
    return KvBlocks(
        request_id,
        tuple(prompt_token_ids[: count * size]),
        size,
        dtype,
        data.numpy(),
        cache_key,
    )


def import_prompt_blocks(
    kv_cache: KVCache,
    allocator: BlockAllocator,
    blocks: KvBlocks,
    prompt_token_ids: Sequence[int],
    cache_key: bytes,
) -> int:
    """Import ``blocks`` into the prefix cache of ``allocator`` / ``kv_cache`` (see the
    module docstring), for the request whose prompt is ``prompt_token_ids`` and cache key
    ``cache_key``. Nothing is imported (and a warning says why) when the blocks are not that
    prompt's, were computed under another cache key, do not have this cache's layout, or
    the cache has too few free blocks; the request then computes its whole prompt.

    Returns:
        How many blocks were published (blocks the cache held already are not counted).
    """
    problem = _mismatch(kv_cache, blocks, prompt_token_ids, cache_key)
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
        ids = torch.tensor(allocator.block_table(name), dtype=torch.long)
        with warnings.catch_warnings():
            # NOTE: a received frame is read-only, and torch warns of it; the K/V is only
            # read from here (copied into the cache), never written
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(blocks.data))
        if blocks.dtype == "bfloat16":
            data = data.view(torch.bfloat16)
        data = data.to(kv_cache.key[0].device)
        size = blocks.block_size
        for layer in range(len(kv_cache.key)):
            for side, cache in enumerate((kv_cache.key, kv_cache.value)):
                slots = cache[layer]
                view = slots.view(-1, size, slots.shape[1], slots.shape[2])
                view.index_copy_(0, ids.to(view.device), data[side, layer])
        return allocator.commit(name, blocks.token_ids, count * size, cache_key)
    finally:
        allocator.free(name)


def _mismatch(
    kv_cache: KVCache, blocks: KvBlocks, prompt_token_ids: Sequence[int], cache_key: bytes
) -> str | None:
    """Why ``blocks`` cannot be imported for this prompt into ``kv_cache`` (None: they can)."""
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
    expected = (2, len(kv_cache.key), blocks.num_blocks, size, slots[1], slots[2])
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


def export_computed_prompts(
    kv_cache: KVCache | None, allocator: BlockAllocator, works: Sequence[_Computed]
) -> list[KvBlocks]:
    """:func:`export_prompt_blocks` of each request whose prompt a step's ``works`` (its
    computed chunks, ``[start, end)`` each) completed: the prefill engine's side, after the
    step's forward pass wrote their K/V."""
    assert kv_cache is not None
    exported = []
    for work in works:
        request = work.request
        prompt = request.sampling.prompt_token_ids
        if work.start < len(prompt) <= work.end:
            exported.append(
                export_prompt_blocks(
                    kv_cache, allocator, request.request_id, prompt, request.cache_key
                )
            )
    return exported


def import_moved_blocks(
    kv_cache: KVCache | None, allocator: BlockAllocator, requests: Sequence[EngineRequest]
) -> int:
    """:func:`import_prompt_blocks` of each new request that carries moved blocks
    (``EngineRequest.kv_blocks``): the decode engine's side, before the step's chunks are
    planned, so their prefix-cache lookup finds them.

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
            )
    return published
