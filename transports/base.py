"""The link contract every transport implements.

A link carries messages one way, from a :class:`Sender` to a :class:`Receiver`, in order.
A transport creates receivers with :meth:`Transport.listen` (the receiver binds an address)
and senders with :meth:`Transport.connect` (the sender connects to that address). One sender
per receiver. Links are bounded: ``send`` waits while the link is full (backpressure).

Errors (all in :mod:`transports.errors`):

- ``send`` raises :class:`LinkClosedError` after this sender was closed (or, where the
  transport can tell, after the receiver was closed), :class:`PeerLostError` where the
  transport can tell the receiver is gone, :class:`EncodeError` for a message it cannot encode.
- ``receive`` raises :class:`EndOfStream` once the sender closed gracefully and everything it
  sent was delivered, :class:`PeerLostError` when the sender vanished (connection broken, or
  silent past ``heartbeat_timeout``), :class:`LinkClosedError` after this receiver was closed.
  A frame that does not decode never surfaces from ``receive``: it is logged with the peer,
  counted in ``statistics().decode_errors`` and skipped.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, ClassVar

from transports.codec import Codec
from transports.compression import Compression
from transports.errors import EndOfStream

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["LinkOptions", "LinkStatistics", "Receiver", "Sender", "Transport"]


@dataclasses.dataclass(frozen=True, slots=True)
class LinkOptions:
    """Options shared by every transport.

    ``capacity``: messages buffered per link before ``send`` waits.
    ``heartbeat_interval``: an idle sender sends a heartbeat this often (seconds).
    ``heartbeat_timeout``: a receiver that hears nothing for this long raises PeerLostError.
    ``max_message_bytes``: largest frame (or decompressed frame) a receiver accepts.
    """

    compression: Compression | None = None
    capacity: int = 1024
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    max_message_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {self.heartbeat_interval}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")


@dataclasses.dataclass(frozen=True, slots=True)
class LinkStatistics:
    """A snapshot of one end of a link.

    ``queued``: messages buffered at this end. ``waiting_senders`` / ``waiting_receivers``:
    tasks blocked in ``send`` / ``receive``. Byte counts are on the wire (after compression).
    ``codec_seconds``: time spent encoding (sending end) or decoding (receiving end)
    messages, compression included (0 where nothing is encoded, as in memory links).
    """

    transport: str
    address: str
    capacity: int
    queued: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    decode_errors: int = 0
    waiting_senders: int = 0
    waiting_receivers: int = 0
    closed: bool = False
    codec_seconds: float = 0.0


class Sender(abc.ABC):
    """The sending end of a link."""

    address: str

    @abc.abstractmethod
    async def send(self, message: object) -> None:
        """Send one message, waiting while the link is full."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close gracefully: the receiver gets what was sent, then EndOfStream. Idempotent."""

    @abc.abstractmethod
    def statistics(self) -> LinkStatistics: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Receiver(abc.ABC):
    """The receiving end of a link; ``address`` is where a sender connects."""

    address: str

    @abc.abstractmethod
    async def receive(self) -> object:
        """Receive the next message, waiting until one arrives."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop receiving and release the address. Idempotent."""

    @abc.abstractmethod
    def statistics(self) -> LinkStatistics: ...

    def __aiter__(self) -> Receiver:
        return self

    async def __anext__(self) -> object:
        try:
            return await self.receive()
        except EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Transport(abc.ABC):
    """Creates links of one kind. Registered in the ``actorline.transports`` plugin group.

    A transport instance may hold shared resources (a ZMQ context, a gRPC server); release
    them with :meth:`aclose` after closing its links.
    """

    name: ClassVar[str]
    api_version: ClassVar[int] = 1
    #: whether messages cross a process boundary as bytes (memory links pass objects)
    encodes: ClassVar[bool] = True

    def __init__(self, options: LinkOptions | None = None, *, codec: Codec | None = None) -> None:
        self.options = options if options is not None else LinkOptions()
        self.codec = codec

    @abc.abstractmethod
    async def listen(self, address: str | None = None) -> Receiver:
        """Bind a receiver. ``address`` None picks a fresh local address (an ipc path, a
        free port); the receiver's ``address`` attribute says where it is."""

    @abc.abstractmethod
    async def connect(self, address: str, *, name: str = "") -> Sender:
        """Connect a sender to a receiver's address. ``name`` identifies this sender to the
        receiver in its logs and errors."""

    async def aclose(self, *, abort: bool = False) -> None:
        """Close links still open and release resources shared by this transport's links.
        Graceful by default (queued messages are still delivered, bounded by
        ``heartbeat_timeout``); ``abort=True`` drops them and returns at once."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
