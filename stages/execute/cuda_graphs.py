"""CUDA graphs for decode steps: the whole forward pass of a decode batch, padded to a
captured batch size and context bucket, replayed from static input buffers.

After nano-vllm (``nanovllm/engine/model_runner.py``, ``capture_cudagraph`` / ``run_model``)
and vLLM (``vllm/v1/worker/gpu_model_runner.py``, ``capture_model``): static buffers sized for
the largest batch, sizes captured largest first sharing one memory pool, one warm-up before
each capture, eager execution for prefill and for batches past the largest size or context.

Everything the attention layers need is derived *inside* the graph from the static buffers
with fixed-shape tensor ops (:func:`stages.execute.attention.key_padding_mask`), so a replay
only copies the step's token ids, positions, block tables and context lengths in. Padding
rows read and write block 0 (the reserved trash block) and see exactly one key, so their
softmax is finite; their outputs are never used.

Without capture (``capture(enabled=False)``, e.g. on CPU) the same static path runs eagerly,
which is how the CPU tests check it.

With ``flex`` (``attention_backend="flex"``) the graph attends through
:mod:`stages.execute.flex` instead: the block mask and inverse block tables are built inside
the graph from the same static buffers (static shapes, no host synchronisation), and the
compiled FlexAttention kernel is compiled by the warm-up run before each capture. Padding
rows then see no key at all and attend to zeros. (Captured on a GPU only: checked by the
``cuda``-marked tests that ``.ci/cuda-check`` runs.)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from stages.execute.allocator import RESERVED_BLOCK_ID
from stages.execute.attention import (
    DecodeGroup,
    KVCache,
    StepMetadata,
    forward_context,
    key_padding_mask,
)
from stages.execute.flex import FlexRows

__all__ = ["DecodeGraphs", "graph_batch_sizes", "graph_context_buckets"]

logger = logging.getLogger("actorline.execute")

# Context buckets grow by this factor from the smallest: a decode batch attends over its
# bucket's padded length, so coarse buckets waste attention work, fine ones add graphs.
_SMALLEST_CONTEXT_BUCKET = 256
_CONTEXT_BUCKET_GROWTH = 4


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Captured batch sizes, ascending: 1, 2, 4, 8, then every 16 up to the maximum (which is
    always included), as nano-vllm does."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return [*sizes, max_batch_size]


def graph_context_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Captured context lengths (multiples of ``block_size``), ascending, the last covering
    ``max_model_len``."""
    ceiling = -(-max_model_len // block_size) * block_size
    buckets: list[int] = []
    bucket = _SMALLEST_CONTEXT_BUCKET
    while bucket < ceiling:
        buckets.append(-(-bucket // block_size) * block_size)
        bucket *= _CONTEXT_BUCKET_GROWTH
    return [*buckets, ceiling]


@dataclasses.dataclass(slots=True)
class _Graph:
    batch_size: int
    context_len: int
    logits: torch.Tensor  # [batch_size, V], overwritten by every replay
    graph: Any = None  # torch.cuda.CUDAGraph when captured


class DecodeGraphs:
    """Decode forward passes over static buffers, captured as CUDA graphs per (batch size,
    context bucket).

    Args:
        model: the HF model, already switched to paged attention.
        kv_cache: the paged cache (allocated before capture; never reallocated).
        max_batch_size: the largest decode batch run through a graph.
        max_model_len: the longest context (sets the largest bucket).
        device: where the buffers live.
        flex: attend through FlexAttention (``attention_backend="flex"``).
    """

    def __init__(
        self,
        model: Any,
        kv_cache: KVCache,
        *,
        max_batch_size: int,
        max_model_len: int,
        device: torch.device,
        flex: bool = False,
    ) -> None:
        self.model = model
        self.flex = flex
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_model_len = max_model_len
        self.device = device
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.context_buckets = graph_context_buckets(max_model_len, self.block_size)
        max_blocks = self.context_buckets[-1] // self.block_size
        # NOTE: static inputs. Replays only copy into them; graphs read them by address.
        self._token_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._block_tables = torch.full(
            (max_batch_size, max_blocks), RESERVED_BLOCK_ID, dtype=torch.long, device=device
        )
        self._context_lens = torch.ones(max_batch_size, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._captured = False

    def capture(self, *, enabled: bool = True) -> None:
        """Capture every (batch size, context bucket), largest first, sharing one memory
        pool. With ``enabled=False`` nothing is captured and :meth:`run` executes the same
        static forward eagerly."""
        if not enabled:
            self._captured = False
            return
        pool = None
        with torch.inference_mode():
            for context_len in reversed(self.context_buckets):
                for batch_size in reversed(self.batch_sizes):
                    self._reset_inputs()
                    self._static_forward(batch_size, context_len)  # warm-up
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                        logits = self._static_forward(batch_size, context_len)
                    if pool is None:
                        pool = graph.pool()
                    self._graphs[(batch_size, context_len)] = _Graph(
                        batch_size, context_len, logits, graph
                    )
            torch.cuda.synchronize(self.device)
        self._captured = True
        logger.info(
            "execute: captured %d decode CUDA graphs (batch sizes %s, contexts %s)",
            len(self._graphs),
            self.batch_sizes,
            self.context_buckets,
        )

    def can_run(self, batch_size: int, max_context_len: int) -> bool:
        """Whether a decode batch of this size and longest context fits a graph."""
        return batch_size <= self.batch_sizes[-1] and max_context_len <= self.context_buckets[-1]

    def run(
        self,
        *,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
    ) -> torch.Tensor:
        """Run a decode batch (one token per row) through the smallest fitting graph.

        Returns:
            ``[len(token_ids), V]`` logits, a view of the graph's output buffer: consume it
            before the next call.

        Raises:
            ValueError: the batch does not fit (check :meth:`can_run` first).
        """
        count = len(token_ids)
        longest = max(context_lens)
        if not self.can_run(count, longest):
            raise ValueError(f"decode batch {count} x {longest} fits no captured graph")
        batch_size = next(size for size in self.batch_sizes if size >= count)
        context_len = next(bucket for bucket in self.context_buckets if bucket >= longest)
        num_blocks = context_len // self.block_size
        tables = torch.full((batch_size, num_blocks), RESERVED_BLOCK_ID, dtype=torch.long)
        for row, table in enumerate(block_tables):
            used = table[:num_blocks]  # a row never needs more blocks than its bucket
            tables[row, : len(used)] = torch.tensor(used, dtype=torch.long)
        pad = batch_size - count
        # Padding rows: token 0 at position 0 in block 0, a context of one key.
        self._token_ids[:batch_size].copy_(_padded(token_ids, pad, 0), non_blocking=True)
        self._positions[:batch_size].copy_(_padded(positions, pad, 0), non_blocking=True)
        self._context_lens[:batch_size].copy_(_padded(context_lens, pad, 1), non_blocking=True)
        self._block_tables[:batch_size, :num_blocks].copy_(tables, non_blocking=True)
        if self._captured:
            entry = self._graphs[(batch_size, context_len)]
            entry.graph.replay()
            return entry.logits[:count]
        with torch.inference_mode():
            return self._static_forward(batch_size, context_len)[:count]

    def _reset_inputs(self) -> None:
        self._token_ids.zero_()
        self._positions.zero_()
        self._block_tables.fill_(RESERVED_BLOCK_ID)
        self._context_lens.fill_(1)

    def _static_forward(self, batch_size: int, context_len: int) -> torch.Tensor:
        """The captured computation: fixed shapes, no host synchronisation.

        Returns:
            ``[batch_size, V]`` logits.
        """
        block_size = self.block_size
        tables = self._block_tables[:batch_size, : context_len // block_size]  # [G, blocks]
        positions = self._positions[:batch_size]  # [G]
        rows = torch.arange(batch_size, device=self.device)
        slot_mapping = (
            tables[rows, positions // block_size] * block_size + positions % block_size
        )  # [G]
        if self.flex:
            flex_rows = FlexRows.build(
                tables,
                self._context_lens[:batch_size] - 1,
                1,
                block_size=block_size,
                num_slots=self.kv_cache.num_slots,
                compiled=self.device.type == "cuda",
            )
            metadata = StepMetadata(
                kv_cache=self.kv_cache,
                slot_mapping=slot_mapping,
                decode_groups=[],
                prefills=[],
                max_model_len=self.max_model_len,
                flex_decode=flex_rows,
            )
            return self._run_model(metadata, batch_size, positions)
        key_mask = key_padding_mask(self._context_lens[:batch_size], context_len)  # [G,1,1,C]
        metadata = StepMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping,
            decode_groups=[
                DecodeGroup(
                    0,
                    batch_size,
                    tables,
                    context_len,
                    key_mask,
                    lengths=self._context_lens[:batch_size],
                )
            ],
            prefills=[],
            max_model_len=self.max_model_len,
        )
        return self._run_model(metadata, batch_size, positions)

    def _run_model(
        self, metadata: StepMetadata, batch_size: int, positions: torch.Tensor
    ) -> torch.Tensor:
        with forward_context(metadata):
            output = self.model(
                input_ids=self._token_ids[:batch_size].unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
            )
        return output.logits[0]  # [G, V]


def _padded(values: Sequence[int], pad: int, fill: int) -> torch.Tensor:
    return torch.tensor([*values, *([fill] * pad)], dtype=torch.long)
