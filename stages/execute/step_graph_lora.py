"""LoRA in the CPU step graph (docs/lora.md "What runs where"): a decode step whose rows have
adapters runs as the one native call of :mod:`stages.execute.step_graph` too, its C code
adding each row's delta after every linear an adapter targets, instead of the module path's
Python dispatch per layer and op (at 16 rows and below the module path's per-op cost is most
of a step, issue 36; the deltas are ~1% of the step's multiply-adds at rank 8).

The weights are the module path's own: the concatenated ``A [sum R, in]`` and ``B^T [sum R,
out]`` of the step's set of adapters (:class:`~stages.execute.lora_segments.StepSegments`,
from the bank's cache), which a table of ``sg_lora`` entries (``kernels/step_graph.c``) points
at, per layer and linear, with each adapter group's rank columns. A table is built once per
set of adapters and kept (the last :data:`~stages.execute.lora_segments.CONCAT_SETS` sets),
holding the tensors it points into, so their addresses stay valid while it is kept; a step
passes the table and each row's group (-1: the base model). The C code shrinks (``x . A``
over the row's own rank columns: a base row costs nothing) and expands over the same column
ranges the threads take of the linear, as vLLM's punica kernels shrink and expand per row's
adapter (``vllm/lora/ops/torch_ops/lora_ops.py``: ``bgmv_shrink`` / ``bgmv_expand``).

The sums run in another order than torch's GEMMs, so the logits are not the module path's bit
for bit: within :data:`~stages.execute.step_graph.CHECK_TOLERANCE` of the largest logit
(tests/stages/execute/test_step_graph_lora.py).
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Sequence

import torch

from stages.execute.lora import LoadedAdapter, LoRABank
from stages.execute.lora_native import LoRAEntry, lora_offsets
from stages.execute.lora_segments import CONCAT_SETS
from stages.execute.step_graph import LORA_SLOTS, StepGraph, StepLoRA

__all__ = ["StepGraphLoRA", "lora_slot_kinds", "lora_tables", "step_lora"]


def lora_slot_kinds(fused_mlp: bool) -> dict[str, str]:
    """The step graph's linears (:data:`~stages.execute.step_graph.LORA_SLOTS`) -> the
    :class:`~stages.execute.lora.LoRALinear` kind whose deltas they take (a fused gate/up
    projection: ``gate_up`` on the ``gate`` slot)."""
    kinds = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "down": "down_proj"}
    if fused_mlp:
        kinds["gate"] = "gate_up"
    else:
        kinds.update(gate="gate_proj", up="up_proj")
    return kinds


class StepGraphLoRA:
    """The LoRA tables of one step graph over one bank's adapters (see the module docstring).

    Raises:
        ValueError: the graph fuses SiLU into its gate/up projections (it serves no delta).
    """

    def __init__(self, bank: LoRABank, graph: StepGraph, capacity: int = CONCAT_SETS) -> None:
        if not graph.serves_lora:
            raise ValueError("the step graph fuses SiLU into gate/up: it serves no LoRA delta")
        self._bank = bank
        self._graph = graph
        self._capacity = capacity
        self._kinds = lora_slot_kinds(bank.fused_mlp)
        self._tables: collections.OrderedDict[tuple[int, ...], StepLoRA] = collections.OrderedDict()
        #: tables built (one per new set of adapters)
        self.tables_built = 0

    def step(self, adapters: Sequence[LoadedAdapter | None]) -> StepLoRA | None:
        """The LoRA of a decode step whose row ``r`` is under ``adapters[r]`` (None: the base
        model); None where no row has one.

        Raises:
            ValueError: an adapter's weights do not fit the plan's linears (other widths).
        """
        order: dict[int, int] = {}
        kept: list[LoadedAdapter] = []
        groups = []
        for adapter in adapters:
            if adapter is None:
                groups.append(-1)
                continue
            group = order.get(id(adapter))
            if group is None:
                group = order[id(adapter)] = len(kept)
                kept.append(adapter)
            groups.append(group)
        if not kept:
            return None
        key = tuple(order)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._build(kept)
            while len(self._tables) > self._capacity:
                self._tables.popitem(last=False)
        self._tables.move_to_end(key)
        return StepLoRA(table.table, table.rank, tuple(groups), table.keep)

    def _build(self, adapters: list[LoadedAdapter]) -> StepLoRA:
        segments = self._bank.segments(adapters)
        graph = self._graph
        num_layers = self._bank.num_layers
        table = (LoRAEntry * (num_layers * len(LORA_SLOTS)))()
        keep: list[object] = [table, tuple(adapters)]
        rank = 1
        for layer in range(num_layers):
            for slot_index, slot in enumerate(LORA_SLOTS):
                kind = self._kinds.get(slot)
                entry = None if kind is None else segments.weights((layer, kind))
                if entry is None:
                    continue
                a, bt, widths = entry
                shape = graph.linear_shape(layer, slot)
                if (
                    shape is None
                    or a.dtype != torch.float32
                    or a.device.type != "cpu"
                    or tuple(a.shape[1:]) != (shape[0],)
                    or bt.shape[1] > shape[1]
                ):
                    raise ValueError(
                        f"layer {layer}'s {kind}: the adapters' weights do not fit the step "
                        "graph's linear"
                    )
                # every group index a row may carry (< max_rows) has its two offsets
                offsets = lora_offsets(widths, graph.max_rows)
                keep.extend((a, bt, offsets))
                table[layer * len(LORA_SLOTS) + slot_index] = LoRAEntry(
                    a.data_ptr(), bt.data_ptr(), offsets.ctypes.data, a.shape[0], bt.shape[1]
                )
                rank = max(rank, int(a.shape[0]))
        self.tables_built += 1
        return StepLoRA(ctypes.addressof(table), rank, (), keep)


def lora_tables(bank: LoRABank | None, graph: StepGraph | None) -> StepGraphLoRA | None:
    """The LoRA tables of ``graph`` over ``bank`` where both exist and the graph serves deltas
    (:attr:`~stages.execute.step_graph.StepGraph.serves_lora`); else None (the runner then
    takes the module path for steps with adapter rows)."""
    if bank is None or graph is None or not graph.serves_lora:
        return None
    return StepGraphLoRA(bank, graph)


def step_lora(
    tables: StepGraphLoRA | None, rows: Sequence[tuple[LoadedAdapter | None, int]]
) -> StepLoRA | None:
    """A step's LoRA on the step graph: ``rows``, each work's adapter and its row count in
    packed order; None where no row has an adapter.

    Raises:
        ValueError: a row has an adapter and ``tables`` is None (the runner takes the module
            path for such steps), or the adapters' weights do not fit (:meth:`StepGraphLoRA.step`).
    """
    if all(adapter is None for adapter, _ in rows):
        return None
    if tables is None:
        raise ValueError("a step with adapter rows on a step graph that serves no LoRA")
    return tables.step([adapter for adapter, count in rows for _ in range(count)])
