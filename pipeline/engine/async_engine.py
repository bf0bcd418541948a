"""``AsyncEngine``: the async API over the LLM pipeline.

::

    async with AsyncEngine("smollm2-135m") as engine:
        async for output in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(output.delta, end="", flush=True)

Each ``generate`` call is an async iterator of :class:`~stages.messages.RequestOutput`
streaming text deltas. Breaking out of it, or cancelling the task that iterates it, aborts the
request in the engine and frees its KV blocks. If the consumer falls behind, pending outputs
of a request are merged (deltas concatenated), so a slow reader never backs up the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pipeline.engine.collector import OutputCollector
from pipeline.engine.embeddings import EmbeddingRequestOutput, check_embedding, embed
from pipeline.engine.errors import EngineCrashLoopError, EngineDeadError, WrongEventLoopError
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import (
    ENGINE_HOST,
    REPLICA_SET,
    check_parallelism,
    llm_pipeline,
    options_of,
    start_options,
)
from pipeline.engine.prompts import CheckedPrompt, Prompt, as_checked, check_prompt
from pipeline.engine.replica_heal import ReplicaHealer
from pipeline.engine.restarts import RestartPolicy
from pipeline.runtime.errors import (
    GraphError,
    HostDiedError,
    HostUnresponsiveError,
    PipelineClosedError,
    PipelineError,
    StageFailedError,
)
from pipeline.runtime.graph import Pipeline
from pipeline.runtime.replicas import ReplicaLost, ReplicaStatus
from pipeline.runtime.running import RunningPipeline
from stages.checks import check_text
from stages.errors import ENGINE_DEAD, InvalidRequestError, RequestError, error_from_kind
from stages.lora import LoRAAdapterError, LoRAChecker, LoRARequest
from stages.messages import (
    AbortRequests,
    ChatRendering,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    RequestOutput,
    RequestOutputs,
    RequestRejected,
)
from stages.params import SamplingParams
from stages.pooling import PoolingParams
from stages.tools import ToolUse
from stages.validation import MAX_REQUEST_ID_LENGTH, check_request_id
from transports.tasks import TaskSet

__all__ = ["AsyncEngine", "EngineObserver"]

logger = logging.getLogger("actorline.engine")


class EngineObserver:
    """Hooks the engine calls for every request it runs (e.g.
    :class:`pipeline.engine.metrics.EngineMetrics`); subclass and override what you need.

    The hooks run on the engine's event loop, in the engine's own tasks: they must return
    quickly and never block. An exception in a hook is logged and ignored.

    Every hook names a request by its id inside the pipeline, the same in all hooks (and in
    ``output.request_id`` here): the caller's ``request_id`` when it chose none, else the
    caller's id with ``#<n>`` appended, unique per submission (so a reused id never mixes
    two requests' events).
    """

    def request_sent(self, request: GenerateRequest) -> None:
        """``request`` is about to enter the pipeline."""

    def output_received(self, output: RequestOutput) -> None:
        """The pipeline produced ``output`` (one per engine step that gave the request
        tokens; the last has a ``finish_reason``). Also called with the ``"abort"`` output
        that :meth:`AsyncEngine.abort` and :meth:`AsyncEngine.close` end a stream with."""

    def request_rejected(self, rejected: RequestRejected) -> None:
        """The pipeline refused a request (``rejected.kind`` says why)."""

    def request_ended(self, request_id: str, error: BaseException | None) -> None:
        """The caller's stream of the request ended: after its last output, after a
        rejection or engine failure (``error``), or because the caller stopped reading (the
        request is then aborted). Called exactly once for every request sent."""

    def stats_received(self, stats: EngineStats) -> None:
        """An engine step's stats arrived (one per step of each replica; a replica's
        ``num_steps`` tells a new step from a repeat)."""


class AsyncEngine:
    """The asynchronous LLM engine.

    ``AsyncEngine(model, **options)`` takes :class:`~pipeline.engine.options.EngineOptions` fields
    (or ``options=EngineOptions(...)``);
    ``AsyncEngine(pipeline=...)`` runs a customised pipeline (it must keep the entries
    ``requests``/``aborts`` and exits ``outputs``/``engine_info`` of the default one), with
    the options :func:`~pipeline.engine.presets.llm_pipeline` built it from unless others are given.
    Start it with ``async with`` or :meth:`start`.

    Raises (from the constructor): TypeError for an unknown option, ValueError for a bad value.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        pipeline: Pipeline | None = None,
        options: EngineOptions | None = None,
        **option_values: Any,
    ) -> None:
        if options is not None:
            if model is not None or option_values:
                raise TypeError("give either options=EngineOptions(...) or keyword options")
            self.options = options
        elif pipeline is not None and model is None and not option_values:
            # A pipeline from llm_pipeline(options) runs with the options it was built from
            # (model checked, transport, start timeout), not the defaults.
            self.options = options_of(pipeline) or EngineOptions()
        else:
            self.options = EngineOptions.create(model, **option_values)
        self.pipeline = pipeline if pipeline is not None else llm_pipeline(self.options)
        _check_engine_boundary(self.pipeline)
        self.info: EngineInfo | None = None
        #: the engine's latest stats (with replicas: summed over the live ones)
        self.stats: EngineStats | None = None
        #: with data parallelism, each live replica's latest stats, by replica name
        self.replica_stats: dict[str, EngineStats] = {}
        self._running: RunningPipeline | None = None
        # NOTE: keyed by the id the request has inside the pipeline. A caller's id becomes
        # "<id>#<n>" there, so an abort of a finished request that arrives late (it can:
        # aborts take a shorter path than requests) never hits a later request of the same id.
        self._collectors: dict[str, OutputCollector] = {}
        self._engine_ids: dict[str, str] = {}  # caller's id -> the running request's id
        self._incarnations = itertools.count()
        self._dispatcher: asyncio.Task[None] | None = None
        # each generation's dispatcher and abort sender, and the restart task
        self._tasks = TaskSet("engine")
        self._abort_queue: asyncio.Queue[str] = asyncio.Queue()
        self._abort_sender: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._observers: tuple[EngineObserver, ...] = ()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: times a fresh engine replaced a dead one (``restart_engine``)
        self.restarts = 0
        self._restart_policy = RestartPolicy(
            self.options.restart_backoff, self.options.restart_limit, self.options.restart_window
        )
        self._restarting: asyncio.Task[None] | None = None
        self._restarts_stopped = False  # stop_restarting was called
        self._failure_callbacks: list[Callable[[BaseException], None]] = []
        self._restart_callbacks: list[Callable[[], None]] = []
        self._replica_callbacks: list[Callable[[ReplicaLost], None]] = []
        self._replica_restart_callbacks: list[Callable[[str], None]] = []
        self._healer = ReplicaHealer(self.options, self._on_replica_restored)
        #: restarts a lost draft host placed apart alone (docs/speculative.md)
        self._draft_healer = ReplicaHealer(self.options, _no_callback, "draft host", by_set=True)
        self._lora = LoRAChecker(self.options.enable_lora, self.options.max_lora_rank)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> AsyncEngine:
        """Start the pipeline (spawning the engine process) and wait until the model is loaded.

        An engine starts once: whatever fails here stops what had started (no process is
        left behind), and the engine is then closed.

        Raises:
            ModelNotFoundError: an unknown alias, or a path that does not exist.
            ModelFormatError: not a usable model (a corrupt or truncated GGUF, ...).
            plugins.PluginError: the scheduler plugin is missing, broken or invalid.
            StageFailedError: a stage failed to start for another reason (a model the
                attention path cannot serve, ...).
            TimeoutError: the pipeline did not start within ``start_timeout``.
            PipelineClosedError: the engine was closed (create a new one).
            RuntimeError: the engine is started already.
        """
        if self._closed:
            raise PipelineClosedError("this engine was closed; create a new AsyncEngine")
        if self._running is not None:
            raise RuntimeError("this engine is started already ('async with' it only once)")
        self._loop = asyncio.get_running_loop()
        try:
            # NOTE: what can be checked here is, so the caller gets the typed error rather
            # than a StageFailedError from a stage in another process. The model is resolved
            # (a GGUF converted, once) here instead of in two stages at once.
            await asyncio.to_thread(_preflight, self.options)
            running, info = await self._launch()
        except BaseException:
            await self.close()
            raise
        if self.options.on_ray:
            _warn_of_few_threads_on_ray(self.options)
        self._adopt(running, info)
        return self

    async def _launch(self) -> tuple[RunningPipeline, EngineInfo]:
        """Start a fresh pipeline and wait for its engine's info; whatever fails stops what
        had started. Raises what :meth:`start` does."""
        running = await self.pipeline.start(start_options(self.options))
        try:
            info = await running.receive("engine_info")
            if not isinstance(info, EngineInfo):
                raise GraphError(
                    f"exit 'engine_info' gave a {type(info).__qualname__}, not an EngineInfo"
                )
        except BaseException:
            await running.stop(graceful=False)
            raise
        return running, info

    def _adopt(self, running: RunningPipeline, info: EngineInfo) -> None:
        """Serve from ``running`` (a fresh generation of the engine): its own dispatcher and
        abort sender, failure and replica callbacks bound to it, so nothing of a dead
        generation reaches the new one."""
        self._running = running
        self.info = info
        self._failure = None
        self.stats = None
        self.replica_stats = {}
        while not self._abort_queue.empty():  # ids of the dead generation's requests
            self._abort_queue.get_nowait()
        self._dispatcher = self._tasks.spawn(self._dispatch(running), name="engine:dispatch")
        self._abort_sender = self._tasks.spawn(self._send_aborts(running), name="engine:aborts")
        self._healer.adopt(running)
        self._draft_healer.adopt(running)
        running.add_replica_callback(self._on_replica_lost)
        for callback in self._replica_callbacks:
            running.add_replica_callback(_engine_replicas_only(callback))
        # NOTE: last: called at once if this generation has failed already
        running.add_failure_callback(functools.partial(self._on_failure, running))

    async def stop_restarting(self) -> None:
        """Start no fresh engine from now on, and cancel a restart under way. A server that
        shuts down calls it first (``actorline serve`` on SIGTERM): a restart let finish
        while the server stops would come up only to be closed."""
        self._restarts_stopped = True
        restarting, self._restarting = self._restarting, None
        if restarting is not None:
            restarting.cancel()
            with contextlib.suppress(BaseException):
                await restarting

    async def close(self) -> None:
        """Abort every running request and stop the pipeline (and the engine process)."""
        if self._closed:
            return
        self._closed = True
        await self.stop_restarting()
        await self._healer.close()
        await self._draft_healer.close()
        engine_ids = tuple(self._collectors)
        for engine_id in engine_ids:
            self._engine_ids.pop(self._collectors[engine_id].request_id, None)
            self._finish_aborted(engine_id)
        if self._running is not None:
            with contextlib.suppress(Exception):
                await self._running.send("aborts", AbortRequests(engine_ids))
            await self._running.stop(graceful=False)
        for task in (self._dispatcher, self._abort_sender):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for collector in self._collectors.values():
            collector.fail(PipelineClosedError("the engine was closed"))

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def failure(self) -> BaseException | None:
        """Why the engine stopped working (an EngineDeadError, ...); None while it works.
        With ``restart_engine`` it is set while a fresh engine starts, and None again once
        that one serves; an :class:`EngineCrashLoopError` once the engine is given up."""
        return self._failure

    @property
    def restarting(self) -> bool:
        """Whether a fresh engine is being started in place of a dead one."""
        return self._restarting is not None

    def add_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` each time the engine stops serving (on the engine's
        loop): ``error`` is the :class:`EngineDeadError` (:attr:`restarting` says whether a
        fresh engine follows), or :class:`EngineCrashLoopError` when the engine is given
        up. Called at once if the engine has failed already."""
        self._failure_callbacks.append(callback)
        if self._failure is not None:
            callback(self._failure)

    def add_restart_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` each time a fresh engine serves in place of a dead one."""
        self._restart_callbacks.append(callback)

    @property
    def replica_restarts(self) -> dict[str, int]:
        """Times each engine replica was restarted on its own (data parallelism with
        ``restart_engine``), by replica name."""
        return dict(self._healer.restarts)

    @property
    def draft_restarts(self) -> dict[str, int]:
        """Times each draft host placed apart was restarted (docs/speculative.md), by its
        draft stage's name (``draft``, ``draft_1``, ...)."""
        return dict(self._draft_healer.restarts)

    def add_replica_restart_callback(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(replica)`` each time an engine replica restarted on its own
        serves again (data parallelism with ``restart_engine``)."""
        self._replica_restart_callbacks.append(callback)

    def add_replica_callback(self, callback: Callable[[ReplicaLost], None]) -> None:
        """Call ``callback(lost)`` for every engine replica lost from now on (data
        parallelism), in this engine generation and the ones after a restart."""
        self._replica_callbacks.append(callback)
        if self._running is not None:
            self._running.add_replica_callback(_engine_replicas_only(callback))

    @property
    def replicas(self) -> list[ReplicaStatus]:
        """The engine replicas (data parallelism), each with its failure once it is lost;
        empty with one engine. The engine serves while one replica lives. (A draft host
        placed apart is an expendable replica set of its own, not listed here.)"""
        if self._running is None:
            return []
        return [status for status in self._running.replicas() if status.replica_set == REPLICA_SET]

    @property
    def num_unfinished_requests(self) -> int:
        """Requests of this engine whose stream has not ended yet."""
        return len(self._collectors)

    @property
    def running(self) -> RunningPipeline:
        """The running pipeline (for statistics and advanced use)."""
        if self._running is None:
            raise PipelineClosedError("the engine is not started")
        return self._running

    # -- requests -------------------------------------------------------------------------------

    def check(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str = "",
        chat_template: bool = False,
        tools: ToolUse | None = None,
        rendering: ChatRendering | None = None,
        lora_request: LoRARequest | None = None,
    ) -> CheckedPrompt:
        """``prompt`` and ``sampling_params`` checked by the validation core, as
        :meth:`generate` checks them, for a front end that checks a batch before any of it
        starts (``LLM.generate``, an HTTP request's choices): :meth:`generate` takes the
        result without checking again. ``request_id`` is only named by an error;
        ``lora_request``: as :meth:`generate`'s.

        Raises:
            InvalidRequestError: a bad prompt or sampling parameter (the field is named);
                LoRAAdapterError, an adapter that cannot be served.
        """
        info = self.info
        checked = check_prompt(
            prompt,
            sampling_params,
            tenant=tenant,
            chat_template=chat_template,
            vocab_size=info.vocab_size if info is not None else None,
            request_id=request_id,
            tools=tools,
            rendering=rendering,
        )
        if lora_request is None:
            return checked
        lora = self._check_lora(lora_request, request_id)
        return CheckedPrompt(dataclasses.replace(checked.request, lora=lora), checked.vocab_size)

    def _check_lora(self, lora_request: object, request_id: str | None) -> LoRARequest:
        """The request's adapter checked against the engine's model (stages.lora).

        Raises:
            LoRAAdapterError: naming what is wrong.
        """
        info = self.info
        try:
            return self._lora.check(
                lora_request,
                info.lora_targets if info is not None else (),
                info.lora_layers if info is not None else 0,
            )
        except LoRAAdapterError as exc:
            exc.request_id = request_id
            raise

    async def generate(
        self,
        prompt: Prompt | CheckedPrompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str = "",
        chat_template: bool = False,
        tools: ToolUse | None = None,
        rendering: ChatRendering | None = None,
        parent: tuple[str, int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Generate for one prompt, yielding outputs as tokens arrive (the last one has a
        ``finish_reason``).

        ``prompt``: a string (``chat_template=True`` wraps it as a user message), a list of
        chat messages, a list of token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``; or a :class:`~pipeline.engine.prompts.CheckedPrompt`
        from :meth:`check`, which carries its parameters, tenant and chat-template flag (then
        give none of them here) and is not checked again. ``tools``: the functions a chat may
        call, the tool choice and whether calls may be parallel
        (:class:`~stages.tools.ToolUse`; the output's ``tool_calls`` then holds the calls
        parsed from it). ``rendering``: how the chat template renders a chat
        (:class:`~stages.messages.ChatRendering`: a template of its own, its variables,
        ``add_generation_prompt``, ``continue_final_message``; None: the model's template
        with the generation prompt). ``parent``: ``(parent_id, n)`` when this request is
        one of the ``n`` choices of the caller's request ``parent_id`` (an HTTP request's
        ``n``), which metrics count once (:class:`~stages.messages.GenerateRequest`).
        ``lora_request``: serve it with this LoRA adapter (:class:`~stages.lora.LoRARequest`,
        vLLM's; with ``enable_lora``; docs/lora.md), checked against the model first.
        ``request_id``: a non-empty string, unique among this engine's running requests
        (default: a fresh uuid).

        Raises:
            InvalidRequestError: a bad prompt, sampling parameter or request id (the field is
                named).
            RateLimitedError, OverloadedError: refused by admission.
            EngineDeadError: the engine died (or is being restarted).
            WrongEventLoopError: called on another event loop than the engine's.
        """
        self._check_loop("generate")
        if request_id is None:
            request_id = engine_id = uuid.uuid4().hex
        else:
            request_id = check_request_id(request_id)
            engine_id = f"{request_id}#{next(self._incarnations)}"
        # NOTE: the one validation core of every front end (docs/architecture.md §7.1): a
        # value no stage or link could carry is refused here, naming its field, before it
        # can reach a stage; the error names the caller's id, not the pipeline's "<id>#<n>".
        info = self.info
        checked = as_checked(
            prompt,
            sampling_params,
            tenant=tenant,
            chat_template=chat_template,
            vocab_size=info.vocab_size if info is not None else None,
            request_id=request_id,
            tools=tools,
            rendering=rendering,
        )
        request = dataclasses.replace(
            checked.request, request_id=engine_id, arrival_time=time.time()
        )
        if lora_request is not None:
            lora = self._check_lora(lora_request, request_id)
            request = dataclasses.replace(request, lora=lora)
        if parent is not None:
            parent_id, n = _check_parent(parent, request_id)
            request = dataclasses.replace(request, parent_id=parent_id, n=n)
        running = self._check_usable()
        if request_id in self._engine_ids:
            raise InvalidRequestError(
                f"request id {request_id!r} is already running",
                field="request_id",
                request_id=request_id,
            )
        collector = OutputCollector(request_id, stop_strings=bool(request.params.stop))
        self._collectors[engine_id] = collector
        self._engine_ids[request_id] = engine_id
        finished = False
        try:
            if self._observers:
                self._notify(lambda observer: observer.request_sent(request))
            await running.send("requests", request)
            while True:
                output = await collector.get()
                finished = output.finish_reason is not None
                yield output
                if finished:
                    return
        except PipelineError as exc:
            raise self._engine_error(exc) from exc
        finally:
            self._collectors.pop(engine_id, None)
            self._forget(request_id, engine_id)
            self._stream_ended(engine_id, collector, finished)

    def _stream_ended(self, engine_id: str, collector: OutputCollector, finished: bool) -> None:
        """The caller's stream of ``engine_id`` ended: abort the request unless it finished
        or failed, tell the observers.

        NOTE: a refused request's error is on its way to the caller, with a traceback through
        ``generate``'s frame and the collector's: the collector lets go of it here (and no
        local of ``generate`` holds it), or every refused request would be a reference cycle
        (error, traceback, frame, collector, error) that only the cycle collector frees.
        """
        error, collector.error = collector.error, None
        if not finished and not self._closed and error is None:
            self._abort_queue.put_nowait(engine_id)
        for observer in self._observers:
            try:
                observer.request_ended(engine_id, error)
            except Exception:
                logger.exception("engine observer %r failed", observer)

    def check_embedding(
        self,
        prompt: Prompt,
        pooling_params: PoolingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str = "",
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> CheckedPrompt:
        """``prompt`` checked as an embedding request (:func:`~pipeline.engine.embeddings.
        check_embedding`), for :meth:`embed` or :meth:`generate`.

        Raises:
            InvalidRequestError: a bad prompt or pooling parameter (the field is named).
        """
        return check_embedding(
            self, prompt, pooling_params, request_id=request_id, tenant=tenant,
            truncate_prompt_tokens=truncate_prompt_tokens, priority=priority,
        )  # fmt: skip

    async def embed(
        self,
        prompt: Prompt | CheckedPrompt,
        pooling_params: PoolingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str = "",
        truncate_prompt_tokens: int | None = None,
    ) -> EmbeddingRequestOutput:
        """The embedding of one prompt (vLLM's ``embed``), batched with whatever else runs:
        :func:`~pipeline.engine.embeddings.embed` (docs/serving.md, "Embeddings").

        Raises: as :meth:`generate`; InvalidRequestError also for ``dimensions`` the model
        does not allow, or an engine that computes no embeddings (the null model).
        """
        return await embed(
            self, prompt, pooling_params, request_id=request_id, tenant=tenant,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )  # fmt: skip

    async def abort(self, request_id: str) -> bool:
        """Abort a running request: its stream ends with ``finish_reason="abort"`` and its KV
        blocks are freed. Returns False (and does nothing) for an unknown or finished id,
        including one whose last output has arrived but was not read yet.

        The final output's text is all the request generated: with stop strings, the text
        stop-check held back as a possible start of one is delivered too (as at every
        finish), so that stream ends once the pipeline's final output arrives; any other
        stream ends at once. The id is free for a new request as soon as this returns.

        Raises:
            EngineDeadError: the engine died (or is being restarted).
            WrongEventLoopError: called on another event loop than the engine's.
        """
        self._check_loop("abort")
        self._check_usable()
        engine_id = self._engine_ids.pop(request_id, None)
        collector = self._collectors.get(engine_id) if engine_id is not None else None
        if engine_id is None or collector is None:
            return False
        # NOTE: stop-check answers an abort of a request it has sent an output for with the
        # final "abort" output, held-back text included (StopCheckStage.on_abort). Once an
        # output of the request has arrived here, that answer will come: stop-check has the
        # request, and the abort reaches it after that output (or the request has finished
        # there, and its final output comes instead). Before any output nothing is held.
        if collector.stop_strings and collector.last is not None:
            collector.aborting = True
        else:
            self._finish_aborted(engine_id)
        self._abort_queue.put_nowait(engine_id)
        return True

    def _finish_aborted(self, engine_id: str) -> None:
        """End the stream of the request ``engine_id`` (its id in the pipeline) at once with
        an "abort" output carrying what the caller has received; nothing if it has ended."""
        collector = self._collectors.pop(engine_id, None)
        if collector is None:
            return
        last = collector.last
        aborted = RequestOutput(
            engine_id,
            last.text if last else "",
            "",
            last.token_ids if last else (),
            "abort",
            None,
            last.logprobs if last else None,
            last.num_prompt_tokens if last else 0,
            last.num_cached_tokens if last else 0,
            prompt_token_ids=last.prompt_token_ids if last else None,
            prompt_logprobs=last.prompt_logprobs if last else None,
        )
        if self._observers:
            self._notify(lambda observer: observer.output_received(aborted))
        collector.put(aborted)

    def _check_loop(self, method: str) -> None:
        """Raise WrongEventLoopError unless called on the loop the engine started on: its
        futures and tasks belong to that loop, and another would wait on them for ever."""
        loop = self._loop
        if loop is not None and asyncio.get_running_loop() is not loop:
            raise WrongEventLoopError(
                f"AsyncEngine.{method}() was called on another event loop than the one the "
                f"engine started on (thread {threading.current_thread().name!r}): an "
                "AsyncEngine is bound to its loop; call it there (e.g. "
                "asyncio.run_coroutine_threadsafe(coroutine, loop)), or use LLM from threads"
            )

    def _check_usable(self) -> RunningPipeline:
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        if self._running is None or self._closed:
            raise PipelineClosedError("the engine is not running; use 'async with' or start()")
        return self._running

    # -- observers ------------------------------------------------------------------------------

    def add_observer(self, observer: EngineObserver) -> None:
        """Call ``observer``'s hooks for every request from now on (see
        :class:`EngineObserver`)."""
        if observer not in self._observers:
            self._observers = (*self._observers, observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        """Stop calling ``observer`` (ignored if it is not attached)."""
        self._observers = tuple(known for known in self._observers if known is not observer)

    def _notify(self, hook: Callable[[EngineObserver], None]) -> None:
        for observer in self._observers:
            try:
                hook(observer)
            except Exception:
                logger.exception("engine observer %r failed", observer)

    def _notify_batch(self, batch: RequestOutputs) -> None:
        for observer in self._observers:
            try:
                if batch.stats is not None:
                    observer.stats_received(batch.stats)
                for output in batch.outputs:
                    observer.output_received(output)
                for rejected in batch.rejected:
                    observer.request_rejected(rejected)
            except Exception:
                logger.exception("engine observer %r failed", observer)

    # -- internals ------------------------------------------------------------------------------

    async def _dispatch(self, running: RunningPipeline) -> None:
        channel = running.exit_channel("outputs")
        collectors = self._collectors
        with contextlib.suppress(Exception):  # the pipeline's failure is handled in _on_failure
            while True:
                batch = await channel.receive()
                if not isinstance(batch, RequestOutputs):
                    continue
                if batch.stats is not None:
                    self._record_stats(batch.stats)
                if self._observers:
                    self._notify_batch(batch)
                for output in batch.outputs:
                    collector = collectors.get(output.request_id)
                    if collector is not None:
                        collector.put(output)
                        if output.finish_reason is not None:
                            del collectors[output.request_id]
                            self._forget(collector.request_id, output.request_id)
                for rejected in batch.rejected:
                    collector = collectors.pop(rejected.request_id, None)
                    if collector is not None:
                        self._forget(collector.request_id, rejected.request_id)
                        if rejected.kind == ENGINE_DEAD:  # its replica died; others serve
                            collector.fail(EngineDeadError.replica_lost(rejected.message))
                            continue
                        collector.fail(
                            error_from_kind(
                                rejected.kind,
                                rejected.message,
                                field=rejected.field,
                                request_id=collector.request_id,
                                retry_after=rejected.retry_after,
                            )
                        )

    def _record_stats(self, stats: EngineStats) -> None:
        if not stats.replica:
            self.stats = stats
            return
        self.replica_stats[stats.replica] = stats
        self.stats = _summed(tuple(self.replica_stats.values()), stats)

    def _on_replica_lost(self, lost: ReplicaLost) -> None:
        if lost.replica_set != REPLICA_SET:
            # a draft host: its execute stage logs it and decodes on without drafts until
            # its fresh host drafts again (docs/speculative.md)
            if not self._closed:
                self._draft_healer.lost(lost)
            return
        logger.error(
            "engine replica %s failed (%s: %s); the others serve on",
            lost.replica,
            lost.error_type,
            lost.message,
        )
        self.replica_stats.pop(lost.replica, None)
        if self.replica_stats:
            latest = next(reversed(self.replica_stats.values()))
            self.stats = _summed(tuple(self.replica_stats.values()), latest)
        if self.options.restart_engine and not self._closed:
            self._healer.lost(lost)

    def _on_replica_restored(self, replica: str) -> None:
        for callback in self._replica_restart_callbacks:
            try:
                callback(replica)
            except Exception:
                logger.exception("engine replica restart callback %r failed", callback)

    def _forget(self, request_id: str, engine_id: str) -> None:
        """Drop the caller's ``request_id`` if it still names ``engine_id``."""
        if self._engine_ids.get(request_id) == engine_id:
            del self._engine_ids[request_id]

    async def _send_aborts(self, running: RunningPipeline) -> None:
        while True:
            ids = [await self._abort_queue.get()]
            while not self._abort_queue.empty():
                ids.append(self._abort_queue.get_nowait())
            try:
                await running.send("aborts", AbortRequests(tuple(ids)))
            except PipelineError:
                return

    def _engine_error(self, error: BaseException) -> BaseException:
        if isinstance(error, (EngineDeadError, RequestError, PipelineClosedError)):
            return error
        if isinstance(error, HostUnresponsiveError):  # alive, frozen: not "died"
            dead = EngineDeadError(
                error.host,
                None,
                "the engine was shut down",
                unresponsive=True,
                unresponsive_for=error.seconds,
            )
        elif isinstance(error, HostDiedError):
            dead = EngineDeadError(error.host, error.exitcode)
        elif isinstance(error, StageFailedError):  # the host lives; a stage on it raised
            dead = EngineDeadError(error.host, None, str(error), failed=True)
        else:
            dead = EngineDeadError(ENGINE_HOST, None, str(error))
        dead.__cause__ = error
        return dead

    def _on_failure(self, running: RunningPipeline, error: BaseException) -> None:
        """The pipeline ``running`` failed: fail every running request, tell the listeners,
        and with ``restart_engine`` start a fresh one (docs/architecture.md §4.7)."""
        if running is not self._running:
            return  # a dead generation's late news
        dead = self._engine_error(error)
        self._failure = dead
        # NOTE: the pipeline has logged the failure already (one line, at ERROR)
        logger.debug("engine failed: %s", error)
        if self._collectors:
            ids = [collector.request_id for collector in self._collectors.values()]
            shown = ", ".join(ids[:_IDS_LOGGED]) + (
                f" and {len(ids) - _IDS_LOGGED} more" if len(ids) > _IDS_LOGGED else ""
            )
            logger.warning("the engine ended with %d request(s) in flight: %s", len(ids), shown)
        for collector in self._collectors.values():
            collector.fail(dead)
        self._collectors.clear()
        self._engine_ids.clear()
        self._healer.cancel()
        self._draft_healer.cancel()
        if self.options.restart_engine and not self._closed:
            self._schedule_restart(running, dead)
        self._tell_failure(self._failure)

    def _schedule_restart(self, running: RunningPipeline, dead: BaseException) -> None:
        """Count the death; start the restart task, or give up in a crash loop (nothing
        once :meth:`stop_restarting` was called)."""
        if self._restarts_stopped:
            return
        delay = self._restart_policy.died(time.monotonic())
        if delay is None:
            policy = self._restart_policy
            self._failure = EngineCrashLoopError(policy.recent, policy.window, str(dead))
            logger.error("%s", self._failure)
            return
        # NOTE: what new calls get meanwhile (/health's 503 shows it): the death, and that a
        # fresh engine is coming; the requests that were running got the death alone
        waiting = copy.copy(dead)
        waiting.args = (f"{dead}; the engine is restarting",)
        self._failure = waiting
        policy = self._restart_policy
        logger.warning(
            "restarting the engine in %.3g s (%d death(s) within %g s; %d give up)",
            delay,
            policy.recent,
            policy.window,
            policy.limit,
        )
        self._restarting = self._tasks.spawn(self._restart(running, delay), name="engine:restart")

    async def _restart(self, dead: RunningPipeline, delay: float) -> None:
        """Stop the dead generation, wait ``delay``, start a fresh one and serve from it; a
        start that fails counts as another death."""
        died = time.monotonic()
        for task in (self._dispatcher, self._abort_sender):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await dead.stop(graceful=False)
        await asyncio.sleep(max(0.0, died + delay - time.monotonic()))
        try:
            running, info = await self._launch()
        except Exception as exc:
            self._restarting = None
            logger.error("the engine did not restart: %s: %s", type(exc).__name__, exc)
            self._failure = self._engine_error(exc)
            self._schedule_restart(dead, self._failure)
            self._tell_failure(self._failure)
            return
        self._restarting = None
        self.restarts += 1
        logger.warning(
            "the engine serves again (restart %d, %.1f s after it failed)",
            self.restarts,
            time.monotonic() - died,
        )
        self._adopt(running, info)
        if self._running is running and self._failure is None:
            for callback in self._restart_callbacks:
                try:
                    callback()
                except Exception:
                    logger.exception("engine restart callback %r failed", callback)

    def _tell_failure(self, error: BaseException) -> None:
        for callback in self._failure_callbacks:
            try:
                callback(error)
            except Exception:
                logger.exception("engine failure callback %r failed", callback)


#: request ids named in the log line of an engine's death, at most
_IDS_LOGGED = 8


#: what the engine sends into and reads from a pipeline
_ENGINE_ENTRIES = ("requests", "aborts")
_ENGINE_EXITS = ("outputs", "engine_info")


def _check_engine_boundary(pipeline: Pipeline) -> None:
    """Raise GraphError unless ``pipeline`` has the entries and exits the engine uses."""
    missing = [f"entry {name!r}" for name in _ENGINE_ENTRIES if name not in pipeline.entries]
    missing += [f"exit {name!r}" for name in _ENGINE_EXITS if name not in pipeline.exits]
    if missing:
        raise GraphError(
            f"pipeline {pipeline.name!r} lacks {', '.join(missing)}: an AsyncEngine needs the "
            f"entries {list(_ENGINE_ENTRIES)} and exits {list(_ENGINE_EXITS)} of the default "
            f"LLM pipeline (it has entries {pipeline.entries}, exits {pipeline.exits})"
        )


def _warn_of_few_threads_on_ray(options: EngineOptions) -> None:
    """Say so when the engine hosts on Ray reserve too few CPUs to compute on more than one
    thread while the cluster's nodes have more: Ray sets an actor's ``OMP_NUM_THREADS`` to the
    CPUs it reserves (one for ``ray_num_cpus`` under 2), and on 2 cores one thread ran the
    default model at 0.67x a local engine (docs/performance.md §10). Tensor-parallel ranks set
    their own threads and are left out."""
    from pipeline.runtime.ray_hosts import largest_node_cpus

    threads = max(1, int(options.ray_num_cpus))
    if options.tensor_parallel_size > 1 or options.null_model or threads > 1:
        return
    cpus = largest_node_cpus()
    if cpus > threads:
        logger.warning(
            "each engine host on Ray reserves %g CPU (ray_num_cpus), and Ray gives an actor as "
            "many OpenMP threads as CPUs it reserves: the model computes on %d thread while "
            "the cluster's nodes have up to %g CPUs; reserve more with ray_num_cpus / "
            "--ray-num-cpus",
            options.ray_num_cpus,
            threads,
            cpus,
        )


def _summed(replicas: tuple[EngineStats, ...], latest: EngineStats) -> EngineStats:
    """The engine's stats over its live replicas: gauges and counters summed, the step
    timings of the replica that reported ``latest``."""
    return dataclasses.replace(
        latest,
        num_running=sum(s.num_running for s in replicas),
        num_waiting=sum(s.num_waiting for s in replicas),
        kv_blocks_total=sum(s.kv_blocks_total for s in replicas),
        kv_blocks_free=sum(s.kv_blocks_free for s in replicas),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in replicas),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in replicas),
        num_preemptions=sum(s.num_preemptions for s in replicas),
        num_steps=sum(s.num_steps for s in replicas),
        communication_seconds=sum(s.communication_seconds for s in replicas),
        pipeline_answer_bytes=sum(s.pipeline_answer_bytes for s in replicas),
        replica="",
        spec_num_drafts=sum(s.spec_num_drafts for s in replicas),
        spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in replicas),
        spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in replicas),
        spec_num_drafts_dropped=sum(s.spec_num_drafts_dropped for s in replicas),
        spec_accepted_per_position=tuple(
            map(
                sum,
                itertools.zip_longest(
                    *(s.spec_accepted_per_position for s in replicas), fillvalue=0
                ),
            )
        ),
    )


def _preflight(options: EngineOptions) -> None:
    """Resolve the model, check it splits over ``tensor_parallel_size`` ranks, construct the
    scheduling and routing policies, raising their typed errors."""
    from stages.models import resolve_model
    from stages.policies import load_policy

    resolve_model(options.model)
    load_policy(options.scheduler)
    check_parallelism(options)


def _check_parent(parent: object, request_id: str) -> tuple[str, int]:
    """``generate``'s ``parent``: a (non-empty id, n >= 1) pair.

    Raises:
        InvalidRequestError: naming ``parent``.
    """
    if (
        isinstance(parent, tuple)
        and len(parent) == 2
        and isinstance(parent[0], str)
        and type(parent[1]) is int
        and parent[1] >= 1
    ):
        check_text(
            "parent",
            parent[0],
            allow_empty=False,
            max_length=MAX_REQUEST_ID_LENGTH,
            request_id=request_id,
        )
        return parent[0], parent[1]
    raise InvalidRequestError(
        f"parent must be a (request id, n >= 1) pair, got {parent!r:.60}",
        field="parent",
        request_id=request_id,
    )


def _no_callback(name: str) -> None:
    """Nothing to tell when a draft host runs again (its execute stage hears it)."""


def _engine_replicas_only(
    callback: Callable[[ReplicaLost], None],
) -> Callable[[ReplicaLost], None]:
    """``callback`` called for lost engine replicas only (not a draft host placed apart,
    docs/speculative.md, whose loss costs drafts, not requests)."""

    def call(lost: ReplicaLost) -> None:
        if lost.replica_set == REPLICA_SET:
            callback(lost)

    return call
