"""In-memory links: the reference transport, and the bounded mailbox of every stage.

:class:`MemoryChannel` is a bounded FIFO between tasks of one event loop. It passes objects
as they are (no encoding), so it is also the fastest link. :class:`MemoryTransport` exposes
it behind the :class:`~transports.base.Transport` contract for links inside one process.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from typing import Any, ClassVar, Generic, TypeVar

from transports.base import LinkOptions, LinkStatistics, Receiver, Sender, Transport
from transports.errors import EndOfStream, LinkClosedError, TransportError

__all__ = [
    "MemoryChannel",
    "MemoryReceiver",
    "MemorySender",
    "MemoryTransport",
    "WouldBlock",
    "wake_all",
    "wake_one",
]

T = TypeVar("T")


class WouldBlock(TransportError):
    """``send_nowait`` on a full channel, or ``receive_nowait`` on an empty one."""


def wake_one(waiters: collections.deque[asyncio.Future[None]]) -> None:
    """Wake the first of ``waiters`` still waiting (removing it and any cancelled before it)."""
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return


def wake_all(waiters: collections.deque[asyncio.Future[None]]) -> None:
    """Wake every one of ``waiters`` still waiting, emptying the queue."""
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)


class MemoryChannel(Generic[T]):
    """A bounded FIFO channel between tasks of one event loop.

    ``send`` waits while ``capacity`` items are queued. ``close_sending`` ends the stream:
    the receiver drains what is queued, then gets :class:`EndOfStream`. ``close_receiving``
    makes every further ``send`` raise :class:`LinkClosedError`. ``fail(exc)`` makes waiting
    and later calls on both ends raise ``exc`` (used when a peer is lost).
    """

    def __init__(self, capacity: int, *, name: str = "") -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._items: collections.deque[T] = collections.deque()
        self._getters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._putters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sending_closed = False
        self._receiving_closed = False
        self._error: BaseException | None = None
        self.sent = 0
        self.received = 0

    # -- sending -----------------------------------------------------------------------------

    async def send(self, item: T) -> None:
        """Queue ``item``, waiting while the channel is full.

        Raises LinkClosedError if either end is closed, or the error given to ``fail``.
        """
        while True:
            self._check_send()
            if len(self._items) < self.capacity:
                break
            waiter = asyncio.get_running_loop().create_future()
            self._putters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                wake_one(self._putters)  # pass the slot on if we were woken then cancelled
                raise
        self._items.append(item)
        self.sent += 1
        if self._getters:
            wake_one(self._getters)

    def send_nowait(self, item: T) -> None:
        """Queue ``item`` or raise :class:`WouldBlock` if full."""
        self._check_send()
        if len(self._items) >= self.capacity:
            raise WouldBlock(f"channel {self.name!r} is full ({self.capacity} items)")
        self._items.append(item)
        self.sent += 1
        if self._getters:
            wake_one(self._getters)

    def _check_send(self) -> None:
        if self._error is not None:
            raise self._error
        if self._sending_closed:
            raise LinkClosedError(f"channel {self.name!r}: sending end is closed")
        if self._receiving_closed:
            raise LinkClosedError(f"channel {self.name!r}: receiving end is closed")

    def close_sending(self) -> None:
        """End the stream; the receiver drains queued items then gets EndOfStream."""
        self._sending_closed = True
        wake_all(self._getters)
        wake_all(self._putters)

    # -- receiving ---------------------------------------------------------------------------

    async def receive(self) -> T:
        """Take the next item, waiting while the channel is empty.

        Raises EndOfStream after ``close_sending`` once drained, LinkClosedError after
        ``close_receiving``, or the error given to ``fail``.
        """
        while not self._items:
            self._check_receive()
            waiter = asyncio.get_running_loop().create_future()
            self._getters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                if self._items:
                    wake_one(self._getters)
                raise
        return self._take()

    def receive_nowait(self) -> T:
        """Take the next item or raise :class:`WouldBlock` if empty."""
        if not self._items:
            self._check_receive()
            raise WouldBlock(f"channel {self.name!r} is empty")
        return self._take()

    def _take(self) -> T:
        """The next queued item (there is one), waking a sender waiting for room.

        Raises:
            LinkClosedError: after ``close_receiving``.
        """
        if self._receiving_closed:
            raise LinkClosedError(f"channel {self.name!r}: receiving end is closed")
        item = self._items.popleft()
        self.received += 1
        if self._putters:
            wake_one(self._putters)
        return item

    def _check_receive(self) -> None:
        if self._receiving_closed:
            raise LinkClosedError(f"channel {self.name!r}: receiving end is closed")
        if self._error is not None:
            raise self._error
        if self._sending_closed:
            raise EndOfStream(f"channel {self.name!r}: the sender closed")

    def close_receiving(self) -> None:
        """Stop receiving; queued items are dropped and senders get LinkClosedError."""
        self._receiving_closed = True
        self._items.clear()
        wake_all(self._getters)
        wake_all(self._putters)

    def fail(self, error: BaseException) -> None:
        """Make both ends raise ``error`` (queued items are still delivered first)."""
        if self._error is None:
            self._error = error
        wake_all(self._getters)
        wake_all(self._putters)

    # -- introspection -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._sending_closed or self._receiving_closed

    def statistics(self, *, transport: str = "memory", address: str = "") -> LinkStatistics:
        return LinkStatistics(
            transport=transport,
            address=address or self.name,
            capacity=self.capacity,
            queued=len(self._items),
            messages_sent=self.sent,
            messages_received=self.received,
            waiting_senders=sum(1 for f in self._putters if not f.done()),
            waiting_receivers=sum(1 for f in self._getters if not f.done()),
            closed=self.closed,
        )


class MemorySender(Sender):
    def __init__(self, channel: MemoryChannel[Any], address: str) -> None:
        self._channel = channel
        self.address = address
        self._closed = False

    async def send(self, message: object) -> None:
        if self._closed:
            raise LinkClosedError(f"sender to {self.address} is closed")
        await self._channel.send(message)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close_sending()

    def statistics(self) -> LinkStatistics:
        return self._channel.statistics(address=self.address)


class MemoryReceiver(Receiver):
    def __init__(self, channel: MemoryChannel[Any], address: str) -> None:
        self._channel = channel
        self.address = address

    async def receive(self) -> object:
        return await self._channel.receive()

    async def aclose(self) -> None:
        self._channel.close_receiving()
        MemoryTransport._listeners.pop(self.address, None)

    def statistics(self) -> LinkStatistics:
        return self._channel.statistics(address=self.address)


class MemoryTransport(Transport):
    """Links between tasks of one process, passing objects without encoding."""

    name: ClassVar[str] = "memory"
    encodes: ClassVar[bool] = False
    _listeners: ClassVar[dict[str, MemoryChannel[Any]]] = {}
    _counter: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(self, options: LinkOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)

    async def listen(self, address: str | None = None) -> Receiver:
        if address is None:
            address = f"memory://{next(self._counter)}"
        if not address.startswith("memory://"):
            raise ValueError(f"a memory address starts with 'memory://', got {address!r}")
        if address in self._listeners:
            raise ValueError(f"memory address {address} is already in use")
        channel: MemoryChannel[Any] = MemoryChannel(self.options.capacity, name=address)
        self._listeners[address] = channel
        return MemoryReceiver(channel, address)

    async def connect(self, address: str, *, name: str = "") -> Sender:
        channel = self._listeners.get(address)
        if channel is None:
            raise LinkClosedError(f"nothing listens on {address}")
        return MemorySender(channel, address)
