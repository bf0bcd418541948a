"""Tests of stages/scheduler.py with small fake configs and hand-made step results."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.errors import InvalidRequestError
from stages.messages import (
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    Logprobs,
    ScheduledChunk,
    SchedulerStep,
    StepResult,
)
from stages.params import SamplingParams
from stages.policies import FcfsPolicy, PriorityPolicy, RequestView, ShortestJobFirstPolicy
from stages.scheduler import Scheduler, SchedulerConfig, SchedulerError
from stages.validation import resolve_max_tokens

EOS = 2
FILLER = 7  # a token that stops nothing


def engine_info(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128) -> EngineInfo:
    return EngineInfo(
        model="fake",
        vocab_size=100,
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
        num_blocks=num_blocks,
        block_size=block_size,
        dtype="float32",
        device="cpu",
        kv_cache_bytes=0,
        enable_prefix_caching=False,
    )


def request(request_id: str, num_prompt: int, **params: object) -> EngineRequest:
    params.setdefault("max_tokens", 8)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(10 + i % 50 for i in range(num_prompt)),
        params=SamplingParams(**params),  # type: ignore[arg-type]
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


class Execute:
    """A stand-in for the execute stage with an exact block allocator: it checks every
    step against the protocol and never lets an allocation exceed the free blocks. Like the
    real one it knows each request's tokens (prompt + what it sampled), so it decides by
    itself which chunks sample."""

    def __init__(self, info: EngineInfo) -> None:
        self.block_size = info.block_size
        self.total_blocks = info.num_blocks
        self.free = info.num_blocks
        self.held: dict[str, int] = {}  # request id -> blocks
        self.computed: dict[str, int] = {}  # request id -> tokens computed
        self.lengths: dict[str, int] = {}  # request id -> prompt + sampled tokens
        self.steps: list[SchedulerStep] = []

    def run(
        self,
        step: SchedulerStep,
        sample: Callable[[str], int] = lambda request_id: FILLER,
        preempt: Sequence[str] = (),
        cached_tokens: dict[str, int] | None = None,
        logprobs: bool = False,
    ) -> StepResult:
        self.steps.append(step)
        for request_id in (*step.finished, *step.preempted):
            assert request_id in self.computed, f"freeing unknown {request_id}"
            self.free += self.held.pop(request_id, 0)
            self.computed[request_id] = 0
        for request_id in step.finished:
            del self.computed[request_id], self.lengths[request_id]
        for new in step.new_requests:
            assert new.request_id not in self.computed, f"{new.request_id} sent twice"
            self.computed[new.request_id] = 0
            self.lengths[new.request_id] = len(new.prompt_token_ids)
        for request_id in preempt:  # execute runs short and drops these
            self.free += self.held.pop(request_id, 0)
            self.computed[request_id] = 0
        sampled: list[str] = []
        for chunk in step.chunks:
            if chunk.request_id in preempt:
                continue
            assert chunk.request_id in self.computed, f"chunk for unknown {chunk.request_id}"
            assert chunk.start == self.computed[chunk.request_id], "chunk does not continue"
            end = chunk.start + chunk.num_tokens
            assert end <= self.lengths[chunk.request_id], "chunk beyond the known tokens"
            needed = -(-end // self.block_size)
            extra = needed - self.held.get(chunk.request_id, 0)
            assert extra <= self.free, "scheduler planned more blocks than are free"
            self.free -= extra
            self.held[chunk.request_id] = needed
            self.computed[chunk.request_id] = end
            if end == self.lengths[chunk.request_id]:
                sampled.append(chunk.request_id)
                self.lengths[chunk.request_id] += 1
        return StepResult(
            step_id=step.step_id,
            request_ids=tuple(sampled),
            token_ids=tuple(sample(r) for r in sampled),
            free_blocks=self.free,
            total_blocks=self.total_blocks,
            logprob_request_ids=tuple(sampled) if logprobs else (),
            logprobs=tuple(Logprobs(token_id=FILLER, logprob=-0.5, rank=1) for _ in sampled)
            if logprobs
            else (),
            cached_tokens=cached_tokens or {},
            preempted=tuple(preempt),
            forward_seconds=0.01,
        )


def make(
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    long_prefill_chunk: int | None = None,
    policy: object = None,
    **info: int,
) -> tuple[Scheduler, Execute]:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, long_prefill_chunk),
        policy or FcfsPolicy(),  # type: ignore[arg-type]
        clock=FakeClock(),
    )
    details = engine_info(**info)
    scheduler.set_engine_info(details)
    return scheduler, Execute(details)


@dataclasses.dataclass
class Finished:
    tokens: dict[str, list[int]]
    reasons: dict[str, tuple[str, int | None]]


def collect(outputs: EngineOutputs, finished: Finished) -> None:
    for i, request_id in enumerate(outputs.request_ids):
        finished.tokens.setdefault(request_id, []).extend(outputs.new_token_ids[i])
        if outputs.finish_reasons[i] is not None:
            assert request_id not in finished.reasons, f"{request_id} finished twice"
            finished.reasons[request_id] = (outputs.finish_reasons[i], outputs.stop_reasons[i])  # type: ignore[assignment]


def step_once(
    scheduler: Scheduler,
    execute: Execute,
    sample: Callable[[str], int] = lambda request_id: FILLER,
    **kwargs: object,
) -> tuple[SchedulerStep, EngineOutputs]:
    step = scheduler.schedule()
    assert step is not None
    result = execute.run(step, sample, **kwargs)  # type: ignore[arg-type]
    return step, scheduler.update(result)


def always(token: int) -> Callable[[str], int]:
    return lambda request_id: token


def run_to_completion(
    scheduler: Scheduler,
    execute: Execute,
    sample: Callable[[str], int] = lambda request_id: FILLER,
    max_steps: int = 1000,
) -> Finished:
    finished = Finished({}, {})
    for _ in range(max_steps):
        if not scheduler.has_work():
            return finished
        _, outputs = step_once(scheduler, execute, sample)
        collect(outputs, finished)
    raise AssertionError("requests did not finish")


# ------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": -1},
        {"long_prefill_chunk": 0},
        {"max_num_seqs": 1.5},
    ],
)
def test_config_is_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_nothing_is_scheduled_before_engine_info() -> None:
    scheduler = Scheduler(SchedulerConfig(), FcfsPolicy(), clock=FakeClock())
    scheduler.add_request(request("a", 4))
    assert not scheduler.has_work()
    assert scheduler.schedule() is None


def test_duplicate_or_empty_requests_are_refused() -> None:
    scheduler, _ = make()
    scheduler.add_request(request("a", 4))
    with pytest.raises(InvalidRequestError, match="already scheduled") as info:
        scheduler.add_request(request("a", 4))
    assert info.value.field == "request_id"
    with pytest.raises(InvalidRequestError, match="empty"):
        scheduler.add_request(request("b", 0))


# ------------------------------------------------------------------------ batching


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    scheduler, execute = make(max_num_seqs=3, max_num_batched_tokens=16)
    for i in range(5):
        scheduler.add_request(request(f"r{i}", 10))
    step, _ = step_once(scheduler, execute)
    assert step.chunks == (ScheduledChunk("r0", 0, 10), ScheduledChunk("r1", 0, 6))
    assert [r.request_id for r in step.new_requests] == ["r0", "r1"]
    step, _ = step_once(scheduler, execute)
    # r0 decodes first, then r1 finishes its prompt, then r2 starts (3 running at most).
    assert step.chunks == (
        ScheduledChunk("r0", 10, 1),
        ScheduledChunk("r1", 6, 4),
        ScheduledChunk("r2", 0, 10),
    )
    for _ in range(6):
        step, _ = step_once(scheduler, execute)
        assert sum(c.num_tokens for c in step.chunks) <= 16
        assert scheduler.num_running <= 3
        assert {c.request_id for c in step.chunks} <= {"r0", "r1", "r2"}


def test_chunked_prefill_progresses_then_decodes() -> None:
    scheduler, execute = make(max_num_batched_tokens=10)
    scheduler.add_request(request("a", 25, max_tokens=3))
    chunks: list[ScheduledChunk] = []
    tokens: list[tuple[int, ...]] = []
    for _ in range(5):
        step, outputs = step_once(scheduler, execute)
        chunks.extend(step.chunks)
        tokens.extend(outputs.new_token_ids)
    assert chunks == [
        ScheduledChunk("a", 0, 10),
        ScheduledChunk("a", 10, 10),
        ScheduledChunk("a", 20, 5),  # reaches the end: samples
        ScheduledChunk("a", 25, 1),
        ScheduledChunk("a", 26, 1),
    ]
    assert tokens == [(FILLER,)] * 3
    assert outputs.finish_reasons == ("length",)
    free_only = scheduler.schedule()
    assert free_only is not None
    assert free_only.chunks == () and free_only.finished == ("a",)


def test_long_prefill_chunk_caps_one_request_per_step() -> None:
    scheduler, execute = make(max_num_batched_tokens=32, long_prefill_chunk=8)
    scheduler.add_request(request("a", 20))
    scheduler.add_request(request("b", 20))
    step, _ = step_once(scheduler, execute)
    assert step.chunks == (ScheduledChunk("a", 0, 8), ScheduledChunk("b", 0, 8))


def test_decodes_mix_with_a_new_prefill() -> None:
    scheduler, execute = make(max_num_batched_tokens=12)
    scheduler.add_request(request("old", 4, max_tokens=20))
    step_once(scheduler, execute)
    scheduler.add_request(request("new", 30))
    step, _ = step_once(scheduler, execute)
    assert step.chunks == (ScheduledChunk("old", 4, 1), ScheduledChunk("new", 0, 11))
    step, _ = step_once(scheduler, execute)
    assert step.chunks == (ScheduledChunk("old", 5, 1), ScheduledChunk("new", 11, 11))


def test_one_step_in_flight() -> None:
    scheduler, execute = make()
    scheduler.add_request(request("a", 4))
    step = scheduler.schedule()
    assert step is not None and scheduler.in_flight
    scheduler.add_request(request("b", 4))
    assert scheduler.schedule() is None
    scheduler.update(execute.run(step))
    assert not scheduler.in_flight
    next_step = scheduler.schedule()
    assert next_step is not None and next_step.step_id == step.step_id + 1


def test_results_that_break_the_contract_are_refused() -> None:
    scheduler, _ = make()
    with pytest.raises(SchedulerError, match="no step in flight"):
        scheduler.update(StepResult(0, (), (), 64, 64))
    scheduler.add_request(request("a", 4))
    step = scheduler.schedule()
    assert step is not None
    with pytest.raises(SchedulerError, match="does not answer"):
        scheduler.update(StepResult(step.step_id + 1, ("a",), (FILLER,), 63, 64))
    with pytest.raises(SchedulerError, match="no token"):
        scheduler.update(StepResult(step.step_id, (), (), 63, 64))

    scheduler, _ = make(max_num_batched_tokens=2)
    scheduler.add_request(request("a", 4))
    step = scheduler.schedule()
    assert step is not None
    with pytest.raises(SchedulerError, match="does not sample"):
        scheduler.update(StepResult(step.step_id, ("a",), (FILLER,), 63, 64))


def test_bad_policy_answers_are_refused() -> None:
    class DropsRequests(FcfsPolicy):
        def order_waiting(self, waiting: Sequence[RequestView]) -> Sequence[RequestView]:
            return list(waiting)[1:]

    scheduler, _ = make(policy=DropsRequests())
    scheduler.add_request(request("a", 4))
    scheduler.add_request(request("b", 4))
    with pytest.raises(SchedulerError, match="permutation"):
        scheduler.schedule()


# ------------------------------------------------------------------------ stops


def run_single(
    tokens: Sequence[int], num_prompt: int = 4, max_model_len: int = 128, **params: object
) -> tuple[list[int], tuple[str, int | None]]:
    scheduler, execute = make(max_model_len=max_model_len)
    scheduler.add_request(request("a", num_prompt, **params))
    script = iter(tokens)
    finished = run_to_completion(scheduler, execute, lambda request_id: next(script))
    return finished.tokens["a"], finished.reasons["a"]


def test_eos_stops_with_no_stop_reason() -> None:
    # vLLM: stop_reason names a stop token id or string, never EOS.
    assert run_single([5, 6, EOS, 9]) == ([5, 6, EOS], ("stop", None))
    # EOS is checked first, also when it is listed in stop_token_ids too.
    assert run_single([5, EOS], stop_token_ids=(EOS,)) == ([5, EOS], ("stop", None))


def test_stop_token_ids_stop() -> None:
    assert run_single([5, 42, 9], stop_token_ids=(42,)) == ([5, 42], ("stop", 42))


def test_max_tokens_ends_with_length() -> None:
    assert run_single([5] * 10, max_tokens=3) == ([5, 5, 5], ("length", None))


@pytest.mark.parametrize(("num_prompt", "min_tokens"), [(4, 0), (11, 1), (8, 2), (12, 0), (8, 5)])
def test_max_tokens_none_follows_the_one_rule(num_prompt: int, min_tokens: int) -> None:
    """A request without max_tokens that reaches the scheduler unresolved (a pipeline without
    admit) gets the limit admit would give it, from the same function, or the same error
    (it used to be clamped to 1 token, past the model's length, and min_tokens unchecked)."""
    params = SamplingParams(max_tokens=None, min_tokens=min_tokens)
    try:
        expected = resolve_max_tokens(
            params, prompt_tokens=num_prompt, max_model_len=12, request_id="a"
        )
    except InvalidRequestError as error:
        scheduler, _ = make(max_model_len=12)
        with pytest.raises(type(error)) as caught:
            scheduler.add_request(request("a", num_prompt, max_tokens=None, min_tokens=min_tokens))
        assert (str(caught.value), caught.value.field) == (str(error), error.field)
        assert not scheduler.has_request("a")
        return
    tokens, reason = run_single(
        [FILLER] * 20, num_prompt=num_prompt, max_model_len=12, max_tokens=None,
        min_tokens=min_tokens,
    )  # fmt: skip
    assert (len(tokens), reason) == (expected, ("length", None))


def test_model_length_ends_with_length() -> None:
    assert run_single([5] * 10, num_prompt=6, max_model_len=9) == ([5, 5, 5], ("length", None))


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    tokens, reason = run_single([EOS, 42, 5, EOS], min_tokens=3, stop_token_ids=(42,))
    assert (tokens, reason) == ([EOS, 42, 5, EOS], ("stop", None))
    tokens, reason = run_single([EOS, 42, 5], min_tokens=2, stop_token_ids=(42,))
    assert (tokens, reason) == ([EOS, 42], ("stop", 42))


def test_ignore_eos_runs_to_max_tokens() -> None:
    assert run_single([EOS] * 5, ignore_eos=True, max_tokens=4) == ([EOS] * 4, ("length", None))
    # Stop token ids still apply.
    assert run_single([EOS, 42], ignore_eos=True, stop_token_ids=(42,)) == (
        [EOS, 42],
        ("stop", 42),
    )


def test_a_finished_request_is_freed_in_the_next_step() -> None:
    scheduler, execute = make()
    scheduler.add_request(request("a", 4, max_tokens=1))
    scheduler.add_request(request("b", 4, max_tokens=5))
    _, outputs = step_once(scheduler, execute)
    assert outputs.finish_reasons == ("length", None)
    step, _ = step_once(scheduler, execute)
    assert step.finished == ("a",)
    assert "a" not in execute.computed


def test_outputs_carry_logprobs_cached_tokens_and_stats() -> None:
    scheduler, execute = make(max_num_batched_tokens=8)
    scheduler.add_request(request("a", 12, logprobs=0))
    _, outputs = step_once(scheduler, execute, cached_tokens={"a": 8}, logprobs=True)
    assert outputs.request_ids == ()  # the first chunk does not sample
    _, outputs = step_once(scheduler, execute, logprobs=True)
    assert outputs.request_ids == ("a",)
    assert outputs.num_cached_tokens == {"a": 8}
    assert outputs.logprobs == {"a": (Logprobs(token_id=FILLER, logprob=-0.5, rank=1),)}
    assert outputs.stats is not None
    assert outputs.stats.num_running == 1 and outputs.stats.num_steps == 2
    assert outputs.stats.kv_blocks_free == execute.free
    _, outputs = step_once(scheduler, execute)
    assert outputs.num_cached_tokens == {}  # reported once


# ------------------------------------------------------------------------ abort


def test_abort_while_idle_gives_a_free_only_step() -> None:
    scheduler, execute = make()
    scheduler.add_request(request("a", 4, max_tokens=100))
    step_once(scheduler, execute)
    scheduler.abort(["a", "never-seen"])
    assert scheduler.has_work()
    step = scheduler.schedule()
    assert step is not None
    assert step.chunks == () and step.finished == ("a",)
    outputs = scheduler.update(execute.run(step))
    assert outputs.request_ids == ()
    assert execute.free == execute.total_blocks
    assert not scheduler.has_work() and scheduler.schedule() is None


def test_abort_of_a_request_in_the_step_in_flight_drops_its_tokens() -> None:
    scheduler, execute = make()
    scheduler.add_request(request("a", 4, max_tokens=100))
    scheduler.add_request(request("b", 4, max_tokens=100))
    step = scheduler.schedule()
    assert step is not None
    scheduler.abort(["a"])
    outputs = scheduler.update(execute.run(step))
    assert outputs.request_ids == ("b",)
    next_step = scheduler.schedule()
    assert next_step is not None
    assert next_step.finished == ("a",)
    assert next_step.chunks == (ScheduledChunk("b", 4, 1),)


def test_abort_of_a_request_never_sent_needs_no_free() -> None:
    scheduler, _ = make()
    scheduler.add_request(request("a", 4))
    scheduler.abort(["a"])
    assert not scheduler.has_work()
    assert scheduler.schedule() is None


# ------------------------------------------------------------------------ preemption


def test_running_out_of_blocks_preempts_the_policy_victim_which_resumes() -> None:
    # 4 blocks of 4 tokens: two 7-token prompts fill 2 blocks each... after one decode each
    # needs a third block.
    scheduler, execute = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(request("first", 7, max_tokens=4))
    scheduler.add_request(request("second", 7, max_tokens=4))
    step_once(scheduler, execute)  # both prefill (2 blocks each), both sample
    step, _ = step_once(scheduler, execute)  # both decode token 8: still 2 blocks
    step, _ = step_once(scheduler, execute)  # token 9 needs a 3rd block each
    assert step.preempted == ("second",)  # FCFS: the latest arrival
    assert step.chunks == (ScheduledChunk("first", 8, 1),)
    assert scheduler.stats().num_preemptions == 1
    finished = run_to_completion(scheduler, execute)
    assert finished.reasons == {"first": ("length", None), "second": ("length", None)}
    resumed = [c for s in execute.steps for c in s.chunks if c.request_id == "second"]
    assert ScheduledChunk("second", 0, 9) in resumed  # recomputed prompt + outputs
    assert sum(1 for s in execute.steps for r in s.new_requests if r.request_id == "second") == 1


def test_priority_policy_preempts_the_least_urgent() -> None:
    scheduler, execute = make(
        num_blocks=4, block_size=4, max_num_batched_tokens=64, policy=PriorityPolicy()
    )
    scheduler.add_request(request("urgent-late", 7, max_tokens=4, priority=-5))
    scheduler.add_request(request("lazy", 7, max_tokens=4, priority=5))
    for _ in range(2):
        step_once(scheduler, execute)
    step, _ = step_once(scheduler, execute)
    assert step.preempted == ("lazy",)


def test_preempting_a_request_already_planned_returns_its_blocks_once() -> None:
    # 11 blocks of 4 tokens. "low" (priority 5) runs first; four urgent requests join.
    scheduler, execute = make(
        num_blocks=11, block_size=4, max_num_batched_tokens=64, policy=PriorityPolicy()
    )
    scheduler.add_request(request("low", 7, max_tokens=20, priority=5))
    step_once(scheduler, execute)  # low: 7 tokens computed, 2 blocks
    for name in "BCDE":
        scheduler.add_request(request(name, 8, max_tokens=20))
    step_once(scheduler, execute)  # low decodes in its blocks; B..E take 2 each: 1 left
    # Every request now needs a 3rd block. "low" is planned first and takes the last one;
    # then B preempts "low" (the largest priority value), which gives back its 3 blocks;
    # B, C and D take them and E, the latest of the urgent ones, has to give way.
    step, _ = step_once(scheduler, execute)
    assert step.preempted == ("low", "E")
    assert [c.request_id for c in step.chunks] == ["B", "C", "D"]
    assert execute.free == 2  # E's two blocks, freed by its preemption


def test_a_request_preempts_itself_when_it_is_the_victim() -> None:
    # SJF's victim is the longest remaining job, here the one that needs the block.
    scheduler, execute = make(
        num_blocks=4, block_size=4, max_num_batched_tokens=64, policy=ShortestJobFirstPolicy()
    )
    scheduler.add_request(request("long", 8, max_tokens=50))
    scheduler.add_request(request("short", 7, max_tokens=3))
    finished = Finished({}, {})
    step, outputs = step_once(scheduler, execute)  # each fills 2 blocks
    assert [c.request_id for c in step.chunks] == ["short", "long"]  # shortest first
    collect(outputs, finished)
    step, outputs = step_once(scheduler, execute)  # long needs a 3rd block for token 9
    collect(outputs, finished)
    assert step.preempted == ("long",)
    assert step.chunks == (ScheduledChunk("short", 7, 1),)
    rest = run_to_completion(scheduler, execute)
    finished.reasons.update(rest.reasons)
    assert set(finished.reasons) == {"short", "long"}
    # The KV cache holds 16 tokens, so "long" ends there: 8 prompt + 8 generated.
    assert len(finished.tokens["long"]) + len(rest.tokens["long"]) == 8
    assert finished.reasons["long"] == ("length", None)


def test_execute_initiated_preemption_is_recomputed() -> None:
    scheduler, execute = make()
    scheduler.add_request(request("a", 4, max_tokens=3))
    scheduler.add_request(request("b", 4, max_tokens=3))
    step_once(scheduler, execute)
    step, outputs = step_once(scheduler, execute, preempt=("b",))
    assert outputs.request_ids == ("a",)
    assert scheduler.stats().num_preemptions == 1
    step, _ = step_once(scheduler, execute)
    assert ScheduledChunk("b", 0, 5) in step.chunks
    assert step.preempted == ()  # execute already freed it
    finished = run_to_completion(scheduler, execute)
    assert finished.reasons["b"] == ("length", None)


def test_a_prompt_that_can_never_fit_ends_with_error() -> None:
    """Admit refuses such a prompt; a pipeline without admit still gets an answer."""
    scheduler, execute = make(num_blocks=2, block_size=4, max_model_len=100)
    scheduler.add_request(request("huge", 8))
    scheduler.add_request(request("ok", 3, max_tokens=2))
    finished = run_to_completion(scheduler, execute)
    assert finished.reasons == {"huge": ("error", None), "ok": ("length", None)}
    assert finished.tokens["huge"] == []


# ------------------------------------------------------------------------ randomized

POLICIES = {"fcfs": FcfsPolicy, "priority": PriorityPolicy, "sjf": ShortestJobFirstPolicy}


@dataclasses.dataclass(frozen=True)
class Workload:
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_chunk: int | None
    policy: str
    # (prompt length, max_tokens, priority, step at which it arrives)
    requests: list[tuple[int, int, int, int]]
    # One number per step: < 4 the API aborts a request, < 8 execute preempts one on its
    # own, > 90 every request sampling in that step draws EOS.
    events: list[int]


workloads = st.builds(
    Workload,
    block_size=st.integers(1, 6),
    num_blocks=st.integers(2, 24),
    max_model_len=st.integers(2, 64),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 40),
    long_prefill_chunk=st.none() | st.integers(1, 16),
    policy=st.sampled_from(sorted(POLICIES)),
    requests=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 24), st.integers(-2, 2), st.integers(0, 12)),
        min_size=1,
        max_size=14,
    ),
    events=st.lists(st.integers(0, 99), min_size=200, max_size=200),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_mirror_never_overplans_and_every_request_ends(workload: Workload) -> None:
    scheduler, execute = make(
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        long_prefill_chunk=workload.long_prefill_chunk,
        policy=POLICIES[workload.policy](),
        num_blocks=workload.num_blocks,
        block_size=workload.block_size,
        max_model_len=workload.max_model_len,
    )
    requests = [
        (arrival, request(f"r{i}", prompt, max_tokens=tokens, priority=priority))
        for i, (prompt, tokens, priority, arrival) in enumerate(workload.requests)
    ]
    pending = list(requests)
    events = workload.events
    finished = Finished({}, {})
    aborted: set[str] = set()
    for step_index in range(2000):
        for arrival, new in [p for p in pending if p[0] <= step_index]:
            scheduler.add_request(new)
            pending.remove((arrival, new))
        event = events[step_index % len(events)]
        live = sorted(set(scheduler._running) | set(scheduler._waiting))
        if event < 4 and live:
            victim = live[event % len(live)]
            scheduler.abort([victim])
            aborted.add(victim)
        if not scheduler.has_work():
            if not pending:
                break
            continue
        step = scheduler.schedule()
        assert step is not None, "has_work() but nothing scheduled"
        preempt: tuple[str, ...] = ()
        if 4 <= event < 8 and step.chunks:
            preempt = (step.chunks[event % len(step.chunks)].request_id,)
        token = EOS if event > 90 else FILLER
        # Execute's own allocator asserts that no allocation exceeds its free blocks.
        result = execute.run(step, always(token), preempt=preempt)
        collect(scheduler.update(result), finished)
        assert scheduler.num_running <= workload.max_num_seqs
        # The mirror holds exactly the blocks execute holds for every live request.
        for request_id, state in {**scheduler._running, **scheduler._waiting}.items():
            assert state.num_blocks == execute.held.get(request_id, 0), request_id
    else:
        raise AssertionError("the workload did not drain")

    added = {new.request_id for _, new in requests}
    assert set(finished.reasons) | aborted == added
    assert not set(finished.reasons) & aborted
    max_tokens = {new.request_id: new.params.max_tokens for _, new in requests}
    prompt_lengths = {new.request_id: len(new.prompt_token_ids) for _, new in requests}
    for request_id, (reason, stop_token) in finished.reasons.items():
        tokens = finished.tokens.get(request_id, [])
        assert len(tokens) <= max_tokens[request_id]
        if reason == "stop":
            assert tokens[-1] == EOS and stop_token is None
        elif reason == "error":  # a prompt the model's length or the KV cache cannot hold
            assert tokens == []
            room = min(workload.max_model_len, workload.num_blocks * workload.block_size)
            assert prompt_lengths[request_id] >= room
        else:
            assert reason == "length" and EOS not in tokens
    # Every block came back to execute once the last frees went out.
    assert execute.free == execute.total_blocks and not execute.computed


# ------------------------------------------------------------------------ timing


class SetClock:
    """A clock that reads what the test set."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_first_tokens_carry_queue_and_prefill_times_and_stats_the_step_tokens() -> None:
    clock = SetClock()
    scheduler = Scheduler(SchedulerConfig(1, 8), FcfsPolicy(), clock=clock)
    details = engine_info()
    scheduler.set_engine_info(details)
    execute = Execute(details)

    def step_at(schedule: float, update: float) -> EngineOutputs:
        clock.now = schedule
        step = scheduler.schedule()
        assert step is not None
        clock.now = update
        return scheduler.update(execute.run(step, lambda request_id: FILLER))

    clock.now = 1.0
    scheduler.add_request(request("a", 12, max_tokens=2))
    clock.now = 2.0
    scheduler.add_request(request("b", 4, max_tokens=1))
    outputs = step_at(3.0, 4.0)  # a's first 8 prompt tokens: no token yet
    assert outputs.scheduler_times == {}
    assert outputs.stats is not None and outputs.stats.step_tokens == 8
    outputs = step_at(5.0, 6.0)  # the rest of a's prompt: its first token
    assert outputs.scheduler_times == {"a": (3.0 - 1.0, 6.0 - 3.0)}
    assert outputs.stats is not None and outputs.stats.step_tokens == 4
    outputs = step_at(7.0, 8.0)  # a's second token ends it: reported once
    assert outputs.finish_reasons == ("length",) and outputs.scheduler_times == {}
    assert outputs.stats is not None and outputs.stats.step_tokens == 1
    outputs = step_at(9.0, 10.0)  # b waited for the one seat from 2.0 to 9.0
    assert outputs.scheduler_times == {"b": (9.0 - 2.0, 10.0 - 9.0)}
