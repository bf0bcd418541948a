"""Several steps in flight (pipeline parallelism's micro-batches, stages/steps_in_flight.py):
the scheduler against execute's real KV bookkeeping (the block allocator with prefix caching
and the step functions the model runner uses), split as the pipeline-parallel execute stage
splits a step: ``prepare`` (free, register, allocate) when the step arrives, ``finish``
(commit, give back what fell behind a window, sample, report) when its tokens return, with
other steps prepared in between. Hypothesis draws the workloads, the interleaving of
planning, preparing and finishing (results in any order), and aborts mid-flight.

Checked: a request is in at most one step in flight; a planned step never needs more blocks
than execute has free when it prepares it (execute never preempts); the mirror is exact for
every request not in flight; every workload drains, its aborted requests freed after their
results.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.execute.allocator import RESERVED_BLOCK_ID, BlockAllocator
from stages.execute.bookkeeping import (
    PlanReport,
    commit_chunk,
    plan_chunks,
    release,
    release_behind_windows,
    step_result,
    validate_step,
)
from stages.messages import EngineRequest, SchedulerStep, StepResult
from stages.params import SamplingParams
from stages.scheduler import Scheduler, SchedulerConfig, SchedulerError
from stages.steps_in_flight import bubble_fraction, fair_share, free_after, sum_shard_seconds
from tests.stages.test_scheduler import FILLER, FakeClock, engine_info
from tests.stages.test_scheduler_prefix_cache import (
    POLICIES,
    PREFIXES,
    _prompt,
    _Tracked,
)


@dataclasses.dataclass
class _Prepared:
    step: SchedulerStep
    report: PlanReport
    planned: list[tuple[_Tracked, int, int]]


class SplitExecute:
    """Execute without a model, a step in two halves (as stages/execute/pp_stage.py runs it):
    every sampling chunk draws ``FILLER``."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, window: int | None):
        self.allocator = BlockAllocator(num_blocks + 1, block_size)
        self.max_model_len = max_model_len
        self.window = window
        self.requests: dict[str, _Tracked] = {}
        self.prepared_through = -1

    def prepare(self, step: SchedulerStep) -> _Prepared:
        validate_step(step, self.requests, self.max_model_len)
        release(self.allocator, self.requests, step)
        for new in step.new_requests:
            self.requests[new.request_id] = _Tracked(new.request_id, list(new.prompt_token_ids))
        report = PlanReport()
        planned = plan_chunks(self.allocator, self.requests, step.chunks, report, step.spare_blocks)
        self.prepared_through = step.step_id
        return _Prepared(step, report, planned)

    def finish(self, prepared: _Prepared) -> StepResult:
        sampled = [t for t, _, end in prepared.planned if end == t.num_tokens]
        for tracked, _, end in prepared.planned:
            commit_chunk(self.allocator, tracked, end)
        release_behind_windows(
            self.allocator, self.requests, prepared.step, prepared.report, self.window
        )
        for tracked in sampled:
            tracked.known.append(FILLER)
        result = step_result(
            prepared.step,
            self.allocator,
            request_ids=[tracked.request_id for tracked in sampled],
            token_ids=[FILLER] * len(sampled),
            logprob_request_ids=(),
            logprobs=(),
            report=prepared.report,
            num_computed_tokens=0,
            forward_seconds=0.01,
        )
        return dataclasses.replace(result, prepared_through=self.prepared_through)


@dataclasses.dataclass(frozen=True)
class Workload:
    steps_in_flight: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_chunk: int | None
    policy: str
    window: int | None
    # (shared prefix index, prefix tokens kept, own tail length, max_tokens, priority, arrival)
    requests: list[tuple[int, int, int, int, int, int]]
    # each tick: 0 plan, 1 prepare the oldest unprepared step, 2 finish a prepared step
    # (the one ``pick`` indexes), 3 abort a live request (``pick``)
    actions: list[tuple[int, int]]


workloads = st.builds(
    Workload,
    steps_in_flight=st.integers(2, 4),
    block_size=st.integers(1, 5),
    num_blocks=st.integers(4, 40),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 40),
    long_prefill_chunk=st.none() | st.integers(1, 12),
    policy=st.sampled_from(sorted(POLICIES)),
    window=st.none() | st.integers(1, 14),
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
    actions=st.lists(
        st.tuples(st.sampled_from((0, 0, 1, 1, 2, 2, 3)), st.integers(0, 30)), max_size=200
    ),
)


def _drain(workload: Workload) -> tuple[Scheduler, SplitExecute, int]:
    """Run ``workload`` to the end; return the scheduler, execute and the most steps that
    were in flight at once."""
    info = dataclasses.replace(
        engine_info(workload.num_blocks, workload.block_size, 64),
        enable_prefix_caching=True,
        sliding_window=workload.window,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            workload.max_num_seqs,
            workload.max_num_batched_tokens,
            workload.long_prefill_chunk,
            max_steps_in_flight=workload.steps_in_flight,
        ),
        POLICIES[workload.policy](),
        clock=FakeClock(),
    )
    scheduler.set_engine_info(info)
    execute = SplitExecute(info.num_blocks, info.block_size, info.max_model_len, workload.window)
    pending = [
        (arrival, EngineRequest(f"r{i}", _prompt(i, p, kept, tail), SamplingParams(
            max_tokens=max_tokens, priority=priority, ignore_eos=True)))
        for i, (p, kept, tail, max_tokens, priority, arrival) in enumerate(workload.requests)
    ]  # fmt: skip
    ended: set[str] = set()
    aborted: set[str] = set()
    planned: list[SchedulerStep] = []  # sent, not prepared yet (in order)
    prepared: list[_Prepared] = []  # prepared, result not taken yet
    most = 0
    actions = iter(workload.actions)
    for tick in range(5000):
        for item in [item for item in pending if item[0] <= tick // 3]:
            scheduler.add_request(item[1])
            pending.remove(item)
        # after the drawn actions: plan, plan, prepare, prepare, finish, finish, ...
        action, pick = next(actions, ((tick % 6) // 2, tick))
        if action == 3:
            live = sorted(scheduler._running) + sorted(scheduler._waiting)
            if live:
                victim = live[pick % len(live)]
                scheduler.abort((victim,))
                aborted.add(victim)
            continue
        if action == 0 or (not planned and not prepared):
            step = scheduler.schedule()
            if step is not None:
                in_flight = [c.request_id for s in planned for c in s.chunks]
                in_flight += [c.request_id for p in prepared for c in p.step.chunks]
                assert not {c.request_id for c in step.chunks} & set(in_flight)
                planned.append(step)
                most = max(most, len(planned) + len(prepared))
            elif not planned and not prepared and not scheduler.has_work() and not pending:
                break
            continue
        if (action == 1 and planned) or not prepared:
            prepared.append(execute.prepare(planned.pop(0)))
            assert prepared[-1].report.preempted == [], "the plan needed more blocks than free"
            continue
        result = execute.finish(prepared.pop(pick % len(prepared)))
        outputs = scheduler.update(result)
        ended |= {
            request_id
            for request_id, reason in zip(outputs.request_ids, outputs.finish_reasons)
            if reason is not None
        }
        busy = {c.request_id for s in planned for c in s.chunks}
        busy |= {c.request_id for p in prepared for c in p.step.chunks}
        for request_id, state in scheduler._running.items():
            if request_id in busy:
                continue  # its blocks are charged in full until its result
            table = execute.allocator.block_table(request_id)
            assert len(table) == -(-state.num_computed_tokens // workload.block_size)
            held = execute.allocator.num_held_blocks(request_id)
            assert state.num_blocks == held, request_id
            assert held == sum(1 for block in table if block != RESERVED_BLOCK_ID)
    else:
        raise AssertionError("the workload did not drain (a preemption cycle?)")
    assert ended | aborted == {f"r{i}" for i in range(len(workload.requests))}
    return scheduler, execute, most


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(workloads)
def test_steps_in_flight_over_shared_prefixes_keep_the_mirror_exact_and_drain(
    workload: Workload,
) -> None:
    _, execute, _ = _drain(workload)
    allocator = execute.allocator
    assert not execute.requests
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    assert allocator.shared_block_counts() == {}


def test_a_batch_that_arrives_at_once_splits_over_the_steps_in_flight() -> None:
    scheduler = Scheduler(
        SchedulerConfig(8, 256, max_steps_in_flight=2), POLICIES["fcfs"](), clock=FakeClock()
    )
    scheduler.set_engine_info(engine_info(num_blocks=64, block_size=4))
    for index in range(5):
        scheduler.add_request(
            EngineRequest(f"r{index}", (1, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True))
        )
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first is not None and second is not None
    assert [c.request_id for c in first.chunks] == ["r0", "r1", "r2"]
    assert [c.request_id for c in second.chunks] == ["r3", "r4"]
    assert scheduler.schedule() is None  # two in flight: the most
    assert scheduler.num_in_flight == 2
    # the second's result first: a step's result may come back before an older one's
    update = scheduler.update(
        StepResult(
            second.step_id, ("r3", "r4"), (FILLER, FILLER), free_blocks=62, total_blocks=64,
            prepared_through=second.step_id,
        )
    )  # fmt: skip
    assert update.request_ids == ("r3", "r4")
    third = scheduler.schedule()
    assert third is not None and [c.request_id for c in third.chunks] == ["r3", "r4"]
    with pytest.raises(SchedulerError, match="does not answer step 0 or 2"):
        scheduler.update(StepResult(7, (), (), free_blocks=1, total_blocks=64))


def test_an_abort_mid_flight_frees_the_request_after_its_result() -> None:
    scheduler = Scheduler(
        SchedulerConfig(8, 256, max_steps_in_flight=2), POLICIES["fcfs"](), clock=FakeClock()
    )
    scheduler.set_engine_info(engine_info(num_blocks=64, block_size=4))
    for request_id in ("a", "b"):
        scheduler.add_request(
            EngineRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True))
        )
    first = scheduler.schedule()
    assert first is not None and [c.request_id for c in first.chunks] == ["a"]
    scheduler.abort(("a",))
    # a's chunk is in flight: the next step does not free it (execute samples it first)
    second = scheduler.schedule()
    assert second is not None and second.finished == () and second.chunks[0].request_id == "b"
    # a new request of the same id waits until the old one is freed
    scheduler.add_request(EngineRequest("a", (4, 5), SamplingParams(max_tokens=2, ignore_eos=True)))
    update = scheduler.update(
        StepResult(first.step_id, ("a",), (FILLER,), free_blocks=62, total_blocks=64,
                   prepared_through=second.step_id)
    )  # fmt: skip
    assert update.request_ids == ()  # an aborted request's token is dropped
    third = scheduler.schedule()
    assert third is not None and third.finished == ("a",)
    assert [r.request_id for r in third.new_requests] == ["a"]


def test_the_free_count_discounts_the_steps_execute_had_not_prepared() -> None:
    result = StepResult(3, (), (), free_blocks=20, total_blocks=64, prepared_through=4)
    assert free_after(result, [(4, 5), (5, 3), (6, -2)]) == 20 - 3 + 2
    alone = StepResult(3, (), (), free_blocks=20, total_blocks=64)
    assert free_after(alone, [(4, 5)]) == 15


def test_fair_share_bubble_and_shard_seconds() -> None:
    assert [fair_share(n, 2) for n in (0, 1, 2, 5)] == [1, 1, 1, 3]
    assert fair_share(7, 3) == 3
    assert sum_shard_seconds((), (0.5, 0.25)) == (0.5, 0.25)
    assert sum_shard_seconds((1.0, 1.0), ()) == (1.0, 1.0)
    assert sum_shard_seconds((1.0, 1.0), (0.5, 0.25, 0.125)) == (1.5, 1.25, 0.125)
    # two shards busy 3 s and 1 s over 4 s: 8 shard-seconds, 4 busy
    assert bubble_fraction((3.0, 1.0), 4.0) == pytest.approx(0.5)
    assert bubble_fraction((), 4.0) == 0.0
    with pytest.raises(ValueError, match="wall_seconds"):
        bubble_fraction((1.0,), -1.0)
