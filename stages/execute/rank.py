"""The stage of a tensor-parallel rank other than 0 (``docs/architecture.md`` §8).

Each such rank is a stage on a host of its own (a process; a Ray actor), fed by rank 0's
:class:`~stages.execute.stage.ExecuteStage` over an ordinary link: first the
:class:`~stages.execute.tensor_parallel.Rendezvous` (it then loads its shard of the model and
joins the group), then one :class:`~stages.execute.tensor_parallel.ShardStep` per step, which
it runs in lockstep with rank 0 (their all-reduces pair up). It sends nothing back: rank 0
samples. A rank that dies is a host that dies, seen by the runtime's supervision at once; one
that hangs makes rank 0's next collective time out (``tensor_parallel_timeout``).

With pipeline parallelism too (PP x TP, docs/parallelism.md) every pipeline shard is a
tensor-parallel group of its own: the ranks of shard 0 are fed by the execute stage as above;
those of shard ``k`` > 0 by that shard's :class:`~stages.execute.pp_stage.PipelineShardStage`
(its rank 0), which hosts their rendezvous and hands each of them the
:class:`~stages.execute.pp_messages.PipelineStep` it received (the batch and the hidden state
its layers start from).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pipeline.runtime.stage import Stage, handles
from stages.execute.config import ExecuteConfig
from stages.execute.pp_messages import PipelineStep
from stages.execute.rank_messages import Rendezvous, ShardStep
from stages.models import loading

if TYPE_CHECKING:
    from stages.execute.runner import ModelRunner

__all__ = ["RankConfig", "TensorParallelRankStage"]


@dataclasses.dataclass(frozen=True, slots=True)
class RankConfig:
    """Rank ``rank`` (1 .. N-1) of the engine whose execute stage has config ``execute``, in
    the tensor-parallel group of pipeline shard ``shard`` (0 without pipeline parallelism).

    Raises:
        ValueError: ``rank`` is not one of the engine's other ranks, or ``shard`` not one of
            its pipeline shards.
    """

    execute: ExecuteConfig
    rank: int
    shard: int = 0

    def __post_init__(self) -> None:
        size = self.execute.tensor_parallel_size
        if type(self.rank) is not int or not 1 <= self.rank < size:
            raise ValueError(f"rank must be an integer in [1, {size}), got {self.rank!r}")
        shards = self.execute.pipeline_parallel_size
        if type(self.shard) is not int or not 0 <= self.shard < shards:
            raise ValueError(f"shard must be an integer in [0, {shards}), got {self.shard!r}")


class TensorParallelRankStage(Stage):
    inputs = ("in",)
    outputs = ()

    def __init__(self, config: RankConfig) -> None:
        super().__init__(config)
        self.runner: ModelRunner | None = None

    @handles(Rendezvous)
    async def on_rendezvous(self, rendezvous: Rendezvous) -> None:
        if self.runner is not None:
            raise RuntimeError(f"rank {self.config.rank} got a second rendezvous")
        # NOTE: imported here, not with the module: the frontend imports this class to build
        # the graph, and torch has no business on its side of the start-up.
        import torch

        from stages.execute.runner import ModelRunner
        from stages.execute.tensor_parallel import threads_per_rank

        config = self.config
        runner = ModelRunner(
            config.execute, rank=config.rank, rendezvous=rendezvous, shard=config.shard
        )

        def load() -> None:
            torch.set_num_threads(threads_per_rank(rendezvous.world_size))
            with loading():
                runner.load()

        await self.run_in_thread(load)
        self.runner = runner

    @handles(ShardStep)
    async def on_shard(self, shard: ShardStep) -> None:
        if self.runner is None:
            raise RuntimeError(f"rank {self.config.rank} got a step before its rendezvous")
        await self.run_in_thread(self.runner.run_shard, shard)

    @handles(PipelineStep)
    async def on_pipeline_step(self, step: PipelineStep) -> None:
        # a rank of pipeline shard k > 0: its layers from the hidden state shard k-1 sent
        # (no LM head here either: the shard's rank 0 computes the logits)
        if self.runner is None:
            raise RuntimeError(f"rank {self.config.rank} got a step before its rendezvous")
        if self.config.shard == 0:
            raise RuntimeError("the ranks of pipeline shard 0 run ShardSteps, not PipelineSteps")
        from stages.execute.pipeline_parallel import forward_ranks

        await self.run_in_thread(forward_ranks, self.runner, step.shard, step.hidden)
