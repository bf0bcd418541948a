"""``min_tokens`` with structured outputs (docs/structured-outputs.md, "min_tokens"): both
apply while the grammar allows something other than EOS and the stop ids; once it allows
nothing else (a complete JSON value, one of the choices) the grammar wins: the sampler keeps
EOS in that row instead of leaving every logit -inf, and the scheduler ends the request. First
the sampler alone (stages/execute/sampler.py), then the engine on the tiny model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pipeline import LLM, SamplingParams, StructuredOutputsParams
from stages.execute.grammar_mask import GrammarRows
from stages.execute.sampler import Sampler, new_sampling_state

VOCAB = 64
EOS = 2
STOP = 9  # a stop token id, blocked by min_tokens as EOS is


def allowing(*tokens: int) -> torch.Tensor:
    """A grammar row's ``forbidden`` mask allowing only ``tokens``."""
    forbidden = torch.ones(VOCAB, dtype=torch.bool)
    forbidden[list(tokens)] = False
    return forbidden


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_grammar_wins_only_where_min_tokens_would_leave_nothing(temperature: float) -> None:
    """Four requests short of ``min_tokens``: a grammar allowing only EOS samples EOS, one
    allowing only EOS and a stop id samples one of them, one allowing EOS and token 7 still has
    EOS masked (7), and a free request never samples EOS or the stop id."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, EOS] = logits[:, STOP] = -5.0  # unlikely, so only the rules can choose them
    params = SamplingParams(
        temperature=temperature, min_tokens=5, max_tokens=10, seed=1, stop_token_ids=(STOP,)
    )
    states = [new_sampling_state(params, (5, 6), (EOS,), torch.device("cpu")) for _ in range(4)]
    grammar = GrammarRows(
        (0, 1, 2), torch.stack([allowing(EOS), allowing(EOS, STOP), allowing(EOS, 7)])
    )
    sampler = Sampler(VOCAB, torch.device("cpu"))
    for _ in range(8):  # sampled rows draw again: the rule holds for every draw
        tokens = sampler.sample(logits, states, grammar).token_ids
        assert tokens[0] == EOS
        assert tokens[1] in (EOS, STOP)
        assert tokens[2] == 7
        assert tokens[3] not in (EOS, STOP)
    # once min_tokens are out, EOS is the grammar's to allow as usual
    for state in states:
        state.output_token_ids.extend(range(10, 15))
    assert sampler.sample(logits, states, grammar).token_ids[2] in (EOS, 7)


def test_logits_are_left_untouched_and_no_row_is_all_masked() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    original = logits.clone()
    params = SamplingParams(temperature=1.0, min_tokens=3, seed=4, logprobs=2)
    states = [new_sampling_state(params, (5,), (EOS,), torch.device("cpu")) for _ in range(2)]
    grammar = GrammarRows((1,), allowing(EOS).unsqueeze(0))
    result = Sampler(VOCAB, torch.device("cpu")).sample(logits, states, grammar)
    assert result.token_ids[1] == EOS and result.token_ids[0] != EOS
    assert torch.equal(logits, original)
    logprobs = result.logprobs[1]
    assert logprobs is not None and logprobs.logprob == pytest.approx(0.0)  # all mass on EOS


@pytest.mark.slow
def test_a_complete_constraint_ends_before_min_tokens_and_others_honour_it(
    tiny_model_dir: Path,
) -> None:
    """On the tiny model (greedy and sampled): a choice and a boolean schema complete in one
    or two tokens, then end with EOS though ``min_tokens`` is 6 (no token outside the grammar
    in between); a regex that can go on keeps EOS masked until ``min_tokens``; a free request
    likewise."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    boolean = StructuredOutputsParams(json={"type": "boolean"})
    letters = StructuredOutputsParams(regex="[a-z]{1,40}")
    with LLM(str(tiny_model_dir), transport="memory", num_blocks=64) as llm:
        info = llm.engine.info
        assert info is not None
        eos = set(info.eos_token_ids)
        for temperature in (0.0, 1.0):
            params = [
                SamplingParams(
                    max_tokens=12, min_tokens=6, temperature=temperature, seed=3, **extra
                )
                for extra in (
                    {"structured_outputs": choice},
                    {"structured_outputs": boolean},
                    {"structured_outputs": letters},
                    {},
                )
            ]
            outputs = llm.generate(["Well?"] * 4, params, use_tqdm=False)
            for output, valid in zip(outputs[:2], (("yes", "no"), ("true", "false"))):
                assert output.finish_reason == "stop" and output.text in valid, output
                *text_tokens, last = output.token_ids
                assert last in eos and not eos.intersection(text_tokens), output.token_ids
                assert len(output.token_ids) < 6, output.token_ids
            assert re.fullmatch("[a-z]{1,40}", outputs[2].text), outputs[2].text
            assert len(outputs[2].token_ids) >= 6 and len(outputs[3].token_ids) >= 6
