"""What the shards of a pipeline-parallel engine send each other (``docs/architecture.md``
§8, docs/parallelism.md "Pipeline parallelism"): each step, the batch and the hidden state
from one shard to the next, then the logits of the rows that sample from the last shard back
to the first. Apart from the torch side (:mod:`stages.execute.pipeline_parallel`) so that the
shard stage's module, which the frontend imports to build the pipeline graph, needs no torch.

The arrays travel as the codec's out-of-band frames (zero-copy over ZeroMQ multipart,
``transports/codec.py``); nothing is pickled.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stages.execute.rank_messages import ShardStep
from transports.codec import message

__all__ = ["PipelineLogits", "PipelineStep"]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class PipelineStep:
    """One step for the next shard: the packed batch (``shard``: tokens, positions, block
    tables, as the first shard's allocator decided them), the hidden state after the
    sender's layers (``hidden [T, H]``, float32 whatever the activations' dtype: a bf16 value
    goes there and back exactly), and the packed rows whose logits the last shard returns
    (``keep [K]``: the rows that sample, then prompt-logprob rows)."""

    shard: ShardStep
    hidden: np.ndarray  # [T, H] float32
    keep: np.ndarray  # [K] int64
    #: seconds each earlier shard spent computing this step (forward only), in shard order
    compute_seconds: tuple[float, ...] = ()
    #: when the sender sent it (``time.time()``), and the hops' transfer seconds so far
    #: (stages.execute.pp_stage: the part of each hop the receiving shard sat idle for)
    sent_at: float = 0.0
    transfer_seconds: float = 0.0


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class PipelineLogits:
    """The last shard's answer to step ``step_id``: ``logits [K, V]`` float32 of the rows
    ``keep`` named, in that order. ``compute_seconds``: each shard's forward seconds after
    the first, in shard order (the rest of the round trip is transfer and queueing)."""

    step_id: int
    logits: np.ndarray  # [K, V] float32
    compute_seconds: tuple[float, ...] = ()
    #: when the last shard sent it (``time.time()``), and the earlier hops' transfer seconds
    sent_at: float = 0.0
    transfer_seconds: float = 0.0
