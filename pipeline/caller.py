"""Request/response calls over a pipeline's entry and exit, correlated by a key.

A :class:`Caller` sends a request into an entry and routes what arrives at an exit back to the
call it belongs to (by ``key(message)``), until ``done(message)``. If the pipeline fails,
every pending call raises the failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable
from typing import Any

from pipeline.errors import PipelineClosedError
from pipeline.runtime import RunningPipeline
from transports.errors import EndOfStream, LinkClosedError
from transports.memory import MemoryChannel

__all__ = ["Caller"]

logger = logging.getLogger("actorline.caller")


class Caller:
    """Calls through ``entry`` whose answers arrive at ``exit``.

    ``key(message)`` correlates requests and answers; ``done(answer)`` marks a call's last
    answer; ``split(message)`` (optional) unpacks a batch arriving at the exit into answers;
    ``on_cancel(key)`` runs when a caller abandons a call before its last answer.
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
            self._pending.pop(call_key, None)
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
            self._dispatcher = asyncio.get_running_loop().create_task(
                self._dispatch(), name=f"caller:{self.exit}"
            )

    async def _dispatch(self) -> None:
        exit_channel = self.running.exit_channel(self.exit)
        key, split, pending = self._key, self._split, self._pending
        try:
            while True:
                message = await exit_channel.receive()
                answers = split(message) if split is not None else (message,)
                for answer in answers:
                    channel = pending.get(key(answer))
                    if channel is None:
                        logger.debug("dropping an answer for no pending call: %r", key(answer))
                        continue
                    await channel.send(answer)
        except (EndOfStream, LinkClosedError):
            self._close_all(self.running.failure or PipelineClosedError("the pipeline closed"))
        except Exception as exc:  # the pipeline's failure
            self._close_all(exc)

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
