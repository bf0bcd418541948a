"""The schedule stage: continuous batching around the pure :class:`~stages.scheduler.Scheduler`.

Ports: ``in`` (admitted EngineRequests), ``abort`` (AbortRequests from the API and from
stop-check), ``result`` (EngineInfo and StepResults from execute); ``execute`` (one
SchedulerStep at a time), ``out`` (EngineOutputs for the frontend), ``stats`` (EngineStats
for admit's queue bound), ``rejected`` (requests the scheduler refuses, e.g. a duplicate id).

An abort can overtake its request (the API sends aborts straight here while the request still
passes tokenize and admit); such ids are remembered, in a bounded set, and the request is
dropped when it arrives.

NOTE: exactly one step is in flight. When a result arrives the next step is sent to execute
*before* the outputs go to the frontend, so the model never waits on the frontend.
"""

from __future__ import annotations

import dataclasses

from pipeline.runtime.stage import Stage, handles, recoverable
from stages.early_aborts import EarlyAborts
from stages.errors import RequestError
from stages.failures import rejection
from stages.messages import (
    AbortRequests,
    EngineInfo,
    EngineRequest,
    RequestRejected,
    StepResult,
)
from stages.policies import load_policy
from stages.scheduler import Scheduler, SchedulerConfig

__all__ = ["ScheduleConfig", "ScheduleStage"]


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """``policy``: a name in the ``actorline.schedulers`` plugin group."""

    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    policy: str = "fcfs"


class ScheduleStage(Stage):
    inputs = ("in", "abort", "result")
    outputs = ("execute", "out", "stats", "rejected")

    def __init__(self, config: ScheduleConfig | None = None) -> None:
        super().__init__(config or ScheduleConfig())
        self.scheduler: Scheduler | None = None
        self._early_aborts = EarlyAborts()

    async def start(self) -> None:
        # NOTE: a policy plugin that is missing, broken or invalid fails start-up loudly.
        policy = load_policy(self.config.policy)
        self.scheduler = Scheduler(self.config.scheduler, policy)

    @handles(EngineInfo)
    async def on_engine_info(self, info: EngineInfo) -> None:
        assert self.scheduler is not None
        self.scheduler.set_engine_info(info)
        await self._dispatch_step()

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        assert self.scheduler is not None
        if self._early_aborts.take(request.request_id):
            return  # aborted before it arrived
        try:
            self.scheduler.add_request(request)
        except RequestError as error:
            await self.emit(
                "rejected",
                RequestRejected.of(request.request_id, error),
            )
            return
        except Exception as error:
            # NOTE: a failure taking in one request is that request's (docs/architecture.md,
            # "Failure: one request or the pipeline"): whatever the scheduler took of it is
            # dropped, it is answered, and everyone else runs on. A failure planning a step
            # (below) is the scheduler's own, and fails the pipeline.
            if not recoverable(error):
                raise
            self.scheduler.abort((request.request_id,))
            self.logger.error(
                "failed to take in request %r: %s", request.request_id, error, exc_info=error
            )
            await self.emit("rejected", rejection(self.name, request.request_id, error))
            return
        await self._dispatch_step()

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        assert self.scheduler is not None
        for request_id in abort.request_ids:
            if not self.scheduler.has_request(request_id):
                self._early_aborts.add(request_id)
        self.scheduler.abort(abort.request_ids)
        await self._dispatch_step()

    @handles(StepResult)
    async def on_result(self, result: StepResult) -> None:
        assert self.scheduler is not None
        outputs = self.scheduler.update(result)
        await self._dispatch_step()
        await self.emit("out", outputs)
        if outputs.stats is not None:
            await self.emit("stats", outputs.stats)

    async def _dispatch_step(self) -> None:
        assert self.scheduler is not None
        step = self.scheduler.schedule()
        if step is not None:
            await self.emit("execute", step)

    def idle(self) -> bool:
        return self.scheduler is None or not (self.scheduler.has_work() or self.scheduler.in_flight)
