"""Tests of stages/execute/grammar_mask.py and the sampler's use of it: the step's bitmask
becomes the forbidden-token masks of the constrained sampling rows, and no row picks a
forbidden token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.execute.grammar_mask import grammar_rows
from stages.execute.sampler import Sampler, new_sampling_state
from stages.messages import SchedulerStep
from stages.params import SamplingParams

VOCAB = 100  # 4 words of 32 bits, the last one partly past the vocabulary


def bitmask_of(allowed_rows: list[list[int]], vocab: int = VOCAB) -> np.ndarray:
    words = (vocab + 31) // 32
    bits = np.zeros((len(allowed_rows), words * 32), dtype=np.uint8)
    for row, allowed in enumerate(allowed_rows):
        bits[row, allowed] = 1
    return np.packbits(bits, axis=1, bitorder="little").view("<i4")


def test_the_bitmask_becomes_the_mask_of_the_constrained_sampling_rows() -> None:
    step = SchedulerStep(
        0, grammar_request_ids=("b", "d"), grammar_bitmask=bitmask_of([[3, 99], [0, 31, 32]])
    )
    grammar = grammar_rows(step, ["a", "b", "c", "d"], VOCAB, torch.device("cpu"))
    assert grammar is not None and grammar.rows == (1, 3)
    assert grammar.forbidden.shape == (2, VOCAB) and grammar.forbidden.dtype == torch.bool
    mask = torch.zeros((4, VOCAB), dtype=torch.bool)  # the same mask over the whole batch
    mask[list(grammar.rows)] = grammar.forbidden
    assert not mask[0].any() and not mask[2].any()  # free rows
    assert (~mask[1]).nonzero().flatten().tolist() == [3, 99]
    assert (~mask[3]).nonzero().flatten().tolist() == [0, 31, 32]
    # a constrained request that does not sample here (preempted): no mask at all
    assert grammar_rows(step, ["a", "c"], VOCAB, torch.device("cpu")) is None
    assert grammar_rows(SchedulerStep(1), ["a"], VOCAB, torch.device("cpu")) is None
    # applying it: a copy with the constrained rows' forbidden tokens at -inf, free rows equal
    logits = torch.randn(4, VOCAB)
    masked = grammar.apply(logits)
    assert torch.equal(masked, logits.masked_fill(mask, float("-inf")))
    assert torch.isfinite(logits).all()  # the input is not modified


def test_tokens_past_a_narrow_bitmask_are_forbidden_and_bad_shapes_are_refused() -> None:
    step = SchedulerStep(0, grammar_request_ids=("a",), grammar_bitmask=bitmask_of([[1]], 32))
    grammar = grammar_rows(step, ["a"], VOCAB, torch.device("cpu"))
    assert grammar is not None and (~grammar.forbidden[0]).nonzero().flatten().tolist() == [1]
    bad = SchedulerStep(0, grammar_request_ids=("a", "b"), grammar_bitmask=bitmask_of([[1]]))
    with pytest.raises(ValueError, match="one row"):
        grammar_rows(bad, ["a"], VOCAB, torch.device("cpu"))


@pytest.mark.cuda
def test_the_mask_is_built_on_the_gpu_the_same_way() -> None:
    step = SchedulerStep(0, grammar_request_ids=("b",), grammar_bitmask=bitmask_of([[5, 64]]))
    cpu = grammar_rows(step, ["a", "b"], VOCAB, torch.device("cpu"))
    gpu = grammar_rows(step, ["a", "b"], VOCAB, torch.device("cuda"))
    assert cpu is not None and gpu is not None and gpu.forbidden.is_cuda
    assert cpu.rows == gpu.rows and torch.equal(cpu.forbidden, gpu.forbidden.cpu())
    logits = torch.randn(2, VOCAB)
    assert torch.equal(cpu.apply(logits), gpu.apply(logits.cuda()).cpu())


def test_the_sampler_never_picks_a_forbidden_token() -> None:
    torch.manual_seed(0)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.8, top_p=0.9, logprobs=2),
        SamplingParams(temperature=0.0),
    ]
    states = [new_sampling_state(p, [1, 2], [2], torch.device("cpu")) for p in rows]
    logits = torch.randn(4, VOCAB)
    best = logits.argmax(dim=-1)
    allowed = [[7, 8], [50], [int(best[2]) ^ 1, 60]]
    step = SchedulerStep(
        0, grammar_request_ids=("r0", "r1", "r2"), grammar_bitmask=bitmask_of(allowed)
    )
    mask = grammar_rows(step, ["r0", "r1", "r2", "free"], VOCAB, torch.device("cpu"))
    before = logits.clone()
    for _ in range(20):
        result = sampler.sample(logits, states, mask)
        assert result.token_ids[0] == max((7, 8), key=lambda t: float(logits[0, t]))
        assert result.token_ids[1] == 50
        assert result.token_ids[2] in allowed[2]
        assert result.token_ids[3] == int(best[3])  # the free row is untouched
        lp = result.logprobs[2]
        assert lp is not None and set(lp.top_token_ids) <= set(allowed[2])
    assert torch.equal(logits, before)
