"""Pipeline parallelism for the model runner: the decoder's layers split into contiguous
ranges, one per shard, each shard a process of its own (``docs/architecture.md`` §8,
docs/parallelism.md "Pipeline parallelism").

What each shard holds: its layers (renumbered from 0, so its KV cache holds its layers
only), the embeddings on the first shard, the final norm and the LM head on the last. Every
shard first loads the whole checkpoint and then drops what it does not hold
(:func:`cut_layers`, :func:`drop_embeddings`): on CPU the peak is the whole model for a
moment, what stays is the shard's part (loading only the shard's tensors is a next step).

A step: the first shard (the execute stage, which owns the allocator, block tables and
sampling state) packs the batch, runs the embeddings and its layers, and sends the next shard
a :class:`~stages.execute.pp_messages.PipelineStep` (the batch and the hidden state); each
shard runs its layers and passes it on; the last runs the final norm and the LM head over the
rows that sample and sends their logits back to the first, which samples. Layer ranges
follow vLLM's ``get_pp_indices`` (``vllm/distributed/utils.py``) and its models' first/last
rank split (``vllm/model_executor/models/llama.py``: ``make_layers``, ``PPMissingLayer``);
the hand-off of the hidden state over an ordinary link is actorline's own.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.execute.attention import UnsupportedModelError

__all__ = ["cut_layers", "drop_embeddings", "run_layers"]


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
        arguments["inputs_embeds"] = hidden.unsqueeze(0)
    if keep is not None:
        return model(**arguments, logits_to_keep=keep).logits[0]
    output = model.get_decoder()(**arguments)
    states = output if isinstance(output, torch.Tensor) else output.last_hidden_state
    return states[0]
