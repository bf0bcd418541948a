"""Running a pipeline: hosts, link wiring, supervision, graceful and forced shutdown.

:meth:`Pipeline.start` returns a :class:`RunningPipeline`. Start-up spawns one process per
non-main host, then (1) every host binds its inbound cross-host links, (2) every host connects
its outbound links to those addresses, (3) every stage's ``start`` runs, then messages flow.

Supervision: a stage that raises, a host process that dies (seen on its process sentinel at
once, so SIGKILL and the OOM killer are noticed) or a host that stops answering (a link from
it falls silent past the heartbeat timeout; a host that sends over no link is probed through
its control channel instead) fails the pipeline: the failure is recorded, every exit channel
and pending call raises it, callers blocked in :meth:`RunningPipeline.send` are woken with it
at once, and the hosts are torn down. Nothing hangs. A caller never sees a transport error:
it gets the pipeline's failure, or :class:`~pipeline.runtime.errors.PipelineClosedError` once the
pipeline is stopping. A link that breaks or falls silent is blamed on its sending host: if
that host's process has exited (or exits within :data:`_EXIT_GRACE`) the failure is a
:class:`~pipeline.runtime.errors.HostDiedError` with its exit status, else the host is unresponsive.

Hosts of a replica set (:mod:`pipeline.runtime.replicas`) are the exception: once the
pipeline has started, a failure attributed to one of them (by the same rules) is contained
to its replica, which is killed and cut off; the pipeline fails only when every replica of
the set is lost (never, for an expendable set); that part, and restoring a lost replica, is
:mod:`pipeline.runtime.replica_supervision`. The start options and the split of the graph into
host plans are :mod:`pipeline.runtime.planning`.

Shutdown runs once, in a task of its own that every stop waits for: first gracefully (every
host stops its stages and closes its links), then, whatever that left (all of it when a stop
is cancelled or times out), forced: host processes are killed and links aborted, so a stop cut
short leaves no process, socket or ipc directory behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.runtime.control import HostPlan, HostStatistics
from pipeline.runtime.errors import (
    GraphError,
    HostUnresponsiveError,
    PipelineClosedError,
    PipelineError,
    StageFailedError,
)
from pipeline.runtime.gc_policy import raise_young_threshold, restore_threshold
from pipeline.runtime.host import LocalHost
from pipeline.runtime.hosts import Host, RemoteHost
from pipeline.runtime.planning import StartOptions, plan_hosts
from pipeline.runtime.processes import ProcessHost
from pipeline.runtime.ray_hosts import (
    RayActorHost,
    connect_ray,
    create_placement_group,
    node_ip,
    reachable_plan,
    remove_placement_groups,
    shutdown_ray,
)
from pipeline.runtime.replica_supervision import ReplicaSupervision
from pipeline.runtime.spec import MAIN_HOST
from pipeline.runtime.stage import Stage
from transports.errors import PeerLostError
from transports.memory import MemoryChannel
from transports.tasks import TaskSet

if TYPE_CHECKING:
    from pipeline.runtime.graph import Pipeline

__all__ = ["RunningPipeline", "StartOptions"]

logger = logging.getLogger("actorline.runtime")

#: Seconds each shutdown step waits for a host that was found unresponsive (it has already
#: been silent for the heartbeat timeout) before the controller terminates, then kills, it.
_UNRESPONSIVE_GRACE = 2.0
#: Seconds a host whose link broke or fell silent has to show that its process exited (the
#: exit watch may see a SIGKILL a moment after the link does) before it is called unresponsive.
_EXIT_GRACE = 0.2
#: Seconds each step of a forced teardown (stopping a stage, closing a link) may take.
_FORCED_STEP_TIMEOUT = 1.0
#: How a host names a link in the PeerLostError it reports (see ``LocalHost._pump``).
_LINK_IN_ERROR = re.compile(r"\blink (L\d+) into\b")


class RunningPipeline(ReplicaSupervision):
    """A started pipeline. Use as an async context manager, or call :meth:`stop`."""

    def __init__(self, pipeline: Pipeline, options: StartOptions) -> None:
        self.pipeline = pipeline
        self.options = options
        self.failure: BaseException | None = None
        self._main: LocalHost | None = None
        self._processes: dict[str, RemoteHost] = {}
        self._placement_groups: list[Any] = []
        self._ray_owned = False  # this pipeline connected this process to Ray
        self._exits: dict[str, MemoryChannel[Any]] = {}
        self._failure_callbacks: list[Callable[[BaseException], None]] = []
        self._closing = False
        self._teardown_task: asyncio.Task[None] | None = None
        self._torn_down = False  # the teardown finished (forced or not)
        self._gc_tuned = False  # this pipeline raised the young GC threshold
        self._link_sources: dict[str, str] = {}  # cross-host link id -> its sending host
        self._link_targets: dict[str, str] = {}  # cross-host link id -> its receiving host
        self._init_replicas(pipeline)
        self._plans: dict[str, HostPlan] = {}
        self._started = False  # start-up finished: from now on replica failures are contained
        self._inbound_sources: dict[str, set[str]] = {}  # host -> hosts that send to it
        self._unresponsive: set[str] = set()
        self._sending: set[asyncio.Task[Any]] = set()  # callers inside send()
        self._interrupted: set[asyncio.Task[Any]] = set()  # ... that _interrupt_senders woke
        self._probe_task: asyncio.Task[None] | None = None
        # the probe, exit checks (see _blame_exited_host), containments and the teardown
        self._tasks = TaskSet(f"pipeline {pipeline.name}")

    # -- start ----------------------------------------------------------------------------------

    @classmethod
    async def start(cls, pipeline: Pipeline, options: StartOptions) -> RunningPipeline:
        """Start ``pipeline``; see :meth:`Pipeline.start`."""
        running = cls(pipeline, options)
        try:
            try:
                await asyncio.wait_for(running._start(), options.start_timeout)
            except asyncio.TimeoutError as exc:
                if running.failure is not None:
                    raise
                raise TimeoutError(
                    f"pipeline {pipeline.name!r} did not start within {options.start_timeout:g} s "
                    "(start_timeout); a stage's start() or a host process is still starting"
                ) from exc
        except BaseException as exc:
            await running._teardown()
            if running.failure is not None and running.failure is not exc:
                raise running.failure from exc
            raise
        return running

    async def _start(self) -> None:
        plans = plan_hosts(self.pipeline, self.options)
        self._exits = {
            name: MemoryChannel(self.options.exit_capacity, name=f"exit:{name}")
            for name in self.pipeline.exits
        }
        for name, plan in plans.items():
            for link in plan.outbound:
                self._link_sources[link.link_id] = name
            for link in plan.inbound:
                self._link_targets[link.link_id] = name
        for name, plan in plans.items():
            self._inbound_sources[name] = {self._link_sources[k.link_id] for k in plan.inbound}
        groups = await self._connect_ray(plans)
        if self.options.hosts:
            ip = await asyncio.to_thread(node_ip)
            plans = {
                name: plan if name in self.options.hosts else reachable_plan(plan, ip)
                for name, plan in plans.items()
            }
        self._plans = plans
        self._main = LocalHost(
            plans[MAIN_HOST],
            self._failure_reporter(MAIN_HOST),
            exits=self._exits,
            on_link_lost=self._link_lost_reporter(MAIN_HOST),
        )
        for name, plan in plans.items():
            if name == MAIN_HOST:
                continue
            placement = self.options.hosts.get(name)
            if placement is None:
                self._processes[name] = ProcessHost(
                    plan, self._failure_reporter(name), self._link_lost_reporter(name)
                )
            else:
                group = groups.get(placement.placement_group or "")
                self._processes[name] = RayActorHost(
                    plan,
                    placement,
                    self._failure_reporter(name),
                    self._link_lost_reporter(name),
                    pipeline=self.pipeline.name,
                    placement_group=group,
                )
        await asyncio.gather(*(process.spawn() for process in self._processes.values()))
        self._main.build()
        hosts: list[Host] = [self._main, *self._processes.values()]
        addresses: dict[str, str] = {}
        for bound in await asyncio.gather(*(host.bind_links() for host in hosts)):
            addresses.update(bound)
        await asyncio.gather(*(host.connect_links(addresses) for host in hosts))
        await asyncio.gather(*(host.start_stages() for host in hosts))
        self._raise_if_failed()
        unwatched = [p for p in self._processes.values() if not p.plan.outbound]
        if unwatched:
            self._probe_task = self._tasks.spawn(
                self._probe_hosts(unwatched), name=f"probe:{self.pipeline.name}"
            )
        if self.options.tune_gc:  # _start runs once per RunningPipeline
            self._gc_tuned = True
            raise_young_threshold()
        self._started = True

    async def _connect_ray(self, plans: dict[str, HostPlan]) -> dict[str, Any]:
        """With hosts on Ray: check their placements, connect to the cluster and create the
        placement groups. Returns the groups by name.

        Raises:
            GraphError: a Ray placement names the main host, an unknown host or an unknown
                placement group (or Ray is not installed: RayUnavailableError).
            RayConnectionError: the cluster cannot be reached or refuses this process.
        """
        options = self.options
        if not options.hosts:
            if options.placement_groups:
                raise GraphError("placement_groups are for hosts on Ray; no host is (hosts=)")
            if options.ray_auth_token_file is not None:
                raise GraphError("ray_auth_token_file is for hosts on Ray; no host is (hosts=)")
            return {}
        for name, placement in options.hosts.items():
            if name == MAIN_HOST or name not in plans:
                raise GraphError(
                    f"hosts= places {name!r} on Ray, which is not a spawned host of pipeline "
                    f"{self.pipeline.name!r}; its hosts are {sorted(set(plans) - {MAIN_HOST})}"
                )
            wanted = placement.placement_group
            if wanted is not None and wanted not in options.placement_groups:
                raise GraphError(
                    f"host {name!r} is placed in placement group {wanted!r}, which "
                    f"placement_groups does not define"
                )
        self._ray_owned = await asyncio.to_thread(
            connect_ray, options.ray_address, options.ray_auth_token_file
        )
        groups: dict[str, Any] = {}
        for name, group in options.placement_groups.items():
            created = await create_placement_group(
                f"actorline:{self.pipeline.name}:{name}", group, options.start_timeout
            )
            self._placement_groups.append(created)
            groups[name] = created
        return groups

    def ray_actor(self, host: str) -> Any:
        """The Ray actor handle of host ``host`` (placed on Ray with ``hosts=``).

        Raises:
            KeyError: ``host`` is not on Ray.
        """
        process = self._processes.get(host)
        if not isinstance(process, RayActorHost):
            raise KeyError(f"host {host!r} does not run on Ray")
        return process.actor

    # -- messages -------------------------------------------------------------------------------

    async def send(self, entry: str, message: object) -> None:
        """Send ``message`` into entry ``entry`` (waits while the first link is full).

        A send waiting for room when the pipeline fails or starts stopping is woken at once
        with that error (the message may then not have been delivered).

        Raises:
            PipelineClosedError: the pipeline is stopping or stopped.
            PipelineError: the pipeline failed (the failure itself).
            KeyError: no such entry.
        """
        self._raise_if_closed()
        if entry not in self.pipeline.entries:
            raise KeyError(f"no entry {entry!r}; entries: {self.pipeline.entries}")
        assert self._main is not None
        task = asyncio.current_task()
        assert task is not None
        self._sending.add(task)
        try:
            await self._main.send_entry(entry, message)
        except asyncio.CancelledError:
            if self._was_interrupted(task):
                raise self._closed_error() from None
            raise
        except Exception as exc:
            # NOTE: a link closed under the send (teardown) or any error while failed or
            # stopping surfaces as the pipeline's error, never as a transport error.
            if self._was_interrupted(task) or self.failure is not None or self._closing:
                raise self._closed_error() from exc
            raise
        finally:
            self._sending.discard(task)
            self._interrupted.discard(task)

    async def receive(self, exit: str) -> Any:
        """The next message that reached exit ``exit``.

        Raises:
            PipelineError: the pipeline failed. PipelineClosedError: stopped and drained.
        """
        channel = self.exit_channel(exit)
        try:
            return await channel.receive()
        except PipelineError:
            raise
        except Exception as exc:
            if self.failure is not None:
                raise self.failure from exc
            raise PipelineClosedError(f"pipeline {self.pipeline.name!r} is closed") from exc

    def exit_channel(self, exit: str) -> MemoryChannel[Any]:
        """The channel behind exit ``exit`` (for dispatchers that read it directly)."""
        try:
            return self._exits[exit]
        except KeyError:
            raise KeyError(f"no exit {exit!r}; exits: {list(self._exits)}") from None

    def stage(self, name: str) -> Stage:
        """The stage object ``name`` if it runs in this process (the main host)."""
        assert self._main is not None
        return self._main.stage(name)

    # -- supervision ----------------------------------------------------------------------------

    def add_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` once if the pipeline fails (immediately if it has)."""
        if self.failure is not None:
            callback(self.failure)
        else:
            self._failure_callbacks.append(callback)

    @property
    def pids(self) -> dict[str, int | None]:
        """Process ids of the spawned hosts."""
        return {name: host.pid for name, host in self._processes.items()}

    def _failure_reporter(self, host: str) -> Callable[[BaseException], None]:
        """The failure callback of host ``host``."""

        def report(error: BaseException) -> None:
            if isinstance(error, PeerLostError):
                silent = self._silent_host(host, error)
                suspects = [silent] if silent in self._processes else []
                if silent == "(unknown)":
                    suspects = sorted(self._inbound_sources.get(host, set()) & set(self._processes))
                self._blame_exited_host(
                    suspects,
                    lambda: self._host_unresponsive(
                        silent, str(error), error, seconds=error.silent_for
                    ),
                )
            elif isinstance(error, StageFailedError) and error.remote_type == "PeerLostError":
                # a stage's send found its link broken: the receiving host may have died
                self._blame_exited_host(
                    sorted(self._processes), lambda: self._fail_host(host, error)
                )
            else:
                self._fail_host(host, error)

        return report

    def _link_lost_reporter(self, host: str) -> Callable[[str, str], None]:
        """The callback through which host ``host`` reports a contained link it lost."""

        def report(link_id: str, detail: str) -> None:
            if self.failure is not None or self._closing:
                return
            source, target = self._link_sources[link_id], self._link_targets[link_id]
            other = target if source == host else source
            if other in self._lost_hosts:
                return
            suspects = [other] if other in self._processes else []
            self._blame_exited_host(
                suspects,
                lambda: self._host_unresponsive(
                    other,
                    f"its link {link_id} to host {host!r} broke: {detail}",
                    None,
                    seconds=None,
                ),
            )

        return report

    def _fail_host(self, host: str, error: BaseException) -> None:
        """``error`` is ``host``'s failure: contain it if the host is a replica's (once
        started), else fail the pipeline."""
        replica = self._replica_of.get(host)
        if replica is None or not self._started:
            self._fail(error)
        else:
            self._contain(replica, error)

    def _blame_exited_host(self, suspects: list[str], otherwise: Callable[[], None]) -> None:
        """A link broke or fell silent, maybe because one of the ``suspects`` (spawned hosts)
        died: one whose process has exited, or exits within :data:`_EXIT_GRACE`, fails the
        pipeline with HostDiedError and its exit status (through its exit watch); if none
        does, call ``otherwise``."""
        if self.failure is not None or self._closing:
            return
        hosts = [self._processes[name] for name in suspects if name not in self._lost_hosts]
        if not hosts:
            otherwise()
            return

        async def check() -> None:
            exited = await asyncio.gather(*(host.exited(_EXIT_GRACE) for host in hosts))
            if not any(exited):
                otherwise()

        self._tasks.spawn(check(), name="exit-check")

    def _silent_host(self, reporter: str, error: PeerLostError) -> str:
        """The host whose link into ``reporter`` fell silent, as ``error`` tells."""
        match = _LINK_IN_ERROR.search(str(error))
        if match is not None and match.group(1) in self._link_sources:
            return self._link_sources[match.group(1)]
        sources = self._inbound_sources.get(reporter, set())
        return next(iter(sources)) if len(sources) == 1 else "(unknown)"

    def _host_unresponsive(
        self, host: str, detail: str, cause: BaseException | None, *, seconds: float | None
    ) -> None:
        """Fail the pipeline, or contain the replica: ``host`` does not answer (silent for
        ``seconds``, if known)."""
        if self.failure is not None or self._closing or host in self._lost_hosts:
            return
        self._unresponsive.add(host)
        process = self._processes.get(host)
        doing = process.last_note() if isinstance(process, ProcessHost) else ""
        if doing:
            detail = f"{detail}; {doing}"
        error = HostUnresponsiveError(host, detail, seconds=seconds)
        error.__cause__ = cause
        self._fail_host(host, error)

    async def _probe_hosts(self, hosts: list[RemoteHost]) -> None:
        """Ask ``hosts`` (spawned hosts that send over no link, so no link heartbeat tells
        whether they are alive) for statistics every heartbeat interval; one that does not
        answer within the heartbeat timeout fails the pipeline as unresponsive."""
        interval, timeout = self.options.heartbeat_interval, self.options.heartbeat_timeout

        async def probe(host: RemoteHost) -> None:
            # NOTE: the loop ends on ``_closing`` (set before the teardown cancels this task),
            # not on the cancellation alone: before Python 3.12, ``asyncio.wait_for`` returns
            # the result and drops a cancellation that arrives as the call it awaits completes
            # (CPython bpo-42130), and this loop then probed forever while the teardown waited
            # for it (seen under load: ``stop()`` hung after a stage failure).
            while True:
                await asyncio.sleep(interval)
                if self._closing:
                    return
                try:
                    await asyncio.wait_for(host.statistics(), timeout)
                except asyncio.TimeoutError:  # (TimeoutError itself only from 3.11)
                    detail = f"it did not answer a probe within {timeout} s"
                    self._host_unresponsive(host.name, detail, None, seconds=timeout)
                    return
                except Exception:  # it died: its process sentinel fails the pipeline
                    return

        await asyncio.gather(*(probe(host) for host in hosts))

    def _fail(self, error: BaseException) -> None:
        if self.failure is not None or self._closing:
            return
        self.failure = error
        logger.error("pipeline %r failed: %s", self.pipeline.name, error)
        if self._main is not None:
            self._main.pipeline_failed()
        self._interrupt_senders()
        for channel in self._exits.values():
            channel.fail(error)
        for callback in self._failure_callbacks:
            try:
                callback(error)
            except Exception:
                logger.exception("failure callback raised")
        self._failure_callbacks.clear()
        with contextlib.suppress(RuntimeError):  # no running loop: the next stop tears down
            self._begin_teardown()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _raise_if_closed(self) -> None:
        if self.failure is not None or self._closing or self._main is None:
            raise self._closed_error()

    def _closed_error(self) -> BaseException:
        """What a caller gets from a pipeline that failed (the failure) or stopped."""
        if self.failure is not None:
            return self.failure
        return PipelineClosedError(f"pipeline {self.pipeline.name!r} is closed")

    def _interrupt_senders(self) -> None:
        """Wake every caller waiting in :meth:`send`; each raises :meth:`_closed_error`."""
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no running loop
            current = None
        for task in self._sending - self._interrupted:
            if task is current:  # failed from inside its own send: not interrupted
                continue
            self._interrupted.add(task)
            task.cancel()

    def _was_interrupted(self, task: asyncio.Task[Any]) -> bool:
        """Whether ``task``'s send was cancelled only by :meth:`_interrupt_senders` (False
        when the caller itself is being cancelled too)."""
        if task not in self._interrupted:
            return False
        self._interrupted.discard(task)
        uncancel = getattr(task, "uncancel", None)  # Python >= 3.11
        # NOTE: on 3.10 a caller cancelled at the same moment cannot be told apart; it gets
        # the pipeline's error instead of CancelledError.
        return uncancel() == 0 if uncancel is not None else True

    # -- statistics and shutdown ----------------------------------------------------------------

    async def statistics(self) -> list[HostStatistics]:
        """A statistics snapshot of every host (stages, mailboxes, cross-host links).

        Raises:
            PipelineClosedError: the pipeline is stopped (or a host is gone while stopping).
            PipelineError: the pipeline failed (the failure itself).
        """
        if self._torn_down or self._main is None:
            raise self._closed_error()
        # NOTE: a replica's host may be dying (or lost): its share is left out, not an error
        processes = [p for p in self._processes.values() if p.name not in self._lost_hosts]
        answers = await asyncio.gather(*(p.statistics() for p in processes), return_exceptions=True)
        remote: list[HostStatistics] = []
        for process, answer in zip(processes, answers):
            if isinstance(answer, HostStatistics):
                remote.append(answer)
            elif self._closing or self.failure is not None:
                raise self._closed_error() from answer
            elif process.name not in self._replica_of:
                raise answer
        return [self._main.statistics(), *remote]

    async def wait_idle(self, timeout: float | None = None, *, poll: float = 0.02) -> bool:
        """Wait until nothing is in flight: every mailbox empty, no stage busy or holding work,
        every cross-host link delivered everything it was sent. True if reached in time."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        calm = 0
        while self.failure is None:
            calm = calm + 1 if _quiescent(await self.statistics()) else 0
            if calm >= 2:
                return True
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(poll)
        return False

    async def stop(self, *, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop the pipeline. Graceful: first wait (up to ``timeout``, default the start
        options' ``stop_timeout``) until in-flight work is done. Then stop every stage, close
        every link, end every host process. Idempotent; safe after a failure.

        A stop that is cancelled (or times out under ``asyncio.wait_for``) turns forced before
        the cancellation goes on: host processes are killed, links aborted, ipc directories
        removed; a later stop finishes whatever is still left, if anything.
        """
        timeout = self.options.stop_timeout if timeout is None else timeout
        if graceful and self.failure is None and not self._closing and self._main is not None:
            try:
                drained = await self.wait_idle(timeout)
            except asyncio.CancelledError:
                await self._teardown(force=True)
                raise
            except Exception:  # a host died while we asked it
                drained = False
            if not drained and self.failure is None:
                logger.warning("pipeline %r did not drain in %.1fs; stopping anyway",
                               self.pipeline.name, timeout)  # fmt: skip
        await self._teardown()

    def _begin_teardown(self) -> asyncio.Task[None]:
        """Start the teardown task (once; see :meth:`_teardown`)."""
        if self._teardown_task is None:
            self._closing = True
            self._interrupt_senders()
            self._teardown_task = self._tasks.spawn(
                self._tear_down(), name=f"teardown:{self.pipeline.name}"
            )
        return self._teardown_task

    async def _teardown(self, *, force: bool = False) -> None:
        """Tear down (once; every caller waits for the same teardown task). ``force``, or the
        caller being cancelled while it waits, cuts the graceful part short: the rest is
        forced, and done before the cancellation goes on, so that nothing is left behind."""
        task = self._begin_teardown()
        if force:
            task.cancel()
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            await self._finish_teardown(task)
            raise
        await self._finish_teardown(task)

    async def _finish_teardown(self, task: asyncio.Task[None]) -> None:
        """Wait for the teardown task; force what it left if it was cut short before its
        forced part ran to the end (a cancellation within it, or before it began)."""
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            logger.error("pipeline %r: teardown failed", self.pipeline.name,
                         exc_info=task.exception())  # fmt: skip
        if not self._torn_down:
            await self._force_teardown()

    async def _tear_down(self) -> None:
        """The teardown task: graceful, then (always, even when cancelled) forced."""
        try:
            await self._stop_hosts()
        finally:
            # NOTE: runs when the graceful part is cancelled too (a stop cut short, the event
            # loop shutting down): it kills and closes whatever that part did not finish.
            await self._force_teardown()

    async def _stop_hosts(self) -> None:
        """The graceful part of the teardown."""
        # NOTE: two phases across every host: first all stages stop and every sender says
        # END while every receiver is still open, then links close. After a failure nothing
        # is delivered any more (abort), so no host waits on a peer that is gone.
        abort = self.failure is not None
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.wait([self._probe_task])
        timeout = self.options.stop_timeout
        processes = list(self._processes.values())
        if abort:
            await self._find_silent_hosts(processes)
        timeouts = {p.name: timeout for p in processes}
        for process in processes:
            if process.name in self._unresponsive and process.name not in self._lost_hosts:
                self._resume(process)
                timeouts[process.name] = min(timeout, _UNRESPONSIVE_GRACE)
        phase_one = [p.quiesce(timeouts[p.name], abort=abort) for p in processes]
        if self._main is not None:
            phase_one.append(self._main.quiesce(timeout, abort=abort))
        await asyncio.gather(*phase_one)
        phase_two = [p.stop(timeouts[p.name], abort=abort) for p in processes]
        if self._main is not None:
            phase_two.append(self._main.release(timeout, abort=abort))
        await asyncio.gather(*phase_two)
        for channel in self._exits.values():
            channel.close_sending()

    async def _find_silent_hosts(self, processes: list[RemoteHost]) -> None:
        """After a failure, count a host that does not answer a probe within
        :data:`_UNRESPONSIVE_GRACE` as unresponsive (one frozen, or whose event loop is stuck,
        while another host's failure came first), so that the teardown resumes it and waits
        for it only briefly."""

        async def silent(process: RemoteHost) -> bool:
            try:
                await asyncio.wait_for(process.statistics(), _UNRESPONSIVE_GRACE)
            except asyncio.TimeoutError:
                return True
            except Exception:  # gone: nothing to wait for
                return False
            return False

        candidates = [
            process
            for process in processes
            if process.name not in self._unresponsive and process.name not in self._lost_hosts
        ]
        for process, quiet in zip(
            candidates, await asyncio.gather(*(silent(process) for process in candidates))
        ):
            if quiet:
                logger.warning("host %s does not answer; ending it", process.name)
                self._unresponsive.add(process.name)

    async def _force_teardown(self) -> None:
        """Kill and close whatever the graceful part left (nothing after a full graceful
        teardown). Idempotent."""
        if self._gc_tuned:
            self._gc_tuned = False
            restore_threshold()
        self._tasks.cancel()  # (not the teardown task: this runs in it, or after it)
        processes = list(self._processes.values())
        # NOTE: first signal every host and remove its ipc directory, before anything that
        # waits: a teardown cancelled once more in the middle still leaves no process running.
        for process in processes:
            process.kill_now()
        await asyncio.gather(*(process.kill() for process in processes))
        groups, self._placement_groups = self._placement_groups, []
        remove_placement_groups(groups)
        if self._ray_owned:
            self._ray_owned = False
            shutdown_ray()
        if self._main is not None:
            await self._main.abort(_FORCED_STEP_TIMEOUT)
        for channel in self._exits.values():
            channel.close_sending()
        self._torn_down = True

    @staticmethod
    def _resume(process: RemoteHost) -> None:
        """SIGCONT an unresponsive host, so that one frozen by SIGSTOP can still shut down
        cleanly (its links and ipc files); one whose event loop is stuck is waited for only
        briefly (``_UNRESPONSIVE_GRACE``), then terminated, then killed, by ProcessHost.stop."""
        if isinstance(process, ProcessHost) and process.pid is not None:
            # NOTE: the child stays unreaped (so its pid is not reused) until the
            # ProcessHost notices its exit; a signal to a process that exited is harmless.
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGCONT)

    async def __aenter__(self) -> RunningPipeline:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop(graceful=exc_info[0] is None)


def _quiescent(snapshots: list[HostStatistics]) -> bool:
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    for host in snapshots:
        for stage in host.stages:
            if stage.mailbox.queued or stage.busy or not stage.idle:
                return False
        for link_id, stats in host.links_out.items():
            sent[link_id] = stats.messages_sent
        for link_id, stats in host.links_in.items():
            received[link_id] = stats.messages_received
    return all(received.get(link_id, 0) >= count for link_id, count in sent.items())
