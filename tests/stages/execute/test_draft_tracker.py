"""The target's side of the draft model (stages/execute/draft_tracker.py), pure: which
requests draft after a step, how many tokens, the back-off, and what the draft model must
forget; the codec carries its messages (no pickle)."""

from __future__ import annotations

from stages.execute.draft_messages import DraftFeed, DraftProposals, DraftQuery, DraftReady
from stages.execute.draft_tracker import DraftTracker, with_dropped
from stages.messages import EngineRequest, SchedulerStep, StepResult
from stages.params import SamplingParams
from stages.speculative import SpeculativeConfig
from transports.codec import Codec

SPEC = SpeculativeConfig(
    method="draft_model", model="tiny", num_speculative_tokens=4, disable_by_batch_size=3
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _result(step_id: int, request_ids: tuple[str, ...], **extra: object) -> StepResult:
    return StepResult(step_id, request_ids, tuple(0 for _ in request_ids), 10, 10, **extra)  # type: ignore[arg-type]


def test_requests_draft_from_their_second_output_token_within_max_tokens() -> None:
    tracker = DraftTracker(SPEC)
    outputs: dict[str, list[int]] = {"a": [7], "b": [8]}
    step = SchedulerStep(
        1,
        new_requests=(
            EngineRequest("a", (1, 2), GREEDY),
            EngineRequest("b", (3,), SamplingParams(temperature=0.0, logprobs=1, max_tokens=9)),
        ),
    )
    queries, forget = tracker.observe(step, _result(1, ("a", "b")), outputs.__getitem__)
    assert (queries, forget) == ([], [])  # a first token goes out without a draft
    outputs["a"].extend(range(20, 27))  # 8 outputs of 10: one drafted token fits
    outputs["b"].append(9)
    queries, _ = tracker.observe(SchedulerStep(2), _result(2, ("a", "b")), outputs.__getitem__)
    # b asked for logprobs: it never drafts
    assert queries == [DraftQuery("a", (1, 2, 7, *range(20, 27)), 1)]


def test_a_wholly_rejected_draft_backs_off_and_finished_requests_are_forgotten() -> None:
    tracker = DraftTracker(SPEC)
    outputs = {"a": [5, 6]}
    step = SchedulerStep(1, new_requests=(EngineRequest("a", (1,), GREEDY),))
    queries, _ = tracker.observe(step, _result(1, ("a",)), outputs.__getitem__)
    assert [q.num_tokens for q in queries] == [4]
    missed = _result(2, ("a",), accepted_token_ids={"a": ()})
    queries, _ = tracker.observe(SchedulerStep(2), missed, outputs.__getitem__)
    assert queries == []  # skips a step after a total miss
    queries, forget = tracker.observe(
        SchedulerStep(3, finished=("a",), preempted=("p",)),
        _result(3, (), preempted=("q",)),
        outputs.__getitem__,
    )
    assert queries == [] and forget == ["a", "p", "q"]


def test_no_one_drafts_at_disable_by_batch_size() -> None:
    tracker = DraftTracker(SPEC)
    outputs = {name: [1, 2] for name in "abc"}
    step = SchedulerStep(1, new_requests=tuple(EngineRequest(n, (9,), GREEDY) for n in "abc"))
    queries, _ = tracker.observe(step, _result(1, ("a", "b", "c")), outputs.__getitem__)
    assert queries == []


def test_dropped_drafts_are_counted_on_the_result() -> None:
    result = _result(1, ("a",))
    assert with_dropped(result, 0) is result
    assert with_dropped(with_dropped(result, 2), 1).drafts_dropped == 3


def test_the_draft_messages_travel_through_the_codec() -> None:
    codec = Codec()
    for sent in (
        DraftFeed(3, (DraftQuery("a", (1, 2, 3), 4),), ("gone",)),
        DraftProposals(3, {"a": (5, 6)}),
        DraftProposals(4, error="RuntimeError: boom"),
        DraftReady("smollm2-135m"),
    ):
        payload, buffers = codec.encode(sent)
        assert codec.decode(payload, buffers) == sent
