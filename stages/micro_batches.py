"""The schedule stage's engine loop with several steps in flight (pipeline parallelism's
micro-batches; ``docs/architecture.md`` §2.7, docs/parallelism.md "Pipeline parallelism").

Where the execute stage is colocated, :meth:`~stages.schedule.ScheduleStage` runs
:func:`run_steps_in_flight` instead of its one-step loop when
``SchedulerConfig.max_steps_in_flight`` K > 1: it plans steps (:meth:`EngineCore.plan`) and
starts each on execute until K are in flight or there is nothing more to plan, sends the
outputs of the steps already answered, then waits for the oldest step's result (or, with a
slot free, for new work to plan into it) and takes it in (:meth:`EngineCore.update`).
Results are taken in the order their steps were planned. The scheduler's rules for steps in
flight (disjoint requests, frees after results, the free-block count) are in
:mod:`stages.steps_in_flight`; the shape is vLLM's batch queue
(``vllm/v1/engine/core.py``: ``EngineCore.step_with_batch_queue``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable

from stages.engine_core import EngineCore, Execute, StepPlan, StepUpdate
from stages.messages import SchedulerStep, StepResult
from transports.tasks import TaskSet

__all__ = ["run_steps_in_flight"]


async def run_steps_in_flight(
    core: EngineCore,
    execute: Execute,
    limit: int,
    *,
    tasks: TaskSet,
    wake: asyncio.Event,
    publish: Callable[[StepUpdate], Awaitable[None]],
    record_work: Callable[[float], None],
    stepping: Callable[[bool], None],
) -> None:
    """Run the engine with up to ``limit`` steps in flight (see the module docstring) until
    cancelled. ``tasks`` holds the steps' tasks; ``wake`` is set by whoever adds work;
    ``publish`` sends a step's outputs; ``record_work`` counts the loop's own seconds (plan,
    update, sending) as the stage's work; ``stepping(False)`` is called before the loop
    waits with nothing in flight and every output sent, ``stepping(True)`` when it wakes.

    Raises:
        what a step's ``execute`` raises (the other steps in flight are cancelled), and what
        :meth:`EngineCore.plan` / :meth:`EngineCore.update` raise.
    """
    clock = time.perf_counter
    flight: collections.deque[tuple[StepPlan, asyncio.Task[StepResult]]] = collections.deque()
    answered: list[StepUpdate] = []
    try:
        while True:
            began = clock()
            while len(flight) < limit and (plan := core.plan()) is not None:
                flight.append((plan, tasks.spawn(_execute(execute, plan.step))))
            working = clock() - began
            if flight:
                # NOTE: one turn of the loop starts the new steps on execute (and gives the
                # host a turn between steps, as the one-step loop does)
                await asyncio.sleep(0)
            began = clock()
            for update in answered:
                await publish(update)
            answered.clear()
            working += clock() - began
            if not flight:
                if working:
                    record_work(working)
                stepping(False)  # idle only with the outputs out and no work
                await wake.wait()
                wake.clear()
                stepping(True)
                continue
            oldest = flight[0][1]
            if len(flight) < limit:
                # a slot is free: new work (a request, an abort's free) may be planned into it
                waiter = tasks.spawn(wake.wait())
                try:
                    await asyncio.wait((oldest, waiter), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                if wake.is_set():
                    wake.clear()
                if not oldest.done():
                    if working:
                        record_work(working)
                    continue
            else:
                await asyncio.wait((oldest,))
            plan, task = flight.popleft()
            result = task.result()
            began = clock()
            answered.append(core.update(result, plan))
            record_work(working + clock() - began)
    except BaseException:
        for _, task in flight:
            task.cancel()
            task.add_done_callback(_consume_failure)
        raise


async def _execute(execute: Execute, step: SchedulerStep) -> StepResult:
    """``execute(step)`` as a coroutine, for a step's task."""
    return await execute(step)


def _consume_failure(task: asyncio.Task[StepResult]) -> None:
    """Retrieve the failure of a step nobody awaits any more (the loop stopped while it ran:
    the colocated call has reported it as execute's already)."""
    if not task.cancelled():
        task.exception()
