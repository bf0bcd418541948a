"""LoRA adapters under tensor parallelism (docs/lora.md, ``docs/architecture.md`` §8): each
rank keeps its share of an adapter, cut like the base linear it wraps
(:mod:`stages.execute.tensor_parallel`):

- a **column-parallel** projection (q/k/v, gate/up) keeps rows ``[r * n / N, (r + 1) * n / N)``
  of its weight: the adapter's ``B`` keeps the same rows (``A`` is whole), so each rank's delta
  is its own slice of the output, as its base linear's;
- a **row-parallel** one (o, down) keeps the matching input columns: ``A`` keeps those columns
  (``B`` is whole), so each rank's ``(x_r A_r^T) B^T`` is a partial sum of the delta, added to
  the base linear's partial sum before the module's one all-reduce (the hook sits on the
  wrapper, :func:`~stages.execute.tensor_parallel.install_all_reduces`): no collective of its
  own. After vLLM's ``vllm/lora/layers/column_parallel_linear.py`` (B sliced by output rows)
  and ``row_parallel_linear.py`` (A sliced by input columns).

Rank 0 sends every other rank the step's adapters with its :class:`ShardStep`
(``lora_adapters`` and each packed row group's index among them, ``lora_index``); each rank
loads an adapter from its files the first time a step names it (:func:`shard_lora_rows`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from stages.execute.bookkeeping import StepError
from stages.lora import LoRARequest

if TYPE_CHECKING:
    from stages.execute.lora import LoadedAdapter, LoRABank
    from stages.execute.rank_messages import ShardStep

__all__ = [
    "LoRAShard",
    "full_shape",
    "lora_shard_of",
    "shard_lora_fields",
    "shard_lora_rows",
    "shard_weights",
]

_COLWISE = "colwise"
_ROWWISE = "rowwise"


@dataclasses.dataclass(frozen=True, slots=True)
class LoRAShard:
    """Rank ``rank`` of ``size``; ``styles``: each projection's split (``colwise`` or
    ``rowwise``, from the model's tensor-parallel plan)."""

    rank: int
    size: int
    styles: Mapping[str, str]

    def style(self, projection: str) -> str | None:
        """``colwise``, ``rowwise`` or None (whole on every rank); the fused gate/up
        projection is column-parallel as its two halves."""
        return self.styles.get("gate_proj" if projection == "gate_up" else projection)


def lora_shard_of(model: Any, rank: int, size: int) -> LoRAShard | None:
    """The share of adapters rank ``rank`` of ``size`` keeps for ``model`` (None: no tensor
    parallelism), from the plan :func:`~stages.execute.tensor_parallel.shard_model` split it
    by (``layers.*.self_attn.q_proj: colwise`` and so on)."""
    if size == 1:
        return None
    text = model.config.get_text_config()
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    styles = {key.rpartition(".")[2]: style for key, style in plan.items()}
    return LoRAShard(rank, size, styles)


def full_shape(
    shard: LoRAShard | None, projection: str, in_features: int, out_features: int
) -> tuple[int, int]:
    """The whole model's ``(in, out)`` of a projection this rank holds ``(in, out)`` of:
    what an adapter's files are checked against."""
    if shard is None:
        return in_features, out_features
    style = shard.style(projection)
    if style == _COLWISE:
        return in_features, out_features * shard.size
    if style == _ROWWISE:
        return in_features * shard.size, out_features
    return in_features, out_features


def _slice(length: int, rank: int, size: int) -> slice:
    share = length // size
    return slice(rank * share, (rank + 1) * share)


def shard_weights(
    shard: LoRAShard | None,
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of an adapter's whole ``(layer, projection) -> (A [r, in],
    B [out, r])`` (see the module docstring); all of it without tensor parallelism."""
    if shard is None:
        return dict(weights)
    kept: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, (a, b) in weights.items():
        style = shard.style(key[1])
        if style == _COLWISE:
            b = b[_slice(b.shape[0], shard.rank, shard.size)].contiguous()
        elif style == _ROWWISE:
            a = a[:, _slice(a.shape[1], shard.rank, shard.size)].contiguous()
        kept[key] = (a, b)
    return kept


def shard_lora_fields(loras: list[LoRARequest | None]) -> dict[str, Any]:
    """The :class:`ShardStep` fields naming the adapter of each packed row group (``loras``,
    in packed order; None: the base model): the distinct adapters, and each group's index
    among them (-1: the base model). Empty where no group has one."""
    if all(lora is None for lora in loras):
        return {}
    adapters: list[LoRARequest] = []
    index: list[int] = []
    for lora in loras:
        if lora is None:
            index.append(-1)
            continue
        if lora not in adapters:
            adapters.append(lora)
        index.append(adapters.index(lora))
    return {"lora_adapters": tuple(adapters), "lora_index": tuple(index)}


def shard_lora_rows(
    bank: LoRABank | None, shard: ShardStep
) -> contextlib.AbstractContextManager[None]:
    """Serve a rank's forward pass of ``shard`` with its row groups' adapters, each loaded
    on this rank the first time a step names it (the step's adapters stay loaded).

    Raises:
        StepError: the step names adapters and this rank serves none (a bug: the ranks
            share one config).
        LoRAAdapterError: an adapter rank 0 loaded cannot be loaded here (its files changed
            in between).
    """
    if not shard.lora_adapters:
        return contextlib.nullcontext()
    if bank is None:
        raise StepError(f"step {shard.step_id} names LoRA adapters; enable_lora is off")
    in_use = {lora.lora_int_id for lora in shard.lora_adapters}
    loaded: list[LoadedAdapter] = [bank.acquire(lora, in_use) for lora in shard.lora_adapters]
    groups: list[tuple[LoadedAdapter | None, int, int]] = []
    end = 0
    for length, index in zip(shard.query_lens.tolist(), shard.lora_index, strict=True):
        groups.append((None if index < 0 else loaded[index], end, end + int(length)))
        end += int(length)
    return bank.rows(groups)
