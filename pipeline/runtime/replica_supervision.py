"""A running pipeline's replica sets: containing a lost replica and restoring it.

Once a pipeline has started, a failure attributed to a host of a replica set
(:mod:`pipeline.runtime.replicas`) by the rules of :mod:`pipeline.runtime.running` is
contained to its replica: its hosts are killed, every other host cuts its links to them (the
stages linked to it get a :class:`~pipeline.runtime.replicas.ReplicaLost`) and the replica
callbacks are called; the pipeline fails only when the last replica of a set that is not
expendable is lost. :meth:`ReplicaSupervision.restore_replica` runs a lost replica again on
fresh hosts spawned from its plans.

:class:`ReplicaSupervision` is the part of
:class:`~pipeline.runtime.running.RunningPipeline` that does this; it keeps the replica
state and uses the running pipeline's hosts, task set and failure path, which the class
declares below and ``RunningPipeline`` provides.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline.runtime.control import HostPlan
from pipeline.runtime.errors import HostDiedError
from pipeline.runtime.host import LocalHost
from pipeline.runtime.hosts import RemoteHost
from pipeline.runtime.planning import StartOptions
from pipeline.runtime.processes import ProcessHost
from pipeline.runtime.replicas import ReplicaLost, ReplicaRestored, ReplicaSet, ReplicaStatus
from transports.tasks import TaskSet

if TYPE_CHECKING:
    from pipeline.runtime.graph import Pipeline

__all__ = ["ReplicaSupervision"]

logger = logging.getLogger("actorline.runtime")


class ReplicaSupervision:
    """Containment and restore of a running pipeline's replicas (a base of
    :class:`~pipeline.runtime.running.RunningPipeline`, which calls :meth:`_init_replicas`)."""

    # -- what the running pipeline provides -----------------------------------------------------
    pipeline: Pipeline
    options: StartOptions
    failure: BaseException | None
    _main: LocalHost | None
    _processes: dict[str, RemoteHost]
    _plans: dict[str, HostPlan]
    _closing: bool
    _unresponsive: set[str]
    _tasks: TaskSet

    def _fail(self, error: BaseException) -> None:
        raise NotImplementedError

    def _raise_if_closed(self) -> None:
        raise NotImplementedError

    def _failure_reporter(self, host: str) -> Callable[[BaseException], None]:
        raise NotImplementedError

    def _link_lost_reporter(self, host: str) -> Callable[[str, str], None]:
        raise NotImplementedError

    # -- the replica state ----------------------------------------------------------------------

    def _init_replicas(self, pipeline: Pipeline) -> None:
        self._replica_sets: dict[str, ReplicaSet] = dict(pipeline.replica_sets)
        self._replica_of: dict[str, tuple[str, str]] = {
            host: (replica_set.name, replica)
            for replica_set in self._replica_sets.values()
            for replica, hosts in replica_set.replicas
            for host in hosts
        }
        self._lost: dict[tuple[str, str], BaseException] = {}  # (set, replica) -> its failure
        self._restored: dict[tuple[str, str], int] = {}  # (set, replica) -> times restored
        self._lost_hosts: set[str] = set()
        self._replica_callbacks: list[Callable[[ReplicaLost], None]] = []
        self._containments: set[asyncio.Task[None]] = set()  # (also in _tasks)

    def _contain(self, replica: tuple[str, str], error: BaseException) -> None:
        """Replica ``replica`` failed with ``error``: kill its hosts, cut it off, tell the
        stages linked to it; or fail the pipeline if it was its set's last live replica."""
        if self.failure is not None or self._closing or replica in self._lost:
            return
        set_name, name = replica
        replica_set = self._replica_sets[set_name]
        hosts = replica_set.hosts(name)
        self._lost[replica] = error
        self._lost_hosts.update(hosts)
        if not replica_set.expendable and all(
            (set_name, other) in self._lost for other in replica_set.names
        ):
            logger.error("pipeline %r: the last replica of %r failed", self.pipeline.name, set_name)
            self._fail(error)
            return
        logger.error("pipeline %r: replica %s of %r failed and was cut off: %s",
                     self.pipeline.name, name, set_name, error)  # fmt: skip
        for host in hosts:
            self._processes[host].kill_now()
        lost = ReplicaLost(
            set_name,
            name,
            hosts,
            type(error).__qualname__,
            str(error),
            error.exitcode if isinstance(error, HostDiedError) else None,
        )
        containment = self._tasks.spawn(self._cut_off(lost), name=f"contain:{set_name}/{name}")
        self._containments.add(containment)  # (a restore of the replica waits for it)
        containment.add_done_callback(self._containments.discard)

    async def _cut_off(self, lost: ReplicaLost) -> None:
        """Reap the lost replica's hosts, have every other host cut its links to it (the
        stages linked to it get ``lost``), then call the replica callbacks."""
        await asyncio.gather(*(self._processes[host].kill() for host in lost.hosts))
        key = f"{lost.replica_set}/{lost.replica}"
        cuts = [
            process.cut_replica(lost)
            for process in self._processes.values()
            if process.name not in self._lost_hosts and process.links_to(key)
        ]
        if self._main is not None:
            cuts.append(self._main.cut_replica(lost))
        await asyncio.gather(*cuts, return_exceptions=True)
        for callback in self._replica_callbacks:
            try:
                callback(lost)
            except Exception:
                logger.exception("replica callback raised")

    def add_replica_callback(self, callback: Callable[[ReplicaLost], None]) -> None:
        """Call ``callback(lost)`` for every replica lost from now on (once it is cut off)."""
        self._replica_callbacks.append(callback)

    def unrestorable(self, replica_set: str, replica: str) -> str:
        """Why :meth:`restore_replica` cannot restore replica ``replica`` of ``replica_set``
        ("" when it can): its hosts must be spawned processes (not Ray actors), and so must
        the hosts outside it linked to it (the main host, spawned hosts: each listens and
        connects afresh; a Ray actor is not asked to).

        Raises:
            KeyError: no such replica set or replica.
        """
        hosts = self._replica_sets[replica_set].hosts(replica)
        on_ray = [host for host in hosts if host in self.options.hosts]
        if on_ray:
            return f"its hosts {on_ray} run on Ray"
        key = f"{replica_set}/{replica}"
        linked = sorted(p.name for p in self._processes.values()
                        if p.name not in hosts and not isinstance(p, ProcessHost)
                        and p.links_to(key))  # fmt: skip
        if linked:
            return f"hosts {linked} linked to it run on Ray"
        return ""

    def _linked_processes(self, link_key: str, hosts: tuple[str, ...]) -> list[ProcessHost]:
        """The live spawned hosts outside replica ``link_key`` (of ``hosts``) linked to it."""
        return [
            process
            for process in self._processes.values()
            if isinstance(process, ProcessHost)
            and process.name not in hosts
            and process.name not in self._lost_hosts
            and process.links_to(link_key)
        ]

    async def restore_replica(self, replica_set: str, replica: str) -> None:
        """Run lost replica ``replica`` of ``replica_set`` again on fresh hosts: spawn them
        from their plans, link them to the main host afresh, start their stages (the model
        loads), then take the links back into use and deliver a :class:`ReplicaRestored` to
        the stages linked to it (returns once it is in their mailboxes, behind what they
        hold). The rest of the pipeline runs on meanwhile. A failure of
        the fresh hosts while they start is not contained again: this raises it, the fresh
        hosts are killed and the replica stays lost.

        Raises:
            KeyError: no such replica set or replica.
            ValueError: the replica is not lost, or cannot be restored (:meth:`unrestorable`).
            PipelineError: the pipeline failed or is stopping (its error).
            TimeoutError: the fresh hosts did not start within ``start_timeout``.
            HostDiedError, StageFailedError, ...: a fresh host died or a stage failed to start.
        """
        key = (replica_set, replica)
        hosts = self._replica_sets[replica_set].hosts(replica)
        self._raise_if_closed()
        if key not in self._lost:
            raise ValueError(f"replica {replica} of {replica_set!r} is not lost")
        reason = self.unrestorable(replica_set, replica)
        if reason:
            raise ValueError(f"replica {replica} of {replica_set!r} cannot be restored: {reason}")
        while self._containments:  # its cut-off (reaping its old hosts) comes first
            await asyncio.wait(set(self._containments))
        assert self._main is not None
        link_key = f"{replica_set}/{replica}"
        fresh = {
            host: ProcessHost(
                self._plans[host], self._failure_reporter(host), self._link_lost_reporter(host)
            )
            for host in hosts
        }
        # NOTE: the fresh hosts stay in _lost_hosts (and the replica in _lost) until they
        # have started: a failure of theirs meanwhile is not contained (the calls below
        # raise it instead), and a link of theirs that breaks is not reported.
        self._processes.update(fresh)
        linked = self._linked_processes(link_key, hosts)
        try:
            await asyncio.wait_for(
                self._bring_up(link_key, fresh, linked), self.options.start_timeout
            )
            self._raise_if_closed()
        except BaseException:
            for process in fresh.values():
                process.kill_now()
            await asyncio.gather(*(process.kill() for process in fresh.values()))
            if self.failure is None and not self._closing:
                error = self._lost[key]
                lost = ReplicaLost(
                    replica_set, replica, hosts, type(error).__qualname__, str(error)
                )
                # (its stages heard of the loss already and of no restore: nothing to tell)
                await asyncio.gather(
                    self._main.cut_replica(lost, tell=False),
                    *(process.cut_replica(lost, tell=False) for process in linked),
                )
            raise
        del self._lost[key]
        self._lost_hosts.difference_update(hosts)
        self._unresponsive.difference_update(hosts)
        self._restored[key] = self._restored.get(key, 0) + 1
        logger.warning("pipeline %r: replica %s of %r runs again on fresh hosts",
                       self.pipeline.name, replica, replica_set)  # fmt: skip
        restored = ReplicaRestored(replica_set, replica, hosts, self._restored[key])
        await self._main.replica_restored(restored)
        # NOTE: a linked host that cannot be told is failing on its own (its failure is
        # reported as any host's)
        await asyncio.gather(
            *(process.replica_restored(restored) for process in linked), return_exceptions=True
        )

    async def _bring_up(
        self, link_key: str, fresh: dict[str, ProcessHost], linked: list[ProcessHost]
    ) -> None:
        """Spawn, link and start the fresh hosts of replica ``link_key``; the main host and
        the spawned hosts ``linked`` to it listen and connect afresh."""
        assert self._main is not None
        await asyncio.gather(*(process.spawn() for process in fresh.values()))
        addresses = await self._main.rebind_replica(link_key)
        for bound in await asyncio.gather(
            *(process.bind_links() for process in fresh.values()),
            *(process.rebind_replica(link_key) for process in linked),
        ):
            addresses.update(bound)
        await asyncio.gather(*(process.connect_links(addresses) for process in fresh.values()))
        await self._main.reconnect_replica(link_key, addresses)
        await asyncio.gather(
            *(process.reconnect_replica(link_key, addresses) for process in linked)
        )
        await asyncio.gather(*(process.start_stages() for process in fresh.values()))

    def replicas(self) -> list[ReplicaStatus]:
        """Every replica of the pipeline's replica sets, with its failure if it was lost."""
        return [
            ReplicaStatus(replica_set.name, name, hosts, self._lost.get((replica_set.name, name)))
            for replica_set in self._replica_sets.values()
            for name, hosts in replica_set.replicas
        ]
