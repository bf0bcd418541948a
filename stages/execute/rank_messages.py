"""What rank 0 of a tensor-parallel engine sends its other ranks (stages.execute.tensor_parallel,
``docs/architecture.md`` §8): the rendezvous, then one packed batch per step. Apart from the
rest of tensor_parallel so that the rank stage's module, which the frontend imports to build
the pipeline graph, needs no torch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stages.kv_transfer import KvBlocks
from stages.lora import LoRARequest
from transports.codec import message

__all__ = ["RENDEZVOUS_HOST", "Rendezvous", "ShardStep"]

#: where a rank 0 (the execute stage, or a pipeline shard's) hosts its ranks' rendezvous in a
#: local process (on a Ray host: its node's IP, stages.execute.tensor_parallel.rendezvous_host)
RENDEZVOUS_HOST = "127.0.0.1"


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks of one engine meet: rank 0's ``TCPStore`` at ``host:port``.
    ``timeout``: seconds a collective may wait for the other ranks."""

    host: str
    port: int
    world_size: int
    timeout: float


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class ShardStep:
    """One step's packed batch, from rank 0 to every other rank (see
    :func:`stages.execute.attention.build_step_metadata` for the meaning of each column).
    ``block_tables`` is ``[rows, width]``, each row padded with the reserved block. A
    speculative request's chunk is its last known token and its draft, packed like a short
    prefill chunk; rank 0 alone verifies and rolls back, and the next step's tables are the
    truncated ones (docs/speculative.md). The ``kv_`` fields move a prompt's KV blocks between
    prefill and decode engines (docs/parallelism.md). ``lora_adapters``: the step's LoRA adapters
    (docs/lora.md), ``lora_index`` each row group's among them (-1: the base model); both
    empty in a step of base rows only (:func:`stages.execute.lora_shard.shard_lora_fields`)."""

    step_id: int
    token_ids: np.ndarray  # [T] int64
    query_starts: np.ndarray  # [R] int64
    query_lens: np.ndarray  # [R] int64
    num_decode: int
    block_tables: np.ndarray  # [R, W] int64
    lora_adapters: tuple[LoRARequest, ...] = ()
    lora_index: tuple[int, ...] = ()  # [R], or () with no adapter
    # disaggregated prefill and decode (stages.execute.kv_blocks): the blocks whose K/V every
    # rank gathers to rank 0 after the forward pass (a prefill engine's export), and the
    # blocks rank 0 imported before it (a decode engine's: ``kv_imports`` went to
    # ``kv_import_blocks``, in order), the whole model's heads, each rank keeping its own
    kv_export_blocks: np.ndarray | None = None  # [M] int64
    kv_import_blocks: np.ndarray | None = None  # [sum of the imports' blocks] int64
    kv_imports: tuple[KvBlocks, ...] = ()
