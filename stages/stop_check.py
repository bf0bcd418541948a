"""The stop-check stage: stop strings, and the final shape of every output.

It cuts a matched stop string from the text (unless ``include_stop_str_in_output``), holds
back text that could be the start of a stop string while streaming, honours ``min_tokens``,
flushes held-back text on every finish (an engine stop, length, and an abort from the
caller: docs/architecture.md §2.8), and sends an abort back to schedule when a stop string
ends a request, so its KV blocks are freed at once.

An abort of a request with stop strings that has had an output is answered with its final
``"abort"`` output, carrying the held-back text (vLLM's ``OutputProcessor.abort_requests``
makes the same final output from its detokenizer state, ``vllm/v1/engine/output_processor.py``);
:meth:`pipeline.engine.async_engine.AsyncEngine.abort` ends such a stream with it.

Ports: ``in`` takes EngineRequest (registration), TextOutputs, RequestRejected and
AbortRequests (from detokenize); ``out`` sends :class:`RequestOutputs` to the API; ``abort``
sends :class:`AbortRequests` to schedule.

A request that fails here (registering it, or checking its text in a batch) fails alone
(docs/architecture.md, "Failure: one request or the pipeline"): it is forgotten, answered
with a typed error, and aborted in the engine, as is a request that detokenize failed
(a :class:`RequestRejected` with ``abort`` set); the other requests of the batch go on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.runtime.stage import Stage, handles, recoverable
from stages.messages import (
    AbortRequests,
    EngineRequest,
    Logprobs,
    RequestOutput,
    RequestOutputs,
    RequestRejected,
    TextOutputs,
)
from stages.recovery import rejection, request_id_of
from stages.stop_checker import StopChecker

__all__ = ["StopCheckStage"]


class _Tracked:
    """What stop-check keeps per running request."""

    __slots__ = (
        "checker",
        "logprobs",
        "num_cached_tokens",
        "num_prompt_tokens",
        "prompt_logprobs",
        "prompt_token_ids",
        "text",
        "token_ids",
    )

    def __init__(self, request: EngineRequest) -> None:
        params = request.params
        # NOTE: without stop strings there is nothing to match or hold back (min_tokens only
        # delays stop strings; stop tokens are the scheduler's): the text streams as it comes.
        self.checker: StopChecker | None = (
            StopChecker(
                params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            if params.stop
            else None
        )
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        self.num_prompt_tokens = len(request.prompt_token_ids)
        # None first: the first prompt token has no score (as vLLM's RequestOutput); sent with
        # the output they arrive for only (None after it), as the ids below
        self.prompt_logprobs: tuple[Logprobs | None, ...] | None = None
        self.num_cached_tokens = 0
        # sent with the first output only (None after it): the caller's collector keeps them
        self.prompt_token_ids: tuple[int, ...] | None = request.prompt_token_ids

    def output(
        self,
        request_id: str,
        delta: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        scheduler_times: tuple[float, float, str] | None = None,
        embedding: np.ndarray | None = None,
    ) -> RequestOutput:
        """The request's output now, ``delta`` already added to its text."""
        prompt_token_ids, self.prompt_token_ids = self.prompt_token_ids, None
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return RequestOutput(
            request_id,
            self.text,
            delta,
            tuple(self.token_ids),
            finish_reason,
            stop_reason,
            tuple(self.logprobs) if self.logprobs is not None else None,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            None,
            scheduler_times,
            prompt_token_ids=prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            embedding=embedding,
        )


class StopCheckStage(Stage):
    inputs = ("in",)
    outputs = ("out", "abort")

    def __init__(self, config: object = None) -> None:
        super().__init__(config)
        self._requests: dict[str, _Tracked] = {}

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        self._requests[request.request_id] = _Tracked(request)

    @handles(TextOutputs)
    async def on_text(self, batch: TextOutputs) -> None:
        requests = self._requests
        replica = batch.stats.replica if batch.stats is not None else ""
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        failed: list[RequestRejected] = []
        for index, request_id in enumerate(batch.request_ids):
            tracked = requests.get(request_id)
            if tracked is None:
                continue
            try:
                tracked.token_ids.extend(batch.new_token_ids[index])
                if request_id in batch.num_cached_tokens:
                    tracked.num_cached_tokens = batch.num_cached_tokens[request_id]
                finish_reason = batch.finish_reasons[index]
                stop_reason: str | int | None = batch.stop_reasons[index]
                checker = tracked.checker
                if checker is None:
                    delta = batch.texts[index]
                else:
                    decision = checker.push(batch.texts[index], len(tracked.token_ids))
                    delta = decision.delta
                    if decision.stopped:
                        if finish_reason is None:
                            stopped.append(request_id)  # the engine still runs it: free its KV
                        finish_reason, stop_reason = "stop", decision.stop_reason
                    elif finish_reason is not None:
                        delta += checker.finish()
                tracked.text += delta
                if tracked.logprobs is not None:
                    tracked.logprobs.extend(batch.logprobs.get(request_id, ()))
                scores = batch.prompt_logprobs.get(request_id)
                if scores is not None:
                    tracked.prompt_logprobs = (None, *scores)
                times = batch.scheduler_times.get(request_id)
                outputs.append(
                    tracked.output(
                        request_id,
                        delta,
                        finish_reason,
                        stop_reason,
                        None if times is None else (*times, replica),
                        batch.embeddings.get(request_id),
                    )
                )
            except Exception as error:
                # NOTE: one request's failure is its own (docs/architecture.md, "Failure: one
                # request or the pipeline"): it ends with a typed error and is aborted in the
                # engine; the batch's other requests go on.
                if not recoverable(error):
                    raise
                self.contained(error, batch, request_id)
                del requests[request_id]
                failed.append(rejection(self.name, request_id, error, abort=True))
                continue
            if finish_reason is not None:
                del requests[request_id]
        if outputs or failed or batch.stats is not None:
            await self.emit("out", RequestOutputs(tuple(outputs), tuple(failed), stats=batch.stats))
        if stopped or failed:
            aborted = (*stopped, *(rejected.request_id for rejected in failed))
            await self.emit("abort", AbortRequests(aborted))

    @handles(RequestRejected)
    async def on_rejected(self, rejected: RequestRejected) -> None:
        self._requests.pop(rejected.request_id, None)
        await self.emit("out", RequestOutputs((), rejected=(rejected,)))
        if rejected.abort:  # it failed in detokenize after it entered the engine
            await self.emit("abort", AbortRequests((rejected.request_id,)))

    async def recover(self, message: Any, port: str, error: Exception) -> bool:
        """A request whose registration failed (its stop strings, say) is forgotten,
        answered, and aborted in the engine, which has it already. Failures on other
        messages (a batch, rejections, aborts) are this stage's own."""
        request_id = request_id_of(message)
        if request_id is None:
            return False
        self._requests.pop(request_id, None)
        await self.emit(
            "out", RequestOutputs((), rejected=(rejection(self.name, request_id, error),))
        )
        await self.emit("abort", AbortRequests((request_id,)))
        return True

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        outputs: list[RequestOutput] = []
        for request_id in abort.request_ids:
            tracked = self._requests.pop(request_id, None)
            # NOTE: only requests with stop strings that have had an output get a final
            # output here (the API waits for it exactly then); others hold nothing back and
            # the API ends their stream itself. An id stop-check no longer tracks (finished,
            # or its own stop-string abort coming back through detokenize) gets nothing.
            if tracked is None or tracked.checker is None or not tracked.token_ids:
                continue
            # The held-back text goes out as is: a complete stop string in it would have
            # stopped the request when it arrived (before min_tokens it did not count).
            delta = tracked.checker.finish()
            tracked.text += delta
            outputs.append(tracked.output(request_id, delta, "abort", None))
        if outputs:
            await self.emit("out", RequestOutputs(tuple(outputs)))
