"""Pipeline parallelism for the model runner: the decoder's layers split into contiguous
ranges, one per shard, each shard a process of its own (``docs/architecture.md`` §8,
docs/parallelism.md "Pipeline parallelism").

What each shard holds: its layers (renumbered from 0, so its KV cache holds its layers
only), the embeddings on the first shard, the final norm and the LM head on the last. A shard
reads only those tensors (:mod:`stages.execute.pp_load`: the model built on the meta device,
cut by :func:`cut_layers` and :func:`drop_embeddings`, then loaded).

A step: the first shard (the execute stage, which owns the allocator, block tables and
sampling state) packs the batch, runs the embeddings and its layers, and sends the next shard
a :class:`~stages.execute.pp_messages.PipelineStep` (the batch and the hidden state); each
shard runs its layers and passes it on; the last runs the final norm and the LM head over the
rows that sample, samples them and sends the tokens back to the first
(:func:`sample_step`, :mod:`stages.execute.pp_sampling`). Layer ranges
follow vLLM's ``get_pp_indices`` (``vllm/distributed/utils.py``) and its models' first/last
rank split (``vllm/model_executor/models/llama.py``: ``make_layers``, ``PPMissingLayer``);
the hand-off of the hidden state over an ordinary link is actorline's own.

With ``tensor_parallel_size`` N > 1 too, each shard is a tensor-parallel group of N ranks
(:mod:`stages.execute.tensor_parallel`) over its own layers: its rank 0 (the execute stage,
or the shard's :class:`~stages.execute.pp_stage.PipelineShardStage`) does what is written
above, and its other ranks run the same layers over their heads in lockstep
(:func:`forward_ranks`; shard 0's run ``ModelRunner.run_shard`` as without pipeline
parallelism), their all-reduces within the shard's group. Only a shard's rank 0 sends the
next shard anything: the hidden state after the all-reduce is the same on every rank of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stages.execute.attention import UnsupportedModelError, forward_context
from stages.execute.bookkeeping import StepError
from stages.execute.prompt_scores import prompt_rows

if TYPE_CHECKING:
    from stages.execute.pp_messages import PipelineSampled, PipelineStep
    from stages.execute.pp_sampling import LastShardStates
    from stages.execute.rank_messages import ShardStep
    from stages.execute.runner import ModelRunner, PreparedStep

__all__ = [
    "cut_layers",
    "drop_embeddings",
    "forward_layers",
    "forward_ranks",
    "pipeline_keep",
    "run_layers",
    "sample_step",
]


def cut_layers(model: Any, layers: range, *, first: bool, last: bool) -> None:
    """Keep only decoder layers ``layers`` of ``model`` (in place), renumbered from 0 (the
    paged attention and the KV cache index layers by ``self_attn.layer_idx``); the config's
    layer count (and per-layer types) follow. A shard other than the last loses the final
    norm (its output is the residual stream) and the LM head.

    Raises:
        UnsupportedModelError: the decoder has no ``layers`` list, or a layer has no
            ``self_attn`` with an integer ``layer_idx``.
    """
    decoder = model.get_decoder()
    every = getattr(decoder, "layers", None)
    if not isinstance(every, torch.nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(decoder).__name__} keeps no `layers` list to split into pipeline shards"
        )
    total = len(every)
    kept = [every[index] for index in layers]
    for index, layer in enumerate(kept):
        attention: Any = getattr(layer, "self_attn", None)
        if not isinstance(getattr(attention, "layer_idx", None), int):
            raise UnsupportedModelError(
                f"decoder layer {type(layer).__name__} has no self_attn.layer_idx to renumber"
            )
        attention.layer_idx = index
    decoder.layers = torch.nn.ModuleList(kept)
    text = model.config.get_text_config()
    text.num_hidden_layers = len(kept)
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == total:
        text.layer_types = layer_types[layers.start : layers.stop]
    if not last:
        decoder.norm = torch.nn.Identity()
        model.lm_head = None


def drop_embeddings(model: Any) -> None:
    """Drop the input embeddings of a shard other than the first (after the load's survey,
    which runs the decoder from token ids). A tied LM head keeps its weight."""
    model.get_decoder().embed_tokens = None


def run_layers(
    model: Any,
    positions: torch.Tensor,
    *,
    input_ids: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """This shard's part of the forward pass over the packed batch (inside the step's
    ``forward_context``): from ``input_ids [T]`` (the first shard) or ``hidden [T, H]``
    (the others). With ``keep`` (the last shard): the final norm and the LM head over those
    rows, ``[K, V]`` logits; without: the hidden state after this shard's layers,
    ``[T, H]``."""
    arguments: dict[str, Any] = {"position_ids": positions.unsqueeze(0), "use_cache": False}
    if hidden is None:
        assert input_ids is not None
        arguments["input_ids"] = input_ids.unsqueeze(0)
    else:
        arguments["input_ids"] = None
        arguments["inputs_embeds"] = hidden.unsqueeze(0)
    if keep is not None:
        return model(**arguments, logits_to_keep=keep).logits[0]
    output = model.get_decoder()(**arguments)
    states = output if isinstance(output, torch.Tensor) else output.last_hidden_state
    return states[0]


def pipeline_keep(prepared: PreparedStep) -> list[int]:
    """The packed rows whose logits the last shard returns for ``prepared``, in the order
    :meth:`~stages.execute.runner.ModelRunner.run` reads them: the rows that sample, then
    prompt-logprob rows.

    Raises:
        StepError: the step pools embeddings, which a pipeline-parallel engine does not serve
            (the final hidden states are on the last shard).
    """
    works = prepared.works
    if any(work.request.pooling is not None for work in works):
        raise StepError("embeddings are not served with pipeline_parallel_size > 1")
    sampling = [work for work in works if work.samples]
    scored = prompt_rows([(w.request.prompt_scores, w.start, w.end, w.packed_end) for w in works])
    return [work.packed_end - 1 for work in sampling] + list(scored.packed_rows)


def forward_layers(
    runner: ModelRunner, shard: ShardStep, hidden: np.ndarray | None, keep: np.ndarray | None
) -> np.ndarray:
    """``runner``'s shard of the layers over the step ``shard``: from its tokens (the first
    shard, ``hidden`` None) or the shard before's ``hidden [T, H]``; K/V of its layers go to
    its cache. With ``keep`` (the last shard): the logits of those rows, ``[K, V]``; else the
    hidden state after its layers, ``[T, H]``; float32 either way.

    Raises:
        RuntimeError: the runner is not loaded.
    """
    return _forward(runner, shard, hidden, keep).cpu().numpy()


def sample_step(
    runner: ModelRunner, states: LastShardStates, step: PipelineStep
) -> PipelineSampled:
    """The last shard's part of ``step``: its layers from the shard before's hidden state,
    the LM head over the step's ``keep`` rows, then sampling them with ``states`` (updated
    first with the step's registrations and releases; :mod:`stages.execute.pp_sampling`).

    Raises:
        RuntimeError: the runner is not loaded.
        ValueError: the step's rows do not match its sampling payload.
    """
    states.update(runner, step.sampling)
    logits = _forward(runner, step.shard, step.hidden, step.keep)  # [K, V] float32
    with torch.inference_mode():
        return states.sample(runner, step.shard.step_id, logits, step.sampling)


def _forward(
    runner: ModelRunner, shard: ShardStep, hidden: np.ndarray | None, keep: np.ndarray | None
) -> torch.Tensor:
    """:func:`forward_layers` as a float32 tensor on the runner's device."""
    if runner.kv_cache is None:
        raise RuntimeError("ModelRunner.load() must be called before forward_layers()")
    device = runner.device
    metadata, positions = runner.shard_metadata(shard)
    with torch.inference_mode(), forward_context(metadata):
        output = run_layers(
            runner.model,
            positions,
            input_ids=torch.from_numpy(shard.token_ids).to(device) if hidden is None else None,
            # NOTE: copied out of the received frame (read-only; the layers may work in
            # place): T x H floats, small beside the step
            hidden=(
                None if hidden is None else torch.tensor(hidden, device=device, dtype=runner.dtype)
            ),
            keep=None if keep is None else torch.tensor(keep, device=device),
        )
        result = output.float()
    runner.kv_cache.prefault()
    return result


def forward_ranks(runner: ModelRunner, shard: ShardStep, hidden: np.ndarray) -> None:
    """A tensor-parallel rank other than 0 of a pipeline shard after the first: its part of
    the shard's layers over the step ``shard`` from the shard before's ``hidden [T, H]``,
    all-reducing with the shard's rank 0 (which runs :func:`forward_layers` on the same
    step); K/V of its heads go to its cache. Nothing comes back: rank 0 sends on.

    Raises:
        RuntimeError: the runner is not loaded, or is not a rank other than 0.
        TensorParallelError: a collective failed or timed out.
    """
    group = runner.group
    if runner.kv_cache is None or group is None or runner.rank == 0:
        raise RuntimeError("forward_ranks runs on a loaded tensor-parallel rank other than 0")
    metadata, positions = runner.shard_metadata(shard)
    with torch.inference_mode(), forward_context(metadata):
        run_layers(
            runner.model,
            positions,
            hidden=torch.tensor(hidden, device=runner.device, dtype=runner.dtype),
        )
    runner.kv_cache.prefault()
    group.take_seconds()
