"""A host runs the stages placed on it inside one event loop.

Links between stages of the same host deliver straight into the target's mailbox (a bounded
:class:`~transports.memory.MemoryChannel`); links to other hosts go through a transport: this
host listens for its inbound links (a pump task moves each received message into the target
mailbox) and connects senders for its outbound ones. A stage that raises, or a link whose peer
is lost, is reported through ``on_failure``; the controller then fails the whole pipeline.
A link to or from a replica this host is not part of is *contained*
(:mod:`pipeline.runtime.replicas`): its loss is reported through ``on_link_lost`` instead,
what is sent on it once it is lost is dropped, and :meth:`LocalHost.cut_replica` closes it and
tells the stages linked to the replica.

A stage may send to one target of an output port only (``emit(port, message, to=stage)``),
as a router or partitioner does; by default a message goes to every link of the port.

A handler that raises on a message is first offered to its stage's
:meth:`~pipeline.runtime.stage.Stage.recover`: a failure the stage contains (it answered the one
request the message belongs to) is logged and counted, and the stage goes on; any other fails
the pipeline (docs/architecture.md, "Failure: one request or the pipeline").

A handler that waits to send into a full mailbox of this host is recorded as waiting on that
stage; when the waits close a cycle (every stage in it waits on the next one's full mailbox,
so none can drain its own), the host reports a
:class:`~pipeline.runtime.errors.DeadlockError` instead of hanging. Cycles through other
hosts are not seen (their links are not mailboxes).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import os
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import plugins
from pipeline.runtime.control import (
    HANDLE_SECONDS_BUCKETS,
    HostPlan,
    HostStatistics,
    RemoteLink,
    StageStatistics,
)
from pipeline.runtime.errors import DeadlockError, GraphError, PipelineError, StageFailedError
from pipeline.runtime.replicas import ReplicaLost, ReplicaRestored
from pipeline.runtime.spec import BOUNDARY, Endpoint
from pipeline.runtime.stage import Stage, recoverable
from transports.base import Receiver, Sender, Transport
from transports.errors import EndOfStream, LinkClosedError, PeerLostError
from transports.memory import MemoryChannel, WouldBlock
from transports.tasks import TaskSet

__all__ = ["RUNTIME_PORT", "LocalHost"]

logger = logging.getLogger("actorline.host")
T = TypeVar("T")

FailureCallback = Callable[[BaseException], None]
#: ``on_link_lost(link_id, detail)``: a contained link broke or fell silent
LinkLostCallback = Callable[[str, str], None]
_Deliver = Callable[[Any], Awaitable[None]]
#: the mailbox port of the runtime's own messages to a stage (``ReplicaLost``): no stage
#: port can have this name (it is the boundary's)
RUNTIME_PORT = BOUNDARY


class _StageCell:
    """A stage with its mailbox and counters."""

    __slots__ = (
        "buckets",
        "busy",
        "dropped",
        "handle_seconds",
        "handled",
        "mailbox",
        "name",
        "recovered",
        "recovered_types",
        "stage",
        "stop_started",
        "task",
        "waiting_on",
    )

    def __init__(self, name: str, stage: Stage) -> None:
        self.name = name
        self.stage = stage
        self.mailbox: MemoryChannel[tuple[str, Any]] = MemoryChannel(
            stage.mailbox_capacity, name=f"mailbox:{name}"
        )
        self.task: asyncio.Task[None] | None = None
        self.handled = 0
        self.handle_seconds = 0.0
        self.buckets = [0] * (len(HANDLE_SECONDS_BUCKETS) + 1)
        self.busy = False
        self.dropped = 0
        #: messages whose handler failed and the stage recovered from (see Stage.recover),
        #: and the exception types met so far (each is logged with its traceback once)
        self.recovered = 0
        self.recovered_types: set[type[BaseException]] = set()
        #: the stage whose full mailbox this stage's handler waits to send into
        self.waiting_on: _StageCell | None = None
        self.stop_started = False


class LocalHost:
    """The stages of one placement, their mailboxes, routes and cross-host links."""

    def __init__(
        self,
        plan: HostPlan,
        on_failure: FailureCallback,
        *,
        exits: dict[str, MemoryChannel[Any]] | None = None,
        on_link_lost: LinkLostCallback | None = None,
    ) -> None:
        self.plan = plan
        self.name = plan.name
        self._on_failure = on_failure
        self._on_link_lost = on_link_lost
        self._exits = exits or {}
        self._cells: dict[str, _StageCell] = {}
        self._routes: dict[tuple[str, str], tuple[_Deliver, ...]] = {}
        # (stage, port, target stage) -> the routes of that port into that stage
        self._targeted: dict[tuple[str, str, str], tuple[_Deliver, ...]] = {}
        # (stage, port) -> the stage each of its routes leads to (BOUNDARY: an exit; the
        # target of a link to another host: its stage, though not on this host)
        self._route_targets: dict[tuple[str, str], tuple[str, ...]] = {}
        # the (stage, port)s with a link to a stage of this host
        self._local_ports: set[tuple[str, str]] = set()
        # contained link id -> the replica key of its peer; links cut (their replica lost),
        # and those whose loss was reported already
        self._contained = {
            link.link_id: link.contained
            for link in (*plan.inbound, *plan.outbound)
            if link.contained
        }
        self._cut: set[str] = set()
        self._lost_links: set[str] = set()
        self._pump_of: dict[str, asyncio.Task[None]] = {}
        self._transports: dict[str, Transport] = {}
        self._receivers: dict[str, Receiver] = {}
        self._senders: dict[str, Sender] = {}
        # the stages' tasks, their background tasks and the pumps
        self._tasks = TaskSet(f"host {plan.name}")
        self._cell_of_task: dict[asyncio.Task[Any], _StageCell] = {}
        self._failed = False
        self._stopped = False
        self._warned_ports: set[tuple[str, str]] = set()

    # -- setup ----------------------------------------------------------------------------------

    def build(self) -> None:
        """Construct the stages (constructors only; heavy loading happens in start)."""
        for spec in self.plan.stages:
            stage = spec.factory(spec.config)
            stage._bind(self, spec.name)
            self._cells[spec.name] = _StageCell(spec.name, stage)
        for source, target in self.plan.local_links:
            self._add_route(source, self._local_deliver(target), target.stage)
            if target.stage != BOUNDARY:
                self._local_ports.add((source.stage, source.port))

    def _local_deliver(self, target: Endpoint) -> _Deliver:
        if target.stage == BOUNDARY:
            return self._exits[target.port].send
        cell = self._cells[target.stage]
        mailbox = cell.mailbox
        port = target.port

        async def deliver(message: Any) -> None:
            try:
                mailbox.send_nowait((port, message))
            except WouldBlock:
                await self._send_when_room(cell, (port, message))
                return
            if cell.waiting_on is not None:  # its owner waits too: did this close a cycle?
                self._check_deadlock(cell)

        return deliver

    def _add_route(self, source: Endpoint, deliver: _Deliver, target: str) -> None:
        key = (source.stage, source.port)
        self._route_targets[key] = (*self._route_targets.get(key, ()), target)
        self._routes[key] = (*self._routes.get(key, ()), deliver)
        targeted = (source.stage, source.port, target)
        self._targeted[targeted] = (*self._targeted.get(targeted, ()), deliver)

    def _transport(self, name: str) -> Transport:
        transport = self._transports.get(name)
        if transport is None:
            factory = plugins.load(plugins.TRANSPORTS, name)
            settings = dict(self.plan.transport_settings).get(name) or {}
            transport = factory(self.plan.link_options, **settings)
            self._transports[name] = transport
        return transport

    async def bind_links(self) -> dict[str, str]:
        """Listen for every inbound cross-host link and start its pump; returns addresses."""
        addresses: dict[str, str] = {}
        for link in self.plan.inbound:
            receiver = await self._transport(link.transport).listen()
            self._receivers[link.link_id] = receiver
            addresses[link.link_id] = receiver.address
            pump = self._tasks.spawn(self._pump(link, receiver), name=f"pump:{link.link_id}")
            self._pump_of[link.link_id] = pump
        return addresses

    async def connect_links(self, addresses: dict[str, str]) -> None:
        """Connect a sender for every outbound cross-host link."""
        for link in self.plan.outbound:
            address = addresses[link.link_id]
            sender = await self._transport(link.transport).connect(
                address, name=f"{self.name}/{link.endpoint}#{link.link_id}"
            )
            self._senders[link.link_id] = sender
            deliver = self._contained_deliver(link, sender) if link.contained else sender.send
            self._add_route(link.endpoint, deliver, link.peer.stage if link.peer else "")

    def _contained_deliver(self, link: RemoteLink, sender: Sender) -> _Deliver:
        """Send on a contained link: once the link is lost or cut, drop (a dead replica's
        share of the traffic goes nowhere, and the sending stage goes on)."""
        link_id, cut, lost, senders = link.link_id, self._cut, self._lost_links, self._senders

        async def deliver(message: Any) -> None:
            if link_id in cut or link_id in lost:
                return
            # NOTE: looked up per message: a restored replica's link has a fresh sender
            current = senders.get(link_id, sender)
            try:
                await current.send(message)
            except (LinkClosedError, PeerLostError) as exc:
                if link_id not in cut and not self._stopped:
                    self._link_lost(link_id, f"sending on it failed: {exc}")

        return deliver

    async def start_stages(self) -> None:
        """Run every stage's ``start`` (concurrently), then start handling messages.

        Raises:
            StageFailedError: a stage's start raised.
        """

        async def start_one(cell: _StageCell) -> None:
            try:
                await cell.stage.start()
            except asyncio.CancelledError as exc:
                # NOTE: unlike a handler's task, start runs in the caller's: it may have been
                # cancelled by its caller (a start timeout). Only where Python can tell that
                # it was not (>= 3.11) is this the stage failing.
                if _cancel_requested() is not False:
                    raise
                raise self._cancelled_error(cell.name, exc, "start") from exc
            except Exception as exc:
                raise self._stage_error(cell.name, exc) from exc

        await asyncio.gather(*(start_one(cell) for cell in self._cells.values()))
        for cell in self._cells.values():
            cell.task = self._tasks.spawn(self._run_stage(cell), name=f"stage:{cell.name}")
            self._cell_of_task[cell.task] = cell

    # -- running --------------------------------------------------------------------------------

    async def emit(self, stage: str, port: str, message: Any, to: str | None = None) -> None:
        """Deliver ``message`` from ``stage``'s ``port`` to every link of the port, or with
        ``to`` only to the links into the stage ``to``.

        Raises:
            GraphError: ``port`` is not an output of ``stage``, or ``to`` names a stage the
                port is not linked to.
        """
        if to is None:
            routes = self._routes.get((stage, port))
        else:
            routes = self._targeted.get((stage, port, to))
            if routes is None and (stage, port) in self._routes:
                linked = sorted(t for s, p, t in self._targeted if (s, p) == (stage, port))
                raise GraphError(
                    f"stage {stage!r} emitted on {port!r} to {to!r}, which that port is not "
                    f"linked to (it is linked to {linked})"
                )
        if routes is None:
            self._unrouted(stage, port)
            return
        for deliver in routes:
            await deliver(message)

    def colocated(self, stage: str, port: str) -> Stage | None:
        """The stage that ``stage``'s output ``port`` is linked to, when the port has exactly
        one link and it leads to a stage of this host (None otherwise)."""
        targets = self._route_targets.get((stage, port), ())
        if len(targets) != 1 or (stage, port) not in self._local_ports:
            return None
        cell = self._cells.get(targets[0])
        return None if cell is None else cell.stage

    async def call(self, stage: str, handler: Callable[[Any], Awaitable[T]], message: Any) -> T:
        """Run ``stage``'s ``handler`` on ``message`` in the caller's task, as if ``stage``
        handled a message of its mailbox (see :meth:`Stage.call`): counted in its statistics,
        and a raise fails the pipeline as ``stage``'s failure (then propagates)."""
        cell = self._cells[stage]
        clock = time.perf_counter
        cell.busy = True
        started = clock()
        try:
            return await handler(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(self._stage_error(cell.name, exc), exc)
            raise
        finally:
            self.record_work(stage, clock() - started)
            cell.busy = False

    def record_work(self, stage: str, seconds: float) -> None:
        """Count ``seconds`` of ``stage``'s work outside its handlers as one message handled
        (see :meth:`Stage.record_work`)."""
        cell = self._cells[stage]
        cell.handle_seconds += seconds
        cell.buckets[bisect.bisect_left(HANDLE_SECONDS_BUCKETS, seconds)] += 1
        cell.handled += 1

    def spawn(self, stage: str, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a background ``coroutine`` of ``stage`` (see :meth:`Stage.spawn`): if it
        raises, the stage fails as if its handler had; stopping cancels it."""
        if self._stopped:
            coroutine.close()
            return
        self._tasks.spawn(
            coroutine,
            name=f"stage:{stage}:background",
            on_done=functools.partial(self._background_done, stage),
        )

    def _background_done(self, stage: str, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            if not self._stopped:
                error = asyncio.CancelledError("nothing cancelled the stage")
                self._fail(self._cancelled_error(stage, error, "a background task"), error)
            return
        exc = task.exception()
        if exc is not None:
            self._fail(self._stage_error(stage, exc), exc)

    async def send_entry(self, entry: str, message: Any) -> None:
        """Deliver a message sent by the caller to an entry (main host only)."""
        await self.emit(BOUNDARY, entry, message)

    def _unrouted(self, stage: str, port: str) -> None:
        cell = self._cells.get(stage)
        if cell is not None:
            outputs = type(cell.stage).outputs
            if port not in outputs:  # a misspelt port: fail the handler, never drop silently
                raise GraphError(
                    f"stage {stage!r} emitted on {port!r}, which is not one of its outputs "
                    f"{outputs}"
                )
            cell.dropped += 1
        if (stage, port) not in self._warned_ports:
            self._warned_ports.add((stage, port))
            logger.warning(
                "output %s.%s is linked to nothing; its messages are dropped", stage, port
            )

    async def _run_stage(self, cell: _StageCell) -> None:
        mailbox = cell.mailbox
        handle = cell.stage.handle
        clock = time.perf_counter
        buckets, bounds = cell.buckets, HANDLE_SECONDS_BUCKETS
        while True:
            try:
                port, message = await mailbox.receive()
            except (EndOfStream, LinkClosedError):
                return
            cell.busy = True
            started = clock()
            try:
                if port == RUNTIME_PORT:
                    if isinstance(message, ReplicaRestored):
                        await cell.stage.on_replica_restored(message)
                    else:
                        await cell.stage.on_replica_lost(message)
                else:
                    await handle(message, port)
            except asyncio.CancelledError as exc:
                # NOTE: only this host cancels a stage's task, and it sets _stopped first. A
                # CancelledError that nobody aimed at the task (the handler awaited a future
                # or task that was cancelled) is the handler failing, not the stage stopping.
                # (_cancel_requested also covers the event loop cancelling every task as it
                # shuts down, where Python can tell.)
                if self._stopped or _cancel_requested():
                    raise
                self._fail(self._cancelled_error(cell.name, exc, "its handler"), exc)
                return
            except Exception as exc:
                if port == RUNTIME_PORT or not await self._recover(cell, message, port, exc):
                    self._fail(self._stage_error(cell.name, exc), exc)
                    return
            finally:
                elapsed = clock() - started
                cell.handle_seconds += elapsed
                buckets[bisect.bisect_left(bounds, elapsed)] += 1
                cell.handled += 1
                cell.busy = False

    async def _recover(self, cell: _StageCell, message: Any, port: str, error: Exception) -> bool:
        """Whether ``cell``'s stage contained its handler's ``error`` on ``message`` (see
        :meth:`Stage.recover`); logs what it contained."""
        if not recoverable(error):
            return False
        try:
            recovered = await cell.stage.recover(message, port, error)
        except Exception as failure:
            logger.error(
                "host %s: stage %s could not recover from %s: %s",
                self.name,
                cell.name,
                type(error).__qualname__,
                failure,
                exc_info=failure,
            )
            return False
        if recovered is not True:
            return False
        self.contained(cell.name, error, message)
        return True

    def contained(
        self, stage: str, error: Exception, message: Any, request_id: str | None = None
    ) -> None:
        """Log and count a failure stage ``stage`` contained (docs/architecture.md §7.2):
        its :meth:`Stage.recover` answered ``message``, or (``request_id``) its handler
        answered that one request of ``message``, a message of many, itself
        (:meth:`Stage.contained`)."""
        cell = self._cells[stage]
        cell.recovered += 1
        first = type(error) not in cell.recovered_types
        cell.recovered_types.add(type(error))
        what = type(message).__qualname__
        if request_id is not None:
            what = f"{what} (request {request_id!r})"
        # NOTE: a traceback for the first failure of each kind (a bug to find), one line
        # for the ones after it, so that a request repeated at will cannot flood the log.
        logger.error(
            "host %s: stage %s recovered from %s on a %s: %s",
            self.name,
            stage,
            type(error).__qualname__,
            what,
            error,
            exc_info=error if first else None,
        )

    async def _send_when_room(self, target: _StageCell, item: tuple[str, Any]) -> None:
        """Send ``item`` into ``target``'s full mailbox, waiting for room.

        NOTE: when the waiting task is a stage's own handler (not a pump, the caller or a
        background task of a stage) the wait is recorded, so that a cycle of handlers each
        waiting on the next one's full mailbox is found (:meth:`_check_deadlock`) the moment
        it closes. Only the stage's own task drains its mailbox, so such a cycle never clears.
        """
        sender = self._cell_of_task.get(asyncio.current_task())  # type: ignore[arg-type]
        if sender is None:
            await target.mailbox.send(item)
        else:
            sender.waiting_on = target
            try:
                cycle = self._wait_cycle(sender)
                if cycle is not None:
                    error = self._deadlock(cycle)
                    self._fail(error, None)
                    raise error
                await target.mailbox.send(item)
            finally:
                sender.waiting_on = None
        if target.waiting_on is not None:
            self._check_deadlock(target)

    def _check_deadlock(self, cell: _StageCell) -> None:
        """Fail the host if waits through ``cell`` (whose mailbox just filled) close a cycle."""
        cycle = self._wait_cycle(cell)
        if cycle is not None:
            error = self._deadlock(cycle)
            self._fail(error, None)

    @staticmethod
    def _wait_cycle(start: _StageCell) -> list[_StageCell] | None:
        """The stages of a wait cycle through ``start``: each one's handler waits to send into
        the next one's mailbox, which is full; None if the waits do not lead back."""
        path: list[_StageCell] = []
        cell = start
        while True:
            target = cell.waiting_on
            if target is None or len(target.mailbox) < target.mailbox.capacity:
                return None
            path.append(cell)
            if target is start:
                return path
            if target in path:  # a cycle that does not pass through start
                return None
            cell = target

    def _deadlock(self, cycle: list[_StageCell]) -> DeadlockError:
        return DeadlockError(
            self.name,
            tuple(cell.name for cell in cycle),
            tuple(cell.mailbox.capacity for cell in cycle),
        )

    async def _pump(self, link: RemoteLink, receiver: Receiver) -> None:
        deliver = self._local_deliver(link.endpoint)
        try:
            while True:
                await deliver(await receiver.receive())
        except (EndOfStream, LinkClosedError):
            return
        except PeerLostError as exc:
            if self._stopped or link.link_id in self._cut:
                return
            if link.contained:
                self._link_lost(link.link_id, str(exc))
                return
            lost = PeerLostError(
                f"link {link.link_id} into {link.endpoint}: {exc}", silent_for=exc.silent_for
            )
            self._fail(lost, exc)

    def _link_lost(self, link_id: str, detail: str) -> None:
        """Report the loss of contained link ``link_id`` (once)."""
        if link_id in self._lost_links:
            return
        self._lost_links.add(link_id)
        logger.warning("host %s: link %s to replica %s lost: %s",
                       self.name, link_id, self._contained[link_id], detail)  # fmt: skip
        if self._on_link_lost is not None:
            self._on_link_lost(link_id, detail)

    async def cut_replica(
        self, lost: ReplicaLost, timeout: float = 1.0, *, tell: bool = True
    ) -> None:
        """Close this host's links to and from the replica ``lost`` names (messages still
        sent to it are dropped), then (``tell``) deliver ``lost`` to each stage of this host
        that was linked to it, behind what its mailbox holds already. Idempotent."""
        key = f"{lost.replica_set}/{lost.replica}"
        links = [
            link
            for link in (*self.plan.inbound, *self.plan.outbound)
            if self._contained.get(link.link_id) == key and link.link_id not in self._cut
        ]
        self._cut.update(link.link_id for link in links)
        for link in links:
            pump = self._pump_of.pop(link.link_id, None)
            if pump is not None:
                pump.cancel()
            sender = self._senders.pop(link.link_id, None)
            receiver = self._receivers.pop(link.link_id, None)
            for end in (sender, receiver):
                if end is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(end.aclose(), timeout)
        told: set[str] = set()
        for link in links if tell else ():
            cell = self._cells.get(link.endpoint.stage)
            if cell is None or cell.name in told or self._stopped:
                continue
            told.add(cell.name)
            with contextlib.suppress(LinkClosedError):  # the stage is stopping
                await cell.mailbox.send((RUNTIME_PORT, lost))

    def _replica_links(self, key: str, links: tuple[RemoteLink, ...]) -> list[RemoteLink]:
        return [link for link in links if self._contained.get(link.link_id) == key]

    async def rebind_replica(self, key: str) -> dict[str, str]:
        """Listen afresh for this host's inbound links from replica ``key`` (cut when it was
        lost), for its restored hosts to connect to; returns their addresses. What arrives
        is delivered at once (the restored engine's info); the links stay cut for sending
        until :meth:`reconnect_replica`."""
        addresses: dict[str, str] = {}
        for link in self._replica_links(key, self.plan.inbound):
            receiver = await self._transport(link.transport).listen()
            self._receivers[link.link_id] = receiver
            addresses[link.link_id] = receiver.address
            pump = self._tasks.spawn(self._pump(link, receiver), name=f"pump:{link.link_id}")
            self._pump_of[link.link_id] = pump
            self._cut.discard(link.link_id)  # (so that a cut_replica closes it again)
        return addresses

    async def reconnect_replica(self, key: str, addresses: dict[str, str]) -> None:
        """Connect this host's outbound links to replica ``key`` at ``addresses`` (its
        restored hosts' inbound links) and take every link to and from it back into use."""
        for link in self._replica_links(key, self.plan.outbound):
            sender = await self._transport(link.transport).connect(
                addresses[link.link_id], name=f"{self.name}/{link.endpoint}#{link.link_id}"
            )
            self._senders[link.link_id] = sender
        for link in self._replica_links(key, (*self.plan.inbound, *self.plan.outbound)):
            self._cut.discard(link.link_id)
            self._lost_links.discard(link.link_id)

    async def replica_restored(self, restored: ReplicaRestored) -> None:
        """Deliver ``restored`` to each stage of this host linked to the replica it names,
        behind what its mailbox holds already."""
        key = f"{restored.replica_set}/{restored.replica}"
        told: set[str] = set()
        for link in self._replica_links(key, (*self.plan.inbound, *self.plan.outbound)):
            cell = self._cells.get(link.endpoint.stage)
            if cell is None or cell.name in told or self._stopped:
                continue
            told.add(cell.name)
            with contextlib.suppress(LinkClosedError):  # the stage is stopping
                await cell.mailbox.send((RUNTIME_PORT, restored))

    def _stage_error(self, stage: str, exc: BaseException) -> StageFailedError:
        error = StageFailedError(
            stage,
            self.name,
            type(exc).__qualname__,
            str(exc),
            "".join(traceback.format_exception(exc)),
        )
        error.__cause__ = exc
        return error

    def _cancelled_error(
        self, stage: str, exc: asyncio.CancelledError, where: str
    ) -> StageFailedError:
        """The failure of a stage whose ``where`` raised CancelledError nobody asked for."""
        error = StageFailedError(
            stage,
            self.name,
            "CancelledError",
            f"{where} raised CancelledError, but nothing cancelled the stage (it awaited "
            "a future or task that was cancelled)",
            "".join(traceback.format_exception(exc)),
        )
        error.__cause__ = exc
        return error

    def pipeline_failed(self) -> None:
        """The pipeline failed (whichever host reported it): what fails here from now on
        (a stage sending into an exit that holds the failure, a link whose peer is gone) is
        its consequence, neither reported nor logged again."""
        self._failed = True

    def _fail(self, error: PipelineError | PeerLostError, cause: BaseException | None) -> None:
        if self._failed or self._stopped:
            return
        self._failed = True
        if isinstance(error, PeerLostError) or isinstance(cause, PeerLostError):
            # NOTE: a lost link is the symptom of a peer host that died or froze; the
            # controller says which once it knows (one line, at ERROR), so no traceback here.
            logger.info("host %s: %s", self.name, error)
        else:
            logger.error("host %s: %s", self.name, error, exc_info=cause)
        self._on_failure(error)

    # -- introspection --------------------------------------------------------------------------

    def statistics(self) -> HostStatistics:
        stages = tuple(
            StageStatistics(
                name=cell.name,
                mailbox=cell.mailbox.statistics(),
                handled=cell.handled,
                handle_seconds=cell.handle_seconds,
                busy=cell.busy,
                idle=cell.stage.idle(),
                dropped=cell.dropped,
                handle_buckets=tuple(cell.buckets),
                recovered=cell.recovered,
            )
            for cell in self._cells.values()
        )
        return HostStatistics(
            host=self.name,
            pid=os.getpid(),
            stages=stages,
            links_in={key: r.statistics() for key, r in self._receivers.items()},
            links_out={key: s.statistics() for key, s in self._senders.items()},
        )

    def stage(self, name: str) -> Stage:
        """The stage object ``name`` running on this host."""
        return self._cells[name].stage

    # -- shutdown -------------------------------------------------------------------------------

    async def quiesce(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Shutdown, first phase: stop handling, stop every stage (each ``stop`` gets up to
        ``timeout`` seconds), close every sender (which tells each receiver END, unless
        ``abort``). Receivers stay open so that peers doing the same meanwhile can still
        deliver their END. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self._cancel_tasks(timeout)
        await self._stop_stages(timeout)
        if not abort:
            for sender in self._senders.values():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sender.aclose(), timeout)

    async def release(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Shutdown, second phase: close receivers and transports (``abort`` drops whatever
        is still queued for a peer instead of waiting for it). Idempotent."""
        if not self._stopped:
            await self.quiesce(timeout, abort=abort)
        # NOTE: one at a time off the dicts, so that a release cut short (cancelled) leaves
        # what it has not closed yet for a later one.
        while self._receivers:
            _, receiver = self._receivers.popitem()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(receiver.aclose(), timeout)
        while self._transports:
            _, transport = self._transports.popitem()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(transport.aclose(abort=abort), timeout)

    async def stop(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Both shutdown phases at once. Idempotent."""
        await self.quiesce(timeout, abort=abort)
        await self.release(timeout, abort=abort)

    async def abort(self, timeout: float = 1.0) -> None:
        """Forced shutdown, also finishing one that was cut short (cancelled): cancel what
        still runs, stop the stages whose ``stop`` was not called yet, drop whatever is
        queued, close every link and transport. Idempotent."""
        self._stopped = True
        await self._cancel_tasks(timeout)
        await self._stop_stages(timeout)
        await self.release(timeout, abort=True)

    async def _cancel_tasks(self, timeout: float) -> None:
        """Cancel the stages' tasks (background ones too) and the pumps; wait for them up to
        ``timeout``."""
        for task in await self._tasks.aclose(timeout):
            logger.warning("host %s: task %s ignored its cancellation", self.name, task)

    async def _stop_stages(self, timeout: float) -> None:
        """Call ``stop`` (each up to ``timeout``) of every stage not stopped yet, in order."""
        for cell in self._cells.values():
            if cell.stop_started:
                continue
            cell.stop_started = True
            try:
                await asyncio.wait_for(cell.stage.stop(), timeout)
            except Exception:
                logger.exception("stage %s failed to stop cleanly", cell.name)
            finally:
                cell.stage._shutdown_executor()
                cell.mailbox.close_receiving()


def _cancel_requested() -> bool | None:
    """Whether the current task has been asked to cancel; None where Python cannot tell
    (3.10, which has no ``Task.cancelling``)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return None if cancelling is None else cancelling() > 0
