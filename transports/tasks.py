"""Background tasks with an owner: the one place the packages start an asyncio task.

Every background task in ``plugins``, ``transports``, ``pipeline`` and ``stages`` is spawned
through a :class:`TaskSet` held by the object (or the function) that owns it, and that owner's
close path cancels or awaits it (docs/architecture.md §4.1): no task is left running, or
pending at the end of the event loop, behind an object that was closed. It is what trio's
nurseries and anyio's task groups model, shaped for long-lived supervisors that
``asyncio.TaskGroup`` (Python >= 3.11 only; this project supports 3.10) does not fit: a task is
spawned now and runs while its owner lives, one that fails does not cancel its siblings (its
owner decides what a failure means), and closing the set cancels what still runs and waits for
it. ``tests/test_task_ownership.py`` fails on a ``create_task`` or ``ensure_future``
anywhere else in the packages.

A function that starts tasks for its own duration uses the set as an async context manager:
leaving the block (normally, by an error or by a cancellation) cancels what still runs and
waits for it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["TaskSet", "TaskSetStatistics"]

T = TypeVar("T")


@dataclass(frozen=True)
class TaskSetStatistics:
    """A snapshot of one :class:`TaskSet`."""

    owner: str
    running: int  # tasks not done yet
    spawned: int  # tasks spawned in all
    names: tuple[str, ...]  # the running tasks' names


class TaskSet:
    """The background tasks of one owner (named ``owner`` in task names and statistics).

    :meth:`spawn` starts a task and keeps it referenced until it ends; :meth:`cancel` and
    :meth:`aclose` end what still runs. A task's exception is left to whoever awaits it (or
    to ``on_done``): the set neither logs nor retrieves it, so asyncio still warns of one
    nobody looked at.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._count = itertools.count(1)
        self._spawned = 0

    def spawn(
        self,
        coroutine: Coroutine[Any, Any, T],
        *,
        name: str | None = None,
        on_done: Callable[[asyncio.Task[T]], None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> asyncio.Task[T]:
        """Run ``coroutine`` in a task of this set (named ``name``, else ``owner:<n>``) on
        the running loop (or ``loop``, from one of its callbacks); ``on_done(task)`` runs when
        it ends, after the set has let go of it.

        Raises:
            RuntimeError: no event loop runs (``coroutine`` is closed, not run).
        """
        try:
            running = loop if loop is not None else asyncio.get_running_loop()
        except RuntimeError:
            coroutine.close()
            raise
        task = running.create_task(coroutine, name=name or f"{self.owner}:{next(self._count)}")
        self._spawned += 1
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if on_done is not None:
            task.add_done_callback(on_done)
        return task

    def __len__(self) -> int:
        """The tasks not done yet."""
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        """The tasks not done yet (a copy: the set may change meanwhile)."""
        return iter(list(self._tasks))

    def cancel(self) -> list[asyncio.Task[Any]]:
        """Cancel every task not done yet, except the calling task (a supervisor's own
        teardown may be one of them); returns those cancelled. Never raises."""
        current = asyncio.current_task() if _loop_running() else None
        cancelled = [task for task in self._tasks if task is not current and not task.done()]
        for task in cancelled:
            task.cancel()
        return cancelled

    async def aclose(self, timeout: float | None = None) -> set[asyncio.Task[Any]]:
        """Cancel every task not done yet (the calling one excepted) and wait for them, at
        most ``timeout`` seconds; their exceptions are retrieved, not raised. Returns those
        still running at the end (they ignored the cancellation). The set stays usable."""
        tasks = self.cancel()
        if not tasks:
            return set()
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: its owner closed it, nobody will look
        return pending

    def statistics(self) -> TaskSetStatistics:
        return TaskSetStatistics(
            owner=self.owner,
            running=len(self._tasks),
            spawned=self._spawned,
            names=tuple(sorted(task.get_name() for task in self._tasks)),
        )

    async def __aenter__(self) -> TaskSet:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<TaskSet {self.owner!r}: {len(self._tasks)} running>"


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
