"""One engine step, in straight-line code: schedule, execute, update, outputs.

This is the module to read for what the engine does each step (``docs/architecture.md``
§2.7). :meth:`EngineCore.step` is the whole loop body::

    plan = self.plan()                  # Scheduler.schedule() + the grammar bitmask
    result = await execute(plan.step)   # the execute stage runs the model (KV allocator its own)
    return self.update(result, plan)    # Scheduler.update() + the grammar matchers advance

:class:`EngineCore` holds the pure :class:`~stages.scheduler.Scheduler` and the structured
outputs' :class:`~stages.structured.manager.GrammarManager`; it does no IO and imports no
asyncio. The schedule stage (:mod:`stages.schedule`) owns one and decides how ``execute`` is
reached: where its execute stage runs on the same host (the default placement: admit,
schedule and execute in one engine host) it calls the stage's :meth:`execute_step` directly
(:meth:`pipeline.runtime.stage.Stage.call`, counted as that stage's work), in a loop of
:meth:`plan`, execute and :meth:`update` that sends a step's outputs while the next step
runs; where it runs elsewhere (another host or process, or a user's execute stage
without :meth:`execute_step`) the step goes out on the ``execute`` port and
:meth:`update` runs when the :class:`~stages.messages.StepResult` comes back. Either way one
step is in flight at a time (several with pipeline parallelism's micro-batches:
:mod:`stages.micro_batches`), and requests, aborts and compiled grammars are taken in while it
runs. Flow after vLLM v1 (``vllm/v1/engine/core.py``: ``EngineCore.step``) and nano-vllm
(``nanovllm/engine/llm_engine.py``: ``LLMEngine.step``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from stages.errors import InvalidRequestError
from stages.messages import EngineOutputs, RequestRejected, SchedulerStep, StepResult
from stages.scheduler import Scheduler
from stages.structured.manager import GrammarManager

__all__ = ["EngineCore", "Execute", "StepPlan", "StepUpdate"]

#: how a step reaches the model: the execute stage's ``execute_step``, called directly
Execute = Callable[[SchedulerStep], Awaitable[StepResult]]


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """A step to run. ``rejected``: constrained requests whose matcher failed filling the
    step's mask (aborted already: their token in the step is dropped, as an abort's is)."""

    step: SchedulerStep
    rejected: tuple[RequestRejected, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class StepUpdate:
    """What a step produced: the ``outputs`` for the frontend, and the requests that end with
    a typed error (``rejected``: their matcher failed while filling the mask or on a token)."""

    outputs: EngineOutputs
    rejected: tuple[RequestRejected, ...] = ()


class EngineCore:
    """The engine step over a scheduler and (with structured outputs) its grammars (see the
    module docstring). Not thread-safe: the schedule stage calls it from its event loop."""

    def __init__(self, scheduler: Scheduler, grammars: GrammarManager | None = None) -> None:
        self.scheduler = scheduler
        self.grammars = grammars

    async def step(self, execute: Execute) -> StepUpdate | None:
        """Plan a step, run it, take its result in.

        Returns:
            What the step produced; None when there is nothing to run (no work, a step in
            flight, or the engine's capacity not known yet).

        Raises:
            whatever ``execute`` raises (the model failed), and
            :class:`~stages.scheduler.SchedulerError` (a result that breaks the contract).
        """
        plan = self.plan()
        if plan is None:
            return None
        result = await execute(plan.step)
        return self.update(result, plan)

    def plan(self) -> StepPlan | None:
        """The next step (:meth:`Scheduler.schedule`) with the token bitmask of the
        constrained requests that sample in it; None when there is nothing to run."""
        scheduler = self.scheduler
        step = scheduler.schedule()
        if step is None:
            return None
        grammars = self.grammars
        if grammars is None or not len(grammars):
            return StepPlan(step)
        constrained = [r for r in scheduler.sampling_request_ids() if r in grammars]
        if not constrained:
            return StepPlan(step)
        for request_id in constrained:
            grammars.sync(request_id, scheduler.num_output_tokens(request_id))
        step = dataclasses.replace(
            step,
            grammar_request_ids=tuple(constrained),
            grammar_bitmask=grammars.bitmask(constrained),
        )
        # NOTE: a matcher that failed filling its mask (a lexer limit hit) allows only EOS
        # there; its request ends with the error instead (its token in this step is
        # dropped, as an abort's is).
        failed = {r: e for r in constrained if (e := grammars.error(r)) is not None}
        return StepPlan(step, self.fail_grammars(failed))

    def update(self, result: StepResult, plan: StepPlan | None = None) -> StepUpdate:
        """Take ``result`` in: :meth:`Scheduler.update`, then each constrained request's
        matcher advances over its new tokens (a matcher that fails ends its request with a
        typed error; its outputs so far go out). ``plan``: the step's plan, whose
        rejections join the update's (None: they were sent with the step).

        Raises:
            SchedulerError: ``result`` does not answer the step in flight.
        """
        outputs = self.scheduler.update(result)
        failed: dict[str, str] = {}
        if self.grammars is not None and len(self.grammars):
            failed = self._advance_grammars(outputs)
        rejected = self.fail_grammars(failed)
        if plan is not None and plan.rejected:
            rejected = (*plan.rejected, *rejected)
        return StepUpdate(outputs, rejected)

    def _advance_grammars(self, outputs: EngineOutputs) -> dict[str, str]:
        """Feed each constrained request's new tokens to its matcher; drop finished ones.

        Returns:
            the requests whose matcher failed, with the reason.
        """
        grammars = self.grammars
        assert grammars is not None
        failed: dict[str, str] = {}
        for request_id, tokens, finish in zip(
            outputs.request_ids, outputs.new_token_ids, outputs.finish_reasons, strict=True
        ):
            if request_id not in grammars:
                continue
            if finish is not None:
                grammars.finish(request_id)
                continue
            accepted = grammars.accept(request_id, tokens)
            reason = grammars.error(request_id)
            if reason is None and not accepted:
                reason = f"the grammar refused the sampled token {list(tokens)}"
            if reason is not None:
                failed[request_id] = reason
        return failed

    def fail_grammars(self, failed: dict[str, str]) -> tuple[RequestRejected, ...]:
        """End each of ``failed``'s requests, whose matcher failed, with a typed error: an
        :class:`InvalidRequestError` naming ``structured_outputs.<kind>`` and the grammar
        engine's reason (the constraint asked for more than the engine's limits allow, or a
        language it cannot continue). The request is aborted (its KV blocks freed with the
        next step) and its matcher dropped.

        Returns:
            the rejections to send, one per request of ``failed``.
        """
        if not failed:
            return ()
        grammars = self.grammars
        assert grammars is not None
        self.scheduler.abort(tuple(failed))
        backend = grammars.config.backend
        rejected = []
        for request_id, reason in failed.items():
            kind = grammars.kind(request_id) if request_id in grammars else ""
            grammars.finish(request_id)
            field = f"structured_outputs.{kind}" if kind else "structured_outputs"
            error = InvalidRequestError(
                f"{field} failed while generating ({backend}): {reason}",
                field=field,
                request_id=request_id,
            )
            rejected.append(RequestRejected.of(request_id, error))
        return tuple(rejected)
