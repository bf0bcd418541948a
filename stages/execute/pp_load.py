"""What a pipeline shard loads (``docs/architecture.md`` §8, docs/parallelism.md "What a shard
loads"): the safetensors tensors of its own layer range, renamed to its renumbered layers, the
embeddings on the first shard, the final norm and the LM head on the last (with tied
embeddings, the embedding matrix as the last shard's head), and nothing else.

actorline's own Llama (:func:`stages.execute.llama.load_native_llama`, the default for Llama
and Qwen2 checkpoints) is built on the meta device, cut to the shard (:func:`cut_to_part`)
and given only the tensors :func:`shard_tensor_name` maps, each read alone from the file, so
a shard's resident weights are its share of the model from the start, as vLLM's models skip
the other ranks' tensors at load (``vllm/model_executor/models/llama.py``: ``load_weights``
skips ``is_pp_missing_parameter`` names; ``PPMissingLayer``). transformers' own class
(:func:`load_transformers_model`) is built the same way, its rotary embedding (the one buffer
these model types keep outside the checkpoint) rebuilt from the config; a model with any other
buffer loads whole and is cut after (:func:`cut_to_part`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from stages.execute.model_impl import open_weights, read_tensor, weight_files
from stages.execute.pipeline_parallel import cut_layers, drop_embeddings

__all__ = [
    "ShardPart",
    "cut_to_part",
    "load_transformers_model",
    "shard_part",
    "shard_tensor_name",
    "survey_model",
]

logger = logging.getLogger("actorline.execute")

#: a decoder layer's tensor in a Llama-shaped checkpoint: prefix, layer index, the rest
_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..+)$")
EMBEDDINGS = "model.embed_tokens.weight"
NORM = "model.norm.weight"
HEAD = "lm_head.weight"


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPart:
    """One pipeline shard's part of the model: its decoder ``layers`` (checkpoint indices),
    whether it is the ``first`` (the embeddings) and the ``last`` (norm and LM head)."""

    layers: range
    first: bool
    last: bool


def shard_part(ranges: Sequence[range], shard: int) -> ShardPart | None:
    """Shard ``shard``'s part of a model split into ``ranges`` (None: one shard, the whole
    model)."""
    if len(ranges) == 1:
        return None
    return ShardPart(ranges[shard], first=shard == 0, last=shard == len(ranges) - 1)


def shard_tensor_name(name: str, part: ShardPart, tied: bool) -> str | None:
    """The shard's parameter name of checkpoint tensor ``name``: a layer of the shard's range
    renumbered from 0, the embeddings on the first shard (and, ``tied``, as the last shard's
    ``lm_head.weight`` where the last shard is not the first), the norm and the head on the
    last; None for another shard's tensor; any other name as it is (the loader decides
    whether the model knows it)."""
    layer = _LAYER.match(name)
    if layer is not None:
        index = int(layer.group(2))
        if index not in part.layers:
            return None
        return f"{layer.group(1)}{index - part.layers.start}{layer.group(3)}"
    if name == EMBEDDINGS:
        if part.first:
            return name
        return HEAD if part.last and tied else None
    if name in (NORM, HEAD):
        return name if part.last else None
    return name


def cut_to_part(model: Any, part: ShardPart) -> None:
    """Cut ``model`` (built on the meta device, nothing loaded yet) to ``part``: its layers
    (renumbered), no norm and head unless last, no embeddings unless first.

    Raises:
        UnsupportedModelError: as :func:`~stages.execute.pipeline_parallel.cut_layers`.
    """
    cut_layers(model, part.layers, first=part.first, last=part.last)
    if not part.first:
        drop_embeddings(model)


class _FromZeros:
    """A decoder without embeddings, called as the load's survey calls a model: from zero
    hidden states in place of the token ids' embeddings (the survey records the attention
    calls' shapes; the values are meaningless either way)."""

    def __init__(self, decoder: Any, hidden_size: int, dtype: torch.dtype) -> None:
        self.decoder, self.hidden_size, self.dtype = decoder, hidden_size, dtype

    def __call__(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, **rest: Any) -> Any:
        shape = (*input_ids.shape, self.hidden_size)
        hidden = torch.zeros(shape, device=input_ids.device, dtype=self.dtype)
        return self.decoder(input_ids=None, inputs_embeds=hidden, position_ids=position_ids, **rest)


def survey_model(model: Any, stages: int, dtype: torch.dtype) -> Any:
    """What the load's survey (:func:`~stages.execute.attention.survey_layers`) runs: the model
    (one shard), the decoder (a shard with embeddings), or the decoder from zero hidden states
    in ``dtype`` (the activations'; a later shard, which never loaded the embeddings)."""
    if stages == 1:
        return model
    decoder = model.get_decoder()
    if getattr(decoder, "embed_tokens", None) is not None:
        return decoder
    return _FromZeros(decoder, int(model.config.get_text_config().hidden_size), dtype)


def load_transformers_model(
    model_dir: Path, hf_config: Any, dtype: torch.dtype, part: ShardPart | None
) -> Any:
    """``model_dir`` through transformers' class for its config (a deep copy of ``hf_config``:
    switching the attention implementation mutates it, and models built from one config object
    share it), in ``dtype``: the whole model (``part`` None), or pipeline shard ``part`` cut
    (:func:`cut_to_part`) with only its tensors read; a model that keeps buffers outside the
    checkpoint besides its rotary embedding loads whole and is cut (logged).

    Raises:
        ValueError: the checkpoint lacks a tensor the shard needs, or a tensor's shape differs.
        UnsupportedModelError: as :func:`cut_to_part`.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf_config)
    if part is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    cut_to_part(model, part)
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    others = [name for name, _ in model.named_buffers() if not name.startswith("model.rotary_emb.")]
    if rotary is None or others:
        logger.info(
            "execute: %s keeps buffers %s outside the checkpoint; the shard loads the whole "
            "model and cuts it", type(model).__name__, others or "(no rotary_emb)",
        )  # fmt: skip
        whole = AutoModelForCausalLM.from_pretrained(
            model_dir, config=copy.deepcopy(hf_config), dtype=dtype
        )
        cut_to_part(whole, part)
        return whole
    text = model.config.get_text_config()
    expected = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    tied = bool(getattr(text, "tie_word_embeddings", False))
    for path in weight_files(model_dir):
        with open_weights(path) as handle:
            for stored in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = shard_tensor_name(stored, part, tied)
                if name is None or name not in expected:
                    continue  # another shard's, or what transformers' load ignores too
                try:
                    loaded[name] = read_tensor(handle, stored, name, expected[name].shape, dtype)
                except ValueError as exc:
                    raise ValueError(f"{model_dir}: {exc}") from None
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(missing)} tensors: {missing[:4]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    # NOTE: built as transformers builds it (its own __init__ computes the frequencies)
    decoder.rotary_emb = type(rotary)(config=text)
    return model
