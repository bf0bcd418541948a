"""stages/execute/drafter.py: the draft model beside the target in the execute stage, driven
by real steps of the tiny model (docs/speculative.md): its drafts are its own greedy
continuation, its cache is rolled back to what the target accepted, and it is freed with the
target's blocks (finish, preemption)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.execute.config import ExecuteConfig
from stages.execute.drafter import CATCH_UP_TOKENS, Drafter, DraftQuery
from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
from stages.params import SamplingParams
from stages.speculative import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPT = (100, 200, 300, 400, 500, 100, 200, 300, 400, 500, 100, 200)


def _drafter(model: Path, k: int = 4) -> Drafter:
    spec = SpeculativeConfig("draft_model", k, model=str(model), disable_by_batch_size=64)
    config = ExecuteConfig(model=str(model), num_blocks=64, block_size=4, speculative_config=spec)
    target = ModelRunner(config)
    target.load()
    drafter = Drafter(config, target)
    drafter.load()
    return drafter


@pytest.fixture(scope="module")
def drafter(tiny_model_dir: Path) -> Drafter:
    return _drafter(tiny_model_dir)


def _greedy(runner: ModelRunner, request_id: str, prompt: tuple[int, ...], count: int) -> list[int]:
    """The target's own greedy continuation, one token a step (a fresh request)."""
    step = 1000
    result = runner.execute(
        SchedulerStep(
            step,
            new_requests=(EngineRequest(request_id, prompt, GREEDY),),
            chunks=(ScheduledChunk(request_id, 0, len(prompt)),),
        )
    )
    tokens = list(result.token_ids)
    while len(tokens) < count:
        step += 1
        position = len(prompt) + len(tokens) - 1
        tokens += runner.execute(
            SchedulerStep(step, chunks=(ScheduledChunk(request_id, position, 1),))
        ).token_ids
    runner.execute(SchedulerStep(step + 1, finished=(request_id,)))
    return tokens


def test_a_model_drafting_for_itself_drafts_its_own_greedy_continuation(
    drafter: Drafter,
) -> None:
    target, draft = drafter.target, drafter.runner
    assert draft is not None and draft.allocator is not None
    expected = _greedy(target, "ref", PROMPT, 13)
    result = drafter.execute(
        SchedulerStep(
            1,
            new_requests=(EngineRequest("a", PROMPT, GREEDY),),
            chunks=(ScheduledChunk("a", 0, len(PROMPT)),),
        )
    )
    # the first token goes out without waiting for the draft model's prefill
    assert list(result.token_ids) == expected[:1]
    assert result.draft_token_ids == {}
    result = drafter.execute(SchedulerStep(2, chunks=(ScheduledChunk("a", len(PROMPT), 1),)))
    assert list(result.token_ids) == expected[1:2]
    assert result.draft_token_ids == {"a": tuple(expected[2:6])}
    # the target verifies the draft (all accepted: the same model), the next draft follows
    draft_step = ScheduledChunk("a", len(PROMPT) + 1, 5, tuple(expected[2:6]))
    result = drafter.execute(SchedulerStep(3, chunks=(draft_step,)))
    assert result.accepted_token_ids == {"a": tuple(expected[2:6])}
    assert list(result.token_ids) == expected[6:7]
    assert result.draft_token_ids == {"a": tuple(expected[7:11])}
    # a rejected draft: the target sends a wrong one; the drafter's cache rolls back to the
    # accepted tokens and drafts on from the target's correction
    wrong = (expected[7], 7, 7, 7)
    result = drafter.execute(
        SchedulerStep(4, chunks=(ScheduledChunk("a", len(PROMPT) + 6, 5, wrong),))
    )
    assert result.accepted_token_ids == {"a": (expected[7],)}
    assert list(result.token_ids) == expected[8:9]
    assert result.draft_token_ids == {"a": tuple(expected[9:13])}
    # finished: the draft cache is freed with the target's blocks
    drafter.execute(SchedulerStep(5, finished=("a",)))
    drafter.propose([])  # its next step frees what was dropped
    assert draft.allocator.num_free_blocks == draft.allocator.num_usable_blocks
    assert not draft.has_request("a")


def test_preemption_frees_the_draft_cache_and_a_resumed_request_drafts_again(
    drafter: Drafter,
) -> None:
    target, draft = drafter.target, drafter.runner
    assert draft is not None and draft.allocator is not None
    expected = _greedy(target, "ref", PROMPT, 7)
    drafter.execute(
        SchedulerStep(
            10,
            new_requests=(EngineRequest("p", PROMPT, GREEDY),),
            chunks=(ScheduledChunk("p", 0, len(PROMPT)),),
        )
    )
    result = drafter.execute(SchedulerStep(11, chunks=(ScheduledChunk("p", len(PROMPT), 1),)))
    assert result.draft_token_ids == {"p": tuple(expected[2:6])}
    # preempted by the scheduler: both caches give its blocks back
    drafter.execute(SchedulerStep(12, preempted=("p",)))
    drafter.propose([])
    assert not draft.has_request("p")
    assert draft.allocator.num_free_blocks == draft.allocator.num_usable_blocks
    # resumed (recomputed from 0): the drafter registers it again with all its tokens
    result = drafter.execute(SchedulerStep(13, chunks=(ScheduledChunk("p", 0, len(PROMPT) + 2),)))
    assert list(result.token_ids) == expected[2:3]
    assert result.draft_token_ids == {"p": tuple(expected[3:7])}
    drafter.execute(SchedulerStep(14, finished=("p",)))


def test_requests_that_may_not_draft_get_no_draft_and_max_tokens_cuts_it(
    drafter: Drafter,
) -> None:
    logprobs = SamplingParams(temperature=0.0, max_tokens=64, logprobs=1, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    drafter.execute(
        SchedulerStep(
            20,
            new_requests=(
                EngineRequest("l", PROMPT, logprobs),
                EngineRequest("s", PROMPT, short),
            ),
            chunks=(
                ScheduledChunk("l", 0, len(PROMPT)),
                ScheduledChunk("s", 0, len(PROMPT)),
            ),
        )
    )
    result = drafter.execute(
        SchedulerStep(
            21,
            chunks=(ScheduledChunk("l", len(PROMPT), 1), ScheduledChunk("s", len(PROMPT), 1)),
        )
    )
    # "s" has 2 tokens left: at most 1 drafted (the step after it brings one of its own)
    assert set(result.draft_token_ids) == {"s"}
    assert len(result.draft_token_ids["s"]) == 1
    drafter.execute(SchedulerStep(22, finished=("l", "s")))


def test_the_drafter_answers_queries_as_a_component(drafter: Drafter) -> None:
    # its message interface: tokens in, proposals out (no target step involved)
    expected = _greedy(drafter.target, "ref", PROMPT, 5)
    proposals = drafter.propose([DraftQuery("q", PROMPT, 3)])
    assert proposals == {"q": tuple(expected[:3])}
    # the target accepted one and corrected the next: the draft continues from there
    again = drafter.propose([DraftQuery("q", (*PROMPT, *expected[:2]), 3)])
    assert again == {"q": tuple(expected[2:5])}
    drafter.propose([], forget=["q"])
    assert drafter.runner is not None and not drafter.runner.has_request("q")
    # a long prompt is caught up with CATCH_UP_TOKENS a step, drafting once it is in
    long = tuple(range(1000, 1000 + 2 * CATCH_UP_TOKENS + 12))
    continuation = _greedy(drafter.target, "ref", long, 3)
    assert drafter.propose([DraftQuery("long", long, 3)]) == {}
    assert drafter.propose([DraftQuery("long", long, 3)]) == {}
    assert drafter.propose([DraftQuery("long", long, 3)]) == {"long": tuple(continuation)}
    drafter.propose([], forget=["long"])


def test_a_draft_model_of_another_vocabulary_is_refused(
    tiny_model_dir: Path, tiny_gguf: Path
) -> None:
    spec = SpeculativeConfig("draft_model", 2, model=str(tiny_gguf))
    config = ExecuteConfig(model=str(tiny_model_dir), num_blocks=8, speculative_config=spec)
    target = ModelRunner(config)
    target.load()
    with pytest.raises(ValueError, match=r"speculative_config.*vocabulary of 512"):
        Drafter(config, target).load()
