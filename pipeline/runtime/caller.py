"""Request/response calls over a pipeline's entry and exit, correlated by a key.

A :class:`Caller` sends a request into an entry and routes what arrives at an exit back to the
call it belongs to (by ``key(message)``), until ``done(message)``. If the pipeline fails,
every pending call raises the failure.

One dispatcher task reads the exit and never waits on a call: each call buffers up to
``capacity`` answers its caller has not read yet; a call whose caller falls further behind
fails alone with :class:`~pipeline.runtime.errors.CallOverflowError` (and its ``on_cancel``
runs), so one slow consumer cannot stall the others. An answer whose ``key`` (or a message whose
``split``) raises is logged and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable
from typing import Any

from pipeline.runtime.errors import CallOverflowError, PipelineClosedError
from pipeline.runtime.running import RunningPipeline
from transports.errors import EndOfStream, LinkClosedError
from transports.memory import MemoryChannel, WouldBlock
from transports.tasks import TaskSet

__all__ = ["Caller"]

logger = logging.getLogger("actorline.caller")


class Caller:
    """Calls through ``entry`` whose answers arrive at ``exit``.

    ``key(message)`` correlates requests and answers; ``done(answer)`` marks a call's last
    answer; ``split(message)`` (optional) unpacks a batch arriving at the exit into answers;
    ``on_cancel(key)`` runs when a caller abandons a call before its last answer (also when
    the call overflowed). ``capacity``: answers buffered per call, unread by its caller.
    """

    def __init__(
        self,
        running: RunningPipeline,
        entry: str,
        exit: str,
        *,
        key: Callable[[Any], Hashable],
        done: Callable[[Any], bool] = lambda message: True,
        split: Callable[[Any], Iterable[Any]] | None = None,
        on_cancel: Callable[[Hashable], Awaitable[None]] | None = None,
        capacity: int = 4096,
    ) -> None:
        self.running = running
        self.entry = entry
        self.exit = exit
        self._key = key
        self._done = done
        self._split = split
        self._on_cancel = on_cancel
        self._capacity = capacity
        self._pending: dict[Hashable, MemoryChannel[Any]] = {}
        self._dispatcher: asyncio.Task[None] | None = None
        self._tasks = TaskSet(f"caller of {exit!r}")  # the dispatcher
        self._error: BaseException | None = None

    async def stream(self, request: object) -> AsyncIterator[Any]:
        """Send ``request`` and yield its answers until the last one.

        Raises:
            PipelineError: the pipeline failed or closed before the last answer.
        """
        if self._error is not None:
            raise self._error
        call_key = self._key(request)
        if call_key in self._pending:
            raise ValueError(f"a call with key {call_key!r} is already pending")
        channel: MemoryChannel[Any] = MemoryChannel(self._capacity, name=f"call:{call_key}")
        self._pending[call_key] = channel
        self._ensure_dispatcher()
        finished = False
        try:
            await self.running.send(self.entry, request)
            while True:
                try:
                    answer = await channel.receive()
                except EndOfStream:
                    raise self._error or PipelineClosedError("the pipeline closed") from None
                yield answer
                if self._done(answer):
                    finished = True
                    return
        finally:
            if self._pending.get(call_key) is channel:
                del self._pending[call_key]
            if not finished and self._on_cancel is not None and self._error is None:
                with contextlib.suppress(Exception):
                    await self._on_cancel(call_key)

    async def call(self, request: object) -> Any:
        """Send ``request`` and return its last answer."""
        last = None
        async for answer in self.stream(request):
            last = answer
        return last

    def _ensure_dispatcher(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = self._tasks.spawn(self._dispatch(), name=f"caller:{self.exit}")

    async def _dispatch(self) -> None:
        exit_channel = self.running.exit_channel(self.exit)
        split = self._split
        try:
            while True:
                message = await exit_channel.receive()
                if split is None:
                    self._route(message)
                    continue
                try:
                    answers = list(split(message))
                except Exception:
                    logger.exception("dropping a message at exit %r: split raised", self.exit)
                    continue
                for answer in answers:
                    self._route(answer)
        except (EndOfStream, LinkClosedError):
            self._close_all(self.running.failure or PipelineClosedError("the pipeline closed"))
        except Exception as exc:  # the pipeline's failure
            self._close_all(exc)

    def _route(self, answer: Any) -> None:
        """Hand ``answer`` to its call without waiting (the dispatcher serves every call)."""
        try:
            call_key = self._key(answer)
        except Exception:
            logger.exception("dropping an answer at exit %r: key raised", self.exit)
            return
        channel = self._pending.get(call_key)
        if channel is None:
            logger.debug("dropping an answer for no pending call: %r", call_key)
            return
        try:
            channel.send_nowait(answer)
        except WouldBlock:
            # NOTE: the caller reads what is buffered, then gets the error; later answers
            # of this call find no pending call and are dropped.
            logger.warning("call %r fell %d answers behind; failing it", call_key, self._capacity)
            del self._pending[call_key]
            channel.fail(
                CallOverflowError(
                    f"call {call_key!r}: more than {self._capacity} answers were not read in time"
                )
            )

    def _close_all(self, error: BaseException) -> None:
        self._error = error
        for channel in self._pending.values():
            channel.fail(error)

    async def aclose(self) -> None:
        """Stop dispatching; pending calls raise PipelineClosedError."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(BaseException):
                await self._dispatcher
        self._close_all(PipelineClosedError("the caller was closed"))
