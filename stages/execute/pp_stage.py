"""The stages of pipeline parallelism (``docs/architecture.md`` §8, docs/parallelism.md
"Pipeline parallelism"): the shards after the first, and the first shard's side of a step.

Shard ``k`` (1 .. N-1) is a :class:`PipelineShardStage` on a host of its own (a process, or
a Ray actor on any node of the cluster: ``pipeline.engine.ray_placement``),
linked ``execute.pipeline → execute_pp1 → ... → execute_pp<N-1> → execute.in``.
It loads its layers when it starts (the engine starts when every shard has), then for each
:class:`~stages.execute.pp_messages.PipelineStep` runs its layers and sends the next shard
the hidden state, or, the last, the logits of the rows that sample back to the first shard.

The first shard is the execute stage; :class:`PipelineDriver` is its part of a step: run the
embeddings and its layers, send the step on, wait for the logits (at most
``pipeline_parallel_timeout``), and hand them to the runner, which samples. A shard that dies
is a host that dies: the runtime's supervision fails the engine at once; one that hangs makes
the wait time out with :class:`~stages.execute.pp_split.PipelineParallelError`.

With ``tensor_parallel_size`` N > 1 (PP x TP) each shard is a tensor-parallel group: the
execute stage sends its ranks each step's ``ShardStep`` (port ``ranks``) before its layers run,
as without pipeline parallelism; a :class:`PipelineShardStage` is its shard's rank 0: it hosts
its ranks' rendezvous (port ``ranks``, to ``<execute>_pp<k>_tp<r>`` on hosts
``<engine>_pp<k>_tp<r>``), and hands them each step it receives before running its own part.
A rank that dies is a host that dies; one that hangs makes its shard's next all-reduce fail
after ``tensor_parallel_timeout``, which fails the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.runtime.stage import Stage, handles
from stages.execute.config import ExecuteConfig
from stages.execute.pp_messages import PipelineLogits, PipelineStep
from stages.execute.pp_split import PipelineParallelError
from stages.messages import SchedulerStep, StepResult
from stages.models import loading

if TYPE_CHECKING:
    from stages.execute.runner import ModelRunner

__all__ = ["PipelineDriver", "PipelineShardConfig", "PipelineShardStage"]


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineShardConfig:
    """Shard ``shard`` (1 .. N-1) of the engine whose execute stage has config ``execute``.

    Raises:
        ValueError: ``shard`` is not one of the engine's shards after the first.
    """

    execute: ExecuteConfig
    shard: int

    def __post_init__(self) -> None:
        size = self.execute.pipeline_parallel_size
        if type(self.shard) is not int or not 1 <= self.shard < size:
            raise ValueError(f"shard must be an integer in [1, {size}), got {self.shard!r}")


class PipelineShardStage(Stage):
    inputs = ("in",)
    outputs = ("out", "ranks")
    optional_outputs = ("ranks",)

    def __init__(self, config: PipelineShardConfig) -> None:
        super().__init__(config)
        self.runner: ModelRunner | None = None
        self._store: object = None  # the shard's ranks' TCPStore, alive as long as the group

    @property
    def last(self) -> bool:
        return bool(self.config.shard == self.config.execute.pipeline_parallel_size - 1)

    async def start(self) -> None:
        # NOTE: imported here, not with the module: the frontend imports this class to build
        # the graph, and torch has no business on its side of the start-up. On the stage's
        # thread, so the host's loop keeps sending heartbeats meanwhile (as the execute
        # stage's start).
        from stages.execute.pp_tensor import shard_group

        rendezvous, self._store = await self.run_in_thread(shard_group, self.config.execute)
        if rendezvous is not None:
            await self.emit("ranks", rendezvous)

        def load() -> ModelRunner:
            from stages.execute.runner import ModelRunner

            execute = self.config.execute
            runner = ModelRunner(
                execute, shard=self.config.shard, rendezvous=rendezvous, store=self._store
            )
            with loading():
                runner.load()
            return runner

        self.runner = await self.run_in_thread(load)

    @handles(PipelineStep)
    async def on_step(self, step: PipelineStep) -> None:
        runner = self.runner
        assert runner is not None
        from stages.execute.pipeline_parallel import forward_layers

        keep = step.keep if self.last else None
        began = time.perf_counter()
        if runner.group is not None:  # PP x TP: this shard's other ranks run it too
            await self.emit("ranks", step)
        output = await self.run_in_thread(forward_layers, runner, step.shard, step.hidden, keep)
        seconds = (*step.compute_seconds, time.perf_counter() - began)
        if self.last:
            await self.emit("out", PipelineLogits(step.shard.step_id, output, seconds))
        else:
            await self.emit("out", PipelineStep(step.shard, output, step.keep, seconds))


class PipelineDriver:
    """The first shard's side of pipeline-parallel steps (see the module docstring): one
    step in flight at a time (the scheduler keeps one), its logits awaited by step id."""

    def __init__(self, stage: Stage, timeout: float) -> None:
        self._stage = stage
        self._timeout = timeout
        self._pending: dict[int, asyncio.Future[PipelineLogits]] = {}

    @property
    def idle(self) -> bool:
        return not self._pending

    def answer(self, logits: PipelineLogits) -> None:
        """The last shard's logits arrived (late ones, of a step given up on, are dropped)."""
        future = self._pending.get(logits.step_id)
        if future is not None and not future.done():
            future.set_result(logits)

    async def execute(self, runner: ModelRunner, step: SchedulerStep) -> StepResult:
        """Run ``step`` over the shards: bookkeeping and the first layers here, the rest on
        the other shards, sampling here. The result's ``communication_seconds`` is the round
        trip less the other shards' compute: transfer and queueing.

        Raises:
            PipelineParallelError: the logits did not come back within the timeout.
            StepError: the step does not match the runner's state, or pools embeddings.
        """
        from stages.execute.pipeline_parallel import forward_layers, pipeline_keep

        stage = self._stage
        prepared = await stage.run_in_thread(runner.prepare, step)
        shard = prepared.shard
        if shard is None:  # nothing computes: frees and preemptions only
            return await stage.run_in_thread(runner.run, prepared)
        keep = np.asarray(pipeline_keep(prepared), dtype=np.int64)
        began = time.perf_counter()
        if runner.group is not None:  # PP x TP: shard 0's other ranks run its layers too
            await stage.emit("ranks", shard)
        hidden = await stage.run_in_thread(forward_layers, runner, shard, None, None)
        first = time.perf_counter() - began
        future: asyncio.Future[PipelineLogits] = asyncio.get_running_loop().create_future()
        self._pending[shard.step_id] = future
        try:
            await stage.emit("pipeline", PipelineStep(shard, hidden, keep, (first,)))
            try:
                answer = await asyncio.wait_for(future, self._timeout)
            except TimeoutError:
                raise PipelineParallelError(
                    f"pipeline-parallel step {shard.step_id}: the last shard sent no logits "
                    f"within pipeline_parallel_timeout ({self._timeout:g} s); a shard hangs"
                ) from None
        finally:
            self._pending.pop(shard.step_id, None)
        round_trip = time.perf_counter() - began
        prepared.logits = await stage.run_in_thread(_as_tensor, runner, answer.logits)
        result = await stage.run_in_thread(runner.run, prepared)
        compute = sum(answer.compute_seconds)
        return dataclasses.replace(
            result,
            forward_seconds=result.forward_seconds + round_trip,
            communication_seconds=max(0.0, round_trip - compute),
        )


def _as_tensor(runner: ModelRunner, logits: np.ndarray) -> Any:
    import torch

    # NOTE: a copy: the received frame is read-only and the sampler works on its logits in place
    return torch.tensor(logits, device=runner.device)
