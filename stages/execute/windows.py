"""Sliding windows and KV blocks: which of a request's blocks no layer reads any more
(docs/architecture.md §6.2). Pure Python: the model runner, the null model and the scheduler's
mirror all decide with these functions, so they agree block for block.

When every layer of a model attends within a window (Mistral with ``sliding_window``, Qwen2
with every layer windowed), a request whose next query sits at position ``c`` (it has ``c``
computed tokens) reads only positions ``c - W + 1 ..``; the blocks wholly before that are
freed as it advances, as vLLM's ``SlidingWindowManager`` does
(``vllm/v1/core/single_type_kv_cache_manager.py``: ``get_num_skipped_tokens`` is
``num_computed_tokens - sliding_window + 1``), so a generation of any length holds at most
``ceil((W - 1) / block_size) + 1`` blocks between steps. A model with any full-attention layer
(Gemma 2/3, gpt-oss, Cohere 2) reads every position in that layer, so nothing is freed early.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "blocks_behind_window",
    "config_layer_windows",
    "kv_window",
    "window_blocks_needed",
]


def kv_window(layer_windows: Sequence[int | None], max_model_len: int) -> int | None:
    """The window that bounds what every layer reads: the largest layer window when every
    layer has one shorter than ``max_model_len``, else None (some layer sees everything)."""
    if not layer_windows or any(window is None for window in layer_windows):
        return None
    widest = max(window for window in layer_windows if window is not None)
    return widest if widest < max_model_len else None


def blocks_behind_window(num_computed: int, window: int | None, block_size: int) -> int:
    """How many leading blocks of a request with ``num_computed`` computed tokens lie wholly
    before its window (no layer reads them again): the next query, at position
    ``num_computed``, sees positions from ``num_computed - window + 1`` on."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def window_blocks_needed(window: int, block_size: int) -> int:
    """The most blocks a request holds between steps under ``window`` (its window's blocks)
    plus the one its next token may open: with at least this many a lone request always
    advances, whatever its length."""
    return -(-(window - 1) // block_size) + 2


def config_layer_windows(config: Any) -> list[int | None]:
    """Each layer's window as a model config states it (an HF config object or a parsed
    ``config.json``): ``layer_types`` with ``sliding_attention`` layers taking
    ``sliding_window``, else ``sliding_window`` on every layer (Mistral, Starcoder2), unless
    ``use_sliding_window`` is false (Qwen2). The model runner reads the windows from the
    modules' own attention calls instead; the null model, which runs no modules, uses this.
    """

    def field(name: str) -> Any:
        if isinstance(config, Mapping):
            return config.get(name)
        return getattr(config, name, None)

    num_layers = int(field("num_hidden_layers") or field("n_layer") or 0)
    window = field("sliding_window")
    if field("use_sliding_window") is False or not isinstance(window, int) or window < 1:
        window = None
    layer_types = field("layer_types")
    if isinstance(layer_types, Sequence) and not isinstance(layer_types, str) and layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    return [window] * num_layers
