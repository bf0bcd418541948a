"""Tests of stages/execute/allocator.py: allocation, prefix hits, LRU eviction, invariants."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from stages.execute.allocator import (
    RESERVED_BLOCK_ID,
    AllocatorError,
    BlockAllocator,
    OutOfBlocksError,
    hash_block_tokens,
)

BLOCK = 4


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_allocate_grows_table_and_never_hands_out_the_reserved_block() -> None:
    allocator = BlockAllocator(num_blocks=6, block_size=BLOCK)
    assert allocator.num_usable_blocks == 5
    assert allocator.num_free_blocks == 5
    allocator.allocate("a", 9)  # 3 blocks
    allocator.allocate("a", 9)  # already covered: no-op
    allocator.allocate("b", 8)  # 2 blocks
    table_a, table_b = allocator.block_table("a"), allocator.block_table("b")
    assert len(table_a) == 3 and len(table_b) == 2
    assert RESERVED_BLOCK_ID not in table_a + table_b
    assert sorted(table_a + table_b) == [1, 2, 3, 4, 5]
    assert allocator.num_free_blocks == 0


def test_out_of_blocks_allocates_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BLOCK)
    allocator.allocate("a", 4)
    with pytest.raises(OutOfBlocksError) as caught:
        allocator.allocate("a", 4 * BLOCK)  # needs 3 more, 2 free
    assert caught.value.needed == 3 and caught.value.free == 2
    assert "'a'" in str(caught.value)
    assert len(allocator.block_table("a")) == 1
    assert allocator.num_free_blocks == 2
    with pytest.raises(OutOfBlocksError):
        allocator.allocate("b", 3 * BLOCK)
    assert not allocator.has_request("b")


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(num_blocks=1, block_size=BLOCK)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(num_blocks=4, block_size=0)
    allocator = BlockAllocator(num_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError, match="num_tokens"):
        allocator.allocate("a", -1)
    with pytest.raises(AllocatorError, match="holds no blocks"):
        allocator.commit("a", tokens(0, 4), 4)


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    allocator = BlockAllocator(num_blocks=16, block_size=BLOCK)
    prompt = tokens(100, 10)  # 2 full blocks + 2 tokens
    assert allocator.match_prefix("a", prompt) == 0
    allocator.allocate("a", len(prompt))
    assert allocator.commit("a", prompt, len(prompt)) == 2
    shared = [*prompt[:8], 7, 7, 7]
    assert allocator.match_prefix("b", shared) == 8
    assert allocator.block_table("b") == allocator.block_table("a")[:2]
    assert allocator.ref_count(allocator.block_table("a")[0]) == 2
    allocator.allocate("b", len(shared))
    assert allocator.block_table("b")[2] != allocator.block_table("a")[2]
    assert allocator.stats.queries == len(prompt) + len(shared)
    assert allocator.stats.hits == 8


def test_hit_is_capped_so_one_token_is_computed() -> None:
    allocator = BlockAllocator(num_blocks=16, block_size=BLOCK)
    prompt = tokens(0, 8)  # exactly two full blocks
    allocator.allocate("a", 8)
    allocator.commit("a", prompt, 8)
    # The same 8 tokens: only the first block may hit, the last token must be computed.
    assert allocator.match_prefix("b", prompt) == 4
    assert allocator.match_prefix("c", [*prompt, 9]) == 8


def test_hit_requires_the_whole_chain() -> None:
    allocator = BlockAllocator(num_blocks=16, block_size=BLOCK)
    prompt = tokens(0, 12)
    allocator.allocate("a", 12)
    allocator.commit("a", prompt, 12)
    # Same second block, different first block: the chained hash differs, no hit.
    other = [99, 98, 97, 96, *prompt[4:]]
    assert allocator.match_prefix("b", other) == 0


def test_hash_is_stable_across_processes() -> None:
    here = hash_block_tokens(None, [1, 2, 3], b"model")
    code = (
        "from stages.execute.allocator import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3], b'model').hex())"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert there == here.hex()
    assert hash_block_tokens(here, [4], b"") != hash_block_tokens(None, [4], b"")
    assert hash_block_tokens(None, [1], b"x") != hash_block_tokens(None, [1], b"y")


def test_extra_hash_key_separates_caches() -> None:
    prompt = tokens(0, 9)
    first = BlockAllocator(num_blocks=8, block_size=BLOCK, extra_hash_key=b"fp32")
    second = BlockAllocator(num_blocks=8, block_size=BLOCK, extra_hash_key=b"bf16")
    first.allocate("a", 9)
    first.commit("a", prompt, 9)
    second.allocate("a", 9)
    second.commit("a", prompt, 9)
    assert first._cached.keys().isdisjoint(second._cached.keys())


def test_hash_collision_is_not_served() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BLOCK)
    prompt = tokens(0, 9)
    allocator.allocate("a", 9)
    allocator.commit("a", prompt, 9)
    # Corrupt the stored tokens of the first block, as a colliding hash would look.
    first = allocator._blocks[allocator.block_table("a")[0]]
    first.token_ids = (5, 5, 5, 5)
    assert allocator.match_prefix("b", prompt) == 0


def test_freed_cached_blocks_are_reused_until_evicted_lru() -> None:
    allocator = BlockAllocator(num_blocks=7, block_size=BLOCK)  # 6 usable
    prompt = tokens(0, 13)  # 3 full blocks + 1
    allocator.allocate("a", 13)
    allocator.commit("a", prompt, 13)
    table = allocator.block_table("a")
    assert allocator.free("a") == 4
    # The unhashed tail block is reused first, then the chain tail-first (reverse order).
    free_order = allocator.free_block_ids()
    assert free_order[0] == table[3]
    assert free_order[-3:] == [table[2], table[1], table[0]]
    # Still cached: a new request hits all three full blocks.
    assert allocator.match_prefix("b", prompt) == 12
    assert allocator.block_table("b") == table[:3]
    allocator.free("b")
    # Use up every untouched block plus two cached ones: the two evicted must be the chain
    # tail (blocks 3 and 2 of the prompt), so the head block still hits.
    allocator.allocate("c", BLOCK * 5)
    assert allocator.num_cached_blocks == 1
    assert allocator.match_prefix("d", prompt) == 4
    assert allocator.block_table("d") == [table[0]]


def test_duplicate_content_stays_private() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BLOCK)
    prompt = tokens(0, 5)
    allocator.allocate("a", 5)
    allocator.allocate("b", 5)  # same tokens computed twice (both started before a commit)
    assert allocator.commit("a", prompt, 5) == 1
    assert allocator.commit("b", prompt, 5) == 0
    assert allocator.num_cached_blocks == 1
    allocator.free("a")
    allocator.free("b")
    assert allocator.match_prefix("c", prompt) == 4


def test_match_prefix_extends_only_a_run_of_full_hashed_blocks() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BLOCK)
    allocator.allocate("a", 12)
    allocator.commit("a", tokens(0, 12), 12)
    allocator.allocate("b", 3)  # a partial block, not hashed: nothing can follow it
    assert allocator.match_prefix("b", tokens(0, 13)) == 0
    assert len(allocator.block_table("b")) == 1
    # A request whose blocks are all full and hashed continues from its last one.
    allocator.allocate("c", 4)
    allocator.commit("c", tokens(0, 4), 4)
    assert allocator.match_prefix("c", tokens(0, 13)) == 8
    assert allocator.block_table("c")[1:] == allocator.block_table("a")[1:]


def test_match_prefix_past_the_limit_takes_only_held_or_spare_blocks() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BLOCK)
    prompt = tokens(0, 17)
    allocator.allocate("a", 16)
    allocator.commit("a", prompt, 16)
    allocator.free("a")  # four cached blocks, all free now
    # Within the limit (the chunk) any cached block; past it, none without spare blocks.
    assert allocator.match_prefix("b", prompt, limit=5) == 4
    assert allocator.match_prefix("b", prompt, limit=8, spare_blocks=1) == 8
    assert allocator.num_free_blocks == 7 - 3
    # Blocks another request holds cost no free block: taken past the limit regardless.
    assert allocator.match_prefix("c", prompt, limit=1) == 12
    assert allocator.shared_block_counts() == {"b": 3, "c": 3}


def test_shared_block_counts_follow_every_reference() -> None:
    allocator = BlockAllocator(num_blocks=10, block_size=BLOCK)
    prompt = tokens(0, 13)
    allocator.allocate("a", 12)
    allocator.commit("a", prompt, 12)
    assert allocator.shared_block_counts() == {}
    assert allocator.match_prefix("b", prompt) == 12
    assert allocator.match_prefix("c", tokens(0, 9)) == 8
    assert allocator.shared_block_counts() == {"a": 3, "b": 3, "c": 2}
    assert allocator.free("a") == 0  # every block of a is held by b too
    assert allocator.shared_block_counts() == {"b": 2, "c": 2}
    allocator.free("c")
    assert allocator.shared_block_counts() == {}
    assert allocator.free("b") == 3


def test_prefix_caching_disabled() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    prompt = tokens(0, 9)
    allocator.allocate("a", 9)
    assert allocator.commit("a", prompt, 9) == 0
    allocator.free("a")
    assert allocator.match_prefix("b", prompt) == 0
    assert allocator.stats.queries == 0


def test_reset_prefix_cache_keeps_referenced_blocks() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BLOCK)
    allocator.allocate("a", 8)
    allocator.commit("a", tokens(0, 8), 8)
    allocator.allocate("b", 4)
    allocator.commit("b", tokens(50, 4), 4)
    allocator.free("a")
    assert allocator.reset_prefix_cache() == 2
    assert allocator.num_cached_blocks == 1
    assert allocator.match_prefix("c", tokens(0, 9)) == 0


def test_release_leading_gives_back_blocks_behind_a_window() -> None:
    allocator = BlockAllocator(num_blocks=10, block_size=BLOCK)
    prompt = tokens(0, 13)
    allocator.allocate("a", 13)
    allocator.commit("a", prompt, 13)
    table = allocator.block_table("a")
    assert allocator.match_prefix("b", prompt) == 12  # b holds a's three full blocks too
    free = allocator.num_free_blocks
    # a's first block is shared with b: giving it back frees nothing, and a no longer counts it
    assert allocator.release_leading("a", 1) == 0
    assert allocator.block_table("a") == [RESERVED_BLOCK_ID, *table[1:]]
    assert allocator.num_held_blocks("a") == 3
    assert allocator.shared_block_counts() == {"a": 2, "b": 2}  # b has the first alone
    assert allocator.release_leading("a", 1) == 0  # given back already: nothing happens
    allocator.free("b")
    assert allocator.num_free_blocks == free + 1  # only b held the first block
    assert allocator.release_leading("a", 2) == 1
    assert allocator.free("a") == 2
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    # Published blocks given back stay in the prefix cache.
    assert allocator.match_prefix("c", prompt) == 12


def test_free_of_unknown_request_is_a_no_op() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BLOCK)
    assert allocator.free("never-seen") == 0
    assert allocator.num_free_blocks == 3


# ----------------------------------------------------------------- property tests
REQUEST_IDS = st.sampled_from(["r0", "r1", "r2", "r3", "r4"])
# Prompts start with one of a few shared prefixes so prefix hits (and revivals of freed cached
# blocks) happen often; the tail is random.
SHARED_PREFIXES: tuple[list[int], ...] = ([], [7] * 12, [1, 2, 3, 4, 5, 6, 7, 8])
PROMPTS = st.builds(
    lambda prefix, tail: [*prefix, *tail] or [0],
    st.sampled_from(SHARED_PREFIXES),
    st.lists(st.integers(min_value=0, max_value=2), max_size=12),
)


class AllocatorMachine(RuleBasedStateMachine):
    """Random interleavings of the runner's calls: lookup, grow, compute/commit, give back
    leading blocks (a sliding window), free."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(num_blocks=9, block_size=BLOCK)
        # request id -> (tokens, tokens covered by blocks, tokens computed)
        self.requests: dict[str, tuple[list[int], int, int]] = {}

    @precondition(lambda self: len(self.requests) < 5)
    @rule(request_id=REQUEST_IDS, prompt=PROMPTS)
    def start(self, request_id: str, prompt: list[int]) -> None:
        if request_id in self.requests:
            return
        cached = self.allocator.match_prefix(request_id, prompt)
        assert cached % BLOCK == 0 and cached <= len(prompt) - 1
        assert self.allocator.block_table(request_id)[: cached // BLOCK] == (
            self.allocator.block_table(request_id)
        )
        self.requests[request_id] = (prompt, cached, cached)

    @rule(request_id=REQUEST_IDS, chunk=st.integers(min_value=1, max_value=10))
    def compute(self, request_id: str, chunk: int) -> None:
        if request_id not in self.requests:
            return
        prompt, _, computed = self.requests[request_id]
        end = min(len(prompt), computed + chunk)
        free_before = self.allocator.num_free_blocks
        table_before = self.allocator.block_table(request_id)
        try:
            self.allocator.allocate(request_id, end)
        except OutOfBlocksError:
            assert self.allocator.num_free_blocks == free_before
            assert self.allocator.block_table(request_id) == table_before
            # The runner preempts the request: free everything it holds.
            self.allocator.free(request_id)
            del self.requests[request_id]
            return
        assert len(self.allocator.block_table(request_id)) >= -(-end // BLOCK)
        self.allocator.commit(request_id, prompt, end)
        self.requests[request_id] = (prompt, end, end)

    @rule(request_id=REQUEST_IDS, extra=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append_output(self, request_id: str, extra: list[int]) -> None:
        if request_id in self.requests:
            prompt, covered, computed = self.requests[request_id]
            self.requests[request_id] = (prompt + extra, covered, computed)

    @rule(request_id=REQUEST_IDS, count=st.integers(min_value=0, max_value=4))
    def release_leading(self, request_id: str, count: int) -> None:
        if request_id not in self.requests:
            return
        table = self.allocator.block_table(request_id)
        held = self.allocator.num_held_blocks(request_id)
        newly = min(count, len(table)) - sum(1 for b in table[:count] if b == RESERVED_BLOCK_ID)
        freed = self.allocator.release_leading(request_id, count)
        assert 0 <= freed <= newly
        after = self.allocator.block_table(request_id)
        assert len(after) == len(table)  # positions keep their entries
        assert after[:count] == [RESERVED_BLOCK_ID] * min(count, len(table))
        assert after[count:] == table[count:]
        assert self.allocator.num_held_blocks(request_id) == held - newly

    @rule(request_id=REQUEST_IDS)
    def finish(self, request_id: str) -> None:
        self.allocator.free(request_id)
        self.requests.pop(request_id, None)

    @invariant()
    def blocks_are_consistent(self) -> None:
        allocator = self.allocator
        free = set(allocator.free_block_ids())
        assert RESERVED_BLOCK_ID not in free
        references: dict[int, int] = {}
        held_tables: dict[str, list[int]] = {}
        for request_id in self.requests:
            table = allocator.block_table(request_id)
            # Given-back entries lead the table; the rest are distinct real blocks.
            released = len(table) - allocator.num_held_blocks(request_id)
            assert table[:released] == [RESERVED_BLOCK_ID] * released
            held = held_tables[request_id] = table[released:]
            assert RESERVED_BLOCK_ID not in held
            assert len(set(held)) == len(held)
            for block_id in held:
                references[block_id] = references.get(block_id, 0) + 1
        for block_id in range(1, allocator.num_blocks):
            count = allocator.ref_count(block_id)
            assert count >= 0
            assert count == references.get(block_id, 0)
            # Free exactly when unreferenced: never both free and referenced.
            assert (block_id in free) == (count == 0)
        assert allocator.num_free_blocks == len(free)
        # Each request's shared blocks are exactly its blocks another request holds too.
        shared = {
            request_id: sum(1 for b in held_tables[request_id] if references[b] > 1)
            for request_id in self.requests
        }
        assert allocator.shared_block_counts() == {r: n for r, n in shared.items() if n}
        stats = allocator.stats
        assert 0 <= stats.hits <= stats.queries

    def teardown(self) -> None:
        for request_id in list(self.requests):
            self.allocator.free(request_id)
        allocator = self.allocator
        assert allocator.num_free_blocks == allocator.num_usable_blocks
        assert all(allocator.ref_count(block_id) == 0 for block_id in range(allocator.num_blocks))


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase
