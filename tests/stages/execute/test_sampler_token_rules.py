"""Tests of the sampler's token rules (stages/execute/sampler.py, step 2b): ``logit_bias``,
``allowed_token_ids`` and ``bad_words``, each applied only to the rows that ask, greedy and
sampled, beside rows that do not use them (whose tokens are what they would be alone)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from stages.execute.sampler import Sampler, SamplingState, new_sampling_state
from stages.params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 6
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = PROBS.log()
GREEDY = SamplingParams(temperature=0.0)
DRAWS = 4000


def state(
    params: SamplingParams,
    outputs: Sequence[int] = (),
    bad_words: Sequence[Sequence[int]] = (),
) -> SamplingState:
    made = new_sampling_state(
        params, (0,), (), CPU, vocab_size=VOCAB, bad_words_token_ids=bad_words
    )
    made.output_token_ids.extend(outputs)
    return made


def sample(states: Sequence[SamplingState]) -> list[int]:
    logits = LOGITS.expand(len(states), -1).contiguous()
    before = logits.clone()
    tokens = Sampler(VOCAB, CPU).sample(logits, states).token_ids
    assert torch.equal(logits, before), "the caller's logits are not modified"
    return tokens


def test_rows_without_rules_have_no_rule_state() -> None:
    assert not state(SamplingParams()).has_token_rules
    assert state(SamplingParams(logit_bias={1: 1.0})).has_token_rules


def test_logit_bias_bans_and_forces_the_greedy_token() -> None:
    banned = GREEDY.replace(logit_bias=((0, -100.0),))
    forced = GREEDY.replace(logit_bias=((4, 100.0),))
    # the plain row beside them keeps its argmax; each biased row changes
    assert sample([state(GREEDY), state(banned), state(forced)]) == [0, 1, 4]


def test_a_small_bias_shifts_the_sampled_distribution_by_its_factor() -> None:
    torch.manual_seed(7)
    params = SamplingParams(logit_bias=((3, float(torch.log(torch.tensor(4.0)))),))
    tokens = sample([state(params) for _ in range(DRAWS)])
    wanted = (PROBS * torch.tensor([1, 1, 1, 4, 1, 1])).div(1.3)[3].item()  # 0.4 / 1.3
    observed = tokens.count(3) / DRAWS
    assert abs(observed - wanted) < 0.04, (observed, wanted)


def test_allowed_token_ids_restrict_every_row_that_asks() -> None:
    torch.manual_seed(3)
    allowed = SamplingParams(allowed_token_ids=(2, 4))
    rows = [state(allowed) for _ in range(DRAWS)] + [state(SamplingParams())]
    tokens = sample(rows)
    assert set(tokens[:-1]) == {2, 4}
    assert sample([state(GREEDY.replace(allowed_token_ids=(3, 5))), state(GREEDY)]) == [3, 0]


def test_bad_words_ban_the_last_token_after_the_rest() -> None:
    words = ((0,), (3, 1))
    greedy = GREEDY.replace(bad_words=("unused text; the tokens are given",))
    # a one-token word is always banned; (3, 1) only after a 3
    assert sample([state(greedy, [2], words)]) == [1]
    assert sample([state(greedy, [3], words)]) == [2]
    # longer than the output so far: not applied
    assert sample([state(greedy, [], ((5, 5, 0),))]) == [0]


@pytest.mark.parametrize("greedy", [True, False])
def test_rules_combine_with_penalties_and_min_tokens(greedy: bool) -> None:
    torch.manual_seed(11)
    params = SamplingParams(
        temperature=0.0 if greedy else 1.0,
        allowed_token_ids=(0, 4, 5),
        logit_bias=((4, 100.0),),
        repetition_penalty=1.5,
        min_tokens=2,
    )
    made = new_sampling_state(params, (0,), (5,), CPU, vocab_size=VOCAB)
    assert sample([made]) == [4]  # 5 (EOS) blocked by min_tokens, 4 forced


@pytest.mark.parametrize("greedy", [True, False])
def test_min_tokens_leaves_a_row_whose_rules_allow_only_eos_its_eos(greedy: bool) -> None:
    """allowed_token_ids of only EOS while short of min_tokens: EOS stays (the rules win, as
    a grammar does), never a token outside the allowed ones (an all -inf row)."""
    params = SamplingParams(
        temperature=0.0 if greedy else 1.0, allowed_token_ids=(5,), min_tokens=3
    )
    made = new_sampling_state(params, (0,), (5,), CPU, vocab_size=VOCAB)
    other = new_sampling_state(SamplingParams(temperature=0.0, min_tokens=3), (0,), (0,), CPU)
    assert sample([made, other]) == [5, 1]
