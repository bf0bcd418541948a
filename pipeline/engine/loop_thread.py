"""An event loop running forever in a daemon thread: how the synchronous wrappers
(:class:`~pipeline.engine.llm.LLM`, :class:`~pipeline.server.client.Client`) run one async core
instead of being second implementations."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from pipeline.runtime.errors import PipelineClosedError
from transports.tasks import TaskSet

__all__ = ["LoopThread"]

T = TypeVar("T")

#: how long an interrupted call waits for its cancelled coroutine to unwind
_UNWIND_TIMEOUT = 10.0


class LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.stopped = False
        self._tasks = TaskSet("loop thread")  # the calls running on the loop
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="actorline-llm-loop", daemon=True
        )
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and wait for its result. If the wait is interrupted
        (Ctrl-C in the calling thread), the coroutine is cancelled and allowed to unwind
        (its ``finally`` blocks abort what it started) before the interruption goes on --
        also when the interruption lands while the call is being handed to the loop.

        Raises:
            PipelineClosedError: the loop was stopped (``coroutine`` is closed, not run).
        """
        if self.stopped:  # the owner was closed: nothing would run the coroutine
            coroutine.close()
            raise PipelineClosedError("the event loop thread is stopped")
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        unwound = threading.Event()
        state: dict[str, Any] = {}  # "task" once submitted, "started" once its body runs

        async def guarded() -> T:
            state["started"] = True
            try:
                return await coroutine
            finally:
                unwound.set()

        def submit() -> None:
            task = self._tasks.spawn(guarded(), name="loop-thread:call", loop=self.loop)
            state["task"] = task
            task.add_done_callback(functools.partial(_copy_outcome, result))

        def abandon() -> None:
            # The loop runs callbacks in the order they were queued, so a submit() that made
            # it into the queue has run by now; without a task it never got there.
            task = state.get("task")
            if task is not None:
                task.cancel()
            if not state.get("started"):  # a task cancelled before its first step never
                coroutine.close()  # runs its body, so nothing else would set ``unwound``
                unwound.set()

        # asyncio.run_coroutine_threadsafe is not used: an interrupt inside it can leave the
        # coroutine queued to run with no future in hand to cancel it.
        try:
            self.loop.call_soon_threadsafe(submit)
            return result.result()
        except BaseException:
            if not result.done():
                self.loop.call_soon_threadsafe(abandon)
                unwound.wait(_UNWIND_TIMEOUT)
            raise

    def stop(self) -> None:
        self.stopped = True
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()


def _copy_outcome(result: concurrent.futures.Future[T], task: asyncio.Task[T]) -> None:
    if task.cancelled():
        result.cancel()
    elif (error := task.exception()) is not None:
        result.set_exception(error)
    else:
        result.set_result(task.result())
