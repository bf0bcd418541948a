"""Tests of stages/execute/sampler.py: determinism of seeds and each parameter's effect on the
sampled distribution (many draws of one small distribution, compared with the exact one)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from stages.execute.sampler import Sampler, SamplingState, new_sampling_state
from stages.params import SamplingParams

CPU = torch.device("cpu")
EOS = 5
# A small vocabulary with known probabilities (token 5 is EOS).
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = PROBS.log()
DRAWS = 20_000
TOLERANCE = 0.015  # about 4 standard deviations of a frequency near 0.4 at 20k draws


def make_state(
    params: SamplingParams,
    prompt: Sequence[int] = (0,),
    outputs: Sequence[int] = (),
    eos: Sequence[int] = (EOS,),
    device: torch.device = CPU,
) -> SamplingState:
    state = new_sampling_state(params, prompt, eos, device)
    state.output_token_ids.extend(outputs)
    return state


def frequencies(
    params: SamplingParams,
    logits: torch.Tensor = LOGITS,
    prompt: Sequence[int] = (0,),
    outputs: Sequence[int] = (),
) -> torch.Tensor:
    """Empirical distribution of DRAWS samples (one batch of identical unseeded rows)."""
    torch.manual_seed(1234)
    states = [make_state(params, prompt, outputs) for _ in range(DRAWS)]
    result = Sampler(logits.shape[0], CPU).sample(logits.expand(DRAWS, -1), states)
    counts = torch.bincount(torch.tensor(result.token_ids), minlength=logits.shape[0])
    return counts.float() / DRAWS


def expected(logits: torch.Tensor) -> torch.Tensor:
    return logits.softmax(dim=-1)


def assert_close(observed: torch.Tensor, wanted: torch.Tensor) -> None:
    assert torch.allclose(observed, wanted, atol=TOLERANCE), f"{observed} != {wanted}"


# ------------------------------------------------------------------------ greedy


def test_greedy_is_argmax_in_any_dtype() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    states = [make_state(SamplingParams(temperature=0.0)) for _ in range(8)]
    sampler = Sampler(1000, CPU)
    assert sampler.sample(logits, states).token_ids == logits.argmax(-1).tolist()
    half = logits.to(torch.bfloat16)
    assert sampler.sample(half, states).token_ids == half.float().argmax(-1).tolist()


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    states = [
        make_state(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_k=50, top_p=0.9))
        for i in range(6)
    ]
    for _ in range(5):
        tokens = Sampler(500, CPU).sample(logits, states).token_ids
        assert tokens[0::2] == logits[0::2].argmax(-1).tolist()


def test_padded_vocabulary_columns_are_ignored_and_shapes_checked() -> None:
    logits = torch.zeros(2, 12)
    logits[:, 11] = 100.0  # a padding column of the LM head
    logits[:, 3] = 1.0
    states = [make_state(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert Sampler(10, CPU).sample(logits, states).token_ids == [3, 3]
    with pytest.raises(ValueError, match="num_rows"):
        Sampler(10, CPU).sample(logits, states[:1])
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(20, CPU).sample(logits, states)


# ------------------------------------------------------------------------ seeds


def run_steps(
    sampler: Sampler, logits: torch.Tensor, states: list[SamplingState], steps: int
) -> list[list[int]]:
    history: list[list[int]] = []
    for _ in range(steps):
        tokens = sampler.sample(logits, states).token_ids
        for state, token in zip(states, tokens, strict=True):
            state.output_token_ids.append(token)
        history.append(tokens)
    return history


DEVICES = [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.cuda, id="cuda")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, seed=123),
        SamplingParams(temperature=1.2, repetition_penalty=1.3, presence_penalty=0.5, seed=5),
    ],
)
def test_seeded_sampling_repeats_and_ignores_the_batch(
    params: SamplingParams, device: torch.device
) -> None:
    torch.manual_seed(0)
    vocab = 400
    logits = torch.randn(1, vocab, device=device)
    sampler = Sampler(vocab, device)

    def state(params: SamplingParams) -> SamplingState:
        return make_state(params, device=device)

    alone = [row[0] for row in run_steps(sampler, logits, [state(params)], 12)]
    again = [row[0] for row in run_steps(sampler, logits, [state(params)], 12)]
    assert alone == again
    assert len(set(alone)) > 3  # it really samples

    batch = [
        state(SamplingParams(temperature=1.0)),
        state(SamplingParams(temperature=0.0, logprobs=2)),
        state(params),
        state(SamplingParams(temperature=0.7, seed=99, top_k=5)),
    ]
    batch_logits = torch.randn(4, vocab, device=device)
    batch_logits[2] = logits[0]
    in_batch = [row[2] for row in run_steps(sampler, batch_logits, batch, 12)]
    assert in_batch == alone


def test_the_native_argmax_gives_the_same_tokens() -> None:
    from stages.execute.native import fused_ops_kernel

    kernel = fused_ops_kernel()
    assert kernel is not None, "the C compiler on this machine should build the kernel"
    torch.manual_seed(3)
    vocab = 1000
    logits = torch.randn(5, vocab + 24)  # a padded head: rows a stride apart after the cut
    logits[1, 10] = logits[1, 700] = logits[1].max() + 1.0  # a tie: the first index wins
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.5, seed=4, top_k=20),
    ]

    def tokens(sampler: Sampler, rows: list[int]) -> list[int]:
        states = [make_state(params[row], device=CPU) for row in rows]
        return sampler.sample(logits[rows], states).token_ids

    plain, native = Sampler(vocab, CPU), Sampler(vocab, CPU, argmax=kernel.argmax)
    for rows in ([0, 1], [0, 1, 2, 3, 4], [2, 4]):
        assert tokens(native, rows) == tokens(plain, rows)
    assert tokens(native, [1]) == [10]


def test_different_seeds_give_different_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 400)
    sampler = Sampler(400, CPU)
    first = run_steps(sampler, logits, [make_state(SamplingParams(seed=1))], 12)
    second = run_steps(sampler, logits, [make_state(SamplingParams(seed=2))], 12)
    assert first != second


# ------------------------------------------------------------------------ distribution


def test_temperature_one_samples_the_model_distribution() -> None:
    assert_close(frequencies(SamplingParams(temperature=1.0)), PROBS)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_sharpens_or_flattens(temperature: float) -> None:
    observed = frequencies(SamplingParams(temperature=temperature))
    assert_close(observed, expected(LOGITS / temperature))
    if temperature < 1:
        assert observed[0] > PROBS[0] + 0.1
    else:
        assert observed[0] < PROBS[0] - 0.05


def test_top_k_restricts_the_support() -> None:
    observed = frequencies(SamplingParams(top_k=2))
    assert observed[2:].sum() == 0
    assert_close(observed, torch.tensor([0.4, 0.25, 0, 0, 0, 0]) / 0.65)


def test_top_p_keeps_the_nucleus() -> None:
    # Most likely first: 0.4, 0.65 (reaches 0.6): the nucleus is tokens 0 and 1.
    observed = frequencies(SamplingParams(top_p=0.6))
    assert observed[2:].sum() == 0
    assert_close(observed, torch.tensor([0.4, 0.25, 0, 0, 0, 0]) / 0.65)
    # Top-p 0.7 needs the third token too.
    observed = frequencies(SamplingParams(top_p=0.7))
    assert observed[3:].sum() == 0 and observed[2] > 0.1


def test_the_smallest_top_p_keeps_the_most_likely_token() -> None:
    """A top_p near float32's smallest normal value: only the most likely token (never
    whatever sits at index 0, which is what an empty nucleus would sample)."""
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    for params in (SamplingParams(top_p=1.2e-38), SamplingParams(top_p=1.2e-38, top_k=3)):
        states = [make_state(params) for _ in range(64)]
        tokens = Sampler(4, CPU).sample(logits.expand(64, -1), states).token_ids
        assert set(tokens) == {2}


def test_top_k_and_top_p_together() -> None:
    observed = frequencies(SamplingParams(top_k=3, top_p=0.9))
    # Top-k leaves 0.4, 0.25, 0.15 (renormalised 0.5, 0.3125, 0.1875); all within top-p 0.9.
    assert observed[3:].sum() == 0
    assert_close(observed[:3], torch.tensor([0.4, 0.25, 0.15]) / 0.8)


def test_min_p_removes_unlikely_tokens() -> None:
    # Threshold 0.3 x 0.4 = 0.12: tokens with 0.1, 0.06, 0.04 go.
    observed = frequencies(SamplingParams(min_p=0.3))
    assert observed[3:].sum() == 0
    assert_close(observed[:3], torch.tensor([0.4, 0.25, 0.15]) / 0.8)


def test_rows_with_different_parameters_do_not_mix() -> None:
    torch.manual_seed(3)
    configs = [SamplingParams(top_k=1), SamplingParams(min_p=0.5), SamplingParams()]
    states = [make_state(configs[i % 3]) for i in range(3 * 3000)]
    tokens = torch.tensor(Sampler(6, CPU).sample(LOGITS.expand(len(states), -1), states).token_ids)
    assert set(tokens[0::3].tolist()) == {0}
    assert set(tokens[1::3].tolist()) == {0, 1}
    assert len(set(tokens[2::3].tolist())) == 6


# ------------------------------------------------------------------------ penalties


def test_repetition_penalty_lowers_prompt_and_output_tokens() -> None:
    penalty = 2.0
    observed = frequencies(SamplingParams(repetition_penalty=penalty), prompt=(0,), outputs=(1, 1))
    # Negative logits (log-probabilities) are multiplied by the penalty.
    wanted = LOGITS.clone()
    wanted[0] *= penalty
    wanted[1] *= penalty
    assert_close(observed, expected(wanted))
    assert observed[0] < PROBS[0] - 0.1 and observed[1] < PROBS[1] - 0.05


def test_repetition_penalty_divides_positive_logits() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    observed = frequencies(SamplingParams(repetition_penalty=2.0), logits, prompt=(0,))
    wanted = logits.clone()
    wanted[0] = 1.0
    assert_close(observed, expected(wanted))


def test_presence_and_frequency_penalties_count_outputs_only() -> None:
    # Token 0 is in the prompt only: untouched. Token 1 appears 3 times in the outputs.
    observed = frequencies(
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(0,), outputs=(1,) * 3
    )
    wanted = LOGITS.clone()
    wanted[1] -= 0.5 + 0.25 * 3
    assert_close(observed, expected(wanted))
    assert observed[1] < PROBS[1] - 0.1


def test_greedy_sees_penalties() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    state = make_state(SamplingParams(temperature=0.0, frequency_penalty=1.0), outputs=(0,))
    assert Sampler(3, CPU).sample(logits, [state]).token_ids == [1]


# ------------------------------------------------------------------------ min_tokens


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0, 8.0, 9.0])  # EOS (5) and stop id 4 dominate
    params = SamplingParams(min_tokens=2, stop_token_ids=(4,))
    observed = frequencies(params, logits, outputs=(1,))
    assert observed[4] == 0 and observed[5] == 0
    assert_close(observed[:4], torch.full((4,), 0.25))
    # With min_tokens outputs produced, they are allowed again.
    assert frequencies(params, logits, outputs=(1, 2))[5] > 0.5
    # Greedy rows obey it too.
    state = make_state(params.replace(temperature=0.0))
    assert Sampler(6, CPU).sample(logits.unsqueeze(0), [state]).token_ids[0] not in (4, 5)


def test_ignore_eos_does_not_block_eos() -> None:
    state = make_state(SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=(4,)))
    assert state.min_tokens_blocked == (4,)
    blocked = make_state(SamplingParams(min_tokens=3, stop_token_ids=(4, EOS)))
    assert blocked.min_tokens_blocked == (EOS, 4)


# ------------------------------------------------------------------------ logprobs


def test_logprobs_match_log_softmax_with_ranks_and_alternatives() -> None:
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(4, vocab) * 3
    states = [
        make_state(SamplingParams(temperature=0.0, logprobs=3)),
        make_state(SamplingParams(temperature=0.7, top_k=20, logprobs=5, seed=3)),
        make_state(SamplingParams(temperature=1.0)),  # did not ask
        make_state(SamplingParams(temperature=2.0, logprobs=0, presence_penalty=1.0)),
    ]
    states[3].output_token_ids.extend([1, 2, 3])
    result = Sampler(vocab, CPU).sample(logits, states)
    reference = logits.log_softmax(dim=-1)
    assert result.logprobs[2] is None
    for row in (0, 1, 3):
        logprobs = result.logprobs[row]
        assert logprobs is not None
        token = result.token_ids[row]
        assert logprobs.token_id == token
        # Raw logprobs: before temperature, penalties and filters.
        assert math.isclose(logprobs.logprob, reference[row, token].item(), abs_tol=1e-5)
        assert logprobs.rank == int((reference[row] >= reference[row, token]).sum())
        top = reference[row].topk(states[row].params.logprobs or 0)
        assert list(logprobs.top_token_ids) == top.indices.tolist()
        assert logprobs.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    first = result.logprobs[0]
    assert first is not None and first.rank == 1  # greedy takes the top token
    assert first.top_token_ids[0] == result.token_ids[0]
    assert result.logprobs[3] is not None and result.logprobs[3].top_token_ids == ()


def test_logprobs_are_computed_in_fp32_from_low_precision_logits() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(1, 1000) * 4).to(torch.bfloat16)
    state = make_state(SamplingParams(temperature=0.0, logprobs=2))
    result = Sampler(1000, CPU).sample(logits, [state])
    logprobs = result.logprobs[0]
    assert logprobs is not None
    wanted = logits.float().log_softmax(-1)[0, result.token_ids[0]].item()
    assert math.isclose(logprobs.logprob, wanted, abs_tol=1e-6)


def test_the_callers_logits_are_not_modified() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    before = logits.clone()
    states = [
        make_state(SamplingParams(min_tokens=2, stop_token_ids=(4,), repetition_penalty=1.5)),
        make_state(SamplingParams(temperature=0.0, frequency_penalty=1.0), outputs=(1, 1)),
        make_state(SamplingParams(top_k=3, top_p=0.5, min_p=0.1)),
    ]
    Sampler(50, CPU).sample(logits, states)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_top_p_candidates_match_a_full_sort(scale: float) -> None:
    """The fast top-p path (nucleus sought among the most likely tokens, rows whose nucleus
    is wider sorted in full) keeps exactly the tokens of vLLM's full-sort rule."""
    torch.manual_seed(int(scale * 10))
    vocab = 8000
    configs = [
        SamplingParams(top_p=0.5),
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.99),
        SamplingParams(top_p=0.8, top_k=50),
        SamplingParams(top_p=0.95, top_k=3000),
        SamplingParams(top_k=10, top_p=0.999),
    ]
    params = [configs[i % len(configs)] for i in range(24)]
    logits = torch.randn(len(params), vocab) * scale
    sampler = Sampler(vocab, CPU)
    fast = sampler._apply_top_k_top_p(logits, params)
    k = torch.tensor([p.top_k or vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    reference = Sampler._top_k_top_p_sorted(logits, k, top_p)
    assert torch.equal(fast.isfinite(), reference.isfinite())
    assert torch.equal(fast[fast.isfinite()], logits[fast.isfinite()])
