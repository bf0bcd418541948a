"""A host runs the stages placed on it inside one event loop.

Links between stages of the same host deliver straight into the target's mailbox (a bounded
:class:`~transports.memory.MemoryChannel`); links to other hosts go through a transport: this
host listens for its inbound links (a pump task moves each received message into the target
mailbox) and connects senders for its outbound ones. A stage that raises, or a link whose peer
is lost, is reported through ``on_failure``; the controller then fails the whole pipeline.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import plugins
from pipeline._protocol import (
    HANDLE_SECONDS_BUCKETS,
    HostPlan,
    HostStatistics,
    RemoteLink,
    StageStatistics,
)
from pipeline.errors import PipelineError, StageFailedError
from pipeline.graph import BOUNDARY, Endpoint
from pipeline.stage import Stage
from transports.base import Receiver, Sender, Transport
from transports.errors import EndOfStream, LinkClosedError, PeerLostError
from transports.memory import MemoryChannel

__all__ = ["Host"]

logger = logging.getLogger("actorline.host")

FailureCallback = Callable[[BaseException], None]
_Deliver = Callable[[Any], Awaitable[None]]


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
        "stage",
        "task",
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


class Host:
    """The stages of one placement, their mailboxes, routes and cross-host links."""

    def __init__(
        self,
        plan: HostPlan,
        on_failure: FailureCallback,
        *,
        exits: dict[str, MemoryChannel[Any]] | None = None,
    ) -> None:
        self.plan = plan
        self.name = plan.name
        self._on_failure = on_failure
        self._exits = exits or {}
        self._cells: dict[str, _StageCell] = {}
        self._routes: dict[tuple[str, str], tuple[_Deliver, ...]] = {}
        self._transports: dict[str, Transport] = {}
        self._receivers: dict[str, Receiver] = {}
        self._senders: dict[str, Sender] = {}
        self._pumps: list[asyncio.Task[None]] = []
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
            self._add_route(source, self._local_deliver(target))

    def _local_deliver(self, target: Endpoint) -> _Deliver:
        if target.stage == BOUNDARY:
            return self._exits[target.port].send
        mailbox = self._cells[target.stage].mailbox
        port = target.port

        async def deliver(message: Any) -> None:
            await mailbox.send((port, message))

        return deliver

    def _add_route(self, source: Endpoint, deliver: _Deliver) -> None:
        key = (source.stage, source.port)
        self._routes[key] = (*self._routes.get(key, ()), deliver)

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
            self._pumps.append(
                asyncio.create_task(self._pump(link, receiver), name=f"pump:{link.link_id}")
            )
        return addresses

    async def connect_links(self, addresses: dict[str, str]) -> None:
        """Connect a sender for every outbound cross-host link."""
        for link in self.plan.outbound:
            address = addresses[link.link_id]
            sender = await self._transport(link.transport).connect(
                address, name=f"{self.name}/{link.endpoint}#{link.link_id}"
            )
            self._senders[link.link_id] = sender
            self._add_route(link.endpoint, sender.send)

    async def start_stages(self) -> None:
        """Run every stage's ``start`` (concurrently), then start handling messages.

        Raises:
            StageFailedError: a stage's start raised.
        """

        async def start_one(cell: _StageCell) -> None:
            try:
                await cell.stage.start()
            except Exception as exc:
                raise self._stage_error(cell.name, exc) from exc

        await asyncio.gather(*(start_one(cell) for cell in self._cells.values()))
        for cell in self._cells.values():
            cell.task = asyncio.create_task(self._run_stage(cell), name=f"stage:{cell.name}")

    # -- running --------------------------------------------------------------------------------

    async def emit(self, stage: str, port: str, message: Any) -> None:
        routes = self._routes.get((stage, port))
        if routes is None:
            self._unrouted(stage, port)
            return
        for deliver in routes:
            await deliver(message)

    async def send_entry(self, entry: str, message: Any) -> None:
        """Deliver a message sent by the caller to an entry (main host only)."""
        await self.emit(BOUNDARY, entry, message)

    def _unrouted(self, stage: str, port: str) -> None:
        cell = self._cells.get(stage)
        if cell is not None:
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
                await handle(message, port)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._fail(self._stage_error(cell.name, exc), exc)
                return
            finally:
                elapsed = clock() - started
                cell.handle_seconds += elapsed
                buckets[bisect.bisect_left(bounds, elapsed)] += 1
                cell.handled += 1
                cell.busy = False

    async def _pump(self, link: RemoteLink, receiver: Receiver) -> None:
        deliver = self._local_deliver(link.endpoint)
        try:
            while True:
                await deliver(await receiver.receive())
        except (EndOfStream, LinkClosedError):
            return
        except PeerLostError as exc:
            if not self._stopped:
                self._fail(PeerLostError(f"link {link.link_id} into {link.endpoint}: {exc}"), exc)

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

    def _fail(self, error: PipelineError | PeerLostError, cause: BaseException) -> None:
        if self._failed or self._stopped:
            return
        self._failed = True
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
        """Shutdown, first phase: stop handling, stop every stage, close every sender (which
        tells each receiver END, unless ``abort``). Receivers stay open so that peers doing
        the same meanwhile can still deliver their END. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        tasks = [cell.task for cell in self._cells.values() if cell.task is not None]
        tasks += self._pumps
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for cell in self._cells.values():
            try:
                await asyncio.wait_for(cell.stage.stop(), timeout)
            except Exception:
                logger.exception("stage %s failed to stop cleanly", cell.name)
            cell.stage._shutdown_executor()
            cell.mailbox.close_receiving()
        if not abort:
            for sender in self._senders.values():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sender.aclose(), timeout)

    async def release(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Shutdown, second phase: close receivers and transports (``abort`` drops whatever
        is still queued for a peer instead of waiting for it). Idempotent."""
        if not self._stopped:
            await self.quiesce(timeout, abort=abort)
        receivers, self._receivers = self._receivers, {}
        for receiver in receivers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(receiver.aclose(), timeout)
        transports, self._transports = self._transports, {}
        for transport in transports.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(transport.aclose(abort=abort), timeout)

    async def stop(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Both shutdown phases at once. Idempotent."""
        await self.quiesce(timeout, abort=abort)
        await self.release(timeout, abort=abort)
