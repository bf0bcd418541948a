"""Restarting the engine replicas of data parallelism one by one (``restart_engine``,
docs/architecture.md §4.7).

With ``data_parallel_size`` >= 2 a replica that dies or freezes is cut off by the runtime
while the others serve on (docs/architecture.md §8). With ``restart_engine`` the engine then
restarts that replica alone: after the same backoff as a whole engine's restart, counted by a
:class:`~pipeline.engine.restarts.RestartPolicy` of its own, it asks the running pipeline to
bring the replica up on fresh hosts (:meth:`RunningPipeline.restore_replica
<pipeline.runtime.running.RunningPipeline.restore_replica>`); once they have loaded the model
the router routes to it again. A replica in a crash loop is given up on and stays out (the
others serve on; when the last one dies the whole engine's restart and crash-loop rules
apply). Replicas whose hosts run on Ray are restarted with the whole engine only.

The draft host of a draft model placed apart (docs/speculative.md, "Where the draft model
runs") is healed the same way by a healer of its own (``what`` ``"draft host"``), whether or
not ``restart_engine`` is on: its loss costs only drafts and its restart touches no request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable

from pipeline.engine.options import EngineOptions
from pipeline.engine.restarts import RestartPolicy
from pipeline.runtime.replicas import ReplicaLost
from pipeline.runtime.running import RunningPipeline
from transports.tasks import TaskSet

__all__ = ["ReplicaHealer"]

logger = logging.getLogger("actorline.engine")


class ReplicaHealer:
    """Restarts the lost replicas of one engine (every generation of it, see
    :meth:`adopt`); ``on_restored(name)`` is called after each restart. ``what``: how
    the logs name a replica (``"engine replica"``, ``"draft host"``); ``by_set``: a replica
    is named by its set (each draft host is the one replica of a set of its own), else by
    its name in the set."""

    def __init__(
        self,
        options: EngineOptions,
        on_restored: Callable[[str], None],
        what: str = "engine replica",
        *,
        by_set: bool = False,
    ) -> None:
        self.options = options
        self._on_restored = on_restored
        self._what = what
        self._by_set = by_set
        self._running: RunningPipeline | None = None
        self._policies: dict[str, RestartPolicy] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}  # pending restarts, by replica
        self._taskset = TaskSet("replica restarts")  # owns them
        #: restarts of each replica (by name), over the engine's life
        self.restarts: collections.Counter[str] = collections.Counter()
        #: replicas given up on in a crash loop (until the whole engine restarts)
        self.given_up: set[str] = set()

    def adopt(self, running: RunningPipeline) -> None:
        """Heal the replicas of ``running`` (a fresh engine generation): what was pending
        for the previous one is cancelled, and every replica starts afresh."""
        self.cancel()
        self._running = running
        self._policies.clear()
        self.given_up.clear()

    def cancel(self) -> None:
        """Cancel the pending restarts (the engine failed whole, or closes)."""
        tasks, self._tasks = self._tasks, {}
        for task in tasks.values():
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def name_of(self, lost: ReplicaLost) -> str:
        """The name the healer keeps ``lost``'s replica under (its counts, its restart)."""
        return lost.replica_set if self._by_set else lost.replica

    def lost(self, lost: ReplicaLost) -> None:
        """Replica ``lost`` was cut off: count the death, schedule its restart (or give it
        up in a crash loop)."""
        name = self.name_of(lost)
        running = self._running
        if running is None or running.failure is not None or name in self._tasks:
            return
        reason = running.unrestorable(lost.replica_set, lost.replica)
        if reason:
            logger.warning(
                "%s %s is not restarted on its own (%s); it comes back with the whole engine",
                self._what,
                name,
                reason,
            )
            return
        self._died(running, lost, time.monotonic())

    def _died(self, running: RunningPipeline, lost: ReplicaLost, died: float) -> None:
        options, name = self.options, self.name_of(lost)
        policy = self._policies.get(name)
        if policy is None:
            policy = self._policies[name] = RestartPolicy(
                options.restart_backoff, options.restart_limit, options.restart_window
            )
        delay = policy.died(time.monotonic())
        if delay is None:
            self.given_up.add(name)
            logger.error(
                "%s %s is in a crash loop: it died %d times within %g s "
                "(restart_limit %d); it is given up on, %s",
                self._what,
                name,
                policy.recent,
                policy.window,
                policy.limit,
                "the engine decodes on without its drafts"
                if self._by_set
                else "the others serve on",
            )
            return
        logger.warning(
            "restarting %s %s in %.3g s (%d death(s) within %g s; %d give up)",
            self._what,
            name,
            delay,
            policy.recent,
            policy.window,
            policy.limit,
        )
        self._tasks[name] = self._taskset.spawn(
            self._restore(running, lost, delay, died), name=f"engine:restart:{name}"
        )

    async def _restore(
        self, running: RunningPipeline, lost: ReplicaLost, delay: float, died: float
    ) -> None:
        """Wait ``delay``, bring the replica up again; a start that fails counts as one
        more death."""
        name = self.name_of(lost)
        try:
            await asyncio.sleep(delay)
            try:
                await running.restore_replica(lost.replica_set, lost.replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if running.failure is not None or self._running is not running:
                    return  # the whole engine failed meanwhile: its own restart covers it
                logger.error(
                    "%s %s did not restart: %s: %s",
                    self._what,
                    name,
                    type(exc).__name__,
                    exc,
                )
                self._tasks.pop(name, None)
                self._died(running, lost, died)
                return
        finally:
            if self._tasks.get(name) is asyncio.current_task():
                del self._tasks[name]
        self.restarts[name] += 1
        logger.warning(
            "%s %s serves again (restart %d, %.1f s after it failed)",
            self._what,
            name,
            self.restarts[name],
            time.monotonic() - died,
        )
        self._on_restored(name)
