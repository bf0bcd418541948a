"""The paged KV-cache block allocator: fixed-size blocks, ref counts, per-request block tables
and prefix caching by chained block hashes with LRU eviction.

Pure Python (no torch): the execute stage maps block ids to cache slots, this module only
decides which block holds which tokens.

Algorithm after vLLM v1 (``vllm/v1/core/block_pool.py``, ``vllm/v1/core/kv_cache_utils.py``)
and nano-vllm (``nanovllm/engine/block_manager.py``):

- A block is *free* when no request references it (ref count 0). Free blocks wait in an LRU
  queue; a freed block that holds a full, hashed block of tokens keeps its hash, so a later
  request with the same prefix can take it back ("touch") until it is evicted, which happens
  when it reaches the head of the queue and is handed out for new tokens.
- Block hashes are chained: ``H(parent hash, block tokens, extra key)``, over full blocks only,
  with SHA-256 so they are stable across processes. A hit re-checks the block's token ids
  (hash collisions must never serve wrong K/V).
- A request's cached prefix is matched chunk by chunk (:meth:`BlockAllocator.match_prefix`
  with a ``limit``): past its scheduled tokens a request takes only blocks that cost no free
  block (another request holds them) or that the step can spare, so execute never runs
  short of the blocks the scheduler planned for.
- Each block knows its holders, so the allocator can say how many of a request's blocks are
  shared (:meth:`BlockAllocator.shared_block_counts`): preempting or finishing a request frees
  only its other blocks, which the scheduler needs to know to never plan more than is free.
- A request's blocks are freed tail first, so when they are evicted the chain tails go before
  the shared heads.
- Under a sliding window a request's leading blocks can be given back while it runs
  (:meth:`BlockAllocator.release_leading`, docs/architecture.md §6.2): its table keeps their
  positions with block 0 in their place, so positions still map to table entries.
- Block 0 is reserved and never handed out: padding tokens write their K/V there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

__all__ = [
    "RESERVED_BLOCK_ID",
    "AllocatorError",
    "BlockAllocator",
    "OutOfBlocksError",
    "PrefixCacheStats",
    "hash_block_tokens",
]

RESERVED_BLOCK_ID = 0
"""The block that is never allocated: padding tokens write their K/V into it."""

_HASH_SEED = b"actorline-kv-block-v1"
_LENGTH_FORMAT = "<q"  # the extra key's length, so key bytes never run into token bytes


class AllocatorError(Exception):
    """Base class of block allocator errors."""


class OutOfBlocksError(AllocatorError):
    """Not enough free blocks for an allocation; nothing was allocated.

    ``needed`` blocks were asked for while ``free`` were available.
    """

    def __init__(self, request_id: str, needed: int, free: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {needed} more KV blocks but only {free} are free"
        )
        self.request_id = request_id
        self.needed = needed
        self.free = free

    def __reduce__(self) -> tuple[object, ...]:  # its __init__ is not (message,)
        return (type(self), (self.request_id, self.needed, self.free))


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> bytes:
    """The chained hash of one full block: SHA-256 over the parent block's hash (or a fixed
    seed for the first block), the block's token ids and ``extra_key`` (anything else that
    changes the block's K/V, e.g. the model and dtype). Stable across processes."""
    digest = hashlib.sha256()
    digest.update(parent_hash if parent_hash is not None else _HASH_SEED)
    # Each token id as a little-endian int64: the same bytes on every machine and process.
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(struct.pack(_LENGTH_FORMAT, len(extra_key)))
    digest.update(extra_key)
    return digest.digest()


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens: ``queries`` tokens looked up, ``hits``
    of them served from the cache."""

    queries: int
    hits: int


@dataclasses.dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    holders: list[str] = dataclasses.field(default_factory=list)  # one per reference
    # Set while the block holds a full, published block of tokens (reusable by prefix hits).
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


@dataclasses.dataclass(slots=True)
class _RequestBlocks:
    block_ids: list[int] = dataclasses.field(default_factory=list)
    # Hashes of the request's leading full blocks that are published (hit or committed).
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    # Leading entries given back (release_leading): RESERVED_BLOCK_ID in block_ids.
    released: int = 0


class BlockAllocator:
    """Hands out fixed-size KV blocks to requests, with optional prefix caching.

    Args:
        num_blocks: total blocks in the cache, including the reserved block 0; so
            ``num_blocks - 1`` can be allocated.
        block_size: tokens per block.
        enable_prefix_caching: reuse published full blocks across requests.
        extra_hash_key: mixed into every block hash (model identity, dtype, ...).

    Raises:
        ValueError: ``num_blocks < 2`` or ``block_size < 1``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_hash_key: bytes = b"",
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_hash_key = extra_hash_key
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        # NOTE: the free queue holds exactly the blocks with ref count 0 (never block 0), in
        # LRU order: allocation pops from the front, freeing appends at the back. An
        # OrderedDict gives O(1) removal from the middle when a prefix hit revives a block.
        self._free: OrderedDict[int, None] = OrderedDict(
            (block_id, None) for block_id in range(1, num_blocks)
        )
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._requests: dict[str, _RequestBlocks] = {}
        # request id -> how many of its blocks other requests hold too (only non-zero counts)
        self._shared: dict[str, int] = {}
        self._queries = 0
        self._hits = 0

    # ----------------------------------------------------------------- inspection
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be allocated (all but the reserved block 0)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached-but-unreferenced blocks count as free)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently published in the prefix cache (referenced or not)."""
        return len(self._cached)

    @property
    def stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache counters (tokens)."""
        return PrefixCacheStats(queries=self._queries, hits=self._hits)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds any blocks."""
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (a copy; empty for unknown requests).
        Leading blocks given back by :meth:`release_leading` read ``RESERVED_BLOCK_ID``."""
        blocks = self._requests.get(request_id)
        return list(blocks.block_ids) if blocks is not None else []

    def num_held_blocks(self, request_id: str) -> int:
        """How many blocks the request references (its table less the released entries)."""
        blocks = self._requests.get(request_id)
        return len(blocks.block_ids) - blocks.released if blocks is not None else 0

    def ref_count(self, block_id: int) -> int:
        """How many requests reference ``block_id``."""
        return self._blocks[block_id].ref_count

    def free_block_ids(self) -> list[int]:
        """The free blocks in eviction order (the first is handed out next)."""
        return list(self._free)

    def shared_block_counts(self) -> dict[str, int]:
        """For every request holding a block that another request holds too, how many such
        blocks it holds (a copy). Freeing the request frees its other blocks only."""
        return dict(self._shared)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """How many more blocks ``request_id`` needs to hold ``num_tokens`` tokens."""
        held = len(self._requests[request_id].block_ids) if request_id in self._requests else 0
        return max(0, -(-num_tokens // self.block_size) - held)

    # ----------------------------------------------------------------- operations
    def match_prefix(
        self,
        request_id: str,
        token_ids: Sequence[int],
        limit: int | None = None,
        spare_blocks: int = 0,
        cache_key: bytes = b"",
    ) -> int:
        """Extend the request's run of cached leading blocks with the published blocks that
        continue it in ``token_ids`` (its known tokens), taking a reference on each.
        ``cache_key``: what else the request's K/V depends on (its LoRA adapter, docs/lora.md),
        mixed into each block hash after the allocator's own key; give :meth:`commit` the
        same, so blocks computed under one key never serve another.

        A request with no blocks starts from the first block, and counts ``len(token_ids)``
        queried tokens (once per start, however many calls extend the match). A request that
        holds blocks is extended only while each block it holds is a full block with its
        tokens' hash known (computed and committed, or hit); otherwise nothing matches. The
        match stays below ``len(token_ids)`` tokens, so at least one token is computed (its
        logits are needed). Past the first ``limit`` tokens (when given) a block is taken only
        if another request holds it (taking it costs no free block), or while fewer than
        ``spare_blocks`` free blocks were taken past the limit.

        Returns:
            The number of tokens newly served from the cache (a multiple of ``block_size``).
        """
        if not self.enable_prefix_caching:
            return 0
        blocks = self._requests.get(request_id)
        if blocks is None:
            self._queries += len(token_ids)
            held = 0
            parent: bytes | None = None
        else:
            held = len(blocks.block_ids)
            if len(blocks.block_hashes) != held:
                return 0  # its last block is not a full, hashed block
            parent = blocks.block_hashes[-1] if held else None
        size = self.block_size
        free_up_to = len(token_ids) if limit is None else limit  # blocks ending here are free
        hit_blocks: list[int] = []
        hit_hashes: list[bytes] = []
        extra_key = self.extra_hash_key + cache_key
        for index in range(held, max(0, len(token_ids) - 1) // size):
            block_tokens = tuple(token_ids[index * size : (index + 1) * size])
            block_hash = hash_block_tokens(parent, block_tokens, extra_key)
            block_id = self._cached.get(block_hash)
            if block_id is None or self._blocks[block_id].token_ids != block_tokens:
                break
            if (index + 1) * size > free_up_to and self._blocks[block_id].ref_count == 0:
                if spare_blocks <= 0:
                    break
                spare_blocks -= 1
            hit_blocks.append(block_id)
            hit_hashes.append(block_hash)
            parent = block_hash
        if not hit_blocks:
            return 0
        if blocks is None:
            blocks = self._requests[request_id] = _RequestBlocks()
        for block_id in hit_blocks:
            self._take_reference(block_id, request_id)
        blocks.block_ids.extend(hit_blocks)
        blocks.block_hashes.extend(hit_hashes)
        num_cached = len(hit_blocks) * size
        self._hits += num_cached
        return num_cached

    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's block table to cover ``num_tokens`` tokens (all or nothing).

        Raises:
            OutOfBlocksError: too few free blocks; the request's table is unchanged.
            ValueError: ``num_tokens`` is negative.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        needed = self.blocks_needed(request_id, num_tokens)
        if needed == 0:
            return
        if needed > len(self._free):
            raise OutOfBlocksError(request_id, needed, len(self._free))
        blocks = self._requests.setdefault(request_id, _RequestBlocks())
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block.holders = [request_id]
            blocks.block_ids.append(block_id)

    def commit(
        self, request_id: str, token_ids: Sequence[int], num_computed: int, cache_key: bytes = b""
    ) -> int:
        """Publish the request's blocks that became full now that the K/V of its first
        ``num_computed`` tokens (``token_ids[:num_computed]``) is in the cache, hashed with
        ``cache_key`` (as :meth:`match_prefix`).

        A block whose hash is already published by another block stays private (the first
        copy serves later hits). No-op when prefix caching is off.

        Returns:
            The number of blocks newly published.

        Raises:
            AllocatorError: unknown request, or ``num_computed`` exceeds its tokens or blocks.
        """
        if not self.enable_prefix_caching:
            return 0
        blocks = self._requests.get(request_id)
        if blocks is None:
            raise AllocatorError(f"request {request_id!r} holds no blocks")
        if num_computed > len(token_ids):
            raise AllocatorError(
                f"num_computed ({num_computed}) exceeds the {len(token_ids)} tokens given"
            )
        size = self.block_size
        num_full = num_computed // size
        if num_full > len(blocks.block_ids):
            raise AllocatorError(
                f"request {request_id!r} holds {len(blocks.block_ids)} blocks, fewer than "
                f"the {num_full} full blocks of {num_computed} computed tokens"
            )
        published = 0
        extra_key = self.extra_hash_key + cache_key
        parent = blocks.block_hashes[-1] if blocks.block_hashes else None
        for index in range(len(blocks.block_hashes), num_full):
            block_tokens = tuple(token_ids[index * size : (index + 1) * size])
            block_hash = hash_block_tokens(parent, block_tokens, extra_key)
            blocks.block_hashes.append(block_hash)
            parent = block_hash
            block_id = blocks.block_ids[index]
            block = self._blocks[block_id]
            if block_id == RESERVED_BLOCK_ID or block_hash in self._cached:
                continue  # given back already, or another block holds these tokens
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash
            block.token_ids = block_tokens
            self._cached[block_hash] = block.block_id
            published += 1
        return published

    def free(self, request_id: str) -> int:
        """Drop the request's references (tail block first, so chain tails are evicted
        before shared heads). Blocks left unreferenced become free; published ones stay
        cached until evicted. Unknown requests are ignored.

        Returns:
            The number of blocks that became free.
        """
        blocks = self._requests.pop(request_id, None)
        if blocks is None:
            return 0
        released = 0
        for block_id in reversed(blocks.block_ids[blocks.released :]):
            released += self._drop_reference(block_id, request_id)
        self._shared.pop(request_id, None)
        return released

    def release_leading(self, request_id: str, num_blocks: int) -> int:
        """Give back the request's first ``num_blocks`` blocks while it keeps running (they
        lie behind every layer's sliding window; docs/architecture.md §6.2). Their table
        entries become ``RESERVED_BLOCK_ID``; blocks left unreferenced become free (published
        ones stay cached for other requests until evicted). Entries given back before, and
        unknown requests, are ignored.

        Returns:
            The number of blocks that became free.
        """
        blocks = self._requests.get(request_id)
        if blocks is None:
            return 0
        end = min(num_blocks, len(blocks.block_ids))
        released = 0
        for index in range(blocks.released, end):
            released += self._drop_reference(blocks.block_ids[index], request_id)
            blocks.block_ids[index] = RESERVED_BLOCK_ID
        blocks.released = max(blocks.released, end)
        return released

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Shrink the request's table to the blocks ``num_tokens`` tokens need, giving back
        the trailing ones (speculative decoding's rejected tokens: docs/speculative.md). The
        blocks given back were never published (only computed tokens' full blocks are), so
        they hold nothing another request could share. Unknown requests are ignored.

        Returns:
            The number of blocks that became free.
        Raises:
            ValueError: ``num_tokens`` is negative, or the cut reaches a published block.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        blocks = self._requests.get(request_id)
        if blocks is None:
            return 0
        keep = max(-(-num_tokens // self.block_size), blocks.released)
        if keep < len(blocks.block_hashes):
            raise ValueError(
                f"truncating {request_id!r} to {num_tokens} tokens would drop published blocks"
            )
        released = 0
        while len(blocks.block_ids) > keep:
            released += self._drop_reference(blocks.block_ids.pop(), request_id)
        return released

    def reset_prefix_cache(self) -> int:
        """Forget every published block that no request references.

        Returns:
            The number of blocks evicted.
        """
        evicted = 0
        for block_id in self._free:
            block = self._blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
                evicted += 1
        return evicted

    # ----------------------------------------------------------------- internals
    def _drop_reference(self, block_id: int, request_id: str) -> int:
        """Drop one of ``request_id``'s references to ``block_id``; 1 if it became free."""
        block = self._blocks[block_id]
        block.ref_count -= 1
        block.holders.remove(request_id)
        if block.ref_count >= 1:  # it was shared: no longer counted as shared by request_id
            if block.ref_count == 1:
                self._count_shared(block.holders[0], -1)  # its last holder has it alone
            self._count_shared(request_id, -1)
            return 0
        self._free[block_id] = None
        if block.block_hash is None:
            # NOTE: a block with nothing cached in it is worthless to keep: put it at the
            # front so it is reused before any cached block is evicted.
            self._free.move_to_end(block_id, last=False)
        return 1

    def _take_reference(self, block_id: int, request_id: str) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        else:
            if block.ref_count == 1:
                self._count_shared(block.holders[0], 1)  # no longer its holder's alone
            self._count_shared(request_id, 1)
        block.ref_count += 1
        block.holders.append(request_id)

    def _count_shared(self, request_id: str, delta: int) -> None:
        count = self._shared.get(request_id, 0) + delta
        if count:
            self._shared[request_id] = count
        else:
            del self._shared[request_id]

    def _evict(self, block: _Block) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
