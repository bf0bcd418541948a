"""Which model class serves a checkpoint: actorline's own (:mod:`stages.execute.llama`) or
transformers', read from ``config.json`` alone. No torch and no transformers here: the CLI asks
before it starts the engine process, to decide whether that process preloads transformers
(docs/performance.md §3)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "INDEX_FILE",
    "LLAMA_TP_PLAN",
    "WEIGHTS_FILE",
    "NativeConfig",
    "eos_token_ids",
    "model_config",
    "native_config",
    "open_weights",
    "read_tensor",
    "weight_files",
]

logger = logging.getLogger("actorline.execute")

#: which linears tensor parallelism splits, as transformers' ``LlamaConfig.base_model_tp_plan``
LLAMA_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

#: the model types actorline's own class serves, and their architecture name
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class NativeConfig:
    """A model's ``config.json`` as attributes, with Llama's defaults filled in: what the
    execute stage reads of an HF config (``get_text_config()``, ``to_dict()``, the head counts,
    ``base_model_tp_plan``, ``_attn_implementation``), without transformers' config classes."""

    base_model_tp_plan = LLAMA_TP_PLAN

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = dict(raw)
        self.__dict__.update(raw)
        self.vocab_size = int(raw["vocab_size"])
        self.hidden_size = int(raw["hidden_size"])
        self.intermediate_size = int(raw["intermediate_size"])
        self.num_hidden_layers = int(raw["num_hidden_layers"])
        self.num_attention_heads = heads = int(raw["num_attention_heads"])
        self.num_key_value_heads = int(raw.get("num_key_value_heads") or heads)
        self.head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
        self.rms_norm_eps = float(raw.get("rms_norm_eps", 1e-6))
        self.attention_bias = bool(raw.get("attention_bias", False))
        # Qwen2 is Llama with biases on the query, key and value projections (not the output)
        qwen2 = raw.get("model_type") == "qwen2"
        self.qkv_bias = qwen2 or self.attention_bias
        self.o_bias = not qwen2 and self.attention_bias
        self.mlp_bias = bool(raw.get("mlp_bias", False))
        self.tie_word_embeddings = bool(raw.get("tie_word_embeddings", False))
        self.max_position_embeddings = int(raw.get("max_position_embeddings", 2048))
        rope = _rope_parameters(raw)
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        #: RoPE's type (``default`` or ``llama3``) and, for ``llama3``, its frequency bands:
        #: ``(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)``
        self.rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        self.rope_llama3: tuple[float, float, float, float] | None = None
        if self.rope_type == "llama3":
            # NOTE: as transformers' standardize_rope_params: a top-level
            # original_max_position_embeddings wins, else max_position_embeddings.
            original = raw.get("original_max_position_embeddings") or rope.get(
                "original_max_position_embeddings", self.max_position_embeddings
            )
            self.rope_llama3 = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                float(original),
            )
        self._attn_implementation = "sdpa"

    def get_text_config(self) -> NativeConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self._raw)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE as transformers 5 states it (``rope_parameters``) or 4 (``rope_theta`` beside
    ``rope_scaling``)."""
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, dict):
        return parameters
    merged: dict[str, Any] = dict(raw.get("rope_scaling") or {})
    if "rope_theta" in raw:
        merged["rope_theta"] = raw["rope_theta"]
    return merged


def native_config(model_dir: Path) -> NativeConfig | None:
    """The checkpoint's config when actorline's own Llama serves it (see the module
    docstring), else None (the reason logged at debug): it then loads through transformers."""

    def decline(reason: str) -> None:
        logger.debug("execute: %s loads through transformers: %s", model_dir, reason)

    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as error:
        decline(f"config.json unreadable ({error})")
        return None
    if not isinstance(raw, dict):
        decline("config.json is not an object")
        return None
    rope = _rope_parameters(raw)
    model_type = raw.get("model_type")
    layer_types = raw.get("layer_types") or ()
    checks = (
        (model_type in _ARCHITECTURES, f"model_type {model_type!r}"),
        (
            raw.get("architectures") in (None, [_ARCHITECTURES.get(str(model_type))]),
            f"architectures {raw.get('architectures')!r}",
        ),
        (
            not raw.get("use_sliding_window")
            and all(kind == "full_attention" for kind in layer_types),
            "sliding-window layers",
        ),
        (raw.get("hidden_act", "silu") == "silu", f"hidden_act {raw.get('hidden_act')!r}"),
        (
            rope.get("rope_type", rope.get("type", "default")) in ("default", "llama3"),
            f"RoPE type {rope.get('rope_type', rope.get('type'))!r}",
        ),
        (raw.get("pretraining_tp", 1) in (1, None), "pretraining_tp > 1"),
        ("quantization_config" not in raw, "a quantization_config"),
        (
            (model_dir / WEIGHTS_FILE).is_file() or (model_dir / INDEX_FILE).is_file(),
            "no safetensors weights",
        ),
    )
    for accepted, reason in checks:
        if not accepted:
            decline(reason)
            return None
    try:
        return NativeConfig(raw)
    except (KeyError, TypeError, ValueError) as error:
        decline(f"config incomplete ({type(error).__name__}: {error})")
        return None


def model_config(model_dir: Path, model_impl: str = "auto") -> Any:
    """The config the engine loads ``model_dir`` with: actorline's own (a
    :class:`NativeConfig`) where it serves the checkpoint and ``model_impl`` is not
    ``transformers``, else transformers' ``AutoConfig`` (imported only then)."""
    if model_impl != "transformers":
        own = native_config(model_dir)
        if own is not None:
            return own
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def eos_token_ids(model_dir: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """A checkpoint's EOS ids, read from its files as transformers finds them: the generation
    config's (``generation_config.json``), else the model config's (``config``)."""
    sources: list[dict[str, Any]] = []
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        try:
            sources.append(json.loads(generation.read_text()))
        except ValueError:
            logger.warning("ignoring unreadable %s", generation)
    sources.append(config)
    for source in sources:
        value = source.get("eos_token_id")
        if value is None:
            continue
        ids: Sequence[Any] = value if isinstance(value, list) else [value]
        found = tuple(dict.fromkeys(int(token_id) for token_id in ids))
        if found:
            return found
    return ()


def weight_files(model_dir: Path) -> Iterable[Path]:
    """The checkpoint's safetensors files: the one file, or every shard its index names."""
    if (model_dir / WEIGHTS_FILE).is_file():
        return [model_dir / WEIGHTS_FILE]
    index = json.loads((model_dir / INDEX_FILE).read_text())
    return [model_dir / name for name in dict.fromkeys(index["weight_map"].values())]


def open_weights(path: Path) -> Any:
    """The safetensors file ``path`` opened for torch tensors on the CPU (a context manager
    whose ``keys()`` and ``get_tensor`` read one tensor at a time, memory-mapped)."""
    from safetensors import safe_open

    return safe_open(str(path), framework="pt", device="cpu")


def read_tensor(handle: Any, stored: str, name: str, shape: Sequence[int], dtype: Any) -> Any:
    """The tensor ``stored`` of an open safetensors ``handle`` as ``dtype`` (a torch dtype),
    checked against the ``shape`` the model's config makes its parameter ``name``.

    Raises:
        ValueError: the shapes differ (the message names the tensor and both shapes; the
            caller adds the file).
    """
    tensor = handle.get_tensor(stored)
    if tuple(tensor.shape) != tuple(shape):
        shown = repr(stored) if stored == name else f"{stored!r} (as {name!r})"
        raise ValueError(
            f"tensor {shown} has shape {tuple(tensor.shape)}, the config makes it {tuple(shape)}"
        )
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
