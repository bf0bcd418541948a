"""Turns each sequence's last-token logits into the next token (greedy or random).

Follows vLLM v1 ``vllm/v1/sample/sampler.py`` (order of operations, the exponential-race
sampling trick, per-request generators), ``vllm/model_executor/layers/utils.py``
(``apply_penalties``), ``vllm/v1/sample/ops/topk_topp_sampler.py`` (``apply_top_k_top_p``,
``random_sample``) and vLLM's min-p logits processor. The order, per step:

0. structured outputs: tokens the constrained rows' grammars forbid are set to -inf
   (:mod:`stages.execute.grammar_mask`), before anything else as in vLLM;
1. raw logprobs, if any row asked (log-softmax of the unmodified logits, fp32);
2. logits to fp32;
2b. token rules, only for the rows that have them: ``allowed_token_ids`` (every other token
   -inf), ``bad_words`` (a word's last token -inf when the output ends with the rest of it,
   as vLLM's ``vllm/v1/sample/ops/bad_words.py``), then ``logit_bias`` added, as vLLM applies
   them (``vllm/v1/sample/sampler.py``, ``apply_logits_processors``: allowed ids and bad
   words, then the logits processors) and OpenAI defines the bias (added to the logits);
3. min_tokens: EOS and stop ids masked while a request has fewer than ``min_tokens`` outputs,
   except in a constrained row whose grammar allows nothing else (a complete JSON value, one of
   the choices): there the grammar wins, the row keeps them, and the scheduler ends the
   request (docs/structured-outputs.md, "min_tokens"), as vLLM's PR #54218 does
   (``MinTokensLogitsProcessor``, ``vllm/v1/sample/logits_processor/builtin.py``); masking
   them would leave every logit -inf (a NaN distribution, a token outside the grammar);
4. penalties: repetition over prompt + output tokens, presence and frequency over outputs;
5. greedy rows (temperature 0) take the argmax;
6. temperature, then min-p, then top-k / top-p (sorted once, only rows that use them);
7. sample by ``argmax(probs / q)`` with ``q ~ Exponential(1)``: a seeded row draws ``q`` from
   its own generator (one vocab-sized draw per step), so its tokens do not depend on the
   batch it shares;
8. ``where(greedy, argmax, sampled)``.

Every tensor is built for the batch only when some row uses the feature; a batch of only
greedy rows without penalties is a single argmax.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch

from stages.execute.grammar_mask import GrammarRows
from stages.messages import Logprobs
from stages.params import SamplingParams

__all__ = ["SampleResult", "Sampler", "SamplingState", "new_sampling_state"]

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them would overflow.
GREEDY_TEMPERATURE = 1e-5
# Top-p first looks for the nucleus among this many most likely tokens (a partial top-k is
# several times cheaper than sorting a 49k vocabulary); rows whose nucleus is wider are sorted.
TOP_P_CANDIDATES = 1024


@dataclasses.dataclass(slots=True)
class SamplingState:
    """One request's sampling state, owned by the model runner (kept across preemption).

    ``output_token_ids``: the runner appends every sampled token. ``generator``: the request's
    own random generator when ``params.seed`` is set. ``min_tokens_blocked``: token ids masked
    while ``len(output_token_ids) < params.min_tokens``. ``disallowed``: True for every
    token ``allowed_token_ids`` leaves out (None: any token). ``bias_ids``/``bias_values``:
    ``logit_bias`` as tensors (None: no bias). ``bad_words_token_ids``: the token sequences of
    ``bad_words`` (the tokenize stage's).
    """

    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int]
    generator: torch.Generator | None
    min_tokens_blocked: tuple[int, ...]
    disallowed: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def has_token_rules(self) -> bool:
        """Whether step 2b (allowed ids, bad words, logit bias) touches this row."""
        return (
            self.disallowed is not None
            or self.bias_ids is not None
            or bool(self.bad_words_token_ids)
        )


def new_sampling_state(
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    eos_token_ids: Sequence[int],
    device: torch.device,
    *,
    vocab_size: int | None = None,
    bad_words_token_ids: Sequence[Sequence[int]] = (),
) -> SamplingState:
    """A fresh state for a request: its generator seeded from ``params.seed`` (if any) on
    ``device``; EOS ids (unless ``ignore_eos``) and ``stop_token_ids`` blocked until
    ``min_tokens`` tokens are out; ``allowed_token_ids`` as a mask over ``vocab_size`` tokens
    and ``logit_bias`` as tensors, built once; ``bad_words_token_ids``: the token sequences
    of ``params.bad_words`` (the tokenize stage's). Ids outside the vocabulary (which the
    engine's validation refuses) are left out."""
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed)
    blocked = () if params.ignore_eos else tuple(eos_token_ids)
    blocked = tuple(dict.fromkeys(blocked + tuple(params.stop_token_ids)))
    disallowed = None
    if params.allowed_token_ids is not None and vocab_size is not None:
        disallowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
        allowed = [t for t in params.allowed_token_ids if 0 <= t < vocab_size]
        disallowed[torch.tensor(allowed, dtype=torch.long, device=device)] = False
    bias_ids = bias_values = None
    bias = [(t, b) for t, b in params.logit_bias if vocab_size is None or 0 <= t < vocab_size]
    if bias:
        bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
        bias_values = torch.tensor([float(b) for _, b in bias], dtype=torch.float32, device=device)
    return SamplingState(
        params=params,
        prompt_token_ids=tuple(prompt_token_ids),
        output_token_ids=[],
        generator=generator,
        min_tokens_blocked=blocked,
        disallowed=disallowed,
        bias_ids=bias_ids,
        bias_values=bias_values,
        bad_words_token_ids=tuple(tuple(word) for word in bad_words_token_ids if word),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SampleResult:
    """The sampled token of every row, and its logprobs for rows whose params asked."""

    token_ids: list[int]
    logprobs: list[Logprobs | None]


def _uses_top_k(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size


def _uses_top_p(params: SamplingParams) -> bool:
    return params.top_p < 1.0


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


class Sampler:
    """Samples one token per row; see the module docstring for the order of operations.

    ``vocab_size``: the model's real vocabulary; wider logits (a padded LM head) are cut to it.
    ``argmax``: a faster ``argmax(dim=-1)`` for fp32 CPU logits with contiguous rows (the
    native kernel's, :meth:`stages.execute.native.FusedOpsKernel.argmax`; same answers).
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = device
        self._native_argmax = argmax

    def sample(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        grammar: GrammarRows | None = None,
    ) -> SampleResult:
        """Sample the next token of every row of ``logits`` (``[num_rows, vocab]``, any float
        dtype, one row per state, only each sequence's last position). ``logits`` is not
        modified. ``grammar``: the rows a grammar constrains and the tokens each forbids
        (:func:`stages.execute.grammar_mask.grammar_rows`).

        Returns:
            The tokens (one per row) and, for rows with ``params.logprobs`` set, their
            logprobs. The caller appends the tokens to ``output_token_ids``.
        Raises:
            ValueError: the shapes do not match ``states`` and the vocabulary.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [num_rows={len(states)}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}"
            )
        if not states:
            return SampleResult([], [])
        logits = logits[:, : self.vocab_size]  # [num_rows, V]
        if grammar is not None:
            logits = grammar.apply(logits)
        params = [state.params for state in states]

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            chosen = logits
            if len(logprob_rows) < len(states):
                chosen = logits.index_select(0, self._index(logprob_rows, logits.device))
            raw_logprobs = chosen.float().log_softmax(dim=-1)  # [R, V]

        blocking = [
            i
            for i, state in enumerate(states)
            if len(state.output_token_ids) < state.params.min_tokens and state.min_tokens_blocked
        ]
        penalized = [i for i, p in enumerate(params) if _uses_penalties(p)]
        ruled = [i for i, state in enumerate(states) if state.has_token_rules]
        if blocking or penalized or ruled:
            # NOTE: one fp32 copy that the in-place edits below may change; the caller's
            # logits stay untouched.
            logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            if ruled:
                self._apply_token_rules_(logits, states, ruled)
            self._apply_min_tokens_(logits, [states[i] for i in blocking], blocking, grammar)
            self._apply_penalties_(logits, [states[i] for i in penalized], penalized)

        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        if all(greedy):
            tokens = self._argmax(logits)  # [num_rows]
        else:
            tokens = self._sample_random(logits.float(), states, greedy)

        token_ids: list[int] = tokens.tolist()
        logprobs: list[Logprobs | None] = [None] * len(states)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, logprob_rows, tokens, params, logprobs)
        return SampleResult(token_ids, logprobs)

    # ------------------------------------------------------------------ steps

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [num_rows, V] -> [num_rows]
        if (
            self._native_argmax is not None
            and logits.dtype == torch.float32
            and logits.device.type == "cpu"
            and logits.stride(-1) == 1
        ):
            return self._native_argmax(logits)
        return logits.argmax(dim=-1)

    @staticmethod
    def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=device)

    def _apply_token_rules_(
        self, logits: torch.Tensor, states: Sequence[SamplingState], rows: Sequence[int]
    ) -> None:
        """Apply, in place, step 2b to ``rows``: mask what ``allowed_token_ids`` leaves out and
        the bad words' next tokens, then add ``logit_bias``; one batched write for each."""
        device = logits.device
        allowed_rows = [row for row in rows if states[row].disallowed is not None]
        if allowed_rows:
            index = self._index(allowed_rows, device)
            masks = torch.stack([states[row].disallowed for row in allowed_rows])  # type: ignore[misc]
            logits[index] = logits.index_select(0, index).masked_fill(masks, float("-inf"))
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for row in rows:
            state = states[row]
            output = state.output_token_ids
            for word in state.bad_words_token_ids:
                # vLLM's rule: ban the word's last token when the output ends with the rest
                prefix = len(word) - 1
                if prefix > len(output):
                    continue
                matches = prefix == 0 or tuple(output[-prefix:]) == word[:-1]
                if matches and 0 <= word[-1] < self.vocab_size:
                    banned_rows.append(row)
                    banned_tokens.append(word[-1])
        if banned_rows:
            logits[self._index(banned_rows, device), self._index(banned_tokens, device)] = float(
                "-inf"
            )
        biased = [row for row in rows if states[row].bias_ids is not None]
        if biased:
            ids = [states[row].bias_ids for row in biased]
            row_index = torch.cat(
                [torch.full_like(t, row) for row, t in zip(biased, ids, strict=True)]  # type: ignore[arg-type]
            )
            token_index = torch.cat(ids)  # type: ignore[arg-type]
            values = torch.cat([states[row].bias_values for row in biased])  # type: ignore[misc]
            logits.index_put_((row_index, token_index), values, accumulate=True)

    def _apply_min_tokens_(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        rows: Sequence[int],
        grammar: GrammarRows | None,
    ) -> None:
        """Mask, in place, the blocked ids of ``rows`` (requests short of ``min_tokens``),
        except in the rows ``grammar`` (or their token rules) constrain to nothing but blocked
        ids (step 3 of the module docstring): those keep their logits."""
        row_ids: list[int] = []
        token_ids: list[int] = []
        for row, state in zip(rows, states, strict=True):
            blocked = [t for t in state.min_tokens_blocked if 0 <= t < self.vocab_size]
            row_ids.extend([row] * len(blocked))
            token_ids.extend(blocked)
        if not row_ids:
            return
        device = logits.device
        row_index, token_index = self._index(row_ids, device), self._index(token_ids, device)
        # NOTE: only constrained rows (a grammar, or allowed_token_ids / bad words) can be
        # left with nothing (a model's logits are finite), so only they are checked, and their
        # blocked logits kept to put back: one [C, V] comparison, and only while some
        # constrained request is short of min_tokens.
        ruled = {row for row, state in zip(rows, states, strict=True) if state.has_token_rules}
        if grammar is not None:
            ruled.update(set(rows).intersection(grammar.rows))
        constrained = sorted(ruled)
        if not constrained:
            logits[row_index, token_index] = float("-inf")
            return
        before = logits[row_index, token_index]  # [B]
        logits[row_index, token_index] = float("-inf")
        checked = self._index(constrained, device)
        emptied = ~(logits.index_select(0, checked) > float("-inf")).any(dim=-1)  # [C]
        empty_rows = set(checked[emptied].tolist())
        if empty_rows:
            restore = self._index([i for i, r in enumerate(row_ids) if r in empty_rows], device)
            logits[row_index[restore], token_index[restore]] = before[restore]

    def _apply_penalties_(
        self, logits: torch.Tensor, states: Sequence[SamplingState], rows: Sequence[int]
    ) -> None:
        """Apply, in place, the penalties of ``rows`` (vLLM ``apply_penalties``).

        Only the (row, token) entries a penalty touches are read and written: a request's
        history is a few thousand tokens, the vocabulary tens of thousands.
        """
        if not rows:
            return
        device = logits.device
        vocab = self.vocab_size
        flat = logits.view(-1)  # [num_rows * V]

        def keys(histories: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
            # Flat indices row * V + token of every token of every (row, history), [sum len].
            row_ids = itertools.chain.from_iterable([row] * len(h) for row, h in histories)
            token_ids = itertools.chain.from_iterable(h for _, h in histories)
            return self._index(list(row_ids), device) * vocab + self._index(list(token_ids), device)

        repetition = [
            (row, s)
            for row, s in zip(rows, states, strict=True)
            if s.params.repetition_penalty != 1.0
        ]
        if repetition:
            # NOTE: a token seen several times appears several times in `seen`; every copy
            # writes the same value, so no deduplication is needed.
            seen = keys(
                [(row, (*s.prompt_token_ids, *s.output_token_ids)) for row, s in repetition]
            )  # [num_seen]
            factor_by_row = torch.ones(logits.shape[0], device=device)
            factor_by_row[self._index([row for row, _ in repetition], device)] = torch.tensor(
                [s.params.repetition_penalty for _, s in repetition], device=device
            )
            factor = factor_by_row[seen // vocab]  # [num_seen]
            values = flat[seen]
            # A seen token's positive logit is divided and a negative one multiplied, so the
            # penalty always lowers it (vLLM / CTRL semantics).
            flat[seen] = torch.where(values > 0, values / factor, values * factor)

        additive = [
            (row, s)
            for row, s in zip(rows, states, strict=True)
            if (s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0)
            and s.output_token_ids
        ]
        if additive:
            output_keys = keys([(row, s.output_token_ids) for row, s in additive])  # [num_out]
            presence = torch.zeros(logits.shape[0], device=device)
            frequency = torch.zeros(logits.shape[0], device=device)
            additive_rows = self._index([row for row, _ in additive], device)
            presence[additive_rows] = torch.tensor(
                [s.params.presence_penalty for _, s in additive], device=device
            )
            frequency[additive_rows] = torch.tensor(
                [s.params.frequency_penalty for _, s in additive], device=device
            )
            row_of_key = output_keys // vocab  # [num_out]
            # Presence once per distinct token (duplicate keys write the same value), then
            # frequency once per occurrence (accumulated).
            flat[output_keys] = flat[output_keys] - presence[row_of_key]
            flat.index_add_(0, output_keys, -frequency[row_of_key])

    def probabilities(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """The distribution each row of ``logits`` (``[num_rows, vocab]``, one row per state)
        samples from at temperature > 0: steps 2, 2b and 6 (speculative decoding's
        verification, :mod:`stages.execute.speculative`, whose rows have no grammar,
        min_tokens, penalties or bad words). ``logits`` is not modified.

        Returns:
            ``[num_rows, vocab_size]`` fp32 probabilities.
        """
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True)  # [num_rows, V]
        ruled = [i for i, state in enumerate(states) if state.has_token_rules]
        if ruled:
            self._apply_token_rules_(logits, states, ruled)
        params = [state.params for state in states]
        return self._filtered(logits, params, [False] * len(states)).softmax(dim=-1)

    def _filtered(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], greedy: Sequence[bool]
    ) -> torch.Tensor:
        """Temperature, min-p, then top-k / top-p (step 6) of the rows that are not greedy."""
        device = logits.device
        # Greedy rows are divided by 1 (never by 0); their sample is discarded below.
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        if any(t != 1.0 for t in temperatures):
            logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)

        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        if any(m > 0.0 for m in min_p):
            probs = logits.softmax(dim=-1)  # [num_rows, V]
            threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(
                min_p, device=device
            ).unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))

        filtered = [
            i
            for i, (p, g) in enumerate(zip(params, greedy, strict=True))
            if not g and (_uses_top_k(p, self.vocab_size) or _uses_top_p(p))
        ]
        if len(filtered) == len(params):
            logits = self._apply_top_k_top_p(logits, params)
        elif filtered:
            row_index = self._index(filtered, device)
            subset = self._apply_top_k_top_p(
                logits.index_select(0, row_index), [params[i] for i in filtered]
            )
            logits = logits.index_copy(0, row_index, subset)
        return logits

    def _sample_random(
        self, logits: torch.Tensor, states: Sequence[SamplingState], greedy: Sequence[bool]
    ) -> torch.Tensor:
        device = logits.device
        params = [state.params for state in states]
        any_greedy = any(greedy)
        argmax_tokens = self._argmax(logits) if any_greedy else None  # [num_rows]
        probs = self._filtered(logits, params, greedy).softmax(dim=-1)  # [num_rows, V]
        # Exponential(1) noise as -log(U): a uniform draw is much cheaper than exponential_()
        # on CPU. A seeded row draws from its own generator: one row-sized draw per step.
        noise = torch.empty_like(probs)
        seeded = [
            (row, state.generator)
            for row, (state, g) in enumerate(zip(states, greedy, strict=True))
            if state.generator is not None and not g
        ]
        if len(seeded) < len(states):
            noise.uniform_()  # the default generator, shared by unseeded rows
        for row, generator in seeded:
            noise[row].uniform_(generator=generator)
        noise.log_().neg_()
        sampled = self._argmax(probs.div_(noise))  # [num_rows]
        if argmax_tokens is None:
            return sampled
        greedy_rows = torch.tensor(greedy, dtype=torch.bool, device=device)
        return torch.where(greedy_rows, argmax_tokens, sampled)

    def _apply_top_k_top_p(
        self, logits: torch.Tensor, params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        """Mask all but each row's top-k and top-p nucleus (vLLM ``apply_top_k_top_p``).

        Top-k alone needs only a partial top-k. With top-p, the rows are first tried on their
        ``TOP_P_CANDIDATES`` most likely tokens, which hold the nucleus whenever their mass
        reaches ``top_p`` (nearly always); only the other rows are sorted in full.
        """
        device = logits.device
        vocab = self.vocab_size
        top_k = [p.top_k if _uses_top_k(p, vocab) else vocab for p in params]
        k = torch.tensor(top_k, device=device)  # [F]
        if not any(_uses_top_p(p) for p in params):
            top_values = logits.topk(max(top_k), dim=-1).values  # [F, max_k]
            threshold = top_values.gather(1, (k - 1).unsqueeze(1))  # [F, 1]
            return logits.masked_fill(logits < threshold, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=device)  # [F]
        num_candidates = max([TOP_P_CANDIDATES, *(n for n in top_k if n < vocab)])
        if num_candidates >= vocab:
            return self._top_k_top_p_sorted(logits, k, top_p)

        values, indices = logits.topk(num_candidates, dim=-1)  # [F, C], most likely first
        positions = torch.arange(num_candidates, device=device)
        values = values.masked_fill(positions >= k.unsqueeze(1), float("-inf"))  # top-k
        # Log of each row's total mass: within the candidates for top-k rows, else the row.
        has_top_k = k < vocab
        total = torch.where(has_top_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
        probs = (values - total.unsqueeze(1)).exp()  # [F, C]
        cumulative = probs.cumsum(dim=-1)  # [F, C]
        # NOTE: a token stays when the mass of the tokens more likely than it is below top_p
        # (the most likely always stays); the same set as vLLM's ascending-sort rule.
        keep = (cumulative - probs) < top_p.unsqueeze(1)
        keep[:, 0] = True  # whatever rounding does to a tiny top_p
        covered = has_top_k | (cumulative[:, -1] >= top_p)  # no token beyond the candidates
        kept = values.masked_fill(~keep, float("-inf"))
        result = torch.full_like(logits, float("-inf")).scatter_(1, indices, kept)
        uncovered = (~covered).nonzero().squeeze(1)  # [U]
        if uncovered.numel():
            result[uncovered] = self._top_k_top_p_sorted(
                logits[uncovered], k[uncovered], top_p[uncovered]
            )
        return result

    @staticmethod
    def _top_k_top_p_sorted(
        logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor
    ) -> torch.Tensor:
        """Top-k then top-p by one full ascending sort (vLLM ``apply_top_k_top_p``)."""
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1)  # [F, V], ascending
        threshold = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # [F, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [F, V]
        outside = cumulative <= (1.0 - top_p).unsqueeze(1)
        outside[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor,
        rows: Sequence[int],
        tokens: torch.Tensor,
        params: Sequence[SamplingParams],
        out: list[Logprobs | None],
    ) -> None:
        chosen = tokens.unsqueeze(1)  # [R, 1]
        if len(rows) < tokens.shape[0]:
            chosen = tokens.index_select(0, torch.tensor(rows, device=tokens.device)).unsqueeze(1)
        token_logprobs = raw_logprobs.gather(1, chosen)  # [R, 1]
        # Rank: how many tokens are at least as likely (1 = the most likely), as in vLLM.
        ranks = (raw_logprobs >= token_logprobs).sum(dim=-1)  # [R]
        num_top = [params[row].logprobs or 0 for row in rows]
        top_values: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if max(num_top) > 0:
            top = raw_logprobs.topk(max(num_top), dim=-1)  # [R, max_n]
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        token_list = chosen.squeeze(1).tolist()
        logprob_list = token_logprobs.squeeze(1).tolist()
        rank_list = ranks.tolist()
        for i, row in enumerate(rows):
            n = num_top[i]
            out[row] = Logprobs(
                token_id=token_list[i],
                logprob=logprob_list[i],
                rank=rank_list[i],
                top_token_ids=tuple(top_ids[i][:n]),
                top_logprobs=tuple(top_values[i][:n]),
            )
