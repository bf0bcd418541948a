"""The schedule stage: continuous batching around the pure :class:`~stages.scheduler.Scheduler`.

Ports: ``in`` (admitted EngineRequests), ``abort`` (AbortRequests from the API and from
stop-check), ``result`` (EngineInfo and StepResults from execute); ``execute`` (one
SchedulerStep at a time), ``out`` (EngineOutputs for the frontend), ``stats`` (EngineStats
for admit's queue bound), ``rejected`` (requests the scheduler refuses, e.g. a duplicate id).

An abort can overtake its request (the API sends aborts straight here while the request still
passes tokenize and admit); such ids are remembered, in a bounded set, and the request is
dropped when it arrives.

Structured outputs (``docs/architecture.md`` §11, "Structured outputs"): a request with
``params.structured_outputs`` reaches the scheduler only once its grammar is compiled. A
cache hit is immediate; otherwise the grammar compiles on this stage's grammar thread (its
stack sized to the grammar bounds, :mod:`stages.structured.limits`), in the background, while
steps go on; a grammar over a bound or that does not compile answers that request alone on
``rejected``. Each step then carries the token bitmask of the constrained requests that
sample in it (filled here, applied by execute's sampler), and each result advances their
matchers (:class:`~stages.structured.manager.GrammarManager`). A matcher that fails (a token
refused, a limit of the grammar engine hit mid-way) ends its request with a typed error on
``rejected``, never with a "stop" its all-EOS mask would fake.

LoRA adapters (docs/lora.md, "Loading"): where the colocated execute stage loads adapters
beside the steps, a request whose adapter is not loaded yet waits here
(:class:`~stages.lora_loads.AdapterLoads`) while it loads, and reaches the scheduler once it
is; an adapter that cannot be served answers its requests alone on ``rejected``.

The step itself (plan, execute, update) is :class:`~stages.engine_core.EngineCore`'s, in
:mod:`stages.engine_core` (``docs/architecture.md`` §2.7). Where the execute stage linked to
``execute`` runs on this stage's host and offers ``execute_step`` (the default placement:
admit, schedule and execute in one engine host), a loop in this stage runs
:meth:`EngineCore.step`'s plan, execute and update with it, directly
(:meth:`~pipeline.runtime.stage.Stage.call`: counted as execute's work, its failure
execute's); otherwise each step goes out on ``execute`` and its StepResult comes back on
``result``. Either way one step is in flight (up to ``max_steps_in_flight`` with pipeline
parallelism's micro-batches: :mod:`stages.micro_batches`), and requests, aborts and compiled
grammars are taken in while it runs. On both paths the next step is started *before* the
outputs go to the frontend, so their sending (and detokenize and stop-check on a shared host)
overlaps the next forward pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time

from pipeline.runtime.stage import Stage, handles, recoverable
from stages.early_aborts import EarlyAborts
from stages.engine_core import EngineCore, Execute, StepUpdate
from stages.errors import InvalidRequestError, RequestError
from stages.lora import LoRAAdapterError, LoRARequest
from stages.lora_loads import AdapterLoads
from stages.messages import (
    AbortRequests,
    EngineInfo,
    EngineRequest,
    RequestRejected,
    SchedulerStep,
    StepResult,
)
from stages.micro_batches import run_steps_in_flight
from stages.policies import load_policy
from stages.recovery import rejection
from stages.scheduler import Scheduler, SchedulerConfig
from stages.structured.backend import CompiledGrammar, load_grammar_backend
from stages.structured.manager import CompileThread, GrammarConfig, GrammarManager
from transports.tasks import TaskSet

__all__ = ["ScheduleConfig", "ScheduleStage"]


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """``policy``: a name in the ``actorline.schedulers`` plugin group. ``grammar``: the
    structured-outputs backend and the model whose tokenizer it uses (None: requests with
    ``structured_outputs`` are refused)."""

    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    policy: str = "fcfs"
    grammar: GrammarConfig | None = None


class ScheduleStage(Stage):
    inputs = ("in", "abort", "result")
    outputs = ("execute", "out", "stats", "rejected")

    def __init__(self, config: ScheduleConfig | None = None) -> None:
        super().__init__(config or ScheduleConfig())
        self.scheduler: Scheduler | None = None
        self.grammars: GrammarManager | None = None
        self.core: EngineCore | None = None
        # the colocated execute stage's execute_step (None: steps go out on "execute"), and
        # the engine loop's wake-up when there is work
        self._execute: Execute | None = None
        self._running = False
        self._stepping = False
        self._steps = TaskSet("schedule steps")  # the engine loop's step in flight
        self._wake = asyncio.Event()
        self._early_aborts = EarlyAborts()
        # requests whose grammar compiles in the background, and their compile thread
        self._compiling: dict[str, EngineRequest] = {}
        self._compile_pool: CompileThread | None = None
        self._info_known = asyncio.Event()
        # requests waiting for their LoRA adapter to load (None: execute loads none ahead)
        self._adapter_loads: AdapterLoads | None = None

    async def start(self) -> None:
        # NOTE: a policy or grammar plugin that is missing, broken or invalid fails start-up
        # loudly (the grammar backend's tokenizer is loaded on the first compile).
        policy = load_policy(self.config.policy)
        self.scheduler = Scheduler(self.config.scheduler, policy)
        if self.config.grammar is not None:
            load_grammar_backend(self.config.grammar.backend)
            self.grammars = GrammarManager(self.config.grammar)
        self.core = EngineCore(self.scheduler, self.grammars)
        execute = self.colocated("execute")
        execute_step = getattr(execute, "execute_step", None)
        if execute is not None and callable(execute_step):
            self._execute = functools.partial(self.call, execute, execute_step)
        ready = getattr(execute, "adapter_ready", None)
        load = getattr(execute, "load_adapter", None)
        if callable(ready) and callable(load):
            info_known = self._info_known

            def loaded(lora: LoRARequest) -> bool:
                return info_known.is_set() and bool(ready(lora))

            async def load_adapter(lora: LoRARequest) -> LoRAAdapterError | None:
                await info_known.wait()
                # NOTE: not through Stage.call: the load runs beside the step in flight (on
                # execute's loader thread), it is no step's work
                error: LoRAAdapterError | None = await load(lora)
                return error

            self._adapter_loads = AdapterLoads(loaded, load_adapter, self._loaded, self.spawn)

    async def stop(self) -> None:
        self._steps.cancel()
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
            self._compile_pool = None

    @handles(EngineInfo)
    async def on_engine_info(self, info: EngineInfo) -> None:
        assert self.scheduler is not None
        self.scheduler.set_engine_info(info)
        if self.grammars is not None:
            self.grammars.set_engine_info(info.vocab_size, info.eos_token_ids)
        self._info_known.set()
        if self._execute is not None and not self._running:
            self._running = self._stepping = True
            limit = self.config.scheduler.max_steps_in_flight
            if limit > 1:  # pipeline parallelism's micro-batches (stages.micro_batches)
                self.spawn(self._run_steps_in_flight(self._execute, limit))
            else:
                self.spawn(self._run_steps(self._execute))
        await self._dispatch_step()

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        assert self.scheduler is not None
        if self._early_aborts.take(request.request_id):
            return  # aborted before it arrived
        if self._adapter_loads is not None and self._adapter_loads.holds(request):
            return  # its adapter loads first (_loaded takes it in)
        await self._take_in(request)

    async def _loaded(self, request: EngineRequest, error: LoRAAdapterError | None) -> None:
        """``request``'s adapter loaded (``error``: it cannot be served)."""
        if error is not None:
            await self.emit("rejected", RequestRejected.of(request.request_id, error))
            return
        await self._take_in(request)

    async def _take_in(self, request: EngineRequest) -> None:
        """Compile ``request``'s grammar first, or hand it to the scheduler."""
        if request.params.structured_outputs is not None:
            await self._on_constrained(request)
            return
        if await self._admit(request):
            await self._dispatch_step()

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        assert self.scheduler is not None
        for request_id in abort.request_ids:
            if self._adapter_loads is not None and self._adapter_loads.drop(request_id):
                continue  # its adapter's load goes on for the others
            if self._compiling.pop(request_id, None) is not None:
                continue  # its compile finishes unheeded
            if not self.scheduler.has_request(request_id):
                self._early_aborts.add(request_id)
            if self.grammars is not None:
                self.grammars.finish(request_id)
        self.scheduler.abort(abort.request_ids)
        await self._dispatch_step()

    @handles(StepResult)
    async def on_result(self, result: StepResult) -> None:
        """A step's result, on the message path (execute on another host)."""
        assert self.core is not None
        update = self.core.update(result)
        await self._dispatch_step()
        await self._publish(update)

    async def _run_steps(self, execute: Execute) -> None:
        """The engine loop where execute is colocated: :meth:`EngineCore.plan` a step, start
        it, and while the model runs it on execute's worker thread send the previous step's
        outputs (:meth:`_publish`; detokenize and stop-check run then where they share this
        host, the zmq link encodes them where they do not); then :meth:`EngineCore.update`
        with its result. The next step is planned only after the previous one's update, as
        :meth:`EngineCore.step` does; only the sending moved (vLLM's engine core hands a
        step's outputs to a thread that serializes and sends them while its busy loop runs
        the next step: ``vllm/v1/engine/core.py``, ``EngineCoreProc.process_output_sockets``).
        Waits for work when there is none (the handlers wake
        it); the previous step's outputs go out before it waits.

        Raises:
            what :meth:`EngineCore.step` raises, once the previous step's outputs are out.
        """
        core = self.core
        assert core is not None
        clock = time.perf_counter
        done: StepUpdate | None = None  # the last step's update, its outputs not sent yet
        while True:
            began = clock()
            plan = core.plan()
            if plan is None:
                if done is not None:
                    await self._publish(done)
                    done = None
                    self.record_work(clock() - began)
                self._stepping = False  # idle only with the outputs out and no work
                await self._wake.wait()
                self._wake.clear()
                self._stepping = True
                continue
            working = clock() - began
            running = self._steps.spawn(_execute(execute, plan.step))
            try:
                # NOTE: one turn of the event loop starts the step on execute's thread (and
                # gives the host a turn between steps: an execute that answers without
                # suspending, the null model's, would otherwise run step after step while
                # nothing else on this host runs: no request taken in, no heartbeat sent)
                await asyncio.sleep(0)
                if done is not None:
                    began = clock()
                    await self._publish(done)
                    working += clock() - began
            except BaseException:
                running.cancel()
                running.add_done_callback(_consume_failure)
                raise
            result = await running
            began = clock()
            done = core.update(result, plan)
            # this stage's part of the step (plan, update, sending), as a handler counts it
            self.record_work(working + clock() - began)

    async def _run_steps_in_flight(self, execute: Execute, limit: int) -> None:
        """:func:`~stages.micro_batches.run_steps_in_flight` over this stage's core."""
        assert self.core is not None

        def stepping(busy: bool) -> None:
            self._stepping = busy

        await run_steps_in_flight(
            self.core,
            execute,
            limit,
            tasks=self._steps,
            wake=self._wake,
            publish=self._publish,
            record_work=self.record_work,
            stepping=stepping,
        )

    async def _publish(self, update: StepUpdate) -> None:
        """Send a step's outputs to the frontend, its failed requests' errors, its stats."""
        await self.emit("out", update.outputs)
        await self._reject(update.rejected)
        if update.outputs.stats is not None:
            await self.emit("stats", update.outputs.stats)

    async def _reject(self, rejected: tuple[RequestRejected, ...]) -> None:
        for refused in rejected:
            # NOTE: the caller gets the reason; the log does not repeat it above DEBUG, as
            # no other refusal of a request's input is (a client may send many).
            self.logger.debug("request %s: %s", refused.request_id, refused.message)
            await self.emit("rejected", refused)

    async def _admit(self, request: EngineRequest, compiled: CompiledGrammar | None = None) -> bool:
        """Hand ``request`` to the scheduler (with its grammar's matcher), or reject it."""
        assert self.scheduler is not None
        try:
            self.scheduler.add_request(request)
            if compiled is not None:
                assert self.grammars is not None
                params = request.params.structured_outputs
                kind = params.kind if params is not None else ""
                self.grammars.start(request.request_id, compiled, kind)
        except RequestError as error:
            await self.emit("rejected", RequestRejected.of(request.request_id, error))
            return False
        except Exception as error:
            # NOTE: a failure taking in one request is that request's (docs/architecture.md,
            # "Failure: one request or the pipeline"): whatever the scheduler took of it is
            # dropped, it is answered, and everyone else runs on. A failure planning a step
            # (below) is the scheduler's own, and fails the pipeline.
            if not recoverable(error):
                raise
            self.scheduler.abort((request.request_id,))
            if self.grammars is not None:
                self.grammars.finish(request.request_id)
            self.logger.error(
                "failed to take in request %r: %s", request.request_id, error, exc_info=error
            )
            await self.emit("rejected", rejection(self.name, request.request_id, error))
            return False
        return True

    async def _on_constrained(self, request: EngineRequest) -> None:
        request_id = request.request_id
        params = request.params.structured_outputs
        assert params is not None and self.scheduler is not None
        error: RequestError | None = None
        if self.grammars is None:
            error = InvalidRequestError(
                "structured outputs are not enabled in this pipeline (its schedule stage has "
                "no grammar backend)",
                field="structured_outputs",
                request_id=request_id,
            )
        elif request_id in self._compiling:
            error = InvalidRequestError(
                f"request id {request_id!r} is already scheduled",
                field="request_id",
                request_id=request_id,
            )
        if error is not None:
            await self.emit("rejected", RequestRejected.of(request_id, error))
            return
        assert self.grammars is not None
        compiled = self.grammars.cached(params) if self._info_known.is_set() else None
        if compiled is not None:
            if await self._admit(request, compiled):
                await self._dispatch_step()
            return
        self._compiling[request_id] = request
        self.spawn(self._compile(request))

    async def _compile(self, request: EngineRequest) -> None:
        """Compile ``request``'s grammar on the grammar thread, then admit or reject it
        (unless it was aborted meanwhile)."""
        assert self.grammars is not None and request.params.structured_outputs is not None
        await self._info_known.wait()
        if self._compile_pool is None:
            self._compile_pool = self.grammars.compile_thread(f"actorline-{self.name}-grammar")
        compile_one = functools.partial(
            self.grammars.compile,
            request.params.structured_outputs,
            request_id=request.request_id,
        )
        compiled: CompiledGrammar | None = None
        error: RequestError | None = None
        try:
            compiled = await asyncio.get_running_loop().run_in_executor(
                self._compile_pool, compile_one
            )
        except RequestError as exc:
            error = exc
        except Exception as exc:  # the backend or its tokenizer failed (to load)
            if not recoverable(exc):
                raise
            self.logger.exception("the grammar backend failed on request %s", request.request_id)
            error = RequestError(
                f"structured outputs are unavailable: {type(exc).__name__}: {exc}",
                field="structured_outputs",
                request_id=request.request_id,
            )
        if self._compiling.get(request.request_id) is not request:
            return  # aborted while it compiled
        del self._compiling[request.request_id]
        if error is not None:
            await self.emit("rejected", RequestRejected.of(request.request_id, error))
            return
        if await self._admit(request, compiled):
            await self._dispatch_step()

    async def _dispatch_step(self) -> None:
        """There may be a step to run: wake the engine loop, or (message path) send the
        next step to execute unless one is in flight."""
        if self._execute is not None:
            self._wake.set()
            return
        assert self.core is not None
        # NOTE: with max_steps_in_flight > 1 several go out; the scheduler says when not
        while (plan := self.core.plan()) is not None:
            await self.emit("execute", plan.step)
            await self._reject(plan.rejected)

    def idle(self) -> bool:
        if self._compiling or self._stepping:
            return False
        if self._adapter_loads is not None and self._adapter_loads.pending:
            return False
        return self.scheduler is None or not (self.scheduler.has_work() or self.scheduler.in_flight)


async def _execute(execute: Execute, step: SchedulerStep) -> StepResult:
    """``execute(step)`` as a coroutine, for the engine loop's task."""
    return await execute(step)


def _consume_failure(task: asyncio.Future[StepResult]) -> None:
    """Retrieve a step's failure that nobody awaits any more (the loop stopped while the step
    ran); the colocated call has reported it as execute's already."""
    if not task.cancelled():
        task.exception()
