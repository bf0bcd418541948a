"""The execute stage: runs the model runner's steps on the stage's worker thread.

Ports: ``in`` (SchedulerStep); ``out`` (StepResult), ``info`` (EngineInfo, once, when the model
and KV cache are ready — linked to schedule and admit), ``ranks`` (with tensor parallelism:
the :class:`~stages.execute.tensor_parallel.Rendezvous`, then one
:class:`~stages.execute.tensor_parallel.ShardStep` per step, to every other rank's
:class:`~stages.execute.rank.TensorParallelRankStage`; linked to nothing otherwise),
``pipeline`` (with pipeline parallelism: each step's
:class:`~stages.execute.pp_messages.PipelineStep` to the second shard; the last shard's
:class:`~stages.execute.pp_messages.PipelineSampled` (what it sampled) come back on ``in``;
:mod:`stages.execute.pp_stage`), ``kv`` (with ``kv_export``, a prefill engine of
disaggregated prefill and decode: each prompt's :class:`~stages.kv_transfer.KvBlocks`, once
computed, straight to the execute stage of the decode engine the router chose for it;
:mod:`stages.execute.kv_links`), ``kv_arrived`` (a decode engine's: a
:class:`~stages.kv_transfer.KvArrived` to the router when blocks came). ``in`` also takes a
decode engine's moved blocks (held until their request's first step) and the router's
:class:`~stages.kv_transfer.KvRelease`.

With ``speculative_config`` method ``draft_model`` the stage also runs the draft model after
each step (:mod:`stages.execute.drafter`): the result carries the requests' next drafts. With
``"placement": "host"`` the draft model is a stage of its own (:mod:`stages.execute.draft_stage`)
on port ``draft``, whose proposals come back on ``in`` (:mod:`stages.execute.draft_client`).

With ``tensor_parallel_size`` N > 1 this stage is rank 0 (``docs/architecture.md`` §8): it
hosts the ranks' rendezvous, loads its shard while they load theirs, and for each step first
does the bookkeeping (:meth:`ModelRunner.prepare`), sends the packed batch to the other ranks,
then runs its forward pass and samples (:meth:`ModelRunner.run`). Each rank gets
``threads_per_rank(N)`` torch threads, so N ranks do not oversubscribe the cores.

LoRA adapters (docs/lora.md, "Loading"): :meth:`ExecuteStage.load_adapter` reads, checks and
lays out an adapter on the stage's loader thread, beside the steps, and hands it to the
runner's :class:`~stages.execute.lora.LoRABank`; the schedule stage holds the adapter's
requests until it is loaded (:mod:`stages.lora_loads`), so the step thread only swaps it in.

NOTE: torch and the runner are imported when the stage starts, not with this module: the
frontend imports every stage class to build and check the pipeline graph, and torch's import
(1.4 s here) has no business on its side of the start-up (docs/performance.md §3).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING

from pipeline.runtime.replicas import ReplicaLost, ReplicaRestored
from pipeline.runtime.stage import Stage, handles
from stages.execute.config import ExecuteConfig
from stages.execute.crash_notes import note_step
from stages.execute.draft_client import DRAFT_PORT, DraftClient
from stages.execute.draft_messages import DraftProposals, DraftReady, with_draft_kv
from stages.execute.draft_stage import DRAFT_HOST_SUFFIX
from stages.execute.kv_links import KvLinks
from stages.execute.pp_messages import PipelineSampled
from stages.execute.pp_stage import PipelineDriver, shard_threads
from stages.execute.rank_messages import RENDEZVOUS_HOST
from stages.kv_transfer import KvBlocks, KvRelease
from stages.lora import LoRAAdapterError, LoRARequest
from stages.messages import EngineInfo, SchedulerStep, StepResult
from stages.models import loading

if TYPE_CHECKING:
    from stages.execute.drafter import Drafter
    from stages.execute.runner import ModelRunner
    from stages.execute.step_threads import StepThreads

__all__ = ["RENDEZVOUS_HOST", "ExecuteStage"]


class ExecuteStage(Stage):
    inputs = ("in",)
    outputs = ("out", "info", "ranks", "pipeline", "kv", "kv_arrived", DRAFT_PORT)
    optional_outputs = ("ranks", "pipeline", "kv", "kv_arrived", DRAFT_PORT)
    #: what start imports (a zygote imports it once: pipeline.runtime.zygote); not
    #: transformers' modeling stack, which only a model that loads through it needs (seconds
    #: of import that a model actorline's own classes serve would pay in every first start)
    host_preload = ("stages.execute.runner",)

    def __init__(self, config: ExecuteConfig) -> None:
        super().__init__(config)
        self.runner: ModelRunner | None = None
        #: what the stage reported once loaded (its ``info``)
        self.info: EngineInfo | None = None
        self.step_threads: StepThreads | None = None
        #: the draft model, with speculative_config method draft_model (stages.execute.drafter)
        self.drafter: Drafter | None = None
        #: the draft model placed apart, with "placement": "host" (stages.execute.draft_client)
        self.draft_client: DraftClient | None = None
        #: disaggregated prefill and decode: where exported blocks go, the blocks held here
        self.kv_links = KvLinks()
        spec = config.speculative_config
        if spec is not None and spec.drafts_apart:
            self.draft_client = DraftClient(self, spec)
        self._steps_in_flight = 0  # steps its handler runs beside it (pipeline, draft stage)
        self._store: object = None  # rank 0's TCPStore, alive as long as the group
        #: the first shard's side of pipeline-parallel steps (stages.execute.pp_stage)
        self._pipeline: PipelineDriver | None = None
        if config.pipeline_parallel_size > 1:
            self._pipeline = PipelineDriver(self, config.pipeline_parallel_timeout)
        #: the thread LoRA adapters load on (created on the first load)
        self._lora_loader: concurrent.futures.ThreadPoolExecutor | None = None

    def idle(self) -> bool:
        return not self._steps_in_flight and (self._pipeline is None or self._pipeline.idle)

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

        host = self.host_name

        def load() -> EngineInfo:
            if size > 1:
                torch.set_num_threads(threads_per_rank(size))
            elif (threads := shard_threads(self.config)) is not None:  # PP micro-batches
                torch.set_num_threads(threads)
            with loading():
                info = runner.load()
                spec = self.config.speculative_config
                if spec is not None and spec.drafts_in_execute and not spec.drafts_apart:
                    from stages.execute.drafter import Drafter

                    self.drafter = Drafter(self.config, runner)
                    draft = self.drafter.load()
                    info = with_draft_kv(
                        info, spec.model or "", draft.num_blocks, draft.kv_cache_bytes, host
                    )
            # on the worker thread: its thread count is the steps'
            self.step_threads = StepThreads(self.config.omp_wait_policy if size == 1 else "")
            return dataclasses.replace(info, omp_wait_policy=self.step_threads.wait_policy)

        self.info = info = await self.run_in_thread(load)
        if self.draft_client is not None:
            # the draft stage loads its model for this target; the info goes out with the
            # draft's KV once it has (or cannot draft, or is lost: without)
            await self.emit(DRAFT_PORT, info)
            self.spawn(self._report_with_draft(self.draft_client, info))
            return
        await self.emit("info", info)

    async def _report_with_draft(self, client: DraftClient, info: EngineInfo) -> None:
        ready = await client.settled()
        if ready is not None:
            self.info = info = with_draft_kv(
                info, ready.model, ready.num_blocks, ready.kv_cache_bytes, ready.host
            )
        await self.emit("info", info)

    async def stop(self) -> None:
        if self._lora_loader is not None:
            self._lora_loader.shutdown(wait=False, cancel_futures=True)
            self._lora_loader = None

    def adapter_ready(self, lora: LoRARequest) -> bool:
        """Whether a request of ``lora`` may be scheduled without :meth:`load_adapter`: it is
        loaded (or this stage serves no adapters, and its runner refuses the request)."""
        runner = self.runner
        bank = runner.lora if runner is not None else None
        return bank is None or bank.ready(lora)

    def lora_loader(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread adapters load on (one: loads run one at a time, in order)."""
        if self._lora_loader is None:
            self._lora_loader = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"actorline-{self.name}-lora"
            )
        return self._lora_loader

    async def load_adapter(self, lora: LoRARequest) -> LoRAAdapterError | None:
        """Load ``lora`` off the step thread: read, checked and laid out on this stage's
        loader thread (:meth:`~stages.execute.lora.LoRABank.prepare`), then kept by the
        runner's bank (:meth:`~stages.execute.lora.LoRABank.offer`). Called by the
        colocated schedule stage before it schedules the adapter's first request.

        Returns:
            None once it is loaded; the error of an adapter that cannot be served (returned,
            not raised: it is its requests' failure, not this stage's).
        """
        runner = self.runner
        bank = runner.lora if runner is not None else None
        if bank is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            adapter = await loop.run_in_executor(self.lora_loader(), bank.prepare, lora)
        except LoRAAdapterError as error:
            return error
        bank.offer(adapter)
        return None

    @handles(SchedulerStep)
    async def on_step(self, step: SchedulerStep) -> None:
        if self._pipeline is not None or self.draft_client is not None:
            # NOTE: beside the handlers: the step's logits (the draft stage's proposals) arrive
            # as messages to this stage (several pipeline steps may be in flight:
            # stages.steps_in_flight)
            self._steps_in_flight += 1
            self.spawn(self._emit_step(step))
            return
        await self.emit("out", await self.execute_step(step))

    async def _emit_step(self, step: SchedulerStep) -> None:
        try:
            await self.emit("out", await self.execute_step(step))
        finally:
            self._steps_in_flight -= 1

    @handles(DraftReady)
    async def on_draft_ready(self, ready: DraftReady) -> None:
        if self.draft_client is not None:
            self.draft_client.on_ready(ready)

    @handles(DraftProposals)
    async def on_draft_proposals(self, proposals: DraftProposals) -> None:
        if self.draft_client is not None:
            self.draft_client.on_proposals(proposals)

    async def on_replica_lost(self, lost: ReplicaLost) -> None:
        # the draft stage's host (an expendable replica set, pipeline.engine.presets)
        if self.draft_client is not None and all(
            host.endswith(DRAFT_HOST_SUFFIX) for host in lost.hosts
        ):
            self.draft_client.lost(f"{lost.error_type}: {lost.message}")
        await super().on_replica_lost(lost)

    async def on_replica_restored(self, restored: ReplicaRestored) -> None:
        # the draft stage's host restarted alone (pipeline.engine.replica_heal): tell the
        # fresh draft stage the target, whose model it loads before it drafts again
        if (
            self.draft_client is not None
            and self.info is not None
            and all(host.endswith(DRAFT_HOST_SUFFIX) for host in restored.hosts)
        ):
            self.draft_client.restored()
            await self.emit(DRAFT_PORT, self.info)
        await super().on_replica_restored(restored)

    @handles(PipelineSampled)
    async def on_pipeline_sampled(self, sampled: PipelineSampled) -> None:
        assert self._pipeline is not None
        self._pipeline.answer(sampled)

    async def execute_step(self, step: SchedulerStep) -> StepResult:
        """Run ``step`` on the stage's worker thread: what a step sent to ``in`` does, less
        sending the result. The schedule stage calls it directly where this stage runs on
        its host (:mod:`stages.engine_core`)."""
        runner = self.runner
        assert runner is not None
        step = self.kv_links.join(step)  # a decode engine's moved blocks join their request
        result = await self._execute_step(runner, step)
        if runner.kv_exports:  # a prefill engine's: sent before the step's tokens
            exports, runner.kv_exports = runner.kv_exports, []
            for to, blocks in self.kv_links.addressed(exports):
                await self.emit("kv", blocks, to=to)
        return result

    @handles(KvBlocks)
    async def on_kv_blocks(self, blocks: KvBlocks) -> None:
        """A decode engine's moved blocks: held until their request comes (the router,
        told, sends it)."""
        await self.emit("kv_arrived", self.kv_links.arrived(blocks, self.name))

    @handles(KvRelease)
    async def on_kv_release(self, release: KvRelease) -> None:
        self.kv_links.release(release)

    async def _execute_step(self, runner: ModelRunner, step: SchedulerStep) -> StepResult:
        note_step(step)
        if self._pipeline is not None:
            return await self._pipeline.execute(runner, step)
        if runner.group is None:
            assert self.step_threads is not None
            # with a draft model the step also drafts the requests' next tokens
            execute = runner.execute if self.drafter is None else self.drafter.execute
            result = await self.run_in_thread(self.step_threads.run, execute, step)
            if self.draft_client is not None:  # the draft stage placed apart drafts
                result = await self.draft_client.after_step(step, result, runner.output_token_ids)
            return result
        prepared = await self.run_in_thread(runner.prepare, step)
        if prepared.shard is not None:
            await self.emit("ranks", prepared.shard)
        # tensor parallelism: rank 0 drafts (unsharded) for the rows all ranks verify
        run = runner.run if self.drafter is None else self.drafter.after_run
        result = await self.run_in_thread(run, prepared)
        if self.draft_client is not None:  # the draft stage placed apart drafts
            result = await self.draft_client.after_step(step, result, runner.output_token_ids)
        return result


def _import_model_stack() -> None:
    """Import what :meth:`ExecuteStage.start` needs (off the event loop)."""
    import torch  # noqa: F401

    import stages.execute.runner  # noqa: F401
