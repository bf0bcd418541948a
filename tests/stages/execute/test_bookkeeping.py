"""Tests of stages/execute/bookkeeping.py with the real block allocator: where a (re)started
chunk computes from, how far its prefix hit may reach, which steps are refused."""

from __future__ import annotations

import dataclasses

import pytest

from stages.execute.allocator import BlockAllocator
from stages.execute.bookkeeping import (
    SpareBlocks,
    StepError,
    commit_chunk,
    plan_chunk,
    spare_blocks,
    validate_step,
)
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
from stages.params import SamplingParams

BLOCK = 4


@dataclasses.dataclass
class Tracked:
    request_id: str
    known: list[int]
    num_computed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.known)

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        return self.known[start:end]


def computed(allocator: BlockAllocator, request_id: str, prompt: list[int]) -> Tracked:
    """A request whose whole prompt is computed and published."""
    tracked = Tracked(request_id, prompt)
    allocator.allocate(request_id, len(prompt))
    commit_chunk(allocator, tracked, len(prompt))
    return tracked


def plan(
    allocator: BlockAllocator,
    request: Tracked,
    chunk: ScheduledChunk,
    spare: SpareBlocks | None = None,
) -> tuple[int | None, dict[str, int], list[str]]:
    cached: dict[str, int] = {}
    preempted: list[str] = []
    start = plan_chunk(allocator, request, chunk, cached, preempted, spare)
    return start, cached, preempted


def test_a_restart_past_0_computes_from_the_cache_hit() -> None:
    allocator = BlockAllocator(num_blocks=16, block_size=BLOCK)
    prompt = list(range(100, 113))  # 3 full blocks + 1
    computed(allocator, "holder", prompt)
    # The scheduler expects the 12 held tokens to be served: the chunk starts there.
    request = Tracked("new", [*prompt[:12], 7, 8])
    start, cached, _ = plan(allocator, request, ScheduledChunk("new", 12, 2))
    assert (start, cached) == (12, {"new": 12})
    assert allocator.block_table("new")[:3] == allocator.block_table("holder")[:3]


def test_a_shorter_hit_than_the_chunk_start_computes_the_gap() -> None:
    """Never expected of the scheduler, but if the cache serves less than the chunk assumes,
    the tokens in between are computed rather than skipped."""
    allocator = BlockAllocator(num_blocks=16, block_size=BLOCK)
    prompt = list(range(100, 113))
    computed(allocator, "holder", prompt[:4])  # only the first block is cached
    request = Tracked("new", prompt)
    start, cached, _ = plan(allocator, request, ScheduledChunk("new", 8, 5))
    assert (start, cached) == (4, {"new": 4})
    assert len(allocator.block_table("new")) == 4  # blocks up to the chunk's end


def test_hits_past_the_chunk_end_take_only_spare_blocks() -> None:
    allocator = BlockAllocator(num_blocks=9, block_size=BLOCK)  # 8 usable
    prompt = list(range(100, 125))  # 6 full blocks + 1
    holder = computed(allocator, "gone", prompt)
    allocator.free(holder.request_id)  # its 7 blocks: free, the 6 full ones cached
    # The two uncached free blocks go first, then the chain's tail: 5 cached blocks remain.
    allocator.allocate("other", 3 * BLOCK)
    assert allocator.num_free_blocks == 5
    assert allocator.lookup_prefix(prompt) == 5 * BLOCK
    request = Tracked("new", prompt)
    # A 4-token chunk is planned one block: the other four spare.
    step = SchedulerStep(0, chunks=(ScheduledChunk("new", 0, 4),))
    assert spare_blocks(allocator, {"new": request}, step) == SpareBlocks(4)
    spare = SpareBlocks(2)
    start, cached, _ = plan(allocator, request, step.chunks[0], spare)
    assert (start, cached) == (None, {"new": 3 * BLOCK})  # 1 planned + 2 spare blocks
    assert spare == SpareBlocks(0)
    allocator.free("new")
    request.num_computed = 0
    spare = SpareBlocks(5)
    start, cached, _ = plan(allocator, request, step.chunks[0], spare)
    assert (start, cached) == (None, {"new": 5 * BLOCK})  # the whole cached chain
    assert spare == SpareBlocks(1)  # four blocks past the chunk's end were revived


def test_preemption_when_the_step_runs_short_gives_the_plan_back() -> None:
    allocator = BlockAllocator(num_blocks=3, block_size=BLOCK)  # 2 usable
    allocator.allocate("hog", 2 * BLOCK)
    request = Tracked("new", list(range(6)))
    spare = SpareBlocks(0)
    start, _, preempted = plan(allocator, request, ScheduledChunk("new", 0, 6), spare)
    assert (start, preempted) == (None, ["new"])
    assert spare == SpareBlocks(2)  # the two planned blocks were not taken


def test_validate_step_lets_a_restart_begin_past_0_but_no_continuation_skip() -> None:
    new = EngineRequest("new", tuple(range(20)), SamplingParams())
    validate_step(SchedulerStep(0, (new,), (ScheduledChunk("new", 12, 8),)), {}, 100)
    running = Tracked("run", list(range(20)), num_computed=8)
    validate_step(SchedulerStep(1, chunks=(ScheduledChunk("run", 8, 4),)), {"run": running}, 100)
    with pytest.raises(StepError, match="starts past"):
        validate_step(
            SchedulerStep(1, chunks=(ScheduledChunk("run", 12, 4),)), {"run": running}, 100
        )
    # Preempted in the same step: it restarts, so it may start anywhere again.
    validate_step(
        SchedulerStep(2, chunks=(ScheduledChunk("run", 12, 4),), preempted=("run",)),
        {"run": running},
        100,
    )
