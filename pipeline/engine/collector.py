"""The outputs of one running request of :class:`~pipeline.engine.async_engine.AsyncEngine`,
waiting for the caller who reads them."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from stages.messages import Logprobs, RequestMetrics, RequestOutput

__all__ = ["OutputCollector", "with_metrics"]


class OutputCollector:
    """The outputs of one request waiting for its consumer; merges when the consumer lags
    (vLLM's RequestOutputCollector does the same)."""

    __slots__ = (
        "aborting",
        "arrival",
        "arrival_wall",
        "error",
        "first_token",
        "last",
        "metrics",
        "pending",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "stop_strings",
        "waiter",
    )

    def __init__(self, request_id: str, stop_strings: bool = False) -> None:
        self.request_id = request_id  # the caller's id (outputs carry it)
        # With stop strings, stop-check may hold text back; an abort then waits for the
        # pipeline's final output, which carries it (see AsyncEngine.abort).
        self.stop_strings = stop_strings
        self.aborting = False
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.arrival = time.monotonic()
        self.arrival_wall = time.time()
        self.first_token: float | None = None
        self.last: RequestOutput | None = None
        # NOTE: the metrics of a running request change only at its first token and at its
        # end, so one object serves every output in between (outputs are immutable).
        self.metrics: RequestMetrics | None = None
        #: the prompt's token ids, from the first output that carries them (stop-check's)
        self.prompt_token_ids: tuple[int, ...] | None = None
        #: the prompt's scores, from the output that carries them (the first token's)
        self.prompt_logprobs: tuple[Logprobs | None, ...] | None = None

    def put(self, output: RequestOutput) -> None:
        if self.aborting and output.finish_reason not in (None, "abort"):
            # The request finished on its own before the abort reached stop-check: the
            # caller asked to abort, so the stream ends as aborted (vLLM's output processor
            # drops what arrives for a request after its abort, too); the text is complete.
            output = dataclasses.replace(output, finish_reason="abort", stop_reason=None)
        now = time.monotonic()
        metrics = self.metrics
        if self.first_token is None and output.token_ids:
            self.first_token = now
            metrics = None
        finished = output.finish_reason is not None
        if metrics is None or finished:
            metrics = RequestMetrics(
                self.arrival_wall,
                None if self.first_token is None else self.first_token - self.arrival,
                now - self.arrival if finished else None,
            )
            self.metrics = metrics
        pending = self.pending
        if pending is None:
            delta, times = output.delta, output.scheduler_times
        else:  # merged: the first token's scheduler times stay on the output that has it
            delta = pending.delta + output.delta
            times = output.scheduler_times or pending.scheduler_times
        if output.prompt_token_ids is not None:
            self.prompt_token_ids = output.prompt_token_ids
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        output = with_metrics(
            output, self.request_id, delta, metrics, times,
            self.prompt_token_ids, self.prompt_logprobs,
        )  # fmt: skip
        self.pending = self.last = output
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while self.pending is None:
            if self.error is not None:
                # NOTE: an engine failure is one error for every request: raised afresh, its
                # traceback does not grow by each request's frames (and hold them all)
                raise self.error.with_traceback(None)
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        output, self.pending = self.pending, None
        return output


def with_metrics(
    output: RequestOutput,
    request_id: str,
    delta: str,
    metrics: RequestMetrics,
    scheduler_times: tuple[float, float, str] | None = None,
    prompt_token_ids: tuple[int, ...] | None = None,
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None,
) -> RequestOutput:
    """``output`` with ``request_id``, ``delta``, ``metrics``, ``scheduler_times``,
    ``prompt_token_ids`` and ``prompt_logprobs`` replaced.

    NOTE: calls the constructor with every field of RequestOutput, in order: half the cost of
    ``dataclasses.replace``, which runs once per token per stream. A new RequestOutput field
    must be added here too.
    """
    return RequestOutput(
        request_id,
        output.text,
        delta,
        output.token_ids,
        output.finish_reason,
        output.stop_reason,
        output.logprobs,
        output.num_prompt_tokens,
        output.num_cached_tokens,
        metrics,
        scheduler_times,
        output.reasoning,
        output.tool_calls,
        prompt_token_ids,
        prompt_logprobs,
        output.embedding,
    )
