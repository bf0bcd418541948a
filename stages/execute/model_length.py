"""The engine's model length: the longest sequence (prompt plus output) it serves.

Three limits bound it: the model's ``max_position_embeddings``, the tokens the KV cache holds,
and, for a RoPE variant whose frequencies depend on the sequence length, the length up to
which those frequencies stay fixed. When every layer attends within a sliding window, the
blocks behind it are freed as a request advances (docs/architecture.md §6.2), so the cache
bounds a request only by its window: :func:`resolve_model_length` lifts the cache's cap then.
Pure Python: the model runner passes the HF config object, the null model the parsed
``config.json``; both resolve the length with the same code.

NOTE: transformers recomputes such RoPE frequencies in the forward pass from the largest
position it is given (``transformers/modeling_rope_utils.py``: ``dynamic_rope_update``). On a
packed batch that is the largest position of *any* request in it, so past the switch one
request's tokens would change with the others it happens to share a step with, and differ
from ``generate`` run alone. Below the switch every forward pass uses the same frequencies as
``generate`` does, so the engine serves such a model only there.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from stages.execute.config import ExecuteConfigError
from stages.execute.windows import kv_window, window_blocks_needed

__all__ = [
    "RopeLengthLimit",
    "resolve_max_model_len",
    "resolve_model_length",
    "rope_length_limit",
]

logger = logging.getLogger("actorline.execute")


@dataclasses.dataclass(frozen=True, slots=True)
class RopeLengthLimit:
    """A RoPE variant whose frequencies stay as ``generate`` uses them only while every
    position of a forward pass is below ``max_model_len``; ``source`` names the config field
    the limit comes from."""

    rope_type: str
    max_model_len: int
    source: str

    def explain(self) -> str:
        """Why a longer model length would give wrong outputs (for errors and warnings)."""
        return (
            f"rope_type {self.rope_type!r} switches its RoPE frequencies once a sequence is "
            f"longer than {self.source} ({self.max_model_len} tokens), and transformers decides "
            "the switch from the longest sequence of the whole packed batch: past it, one "
            "request's outputs would depend on the requests that share its batch"
        )


def _field(config: Any, name: str) -> Any:
    """``name`` of an HF config object or of a parsed ``config.json``; None when absent."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _rope_dicts(config: Any) -> list[Mapping[str, Any]]:
    """The config's RoPE parameter dicts: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (older configs), one per layer type when nested by layer type."""
    for name in ("rope_parameters", "rope_scaling"):
        parameters = _field(config, name)
        if isinstance(parameters, Mapping) and parameters:
            break
    else:
        return []
    if "rope_type" in parameters or "type" in parameters:
        return [parameters]
    # Nested by layer type ({"full_attention": {...}, "sliding_attention": {...}}).
    return [value for value in parameters.values() if isinstance(value, Mapping)]


def rope_length_limit(config: Any) -> RopeLengthLimit | None:
    """The longest model length at which the config's RoPE frequencies never switch, or None
    when they do not depend on the sequence length.

    Mirrors transformers (``modeling_rope_utils.py``, ``dynamic_rope_update``), where
    ``seq_len = max(position_ids) + 1``:

    - ``longrope`` takes the long factors when ``seq_len > original_max_position_embeddings``,
      which is the config's own ``original_max_position_embeddings`` when it has one (Phi-3
      keeps it outside the RoPE parameters and transformers gives it priority:
      ``standardize_rope_params``), else the RoPE parameters' entry, else
      ``max_position_embeddings``;
    - any ``dynamic`` type (dynamic NTK) recomputes its base when ``seq_len`` exceeds the
      rotary embedding's ``max_seq_len_cached``, which starts at ``max_position_embeddings``
      (``LlamaRotaryEmbedding.__init__``).
    """
    max_positions = int(_field(config, "max_position_embeddings") or 0)
    limits: list[RopeLengthLimit] = []
    for parameters in _rope_dicts(config):
        rope_type = str(parameters.get("rope_type", parameters.get("type", "default")))
        if rope_type == "longrope":
            top_level = _field(config, "original_max_position_embeddings")
            if top_level is not None:
                limits.append(
                    RopeLengthLimit(rope_type, int(top_level), "original_max_position_embeddings")
                )
            elif parameters.get("original_max_position_embeddings") is not None:
                limits.append(
                    RopeLengthLimit(
                        rope_type,
                        int(parameters["original_max_position_embeddings"]),
                        "original_max_position_embeddings",
                    )
                )
            elif max_positions > 0:
                limits.append(RopeLengthLimit(rope_type, max_positions, "max_position_embeddings"))
        elif "dynamic" in rope_type and max_positions > 0:
            limits.append(RopeLengthLimit(rope_type, max_positions, "max_position_embeddings"))
    return min(limits, key=lambda limit: limit.max_model_len, default=None)


def resolve_max_model_len(requested: int | None, config: Any, cache_tokens: int) -> int:
    """The engine's model length: ``requested``, or by default the model's
    ``max_position_embeddings`` capped by ``cache_tokens`` and by :func:`rope_length_limit`
    (a warning says why when that cap binds).

    Raises:
        ExecuteConfigError: ``requested`` exceeds the RoPE limit, the model's
            ``max_position_embeddings`` or what the KV cache holds.
    """
    model_limit = int(_field(config, "max_position_embeddings") or 0)
    rope = rope_length_limit(config)
    if requested is None:
        length = min(model_limit, cache_tokens) if model_limit > 0 else cache_tokens
        if rope is not None and rope.max_model_len < length:
            logger.warning(
                "max_model_len capped at %d (the model and KV cache allow %d): %s. Requests "
                "longer than that are refused.",
                rope.max_model_len,
                length,
                rope.explain(),
            )
            length = rope.max_model_len
        return length
    if rope is not None and requested > rope.max_model_len:
        raise ExecuteConfigError(
            "max_model_len",
            f"({requested}) exceeds {rope.max_model_len}, the longest this model is served "
            f"correctly: {rope.explain()}",
        )
    if model_limit > 0 and requested > model_limit:
        raise ExecuteConfigError(
            "max_model_len",
            f"({requested}) exceeds the model's max_position_embeddings ({model_limit})",
        )
    if requested > cache_tokens:
        raise ExecuteConfigError(
            "max_model_len",
            f"({requested}) exceeds what the KV cache holds ({cache_tokens} tokens); "
            "raise num_blocks or kv_cache_memory",
        )
    return requested


def resolve_model_length(
    requested: int | None,
    config: Any,
    usable_blocks: int,
    block_size: int,
    layer_windows: list[int | None],
) -> tuple[int, int | None]:
    """The model length (:func:`resolve_max_model_len`) and the window that bounds every
    layer (:func:`~stages.execute.windows.kv_window`, None when some layer sees the whole
    context). When such a window is shorter than the length and the cache holds a request's
    window (:func:`~stages.execute.windows.window_blocks_needed`), the cache does not cap the
    length: a request of any length holds only its window's blocks.

    Raises:
        ExecuteConfigError: as :func:`resolve_max_model_len`.
    """
    cache_tokens = usable_blocks * block_size
    model_limit = int(_field(config, "max_position_embeddings") or 0)
    if model_limit > cache_tokens:
        window = kv_window(layer_windows, model_limit)
        if window is not None and usable_blocks >= window_blocks_needed(window, block_size):
            length = resolve_max_model_len(requested, config, model_limit)
            if window < length:
                return length, window
    length = resolve_max_model_len(requested, config, cache_tokens)
    return length, kv_window(layer_windows, length)
