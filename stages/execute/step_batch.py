"""A step's batch on the model runner: the requests it holds, each chunk's share of the
packed batch, the packing, and the step once prepared.

:meth:`ModelRunner.prepare <stages.execute.runner.ModelRunner.prepare>` holds each request as a
:class:`RunnerRequest`, turns each planned chunk into a :class:`Work`, packs them with
:func:`pack` and, with tensor or pipeline parallelism, copies the batch for the other ranks with
:func:`shard_step`; :meth:`~stages.execute.runner.ModelRunner.run` takes the
:class:`PreparedStep`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stages.execute.allocator import RESERVED_BLOCK_ID, BlockAllocator
from stages.execute.bookkeeping import PlanReport
from stages.execute.kv_blocks import PlannedExport
from stages.execute.lora import LoadedAdapter
from stages.execute.lora_shard import shard_lora_fields
from stages.execute.pp_sampling import RemoteSample
from stages.execute.prompt_scores import PromptScores
from stages.execute.sampler import SamplingState
from stages.execute.tensor_parallel import ShardStep
from stages.messages import SchedulerStep
from stages.pooling import PoolingParams

__all__ = ["PackedBatch", "PreparedStep", "RunnerRequest", "Work", "pack", "shard_step"]


@dataclasses.dataclass(slots=True)
class RunnerRequest:
    """A request the runner holds: its sampling state, and how much of it is computed."""

    request_id: str
    sampling: SamplingState
    num_computed: int = 0  # leading tokens whose K/V is in the cache
    num_cached: int = 0  # of those, served by the prefix cache since the request started
    prompt_scores: PromptScores | None = None  # its prompt logprobs, when it asked
    pooling: PoolingParams | None = None  # an embedding request (stages.execute.pooling)
    prefix_cache: bool = True  # whether its prefix may come from the cache
    lora: LoadedAdapter | None = None  # its LoRA adapter (stages.execute.lora)
    cache_key: bytes = b""  # mixed into its block hashes (stages.lora.lora_cache_key)

    @property
    def num_tokens(self) -> int:
        return len(self.sampling.prompt_token_ids) + len(self.sampling.output_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """Not while its prompt is being scored (stages/execute/prompt_scores.py), nor when it
        pools rows the cache would skip (stages/execute/pooling.py)."""
        return self.prefix_cache and (self.prompt_scores is None or not self.prompt_scores.owed)

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """Known tokens ``[start, end)`` (prompt then outputs)."""
        prompt, outputs = self.sampling.prompt_token_ids, self.sampling.output_token_ids
        end = self.num_tokens if end is None else end
        split = len(prompt)
        if end <= split:
            return list(prompt[start:end])
        if start >= split:
            return outputs[start - split : end - split]
        return [*prompt[start:], *outputs[: end - split]]


@dataclasses.dataclass(slots=True)
class Work:
    """One request's share of the packed batch: compute positions ``[start, end)``."""

    request: RunnerRequest
    start: int
    end: int
    samples: bool
    packed_end: int = 0  # one past its last row in the packed batch


@dataclasses.dataclass(slots=True)
class PackedBatch:
    """A step's packed batch: decode rows first (ascending context), then prefill chunks."""

    order: list[Work]
    token_ids: list[int]
    query_starts: list[int]
    query_lens: list[int]
    num_decode: int
    block_tables: list[list[int]]


@dataclasses.dataclass(slots=True)
class PreparedStep:
    """A step after :meth:`ModelRunner.prepare <stages.execute.runner.ModelRunner.prepare>`:
    its blocks are allocated, its batch packed. ``shard``: what the other tensor-parallel ranks
    need to run it (None without tensor parallelism, or when nothing is computed). ``drafts``:
    the draft of each chunk that carries one, staged into its request's tokens
    (stages/execute/speculative.py)."""

    step: SchedulerStep
    works: list[Work]
    report: PlanReport
    packed: PackedBatch | None
    shard: ShardStep | None = None
    drafts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    #: with pipeline parallelism: what the last shard sampled (``run`` takes it instead of
    #: a forward pass and sampling; stages.execute.pp_sampling)
    sampled: RemoteSample | None = None
    #: with ``kv_export``: the prompts' blocks to export once the forward pass ran
    kv_out: list[PlannedExport] = dataclasses.field(default_factory=list)


def pack(works: list[Work], allocator: BlockAllocator) -> PackedBatch:
    """Pack the step's chunks: decode rows first, by ascending context length (attention
    groups them), then prefill chunks in scheduled order."""
    decode = sorted((w for w in works if w.end - w.start == 1), key=lambda w: w.end)
    prefill = [w for w in works if w.end - w.start > 1]
    order = decode + prefill
    tokens: list[int] = []
    for work in order:
        tokens.extend(work.request.tokens(work.start, work.end))
        work.packed_end = len(tokens)
    return PackedBatch(
        order,
        tokens,
        [w.start for w in order],
        [w.end - w.start for w in order],
        len(decode),
        [allocator.block_table(w.request.request_id) for w in order],
    )


def shard_step(step_id: int, packed: PackedBatch) -> ShardStep:
    """The other ranks' copy of ``packed`` (block tables padded to one width)."""
    width = max(len(table) for table in packed.block_tables)
    tables = np.full((len(packed.block_tables), width), RESERVED_BLOCK_ID, dtype=np.int64)
    for row, table in enumerate(packed.block_tables):
        tables[row, : len(table)] = table
    return ShardStep(
        step_id=step_id,
        token_ids=np.asarray(packed.token_ids, dtype=np.int64),
        query_starts=np.asarray(packed.query_starts, dtype=np.int64),
        query_lens=np.asarray(packed.query_lens, dtype=np.int64),
        num_decode=packed.num_decode,
        block_tables=tables,
        **shard_lora_fields(
            [w.request.lora.request if w.request.lora else None for w in packed.order]
        ),
    )
