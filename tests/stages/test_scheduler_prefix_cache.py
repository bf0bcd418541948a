"""The scheduler against execute's real KV bookkeeping (the block allocator with prefix caching
and the step functions the model runner and the null model share), with prompts that share
prefixes, under block pressure, with and without a model-wide sliding window (whose blocks
behind the window execute gives back after every step).

The scheduler plans with a mirror of the blocks; these tests check the mirror is exact, that a
planned step never needs more blocks than are free (execute would have to preempt on its own),
and that every workload drains: no preemption cycle (a livelock the old mirror had, found by a
randomized engine run: cached prefixes served past a chunk's end, shared blocks credited as
freed).

With speculative decoding (the n-gram proposer drafting over the prompts and the FILLER
outputs; execute accepts a draft's leading FILLER tokens, as a greedy target that always
samples FILLER would), drafted chunks reserve blocks for their drafts and roll back the
rejected tokens' slots: the mirror stays exact through that too.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.execute.allocator import RESERVED_BLOCK_ID, BlockAllocator
from stages.execute.bookkeeping import (
    PlanReport,
    commit_chunk,
    commit_drafted_chunk,
    plan_chunks,
    release,
    release_behind_windows,
    step_result,
    validate_step,
)
from stages.messages import EngineRequest, SchedulerStep, StepResult
from stages.params import SamplingParams
from stages.policies import FcfsPolicy, PriorityPolicy, ShortestJobFirstPolicy
from stages.scheduler import Scheduler, SchedulerConfig
from stages.speculative import SpeculativeConfig
from tests.stages.test_scheduler import FILLER, FakeClock, engine_info

POLICIES = {"fcfs": FcfsPolicy, "priority": PriorityPolicy, "sjf": ShortestJobFirstPolicy}


@dataclasses.dataclass
class _Tracked:
    request_id: str
    known: list[int]
    num_computed: int = 0
    num_cached: int = 0
    reads_prefix_cache: bool = True
    cache_key: bytes = b""  # no LoRA adapter (stages/lora.py)

    @property
    def num_tokens(self) -> int:
        return len(self.known)

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        return self.known[start:end]


class BookkeepingExecute:
    """Execute without a model: the real allocator and step bookkeeping; every sampling chunk
    draws ``FILLER``."""

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, window: int | None = None
    ) -> None:
        self.allocator = BlockAllocator(num_blocks + 1, block_size)
        self.max_model_len = max_model_len
        self.window = window
        self.requests: dict[str, _Tracked] = {}

    def run(self, step: SchedulerStep) -> StepResult:
        validate_step(step, self.requests, self.max_model_len)
        release(self.allocator, self.requests, step)
        for new in step.new_requests:
            self.requests[new.request_id] = _Tracked(new.request_id, list(new.prompt_token_ids))
        drafts = {c.request_id: c.draft_token_ids for c in step.chunks if c.draft_token_ids}
        for request_id, draft in drafts.items():
            self.requests[request_id].known.extend(draft)
        report = PlanReport()
        planned = plan_chunks(self.allocator, self.requests, step.chunks, report)
        for request_id in report.preempted:
            if request_id in drafts:
                del self.requests[request_id].known[-len(drafts.pop(request_id)) :]
        sampled = [tracked for tracked, _, end in planned if end == tracked.num_tokens]
        accepted: dict[str, tuple[int, ...]] = {}
        for tracked, _, end in planned:
            draft = drafts.get(tracked.request_id, ())
            if not draft:
                commit_chunk(self.allocator, tracked, end)
                continue
            taken = 0
            while taken < len(draft) and draft[taken] == FILLER:
                taken += 1
            rejected = len(draft) - taken
            del tracked.known[len(tracked.known) - rejected :]
            commit_drafted_chunk(self.allocator, tracked, end, rejected)
            accepted[tracked.request_id] = draft[:taken]
        release_behind_windows(self.allocator, self.requests, step, report, self.window)
        for tracked in sampled:
            tracked.known.append(FILLER)
        result = step_result(
            step,
            self.allocator,
            request_ids=[tracked.request_id for tracked in sampled],
            token_ids=[FILLER] * len(sampled),
            logprob_request_ids=(),
            logprobs=(),
            report=report,
            num_computed_tokens=0,
            forward_seconds=0.01,
        )
        return dataclasses.replace(result, accepted_token_ids=accepted)


@dataclasses.dataclass(frozen=True)
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_chunk: int | None
    policy: str
    window: int | None  # a window on every layer (None: full attention)
    speculative: int  # tokens drafted per step (0: no speculative decoding)
    # (shared prefix index, prefix tokens kept, own tail length, max_tokens, priority, arrival)
    requests: list[tuple[int, int, int, int, int, int]]


PREFIXES = ([7] * 24, list(range(20, 44)), list(range(20, 32)) + [5] * 12)

workloads = st.builds(
    Workload,
    block_size=st.integers(1, 5),
    num_blocks=st.integers(4, 40),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 40),
    long_prefill_chunk=st.none() | st.integers(1, 12),
    policy=st.sampled_from(sorted(POLICIES)),
    window=st.none() | st.integers(1, 14),
    speculative=st.integers(0, 4),
    requests=st.lists(
        st.tuples(
            st.integers(0, len(PREFIXES) - 1),
            st.integers(0, 24),
            st.integers(0, 8),
            st.integers(1, 16),
            st.integers(-2, 2),
            st.integers(0, 10),
        ),
        min_size=1,
        max_size=12,
    ),
)


def _prompt(index: int, prefix: int, kept: int, tail: int) -> tuple[int, ...]:
    return (*PREFIXES[prefix][:kept], *(50 + (index * 7 + j) % 40 for j in range(tail))) or (1,)


def _drain(
    workload: Workload, max_model_len: int = 64
) -> tuple[Scheduler, BookkeepingExecute, list[SchedulerStep]]:
    info = dataclasses.replace(
        engine_info(workload.num_blocks, workload.block_size, max_model_len),
        enable_prefix_caching=True,
        sliding_window=workload.window,
    )
    speculative = None
    if workload.speculative:
        speculative = SpeculativeConfig(
            num_speculative_tokens=workload.speculative,
            prompt_lookup_max=3,
            prompt_lookup_min=1,
            disable_by_batch_size=workload.max_num_seqs + 1,
        )
    scheduler = Scheduler(
        SchedulerConfig(
            workload.max_num_seqs,
            workload.max_num_batched_tokens,
            workload.long_prefill_chunk,
            speculative_config=speculative,
        ),
        POLICIES[workload.policy](),
        clock=FakeClock(),
    )
    scheduler.set_engine_info(info)
    execute = BookkeepingExecute(
        info.num_blocks, info.block_size, info.max_model_len, workload.window
    )
    pending = [
        (arrival, EngineRequest(f"r{i}", _prompt(i, p, kept, tail), SamplingParams(
            max_tokens=max_tokens, priority=priority, ignore_eos=True)))
        for i, (p, kept, tail, max_tokens, priority, arrival) in enumerate(workload.requests)
    ]  # fmt: skip
    ended: set[str] = set()
    steps: list[SchedulerStep] = []
    for step_index in range(3000):
        for item in [item for item in pending if item[0] <= step_index]:
            scheduler.add_request(item[1])
            pending.remove(item)
        if not scheduler.has_work():
            if not pending:
                break
            continue
        step = scheduler.schedule()
        assert step is not None
        steps.append(step)
        result = execute.run(step)
        assert result.preempted == (), "the plan needed more blocks than were free"
        outputs = scheduler.update(result)
        ended |= {
            request_id
            for request_id, reason in zip(outputs.request_ids, outputs.finish_reasons)
            if reason is not None
        }
        for request_id, state in scheduler._running.items():
            table = execute.allocator.block_table(request_id)
            assert len(table) == -(-state.num_computed_tokens // workload.block_size)
            held = execute.allocator.num_held_blocks(request_id)
            assert state.num_blocks == held, request_id
            assert held == sum(1 for block in table if block != RESERVED_BLOCK_ID)
    else:
        raise AssertionError("the workload did not drain (a preemption cycle?)")
    assert ended == {f"r{i}" for i in range(len(workload.requests))}
    return scheduler, execute, steps


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_shared_prefixes_under_block_pressure_drain_with_an_exact_mirror(
    workload: Workload,
) -> None:
    _, execute, _ = _drain(workload)
    allocator = execute.allocator
    assert not execute.requests
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    assert allocator.shared_block_counts() == {}


def test_one_token_chunks_over_shared_prefixes_under_block_pressure_drain() -> None:
    # The shape of the engine run that cycled for ever before (tiny chunks, small blocks,
    # prompts sharing a prefix, a cache too small for all of them at once).
    workload = Workload(
        block_size=2,
        num_blocks=16,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        long_prefill_chunk=1,
        policy="fcfs",
        window=None,
        speculative=0,
        requests=[
            (0, 24, 2, 8, 0, 0),
            (0, 24, 3, 8, 0, 0),
            (0, 20, 0, 8, 0, 1),
            (0, 24, 1, 6, 0, 2),
        ],
    )
    scheduler, _, _ = _drain(workload)
    assert scheduler.stats().prefix_cache_hits > 0


def test_drafts_are_accepted_and_rejected_under_block_pressure_with_an_exact_mirror() -> None:
    # FILLER prompts draft FILLER (accepted), the counting prompt drafts its own tokens
    # (rejected, rolled back); blocks are short, so drafts are cut and requests preempted.
    workload = Workload(
        block_size=2,
        num_blocks=14,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        long_prefill_chunk=None,
        policy="fcfs",
        window=None,
        speculative=4,
        requests=[(0, 6, 0, 14, 0, 0), (1, 12, 0, 10, 0, 0), (0, 4, 2, 12, 0, 1)],
    )
    scheduler, execute, steps = _drain(workload)
    stats = scheduler.stats()
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert max(len(c.draft_token_ids) for step in steps for c in step.chunks) >= 2
    assert execute.allocator.num_free_blocks == execute.allocator.num_usable_blocks


def test_a_cached_prompt_is_served_in_one_step_whatever_the_chunk_size() -> None:
    workload = Workload(
        block_size=4,
        num_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        long_prefill_chunk=8,
        policy="fcfs",
        window=None,
        speculative=0,
        # the same 24-token prompt twice, the second after the first has finished
        requests=[(1, 24, 0, 1, 0, 0), (1, 24, 0, 1, 0, 40)],
    )
    scheduler, _, steps = _drain(workload)
    chunks = {
        request_id: [(c.start, c.num_tokens) for step in steps for c in step.chunks
                     if c.request_id == request_id]
        for request_id in ("r0", "r1")
    }  # fmt: skip
    assert chunks["r0"] == [(0, 8), (8, 8), (16, 8)]
    # Every full block but the last token's came from the cache in the first chunk's step,
    # past the chunk's end (the cache had blocks to spare): 20 of 24 tokens.
    assert chunks["r1"] == [(0, 8), (20, 4)]
    assert scheduler.stats().prefix_cache_hits == 20


def test_a_request_sits_out_a_step_rather_than_preempt_itself_on_a_lower_bound() -> None:
    # b and c hold one block each that the other holds too (same prompt, shared): preempting
    # c is credited nothing, though b's own preemption would free their block in fact. b then
    # waits one step for execute's exact count instead of preempting itself (which, repeated
    # after every re-admission, could cycle).
    scheduler = Scheduler(SchedulerConfig(8, 32), FcfsPolicy(), clock=FakeClock())
    scheduler.set_engine_info(engine_info(num_blocks=4, block_size=1))
    for request_id, prompt in (("a", (5,)), ("b", (9,)), ("c", (9,))):
        scheduler.add_request(
            EngineRequest(request_id, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        )
    first = scheduler.schedule()
    assert first is not None and [c.request_id for c in first.chunks] == ["a", "b", "c"]
    scheduler.update(
        StepResult(
            step_id=first.step_id,
            request_ids=("a", "b", "c"),
            token_ids=(FILLER,) * 3,
            free_blocks=1,
            total_blocks=4,
            shared_blocks={"b": 1, "c": 1},
        )
    )
    second = scheduler.schedule()
    assert second is not None
    assert [c.request_id for c in second.chunks] == ["a"]
    assert second.preempted == ("c",)
    assert "b" in scheduler._running  # not preempted: it sits this step out
