"""Attention variants the paged path implements beside plain causal attention: sliding
windows, soft-capped logits and attention sinks (docs/architecture.md §6.1).

transformers hands each layer's variant to the attention function as keyword arguments:
``sliding_window`` (Mistral, Qwen2's windowed layers, the ``sliding_attention`` layers of
Gemma 2/3, Cohere 2 and gpt-oss), ``softcap`` (Gemma 2's ``attn_logit_softcapping``) and
``s_aux`` (gpt-oss's per-head sink logits); the model's own ``scaling`` (Gemma's
``query_pre_attn_scalar``) comes as ``scaling``. :func:`layer_variant` reads them, and
:func:`eager_attention` computes what SDPA cannot (capping, sinks) the way transformers' eager
attention does (``transformers/models/gemma2/modeling_gemma2.py`` and
``transformers/models/gpt_oss/modeling_gpt_oss.py``: ``eager_attention_forward``):

- a window of ``W`` lets the query at position ``q`` see keys ``q - W < k <= q`` (W positions,
  itself included), as ``transformers/masking_utils.py``'s ``sliding_window_overlay``;
- capped scores are ``softcap * tanh(scale * q.k / softcap)``, capped before masking;
- a sink is one more logit per query head in the softmax's max and denominator, with no value.

The masks here are pure tensor ops on their inputs, so a CUDA graph can capture them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = [
    "LayerVariant",
    "UnsupportedModelError",
    "causal_window_mask",
    "eager_attention",
    "key_window_mask",
    "layer_variant",
]


class UnsupportedModelError(ValueError):
    """The model needs an attention feature the paged path does not implement (MLA, ALiBi,
    chunked or linear attention, ...): serving it would be wrong."""


# Keyword arguments of attention features the paged path does not implement: a model that
# passes one is refused rather than served wrongly.
_REFUSED_KWARGS = ("attention_chunk_size", "position_bias", "alibi")


@dataclasses.dataclass(frozen=True, slots=True)
class LayerVariant:
    """One layer's attention variant.

    ``window``: the query sees only its last ``window`` positions (itself included); None:
    all. ``softcap``: scores capped at ``softcap * tanh(s / softcap)``; None: uncapped.
    ``sinks``: one sink logit per query head ``[Hq]``; None: no sinks.
    """

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def needs_eager(self) -> bool:
        """Whether SDPA cannot compute it (capping or sinks)."""
        return self.softcap is not None or self.sinks is not None


_PLAIN = LayerVariant()


def layer_variant(kwargs: dict[str, Any], max_model_len: int) -> LayerVariant:
    """The variant transformers passes one layer's attention call; a window of at least
    ``max_model_len`` never excludes a position and is dropped.

    Raises:
        UnsupportedModelError: a keyword names a feature this path does not implement, or a
            value is not one it can use (a non-positive window, a sink tensor of another shape).
    """
    for name in _REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"the model passes {name}={kwargs[name]!r} to attention, which paged attention "
                "does not implement"
            )
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if window is None and not softcap and sinks is None:
        return _PLAIN
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UnsupportedModelError(
                f"sliding_window must be a positive integer, got {window!r}"
            )
        if window >= max_model_len:
            window = None
    if softcap is not None:
        if not isinstance(softcap, (int, float)) or softcap < 0:
            raise UnsupportedModelError(f"softcap must be a non-negative number, got {softcap!r}")
        softcap = float(softcap) if softcap > 0 else None
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1):
        raise UnsupportedModelError("attention sinks must be one logit per query head")
    return LayerVariant(window, softcap, sinks.detach() if sinks is not None else None)


def key_window_mask(context_lens: torch.Tensor, key_len: int, window: int | None) -> torch.Tensor:
    """Which of the first ``key_len`` key positions each decode row sees: a row of context
    length ``c`` (its query at position ``c - 1``) sees ``max(0, c - window) <= k < c``.

    Returns:
        ``[B, 1, 1, key_len]`` bool.
    """
    positions = torch.arange(key_len, device=context_lens.device).unsqueeze(0)  # [1, L]
    lens = context_lens.unsqueeze(1)  # [B, 1]
    visible = positions < lens
    if window is not None:
        visible = visible & (positions >= lens - window)
    return visible[:, None, None, :]


def causal_window_mask(
    num_queries: int,
    first_query: int,
    num_keys: int,
    first_key: int,
    window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Which keys each query of a chunk sees: queries at positions ``first_query + i``,
    keys at ``first_key + j``; causal, and within ``window`` when given.

    Returns:
        ``[num_queries, num_keys]`` bool.
    """
    queries = torch.arange(first_query, first_query + num_queries, device=device).unsqueeze(1)
    keys = torch.arange(first_key, first_key + num_keys, device=device).unsqueeze(0)
    visible = keys <= queries
    if window is not None:
        visible = visible & (keys > queries - window)
    return visible


def eager_attention(
    query: torch.Tensor,  # [..., H, n, D]
    key: torch.Tensor,  # [..., H or 1, L, D]
    value: torch.Tensor,  # [..., H or 1, L, D]
    mask: torch.Tensor | None,  # bool, broadcastable to [..., H, n, L]; True: attend
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # broadcastable to [..., H, n, 1]
) -> torch.Tensor:
    """Attention with capped scores and sinks, as transformers' eager attention computes it
    (see the module docstring). Every query must see at least one key or have a sink.

    Returns:
        ``[..., H, n, D]``.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [..., H, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sinks = sinks.to(scores.dtype)
        peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
        weights = torch.exp(scores - peak)
        probs = weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sinks - peak))
    return torch.matmul(probs.to(value.dtype), value)
