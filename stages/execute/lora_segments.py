"""The LoRA delta of a step with several adapters in two GEMMs instead of a loop over its row
groups (docs/lora.md): the adapters' ``A`` of one projection concatenated along the rank
(``[sum R, in]``), their ``B`` likewise (``[out, sum R]``); every row is shrunk by all of
them at once, a 0/1 mask keeps each row's own adapter's rank columns (none for a base row),
and one expand adds the delta:

    delta = ((x @ A_cat^T) * mask) @ B_cat^T

The shrink computes ``G`` times the columns it keeps and the expand multiplies by zeros, but
with ranks of 8-64 both are thin GEMMs, so two calls beat ``4 G`` small ones (an
``index_select``, a shrink, an expand and an ``index_add_`` per group), as vLLM's punica
kernels (``vllm/lora/ops/torch_ops/lora_ops.py``: ``bgmv_shrink`` / ``bgmv_expand``) batch
the groups in one call.

The concatenated weights are built once for a set of adapters and kept
(:class:`ConcatCache`, the last few sets: a batch's adapters change rarely between steps);
the masks once per step. ``B`` is kept transposed, ``B_cat^T [sum R, out]`` contiguous, the
layout the CPU step graph's expand reads (:mod:`stages.execute.step_graph_lora` points its
native code at these very tensors).

On the CPU in fp32 the same delta runs as one native call per projection instead
(:mod:`stages.execute.lora_native`, the step graph's shrink and expand: each row by its own
adapter only, no mask), where the library builds; the torch form above is its fallback.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from stages.execute.lora_native import NativeLoRADelta

__all__ = ["CONCAT_SETS", "ConcatCache", "StepSegments"]

#: sets of adapters whose concatenated weights a bank keeps
CONCAT_SETS = 4


#: a projection's concatenated ``A`` and ``B`` over a set of adapters and its rank widths, or
#: None where no adapter of the set has that projection
ConcatWeights = tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None


@dataclasses.dataclass(slots=True)
class _ConcatSet:
    """One kept set: its adapters (held, so their identities stay theirs) and, per
    projection, the concatenated weights and the native entries, each filled lazily."""

    adapters: tuple[Any, ...]
    weights: dict[Any, ConcatWeights] = dataclasses.field(default_factory=dict)
    natives: dict[Any, Any] = dataclasses.field(default_factory=dict)


class ConcatCache:
    """Per set of adapters (their identities, in the step's order), each projection's
    concatenated ``A`` and ``B`` and its rank widths; the least recently used set dropped
    past :data:`CONCAT_SETS`. A set holds its adapters, so an identity is never reused
    while its set is kept."""

    def __init__(self, capacity: int = CONCAT_SETS) -> None:
        self._capacity = capacity
        self._sets: collections.OrderedDict[tuple[int, ...], _ConcatSet] = collections.OrderedDict()

    def _set(self, adapters: Sequence[Any]) -> _ConcatSet:
        key = tuple(id(adapter) for adapter in adapters)
        entry = self._sets.get(key)
        if entry is None:
            entry = self._sets[key] = _ConcatSet(tuple(adapters))
            while len(self._sets) > self._capacity:
                self._sets.popitem(last=False)
        self._sets.move_to_end(key)
        return entry

    def weights_of(self, adapters: Sequence[Any]) -> dict[Any, ConcatWeights]:
        """The (lazily filled) projections of the set ``adapters`` (each with ``deltas``)."""
        return self._set(adapters).weights

    def natives_of(self, adapters: Sequence[Any]) -> dict[Any, Any]:
        """The (lazily filled) native entries of the set ``adapters``' projections
        (:mod:`stages.execute.lora_native`), kept with their weights."""
        return self._set(adapters).natives


class StepSegments:
    """One step's row groups (``groups``: each with ``adapter`` and ``rows``, a tensor of
    packed rows or None for every row) over ``total`` packed rows, served by
    :meth:`add_delta` (``native``: its fp32 CPU rows in native code, see the module
    docstring; None: torch's three calls)."""

    def __init__(
        self,
        groups: Sequence[Any],
        total: int,
        cache: ConcatCache,
        native: NativeLoRADelta | None = None,
    ) -> None:
        self._groups = groups
        self._total = total
        adapters = [group.adapter for group in groups]
        self._weights = cache.weights_of(adapters)
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._native = native
        self._natives = cache.natives_of(adapters) if native is not None else {}
        self._row_groups: np.ndarray | None = None
        self._scratch: torch.Tensor | None = None
        self._threads = torch.get_num_threads()

    @property
    def native(self) -> bool:
        """Whether fp32 CPU rows take the native delta."""
        return self._native is not None

    def weights(self, key: Any) -> ConcatWeights:
        """Projection ``key``'s concatenated ``A [sum R, in]``, ``B^T [sum R, out]`` (both
        contiguous, kept while the set is) and each group's rank width (0: its adapter leaves
        it alone); None where none touches it."""
        if key in self._weights:
            return self._weights[key]
        a_parts, b_parts, widths = [], [], []
        for group in self._groups:
            delta = group.adapter.deltas.get(key)
            widths.append(0 if delta is None else delta.a.shape[0])
            if delta is not None:
                a_parts.append(delta.a)
                b_parts.append(delta.b.t())
        entry = None
        if a_parts:
            entry = (
                torch.cat(a_parts, dim=0).contiguous(),
                torch.cat(b_parts, dim=0).contiguous(),
                tuple(widths),
            )
        self._weights[key] = entry
        return entry

    def _mask(self, widths: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        mask = self._masks.get(widths)
        if mask is None:
            mask = torch.zeros(self._total, sum(widths), dtype=like.dtype, device=like.device)
            column = 0
            for group, width in zip(self._groups, widths, strict=True):
                if width:
                    if group.rows is None:
                        mask[:, column : column + width] = 1
                    else:
                        mask[group.rows, column : column + width] = 1
                column += width
            self._masks[widths] = mask
        return mask

    def delta(self, key: Any, x: torch.Tensor) -> torch.Tensor | None:
        """The delta of projection ``key`` for the packed rows ``x [T, in]``: ``[T, out']``
        (``out'``: the adapters' output width, at most the linear's), or None where no
        adapter of the step touches it."""
        entry = self.weights(key)
        if entry is None:
            return None
        a, bt, widths = entry
        a, bt = a.to(x.dtype), bt.to(x.dtype)
        return ((x @ a.t()) * self._mask(widths, x)) @ bt

    def add_delta(self, key: Any, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the delta of projection ``key`` for the packed rows ``x [T, in]`` to ``out
        [T, N]`` in place (its first ``out'`` columns, see :meth:`delta`), in three torch
        calls: the shrink, the mask (in place) and the expand fused with the add
        (``addmm_``); nothing where no adapter of the step touches it."""
        entry = self.weights(key)
        if entry is None:
            return
        native = self._native
        if (
            native is not None
            and x.dtype == torch.float32
            and out.dtype == torch.float32
            and x.device.type == "cpu"
            and x.stride(1) == 1
            and out.stride(1) == 1
        ):
            self._add_native(native, key, entry, x, out)
            return
        a, bt, widths = entry
        if a.dtype != x.dtype:
            a, bt = a.to(x.dtype), bt.to(x.dtype)
        shrunk = torch.mm(x, a.t()).mul_(self._mask(widths, x))  # [T, sum R]
        target = out if bt.shape[1] == out.shape[1] else out[:, : bt.shape[1]]
        target.addmm_(shrunk, bt)

    def _add_native(
        self,
        native: NativeLoRADelta,
        key: Any,
        entry: tuple[torch.Tensor, torch.Tensor, tuple[int, ...]],
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """:meth:`add_delta` in one native call (:mod:`stages.execute.lora_native`)."""
        kept = self._natives.get(key)
        if kept is None:
            a, bt, widths = entry
            kept = self._natives[key] = native.entry(a, bt, widths)
        rank = int(entry[0].shape[0])
        scratch = self._scratch
        if scratch is None or scratch.numel() < self._total * rank:
            scratch = self._scratch = torch.empty(self._total * rank)
        if self._row_groups is None:
            groups = np.full(self._total, -1, dtype=np.int64)
            for index, group in enumerate(self._groups):
                if group.rows is None:
                    groups[:] = index
                else:
                    groups[group.rows.cpu().numpy()] = index
            self._row_groups = groups
        native.add(kept[0], self._row_groups, len(self._groups), x, out, scratch, self._threads)
