"""The paths a packed batch runs on, and their building at load.

A step's packed batch (:mod:`stages.execute.step_batch`) runs on the fastest path that serves
it: the CPU step graph (:mod:`stages.execute.step_graph`, with its LoRA deltas from
:mod:`stages.execute.step_graph_lora`) for decode rows, and for a step of decode tokens and
drafted runs as one row per token; the captured decode graphs
(:mod:`stages.execute.cuda_graphs`) for a decode-only step without LoRA; else the model's own
modules over paged attention, which alone compute prompt logprobs and whose hidden states a
pooled step captures.

:class:`ForwardPaths` is the part of :class:`~stages.execute.runner.ModelRunner` that builds
the graphs once the model is loaded and runs a packed batch (``_forward``); it uses the
runner's model, cache and settings, which the class declares below and ``ModelRunner``
provides.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from stages.execute.allocator import BlockAllocator
from stages.execute.attention import (
    DecodeAttentionMode,
    KVCache,
    LayerShape,
    build_step_metadata,
    forward_context,
)
from stages.execute.config import ExecuteConfig
from stages.execute.loading import PROBE_REQUEST
from stages.execute.lora import LoRABank, lora_rows
from stages.execute.step_batch import PackedBatch, Work
from stages.execute.step_graph import (
    StepGraph,
    StepGraphUnsupported,
    check_step_graph,
    plan_rows,
)
from stages.execute.step_graph_lora import StepGraphLoRA, step_lora

__all__ = ["ForwardPaths"]

logger = logging.getLogger("actorline.execute")


class ForwardPaths:
    """Building and choosing the path a packed batch runs on (a base of
    :class:`~stages.execute.runner.ModelRunner`)."""

    # -- what the runner provides ---------------------------------------------------------------
    config: ExecuteConfig
    model: Any
    kv_cache: KVCache | None
    allocator: BlockAllocator | None
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    lora: LoRABank | None
    _decode_mode: DecodeAttentionMode
    _flex: bool
    _window: int | None
    _force_static_decode: bool
    _step_graph: StepGraph | None
    _step_graph_lora: StepGraphLoRA | None
    _decode_graphs: Any

    @property
    def step_graph(self) -> StepGraph | None:
        """The CPU step graph serving this runner's small decode steps (None: the module path
        serves every step; the load's log says why)."""
        return self._step_graph

    @property
    def _wants_step_graph(self) -> bool:
        """Whether this load would serve decode steps by the CPU step graph, were the model
        one it serves (stages.execute.step_graph)."""
        return (
            self.device.type == "cpu"
            and self.config.use_cuda_graphs
            and self.config.tensor_parallel_size == 1
            and self.config.pipeline_parallel_size == 1
            and self.dtype == torch.float32
            and self._decode_mode == "native"
            and not self._flex
            and not self._force_static_decode
        )

    def _make_step_graph(self, layers: dict[int, LayerShape], *, verify: bool) -> StepGraph | None:
        """The CPU step graph of this model, checked against the module path on a probe step
        (``verify``); None where it does not serve the model or disagrees (reason logged)."""
        if not self._wants_step_graph:
            return None
        assert self.kv_cache is not None and self.allocator is not None
        variants = [s for s in layers.values() if s.window or s.softcap or s.has_sinks]
        try:
            if self._window is not None or variants:
                raise StepGraphUnsupported("sliding windows, soft caps and sinks")
            rows = plan_rows(self.model, self.config.cuda_graph_max_batch_size)
            graph = StepGraph.build(
                self.model, self.kv_cache, max_rows=rows, max_model_len=self.max_model_len
            )
            if verify:
                check_step_graph(
                    graph,
                    self.model,
                    self.kv_cache,
                    self.allocator,
                    decode_mode=self._decode_mode,
                    max_model_len=self.max_model_len,
                    probe_name=PROBE_REQUEST,
                )
        except StepGraphUnsupported as reason:
            logger.info("execute: decode steps take the module path (step graph: %s)", reason)
            return None
        logger.info("execute: decode steps of up to %d rows run as one native call", rows)
        return graph

    def _make_decode_graphs(self) -> Any:
        if self.config.tensor_parallel_size > 1 or self.config.pipeline_parallel_size > 1:
            return None  # NOTE: captured graphs would need the collectives captured too
        on_cuda = self.device.type == "cuda" and self.config.use_cuda_graphs
        if not (on_cuda or self._force_static_decode):
            return None
        from stages.execute.cuda_graphs import DecodeGraphs

        assert self.kv_cache is not None
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            max_batch_size=self.config.cuda_graph_max_batch_size,
            max_model_len=self.max_model_len,
            device=self.device,
            flex=self._flex,
        )
        graphs.capture(enabled=self.device.type == "cuda")
        return graphs

    def _forward(
        self,
        packed: PackedBatch,
        sampling: list[Work],
        extra_rows: Sequence[int] = (),
        module_path: bool = False,
        token_rows: bool = False,
    ) -> torch.Tensor:
        """Run the model over the packed batch; logits of the sampling rows, in their order,
        then of the packed rows ``extra_rows`` (prompt logprobs: only the module path
        computes them, the decode graphs keep no other row). ``module_path``: through the
        model's modules even where a step graph or CUDA graph could run the step (a pooled
        step's hidden states are captured from them). ``token_rows``: every chunk is a decode
        token or a drafted run, which the step graph runs as one decode row per token (each
        attends the positions up to its own; every row's K/V is written before any attends),
        extra rows included (stages/execute/speculative.py).

        Returns:
            ``[len(sampling) + len(extra_rows), V]`` logits.
        """
        assert self.allocator is not None and self.kv_cache is not None
        order, tokens, num_decode = packed.order, packed.token_ids, packed.num_decode
        block_tables = packed.block_tables
        decode = order[:num_decode]

        step_graph = self._step_graph
        if (
            token_rows
            and not module_path
            and step_graph is not None
            and len(tokens) <= step_graph.max_rows
        ):
            row_positions = [p for w in order for p in range(w.start, w.end)]
            row_tables = [
                t for w, t in zip(order, block_tables, strict=True) for _ in range(w.end - w.start)
            ]
            kept_rows = [w.packed_end - 1 for w in sampling] + list(extra_rows)
            lora = step_lora(
                self._step_graph_lora, [(w.request.lora, w.end - w.start) for w in order]
            )
            return step_graph.run(tokens, row_positions, row_tables, kept_rows, lora)  # [S + E, V]
        if (
            not module_path
            and not extra_rows
            and num_decode == len(order)
            and step_graph is not None
            and num_decode <= step_graph.max_rows
        ):
            rows = {id(w): index for index, w in enumerate(decode)}
            return step_graph.run(
                tokens,
                [w.start for w in decode],
                block_tables,
                [rows[id(w)] for w in sampling],
                step_lora(self._step_graph_lora, [(w.request.lora, 1) for w in decode]),
            )  # [S, V]

        graphs = self._decode_graphs
        if (
            not module_path
            and not extra_rows
            and num_decode == len(order)
            and all(w.request.lora is None for w in order)
            and graphs is not None
            and graphs.can_run(len(decode), decode[-1].end)
        ):
            logits = graphs.run(
                token_ids=tokens,
                positions=[w.start for w in decode],
                block_tables=block_tables,
                context_lens=[w.end for w in decode],
            )  # [B, V] in packed order
            rows = {id(w): index for index, w in enumerate(decode)}
            keep = torch.tensor([rows[id(w)] for w in sampling], device=self.device)
            return logits.index_select(0, keep)

        metadata, positions = build_step_metadata(
            kv_cache=self.kv_cache,
            block_tables=block_tables,
            query_starts=packed.query_starts,
            query_lens=packed.query_lens,
            num_decode=num_decode,
            decode_mode=self._decode_mode,
            flex=self._flex,
            max_model_len=self.max_model_len,
            device=self.device,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long).to(self.device)  # [T]
        keep = torch.tensor(
            [w.packed_end - 1 for w in sampling] + list(extra_rows), dtype=torch.long
        )
        spans = [(w.request.lora, w.packed_end - (w.end - w.start), w.packed_end) for w in order]
        with torch.inference_mode(), forward_context(metadata), lora_rows(self.lora, spans):
            output = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                logits_to_keep=keep.to(self.device),
            )
        return output.logits[0]  # [S, V]
