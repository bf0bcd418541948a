"""Sampling on the last pipeline shard (issue 39: "the last [shard holds] the norm and LM head
and samples"; docs/parallelism.md "Pipeline parallelism").

The first shard (the execute stage) owns every request's bookkeeping, as with one engine; the
last shard holds the LM head. Rather than send the logits of the sampling rows back (``[K, V]``
float32: 192 KB a row for a 49,152-token vocabulary), the last shard samples them and sends
back the tokens, their logprobs and the prompt logprobs where asked (a few bytes a row).

What the last shard cannot know by itself travels with each step
(:class:`~stages.execute.pp_messages.PipelineSampling`):

- each request once, with the first step sent after it was registered: its params, prompt
  (repetition penalty's history) and bad words' token sequences; and the requests that
  finished since the last step sent. The last shard keeps a :class:`SamplingState` for each
  (:class:`LastShardStates`), built as the first shard builds its own (EOS ids, vocabulary,
  generator seeded from ``params.seed``), and appends the tokens it samples to it, so its
  penalties, ``min_tokens``, bad words and seeded generators see what one engine's would. The
  first shard appends the same tokens to its own copy (its next chunks' token ids);
- the step's sampling rows' request ids, in the order of the step's ``keep`` rows;
- the grammar bitmask rows of the constrained sampling rows (the schedule stage computes
  them for the step, as with one engine: ``V / 8`` bytes a row);
- for prompt-logprob rows, the prompt token each scores and the top alternatives asked.

Every request is sampled on the last shard: each feature of the sampler is computed from what
travels here, so nothing stays on the first shard's logits path (speculative decoding, LoRA
and prefill/decode disaggregation are refused with pipeline parallelism by the options, and
embedding requests by the engine).

Ordering: the shards run steps in the order the first shard prepared them, and the first shard
notes each step's registrations and releases as it prepares it (:class:`FirstShardOutbox`),
sending them with the next step that computes anything (a step that only frees sends
nothing), so the last shard's states follow the first shard's step by step, with several
steps in flight too (they are disjoint: a request samples in at most one).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from stages.execute.grammar_mask import mask_rows
from stages.execute.pp_messages import PipelineRequest, PipelineSampled, PipelineSampling
from stages.execute.prompt_scores import chunk_targets, prompt_rows, score_rows
from stages.execute.sampler import SampleResult, SamplingState, new_sampling_state
from stages.messages import Logprobs, SchedulerStep

if TYPE_CHECKING:
    from stages.execute.runner import ModelRunner, PreparedStep

__all__ = ["FirstShardOutbox", "LastShardStates", "RemoteSample", "take_sampled"]


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteSample:
    """What the last shard sampled for a step, as the first shard's runner takes it in place
    of its own forward pass and sampling (:meth:`ModelRunner.run`)."""

    result: SampleResult
    prompt_logprobs: tuple[Logprobs, ...]


class FirstShardOutbox:
    """The first shard's side: the registrations and releases the last shard has not been
    told of, and each sent step's :class:`PipelineSampling`. Used on the execute stage's
    worker thread, one step at a time, in the order the steps are prepared."""

    def __init__(self) -> None:
        self._new: dict[str, PipelineRequest] = {}
        self._released: list[str] = []

    def note(self, step: SchedulerStep) -> None:
        """``step`` was prepared: its finished requests were forgotten (a request registered
        since the last step sent is simply not sent), then its new ones registered."""
        for request_id in step.finished:
            if self._new.pop(request_id, None) is None:
                self._released.append(request_id)
        for request in step.new_requests:
            self._new[request.request_id] = PipelineRequest(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                request.bad_words_token_ids,
            )

    def sampling(self, prepared: PreparedStep) -> PipelineSampling:
        """What the last shard needs to sample ``prepared`` (sent with it: what was noted
        since the last step sent goes out now)."""
        step = prepared.step
        works = prepared.works
        request_ids = tuple(work.request.request_id for work in works if work.samples)
        grammar_ids: tuple[str, ...] = ()
        bitmask = None
        if step.grammar_bitmask is not None and step.grammar_request_ids:
            sampling = set(request_ids)
            rows = [i for i, rid in enumerate(step.grammar_request_ids) if rid in sampling]
            grammar_ids = tuple(step.grammar_request_ids[i] for i in rows)
            bitmask = np.ascontiguousarray(step.grammar_bitmask[rows]) if rows else None
        scored = prompt_rows(
            [(w.request.prompt_scores, w.start, w.end, w.packed_end) for w in works]
        )
        chunks = tuple((len(chunk.positions), chunk.scores.num_top) for chunk in scored.chunks)
        targets = tuple(token for chunk in scored.chunks for token in chunk_targets(chunk))
        new, released = tuple(self._new.values()), tuple(self._released)
        self._new, self._released = {}, []
        return PipelineSampling(
            request_ids=request_ids,
            new_requests=new,
            released=released,
            grammar_request_ids=grammar_ids if bitmask is not None else (),
            grammar_bitmask=bitmask,
            score_chunks=chunks,
            score_targets=targets,
        )


class LastShardStates:
    """The last shard's sampling state of every request the first shard holds (see the
    module docstring), built by :meth:`update` from each step's :class:`PipelineSampling`."""

    def __init__(self) -> None:
        self._states: dict[str, SamplingState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def update(self, runner: ModelRunner, sampling: PipelineSampling) -> None:
        """Forget the released requests, then register the new ones with ``runner``'s EOS
        ids, vocabulary and device (as the first shard's runner registers them).

        Raises:
            ValueError: a new request is registered already.
        """
        info, sampler = runner.info, runner.sampler
        assert info is not None and sampler is not None
        for request_id in sampling.released:
            self._states.pop(request_id, None)
        for request in sampling.new_requests:
            if request.request_id in self._states:
                raise ValueError(f"request {request.request_id!r} is already registered")
            self._states[request.request_id] = new_sampling_state(
                request.params,
                request.prompt_token_ids,
                info.eos_token_ids,
                runner.device,
                vocab_size=sampler.vocab_size,
                bad_words_token_ids=request.bad_words_token_ids,
            )

    def sample(
        self, runner: ModelRunner, step_id: int, logits: torch.Tensor, sampling: PipelineSampling
    ) -> PipelineSampled:
        """Sample the step whose ``keep`` rows' logits are ``logits`` (``[K, V]``): its
        sampling rows with the requests' states (appending each token to its state), then
        its prompt-logprob rows (see :class:`PipelineSampling`).

        Raises:
            ValueError: the rows do not match ``sampling``, or a request is unknown.
        """
        sampler = runner.sampler
        assert sampler is not None
        num_sampling = len(sampling.request_ids)
        num_scored = len(sampling.score_targets)
        if logits.shape[0] != num_sampling + num_scored:
            raise ValueError(
                f"{logits.shape[0]} logits rows for {num_sampling} sampling and "
                f"{num_scored} prompt-logprob rows"
            )
        missing = [rid for rid in sampling.request_ids if rid not in self._states]
        if missing:
            raise ValueError(f"the last pipeline shard holds no sampling state for {missing}")
        states = [self._states[rid] for rid in sampling.request_ids]
        grammar = mask_rows(
            sampling.grammar_bitmask,
            sampling.grammar_request_ids,
            sampling.request_ids,
            sampler.vocab_size,
            runner.device,
        )
        result = sampler.sample(logits[:num_sampling], states, grammar)
        for state, token_id in zip(states, result.token_ids, strict=True):
            state.output_token_ids.append(token_id)
        entries: list[Logprobs] = []
        first = num_sampling
        for rows, num_top in sampling.score_chunks:
            targets = sampling.score_targets[first - num_sampling : first - num_sampling + rows]
            entries += score_rows(logits[first : first + rows], targets, num_top)
            first += rows
        logprob_rows = tuple(i for i, entry in enumerate(result.logprobs) if entry is not None)
        return PipelineSampled(
            step_id,
            token_ids=tuple(result.token_ids),
            logprob_rows=logprob_rows,
            logprobs=tuple(entry for entry in result.logprobs if entry is not None),
            prompt_logprobs=tuple(entries),
        )


def take_sampled(answer: PipelineSampled) -> RemoteSample:
    """The first shard's view of the last shard's answer.

    Raises:
        ValueError: a logprobs row is out of range.
    """
    logprobs: list[Logprobs | None] = [None] * len(answer.token_ids)
    for row, entry in zip(answer.logprob_rows, answer.logprobs, strict=True):
        if not 0 <= row < len(logprobs):
            raise ValueError(f"logprobs row {row} of {len(logprobs)} sampled rows")
        logprobs[row] = entry
    return RemoteSample(SampleResult(list(answer.token_ids), logprobs), answer.prompt_logprobs)
