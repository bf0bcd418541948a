"""The execute stage: runs the model runner's steps on the stage's worker thread.

Ports: ``in`` (SchedulerStep); ``out`` (StepResult), ``info`` (EngineInfo, once, when the model
and KV cache are ready — linked to schedule and admit), ``ranks`` (with tensor parallelism:
the :class:`~stages.execute.tensor_parallel.Rendezvous`, then one
:class:`~stages.execute.tensor_parallel.ShardStep` per step, to every other rank's
:class:`~stages.execute.rank.TensorParallelRankStage`; linked to nothing otherwise),
``pipeline`` (with pipeline parallelism: each step's
:class:`~stages.execute.pp_messages.PipelineStep` to the second shard; the last shard's
:class:`~stages.execute.pp_messages.PipelineLogits` come back on ``in``;
:mod:`stages.execute.pp_stage`).

With ``speculative_config`` method ``draft_model`` the stage also runs the draft model after
each step (:mod:`stages.execute.drafter`): the result carries the requests' next drafts.

With ``tensor_parallel_size`` N > 1 this stage is rank 0 (``docs/architecture.md`` §8): it
hosts the ranks' rendezvous, loads its shard while they load theirs, and for each step first
does the bookkeeping (:meth:`ModelRunner.prepare`), sends the packed batch to the other ranks,
then runs its forward pass and samples (:meth:`ModelRunner.run`). Each rank gets
``threads_per_rank(N)`` torch threads, so N ranks do not oversubscribe the cores.

NOTE: torch and the runner are imported when the stage starts, not with this module: the
frontend imports every stage class to build and check the pipeline graph, and torch's import
(1.4 s here) has no business on its side of the start-up (docs/performance.md §3).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pipeline.runtime.stage import Stage, handles
from stages.execute.config import ExecuteConfig
from stages.execute.crash_notes import note_step
from stages.execute.pp_messages import PipelineLogits
from stages.execute.pp_stage import PipelineDriver
from stages.messages import EngineInfo, SchedulerStep, StepResult
from stages.models import loading

if TYPE_CHECKING:
    from stages.execute.drafter import Drafter
    from stages.execute.runner import ModelRunner
    from stages.execute.step_threads import StepThreads

__all__ = ["RENDEZVOUS_HOST", "ExecuteStage"]

#: where rank 0 hosts the ranks' rendezvous in a local process (on a Ray host: its node's IP,
#: stages.execute.tensor_parallel.rendezvous_host)
RENDEZVOUS_HOST = "127.0.0.1"


class ExecuteStage(Stage):
    inputs = ("in",)
    outputs = ("out", "info", "ranks", "pipeline")
    optional_outputs = ("ranks", "pipeline")

    def __init__(self, config: ExecuteConfig) -> None:
        super().__init__(config)
        self.runner: ModelRunner | None = None
        self.step_threads: StepThreads | None = None
        #: the draft model, with speculative_config method draft_model (stages.execute.drafter)
        self.drafter: Drafter | None = None
        self._store: object = None  # rank 0's TCPStore, alive as long as the group
        #: the first shard's side of pipeline-parallel steps (stages.execute.pp_stage)
        self._pipeline: PipelineDriver | None = None
        if config.pipeline_parallel_size > 1:
            self._pipeline = PipelineDriver(self, config.pipeline_parallel_timeout)

    def idle(self) -> bool:
        return self._pipeline is None or self._pipeline.idle

    async def start(self) -> None:
        # NOTE: torch and the model stack take seconds to import where nothing preloaded
        # them (a restarted engine, docs/architecture.md §4.7): imported on the stage's
        # thread, so the host's loop keeps sending heartbeats (a short heartbeat_timeout
        # would otherwise take the import for a frozen engine)
        await self.run_in_thread(_import_model_stack)
        import torch

        from stages.execute.runner import ModelRunner
        from stages.execute.step_threads import StepThreads
        from stages.execute.tensor_parallel import (
            host_rendezvous,
            rendezvous_host,
            threads_per_rank,
        )

        size = self.config.tensor_parallel_size
        rendezvous = None
        if size > 1:
            self._store, rendezvous = host_rendezvous(
                rendezvous_host(RENDEZVOUS_HOST), size, self.config.tensor_parallel_timeout
            )
            await self.emit("ranks", rendezvous)
        self.runner = runner = ModelRunner(self.config, rendezvous=rendezvous, store=self._store)

        def load() -> EngineInfo:
            if size > 1:
                torch.set_num_threads(threads_per_rank(size))
            with loading():
                info = runner.load()
                spec = self.config.speculative_config
                if spec is not None and spec.drafts_in_execute:
                    from stages.execute.drafter import Drafter

                    self.drafter = Drafter(self.config, runner)
                    self.drafter.load()
            # on the worker thread: its thread count is the steps'
            self.step_threads = StepThreads(self.config.omp_wait_policy if size == 1 else "")
            return dataclasses.replace(info, omp_wait_policy=self.step_threads.wait_policy)

        info = await self.run_in_thread(load)
        await self.emit("info", info)

    @handles(SchedulerStep)
    async def on_step(self, step: SchedulerStep) -> None:
        if self._pipeline is not None:
            # NOTE: beside the handlers: the step's logits arrive as a message to this stage
            # (one step is in flight at a time: the scheduler sends the next on the result)
            self.spawn(self._emit_step(step))
            return
        await self.emit("out", await self.execute_step(step))

    async def _emit_step(self, step: SchedulerStep) -> None:
        await self.emit("out", await self.execute_step(step))

    @handles(PipelineLogits)
    async def on_pipeline_logits(self, logits: PipelineLogits) -> None:
        assert self._pipeline is not None
        self._pipeline.answer(logits)

    async def execute_step(self, step: SchedulerStep) -> StepResult:
        """Run ``step`` on the stage's worker thread: what a step sent to ``in`` does, less
        sending the result. The schedule stage calls it directly where this stage runs on
        its host (:mod:`stages.engine_core`)."""
        runner = self.runner
        assert runner is not None
        note_step(step)
        if self._pipeline is not None:
            return await self._pipeline.execute(runner, step)
        if runner.group is None:
            assert self.step_threads is not None
            # with a draft model the step also drafts the requests' next tokens
            execute = runner.execute if self.drafter is None else self.drafter.execute
            return await self.run_in_thread(self.step_threads.run, execute, step)
        prepared = await self.run_in_thread(runner.prepare, step)
        if prepared.shard is not None:
            await self.emit("ranks", prepared.shard)
        return await self.run_in_thread(runner.run, prepared)


def _import_model_stack() -> None:
    """Import what :meth:`ExecuteStage.start` needs (off the event loop)."""
    import torch  # noqa: F401

    import stages.execute.runner  # noqa: F401
