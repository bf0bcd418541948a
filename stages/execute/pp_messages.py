"""What the shards of a pipeline-parallel engine send each other (``docs/architecture.md``
§8, docs/parallelism.md "Pipeline parallelism"): each step, the batch and the hidden state
from one shard to the next, with what the last shard needs to sample the step
(:class:`PipelineSampling`), then from the last shard back to the first the sampled tokens,
with their logprobs and the prompt logprobs where asked (:class:`PipelineSampled`): no
logits. Apart from the torch side (:mod:`stages.execute.pipeline_parallel`) so that the
shard stage's module, which the frontend imports to build the pipeline graph, needs no torch.

The arrays travel as the codec's out-of-band frames (zero-copy over ZeroMQ multipart,
``transports/codec.py``); nothing is pickled.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stages.execute.rank_messages import ShardStep
from stages.messages import Logprobs
from stages.params import SamplingParams
from transports.codec import message

__all__ = ["PipelineRequest", "PipelineSampled", "PipelineSampling", "PipelineStep"]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class PipelineRequest:
    """A request the first shard registered, as the last shard's sampler needs it (sent once,
    with the first step sent after it came): its prompt (repetition penalty's history), its
    params and its bad words' token sequences (the tokenize stage's)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class PipelineSampling:
    """What the last shard needs to sample a step that it cannot know by itself
    (:mod:`stages.execute.pp_sampling`). Before the step: forget the ``released`` requests
    (finished since the last step sent), then register the ``new_requests``. The step's
    sampling rows (the first ``len(request_ids)`` rows of ``keep``) are those requests' in
    that order; ``grammar_bitmask`` (``int32 [G, W]``, the layout of
    :mod:`stages.structured.backend`) holds the allowed tokens of the constrained ones,
    ``grammar_request_ids[i]`` row ``i``. The other rows of ``keep`` score prompt tokens:
    ``score_chunks`` is ``(rows, top alternatives)`` per chunk, in order, and
    ``score_targets`` each row's next prompt token."""

    request_ids: tuple[str, ...] = ()
    new_requests: tuple[PipelineRequest, ...] = ()
    released: tuple[str, ...] = ()
    grammar_request_ids: tuple[str, ...] = ()
    grammar_bitmask: np.ndarray | None = None  # [G, W] int32
    score_chunks: tuple[tuple[int, int], ...] = ()
    score_targets: tuple[int, ...] = ()


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class PipelineStep:
    """One step for the next shard: the packed batch (``shard``: tokens, positions, block
    tables, as the first shard's allocator decided them), the hidden state after the
    sender's layers (``hidden [T, H]``, float32 whatever the activations' dtype: a bf16 value
    goes there and back exactly), and the packed rows the last shard runs the LM head over
    (``keep [K]``: the rows that sample, then prompt-logprob rows) and what it samples them
    with (``sampling``; every shard passes it on)."""

    shard: ShardStep
    hidden: np.ndarray  # [T, H] float32
    keep: np.ndarray  # [K] int64
    #: seconds each earlier shard spent computing this step (forward only), in shard order
    compute_seconds: tuple[float, ...] = ()
    #: when the sender sent it (``time.time()``), and the hops' transfer seconds so far
    #: (stages.execute.pp_stage: the part of each hop the receiving shard sat idle for)
    sent_at: float = 0.0
    transfer_seconds: float = 0.0
    sampling: PipelineSampling = dataclasses.field(default_factory=PipelineSampling)


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class PipelineSampled:
    """The last shard's answer to step ``step_id``: ``token_ids[i]`` sampled for row ``i``
    of the step's ``PipelineSampling.request_ids``; ``logprobs[j]`` the logprobs of row
    ``logprob_rows[j]`` (the rows whose params ask); ``prompt_logprobs`` one entry per
    prompt-scoring row, in the order of ``score_chunks``. ``compute_seconds``: each shard's
    busy seconds after the first (the last's forward and sampling), in shard order (the
    rest of the round trip is transfer and queueing)."""

    step_id: int
    token_ids: tuple[int, ...] = ()
    logprob_rows: tuple[int, ...] = ()
    logprobs: tuple[Logprobs, ...] = ()
    prompt_logprobs: tuple[Logprobs, ...] = ()
    compute_seconds: tuple[float, ...] = ()
    #: when the last shard sent it (``time.time()``), and the earlier hops' transfer seconds
    sent_at: float = 0.0
    transfer_seconds: float = 0.0
