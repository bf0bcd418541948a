"""The stage of a tensor-parallel rank other than 0 (``docs/architecture.md`` §8).

Each such rank is a stage on a host of its own (a process; a Ray actor), fed by rank 0's
:class:`~stages.execute.stage.ExecuteStage` over an ordinary link: first the
:class:`~stages.execute.tensor_parallel.Rendezvous` (it then loads its shard of the model and
joins the group), then one :class:`~stages.execute.tensor_parallel.ShardStep` per step, which
it runs in lockstep with rank 0 (their all-reduces pair up). It sends nothing back: rank 0
samples. A rank that dies is a host that dies, seen by the runtime's supervision at once; one
that hangs makes rank 0's next collective time out (``tensor_parallel_timeout``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pipeline.runtime.stage import Stage, handles
from stages.execute.config import ExecuteConfig
from stages.execute.rank_messages import Rendezvous, ShardStep
from stages.models import loading

if TYPE_CHECKING:
    from stages.execute.runner import ModelRunner

__all__ = ["RankConfig", "TensorParallelRankStage"]


@dataclasses.dataclass(frozen=True, slots=True)
class RankConfig:
    """Rank ``rank`` (1 .. N-1) of the engine whose execute stage has config ``execute``.

    Raises:
        ValueError: ``rank`` is not one of the engine's other ranks.
    """

    execute: ExecuteConfig
    rank: int

    def __post_init__(self) -> None:
        size = self.execute.tensor_parallel_size
        if type(self.rank) is not int or not 1 <= self.rank < size:
            raise ValueError(f"rank must be an integer in [1, {size}), got {self.rank!r}")


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

        runner = ModelRunner(self.config.execute, rank=self.config.rank, rendezvous=rendezvous)

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
