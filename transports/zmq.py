"""ZeroMQ links: a DEALER socket that connects sends to a ROUTER socket that binds.

Each message is one multipart ZMQ message, ``[header_frame, *out_of_band_buffers]`` from
:class:`~transports.framing.FrameCodec`; buffers go out with ``copy=False`` and arrive as
``zmq.Frame`` memoryviews, so large tensors are not copied on either side. A sender says
HELLO (with its name) when it connects, HEARTBEAT whenever it has been idle for
``heartbeat_interval`` and END when it closes gracefully; a receiver that hears nothing for
``heartbeat_timeout`` while it waits raises :class:`~transports.errors.PeerLostError`.

One sender per receiver: the ROUTER tells connections apart (each sender has a random
routing id, kept across reconnects), and the first peer to say HELLO becomes the link's
sender. Anything else from any other peer (its HELLO, data, END) is dropped with a warning,
so a stray peer cannot end or feed the link. (The sockets are not authenticated: a peer
that says HELLO before the real sender would take its place.)

Size limit: the receiving socket's ZMQ_MAXMSGSIZE is ``max_message_bytes`` plus framing
headroom (see :func:`frame_limit`; libzmq applies it to each frame), so libzmq refuses an
oversized frame as soon as its length arrives, before buffering it, and disconnects that
peer; nothing reaches ``receive``. A connecting peer reconnects and goes on with its next
message: the oversized one is lost. ``send`` therefore refuses (EncodeError) a frame over
that limit. Frames over ``max_message_bytes`` but within the headroom arrive and are
dropped by the decoder (a logged decode error).

Addresses: ``ipc://PATH`` (``listen(None)`` picks a fresh path in a private directory of the
transport), ``tcp://HOST:PORT`` (port 0 binds a free port; the receiver's ``address`` reports
it; ``[HOST]`` for IPv6) and ``inproc://NAME`` (same transport only). A transport made with
``tcp_interface`` binds ``listen(None)`` on that interface and a port the OS picks instead of
on ipc, so that senders on other machines can connect (a runtime setting:
``StartOptions(transport_settings={"zmq": {"tcp_interface": "10.0.0.5"}})``).

Limits of what ZMQ can tell:

- A sender cannot see the receiver go away: DEALER keeps queueing, so once ``capacity``
  messages are buffered on each side (plus what the kernel holds), ``send`` simply waits.
  Supervisors detect a dead receiving process by its sentinel; a dead *sender* is detected by
  the receiver's heartbeat timeout.
- The heartbeat timeout assumes the sender's event loop is not blocked for that long.
- Closing the sending socket while its receiver is behind (receive high-water mark reached)
  can drop the tail of the stream despite ZMQ_LINGER (zeromq/libzmq#4660, #1922). So a closed
  sender keeps its socket, still delivering, until :meth:`ZmqTransport.aclose`: close the
  transport once receivers have drained. If the tail is lost anyway, END is lost with it and
  the receiver raises PeerLostError after ``heartbeat_timeout``: never a silent loss.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import zmq
import zmq.asyncio

from transports._byte_links import (
    InboundFrames,
    SilenceWatchdog,
    cancel_requested,
    link_frame_codec,
)
from transports.base import LinkOptions, LinkStatistics, Receiver, Sender, Transport
from transports.codec import Buffer, Codec
from transports.errors import (
    EncodeError,
    EndOfStream,
    LinkClosedError,
    PeerLostError,
    TransportError,
)
from transports.framing import FrameCodec, FrameKind

__all__ = [
    "IPC_DIR_PREFIX",
    "ZmqReceiver",
    "ZmqSender",
    "ZmqTransport",
    "frame_limit",
    "made_ipc_directory",
]

logger = logging.getLogger("actorline.transports.zmq")

_SCHEMES = ("ipc://", "tcp://", "inproc://")
_IPC = "ipc://"
#: the name of every ipc directory actorline makes (a host process's own, or one its parent
#: made for it), which is how an orphaned host knows what it may remove
IPC_DIR_PREFIX = "actorline-zmq-"
_TCP = "tcp://"
_MILLISECONDS = 1000
_HEARTBEAT_FRAME = FrameCodec.control(FrameKind.HEARTBEAT)[0]
_END_FRAME = FrameCodec.control(FrameKind.END)[0]
#: a HELLO frame starts with these bytes (magic, version, kind: see transports.framing)
_HELLO_PREFIX = bytes(FrameCodec.control(FrameKind.HELLO)[0][:3])
#: how many distinct stray peers a receiver warns about (then it drops them quietly)
_STRAY_WARNINGS = 16


def made_ipc_directory(address: str) -> str | None:
    """The ipc directory actorline made (named :data:`IPC_DIR_PREFIX`...) that holds the
    socket file of ``address``; None for any other address (tcp, a user's ``ipc_dir``)."""
    if not address.startswith(_IPC):
        return None
    directory = os.path.dirname(address[len(_IPC) :])
    return directory if os.path.basename(directory).startswith(IPC_DIR_PREFIX) else None


def frame_limit(max_message_bytes: int) -> int:
    """The largest ZMQ frame a link accepts (its ZMQ_MAXMSGSIZE) for ``max_message_bytes``.

    The decoder limits a header frame's payload and each uncompressed buffer to
    ``max_message_bytes``. On top of that a header frame holds 10 bytes of header and up to
    65535 buffer flags, and a zstd-compressed buffer may be slightly larger than the buffer
    (ZSTD_compressBound: n + n/256 + under 64 KiB).
    """
    return max_message_bytes + (max_message_bytes >> 8) + (128 << 10)


def _events(socket: zmq.Socket[bytes]) -> int:
    """The socket's ZMQ_EVENTS (POLLIN/POLLOUT readiness)."""
    return cast(int, socket.get(zmq.EVENTS))


def _wire_size(frames: Sequence[Buffer]) -> int:
    size = 0
    for frame in frames:
        size += memoryview(frame).nbytes
    return size


class ZmqReceiver(Receiver):
    """The ROUTER end of a ZMQ link. See :class:`~transports.base.Receiver` for the contract."""

    def __init__(
        self,
        transport: ZmqTransport,
        socket: zmq.asyncio.Socket,
        address: str,
        ipc_path: str | None,
    ) -> None:
        options = transport.options
        self.address = address
        self._transport = transport
        self._socket = socket
        # NOTE: the shadow is the same socket without pyzmq's futures: receive() reads it
        # without blocking and waits on its notification fd itself (see _readable).
        self._shadow: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self._fd = cast(int, self._shadow.get(zmq.FD))
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._ipc_path = ipc_path
        self._capacity = options.capacity
        self._timeout = options.heartbeat_timeout
        self._inbound = InboundFrames(link_frame_codec(transport), logger, address)
        #: the receives waiting for a message, first come first woken
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        # NOTE: silence only counts while a receive waits: a consumer busy elsewhere has not
        # read what its peer sent, which says nothing about the peer. (A waiting future that
        # data arrived for is resolved by the fd callback, which the loop runs before due
        # timers.)
        self._watchdog = SilenceWatchdog(
            options.heartbeat_timeout,
            lambda: any(not future.done() for future in self._waiting),
            self._lose,
        )
        #: the routing id of the link's sender (the first peer that said HELLO)
        self._peer_id: bytes | None = None
        self._strays: set[bytes] = set()
        self._ended = False
        self._lost = False
        self._closed = False

    async def receive(self) -> object:
        """Receive the next message.

        Raises:
            EndOfStream: the sender closed gracefully and everything it sent was delivered.
            PeerLostError: nothing arrived for ``heartbeat_timeout`` after the sender's HELLO.
            LinkClosedError: this receiver was closed.
        """
        inbound = self._inbound
        shadow = self._shadow
        wait = bool(self._waiting)  # another task waits: queue behind it
        while True:
            self._raise_if_finished()
            if wait:
                await self._readable()
            try:
                frames = shadow.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                wait = True
                continue
            except zmq.ZMQError as exc:
                raise LinkClosedError(f"receiver {self.address}: {exc}") from exc
            wait = False
            if self._waiting:  # the next waiter may have a message queued already
                self._on_readable()
            if not self._from_sender(frames):
                continue
            self._watchdog.last_heard = time.monotonic()
            body = frames[1:]
            decoded = inbound.accept([frame.buffer for frame in body], sum(map(len, body)))
            if decoded is None:
                continue
            kind, message = decoded
            if kind is FrameKind.DATA:
                return message
            if kind is FrameKind.HELLO:
                self._watchdog.start()
            elif kind is FrameKind.END:
                self._ended = True
                self._watchdog.stop()

    def _from_sender(self, frames: list[zmq.Frame]) -> bool:
        """Whether ``[routing_id, *frames]`` comes from the link's sender. The first peer to
        say HELLO becomes the sender; whatever other peers send is dropped."""
        peer_id = frames[0].bytes
        if peer_id == self._peer_id:
            return True
        if self._peer_id is None and len(frames) == 2 and frames[1].buffer[:3] == _HELLO_PREFIX:
            self._peer_id = peer_id
            return True
        if peer_id not in self._strays and len(self._strays) < _STRAY_WARNINGS:
            self._strays.add(peer_id)
            owner = self._inbound.peer if self._peer_id is not None else "no sender yet"
            logger.warning(
                "receiver %s: dropping frames from a peer that is not its sender (%s)",
                self.address,
                owner,
            )
        return False

    async def _readable(self) -> None:
        """Wait, in line behind earlier waiters, until the socket may have a message.

        NOTE: one reader callback on the socket's notification fd for the receiver's life,
        and one bare future per wait, instead of pyzmq's future socket (a future, an
        add_reader and a remove_reader, an EAGAIN exception and scheduled callbacks per
        message): serving reads one message per engine step on this path. ZMQ's fd is
        edge-triggered (it signals that the socket's state may have changed, and reading
        ZMQ_EVENTS rearms it), so the callback always reads ZMQ_EVENTS, and whoever takes a
        message while others wait re-checks for them (see :meth:`_on_readable`).
        """
        loop = asyncio.get_running_loop()
        if self._reader_loop is not loop:
            self._stop_reading()
            loop.add_reader(self._fd, self._on_readable)
            self._reader_loop = loop
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append(future)
        try:
            if len(self._waiting) == 1 and _events(self._shadow) & zmq.POLLIN:
                future.set_result(None)  # arrived since the last read
            await future
        except asyncio.CancelledError:
            if len(self._waiting) > 1:  # (this one is done: _on_readable skips it)
                self._on_readable()  # a wake-up this waiter may have taken goes to the next
            # The watchdog or aclose() cancels the wait to interrupt it; say why.
            if not cancel_requested():
                self._raise_if_finished()
            raise
        except zmq.ZMQError as exc:
            raise LinkClosedError(f"receiver {self.address}: {exc}") from exc
        finally:
            self._waiting.remove(future)

    def _on_readable(self) -> None:
        """The fd callback (and a receive that leaves others waiting): read ZMQ_EVENTS, which
        rearms the fd, and wake the first waiter when a message is queued."""
        if self._closed:
            return
        try:
            readable = _events(self._shadow) & zmq.POLLIN
        except zmq.ZMQError:  # the socket broke: stop watching; every waiter's read says why
            self._stop_reading()
            for future in self._waiting:
                if not future.done():
                    future.set_result(None)
            return
        if readable:
            for future in self._waiting:
                if not future.done():
                    future.set_result(None)
                    return

    def _stop_reading(self) -> None:
        loop, self._reader_loop = self._reader_loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)

    def _raise_if_finished(self) -> None:
        if self._closed:
            raise LinkClosedError(f"receiver {self.address} is closed")
        if self._ended:
            raise EndOfStream(f"{self._inbound.peer} closed the link")
        if self._lost:
            raise PeerLostError(
                f"{self._inbound.peer} fell silent for more than {self._timeout} s",
                silent_for=self._timeout,
            )

    def _lose(self, silent_for: float) -> None:
        """The watchdog's verdict: interrupt waiting receives with PeerLostError."""
        logger.warning(
            "%s fell silent for %.1f s; the link is lost", self._inbound.peer, silent_for
        )
        self._lost = True
        for future in self._waiting:
            future.cancel()

    # -- closing ---------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop receiving, close the socket and remove its ipc file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.stop()
        for future in list(self._waiting):
            future.cancel()
        self._stop_reading()
        self._socket.close(linger=0)
        if self._ipc_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)
        self._transport._receivers.discard(self)

    def statistics(self) -> LinkStatistics:
        inbound = self._inbound
        return LinkStatistics(
            transport=ZmqTransport.name,
            address=self.address,
            capacity=self._capacity,
            messages_received=inbound.messages_received,
            bytes_received=inbound.bytes_received,
            decode_errors=inbound.decode_errors,
            waiting_receivers=sum(1 for future in self._waiting if not future.done()),
            closed=self._closed,
            codec_seconds=inbound.codec_seconds,
        )


class ZmqSender(Sender):
    """The DEALER end of a ZMQ link. See :class:`~transports.base.Sender` for the contract.

    Tensors and arrays are sent without copying: do not modify them in place after ``send``.
    """

    def __init__(self, transport: ZmqTransport, socket: zmq.asyncio.Socket, address: str) -> None:
        options = transport.options
        self.address = address
        self._transport = transport
        self._socket = socket
        self._shadow: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self._capacity = options.capacity
        self._interval = options.heartbeat_interval
        self._close_timeout = options.heartbeat_timeout
        self._framer = link_frame_codec(transport)
        self._frame_limit = frame_limit(options.max_message_bytes)
        self._waiting: set[asyncio.Future[Any]] = set()
        # NOTE: zero-copy frames must outlive ZMQ's use of them: messages with out-of-band
        # buffers stay here until their tracker says ZMQ is done with them.
        self._in_flight: collections.deque[tuple[zmq.MessageTracker, Sequence[Buffer]]] = (
            collections.deque()
        )
        self._last_activity = time.monotonic()
        self._heartbeat: asyncio.TimerHandle | None = None
        self._closed = False
        self.messages_sent = 0
        self.bytes_sent = 0
        self.codec_seconds = 0.0

    async def _open(self, name: str) -> None:
        await self._transmit(FrameCodec.control(FrameKind.HELLO, name))
        self._heartbeat = asyncio.get_running_loop().call_later(self._interval, self._beat)

    async def send(self, message: object) -> None:
        """Send one message, waiting while the link is full.

        Raises:
            LinkClosedError: this sender was closed (also if closed while waiting).
            EncodeError: the message cannot be encoded, or has a frame over
                :func:`frame_limit` (the receiver's libzmq would drop it).
        """
        if self._closed:
            raise LinkClosedError(f"sender to {self.address} is closed")
        began = time.perf_counter()
        frames = self._framer.encode(message)
        self.codec_seconds += time.perf_counter() - began
        await self._transmit(frames)
        self.messages_sent += 1

    async def send_frames(self, frames: Sequence[Buffer]) -> None:
        """Send frames that are already encoded (by a relay, or a test feeding raw bytes).

        Raises LinkClosedError like :meth:`send`.
        """
        if self._closed:
            raise LinkClosedError(f"sender to {self.address} is closed")
        await self._transmit(list(frames))
        self.messages_sent += 1

    async def _transmit(self, frames: Sequence[Buffer]) -> None:
        for frame in frames:
            size = memoryview(frame).nbytes
            if size > self._frame_limit:
                raise EncodeError(
                    f"a frame of {size} bytes exceeds the link's limit of {self._frame_limit} "
                    f"bytes (max_message_bytes plus framing)"
                )
        track = len(frames) > 1
        tracker: zmq.MessageTracker | None
        if self._waiting:  # keep order behind sends that are already waiting
            tracker = await self._wait_to_send(frames, track)
        else:
            try:
                tracker = self._shadow.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
            except zmq.Again:
                tracker = await self._wait_to_send(frames, track)
            except zmq.ZMQError as exc:
                raise LinkClosedError(f"sender to {self.address}: {exc}") from exc
        self._last_activity = time.monotonic()
        self.bytes_sent += _wire_size(frames)
        in_flight = self._in_flight
        while in_flight and in_flight[0][0].done:
            in_flight.popleft()
        if tracker is not None and not tracker.done:
            in_flight.append((tracker, frames))

    async def _wait_to_send(
        self, frames: Sequence[Buffer], track: bool
    ) -> zmq.MessageTracker | None:
        future: asyncio.Future[zmq.MessageTracker | None] = self._socket.send_multipart(  # type: ignore[assignment]
            frames, copy=False, track=track
        )
        self._waiting.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            if self._closed and not cancel_requested():
                raise LinkClosedError(f"sender to {self.address} was closed") from None
            raise
        except zmq.ZMQError as exc:
            raise LinkClosedError(f"sender to {self.address}: {exc}") from exc
        finally:
            self._waiting.discard(future)

    def _beat(self) -> None:
        """Timer callback: send a heartbeat if nothing was sent for a heartbeat interval."""
        self._heartbeat = None
        if self._closed:
            return
        now = time.monotonic()
        delay = self._interval - (now - self._last_activity)
        if delay <= 0:
            # A sender waiting for room has data queued, which the receiver will hear.
            if not self._waiting:
                try:
                    self._shadow.send(_HEARTBEAT_FRAME, zmq.NOBLOCK)
                    self.bytes_sent += len(_HEARTBEAT_FRAME)
                except zmq.Again:
                    pass  # full: the receiver has data queued, which it hears
                except zmq.ZMQError:
                    return
            self._last_activity = now
            delay = self._interval
        self._heartbeat = asyncio.get_running_loop().call_later(delay, self._beat)

    async def aclose(self) -> None:
        """Send END and stop sending; sends waiting in other tasks raise LinkClosedError.

        The socket itself stays open, delivering what is queued, until the transport
        closes. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        for future in list(self._waiting):
            future.cancel()
        await self._say_end()

    def _abandon(self) -> None:
        """Stop sending without END (the transport is being aborted)."""
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        for future in list(self._waiting):
            future.cancel()

    def _release(self, *, abort: bool = False) -> None:
        """Close the socket; ZMQ goes on flushing for up to ``heartbeat_timeout`` (not at all
        when aborting)."""
        linger = 0 if abort else int(self._close_timeout * _MILLISECONDS)
        self._socket.close(linger=linger)
        self._in_flight.clear()

    async def _say_end(self) -> None:
        try:
            if not _events(self._shadow) & zmq.POLLOUT:
                # The link is full: wait (bounded) for the receiver to make room.
                poller = zmq.asyncio.Poller()
                poller.register(self._socket, zmq.POLLOUT)
                if not await poller.poll(int(self._close_timeout * _MILLISECONDS)):
                    raise zmq.Again()
            self._shadow.send(_END_FRAME, zmq.NOBLOCK)
            self.bytes_sent += len(_END_FRAME)
        except zmq.ZMQError:
            logger.warning("sender to %s closed without END: the link stayed full", self.address)

    def statistics(self) -> LinkStatistics:
        return LinkStatistics(
            transport=ZmqTransport.name,
            address=self.address,
            capacity=self._capacity,
            messages_sent=self.messages_sent,
            bytes_sent=self.bytes_sent,
            waiting_senders=sum(1 for future in self._waiting if not future.done()),
            closed=self._closed,
            codec_seconds=self.codec_seconds,
        )


class ZmqTransport(Transport):
    """ZeroMQ DEALER/ROUTER links (ipc://, tcp://, inproc://).

    One ZMQ context per transport instance, created on first use and terminated by
    :meth:`aclose`, which also closes links still open and removes the private directory
    holding the ipc files of ``listen(None)``.

    ``ipc_dir``: that private directory, chosen by the caller instead of created on first
    use (it is created if missing). It belongs to this transport: aclose removes it with
    everything in it. A parent process that spawns a process running this transport hands
    it a directory this way, so that it can remove it if the child dies without closing.

    ``tcp_interface``: ``listen(None)`` binds ``tcp://INTERFACE:0`` (a port the OS picks)
    instead of a fresh ipc path. INTERFACE is an address or host name of this machine that
    the senders can reach (a receiver reports the address it bound, so a wildcard such as
    ``0.0.0.0`` gives an address only local senders can use); an IPv6 address is fine.

    Raises (constructor):
        ValueError: ``tcp_interface`` is empty or holds a port, a path or a scheme.
    """

    name: ClassVar[str] = "zmq"

    def __init__(
        self,
        options: LinkOptions | None = None,
        *,
        codec: Codec | None = None,
        ipc_dir: str | os.PathLike[str] | None = None,
        tcp_interface: str | None = None,
    ) -> None:
        super().__init__(options, codec=codec)
        self._context: zmq.asyncio.Context | None = None
        self._private_dir: str | None = os.fspath(ipc_dir) if ipc_dir is not None else None
        self._tcp_host = _tcp_host(tcp_interface) if tcp_interface is not None else None
        self._ipc_names = itertools.count(1)
        self._receivers: set[ZmqReceiver] = set()
        #: every sender, its socket open until the transport closes (see the module notes)
        self._senders: list[ZmqSender] = []
        self._closed = False

    async def listen(self, address: str | None = None) -> ZmqReceiver:
        """Bind a ROUTER socket at ``address`` (None: a fresh ipc path, or a free tcp port
        on ``tcp_interface`` when the transport has one).

        Raises:
            ValueError: the address is not ipc://, tcp:// or inproc://.
            TransportError: the address cannot be bound (in use, bad path...).
            LinkClosedError: the transport was closed.
        """
        if self._closed:  # before a fresh ipc address would make a directory nobody removes
            raise LinkClosedError("the zmq transport is closed")
        if address is None:
            if self._tcp_host is not None:
                address = f"{_TCP}{self._tcp_host}:0"
            else:
                address = self._fresh_ipc_address()
        _check_address(address)
        socket = self._new_socket(zmq.ROUTER, address)
        socket.setsockopt(zmq.RCVHWM, self.options.capacity)
        socket.setsockopt(zmq.MAXMSGSIZE, frame_limit(self.options.max_message_bytes))
        try:
            socket.bind(address)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise TransportError(f"cannot bind {address}: {exc}") from exc
        bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        ipc_path = bound[len(_IPC) :] if bound.startswith(_IPC) else None
        if ipc_path is not None and ipc_path.startswith("@"):
            ipc_path = None  # Linux abstract namespace: no file
        receiver = ZmqReceiver(self, socket, bound, ipc_path)
        self._receivers.add(receiver)
        return receiver

    async def connect(self, address: str, *, name: str = "") -> ZmqSender:
        """Connect a DEALER socket to a receiver's address and say HELLO.

        Raises:
            ValueError: the address is not ipc://, tcp:// or inproc://.
            LinkClosedError: the transport was closed.
        """
        _check_address(address)
        socket = self._new_socket(zmq.DEALER, address)
        socket.setsockopt(zmq.SNDHWM, self.options.capacity)
        # NOTE: a routing id of our own (not one the ROUTER makes up per connection) stays
        # the same across reconnects; random, so another peer cannot claim it. libzmq
        # reserves ids starting with a zero byte.
        socket.setsockopt(zmq.ROUTING_ID, b"\x01" + secrets.token_bytes(15))
        try:
            socket.connect(address)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        sender = ZmqSender(self, socket, address)
        self._senders.append(sender)
        await sender._open(name or f"pid {os.getpid()}")
        return sender

    def _new_socket(self, kind: int, address: str) -> zmq.asyncio.Socket:
        if self._closed:
            raise LinkClosedError("the zmq transport is closed")
        if self._context is None:
            self._context = zmq.asyncio.Context()
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if address.startswith(f"{_TCP}["):  # an IPv6 address: libzmq needs it switched on
            socket.setsockopt(zmq.IPV6, 1)
        return socket

    def _fresh_ipc_address(self) -> str:
        if self._private_dir is None:
            self._private_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        elif not os.path.isdir(self._private_dir):
            os.makedirs(self._private_dir, mode=0o700, exist_ok=True)
        return f"{_IPC}{self._private_dir}/{next(self._ipc_names)}"

    async def aclose(self, *, abort: bool = False) -> None:
        """Close links still open, terminate the context, remove the private ipc directory.

        Waits (in a helper thread) for senders' queued messages to drain, at most
        ``heartbeat_timeout``; ``abort`` drops them instead. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for sender in self._senders:
            if abort:
                sender._abandon()
            else:
                await sender.aclose()
        for receiver in list(self._receivers):
            await receiver.aclose()
        for sender in self._senders:
            sender._release(abort=abort)
        self._senders.clear()
        context, self._context = self._context, None
        if context is not None:
            await _terminate(context)
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None


def _tcp_host(interface: str) -> str:
    """``interface`` as the host part of a tcp:// address (IPv6 in brackets).

    Raises:
        ValueError: empty, or it holds a scheme, a port or a path.
    """
    host = interface.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or "/" in host or "[" in host or "]" in host or " " in host:
        raise ValueError(f"tcp_interface must be an address or host name, got {interface!r}")
    if ":" in host:
        if host.count(":") == 1:  # HOST:PORT
            raise ValueError(
                f"tcp_interface names an interface, not a port (the OS picks one); "
                f"got {interface!r}"
            )
        return f"[{host}]"
    return host


def _check_address(address: str) -> None:
    if not address.startswith(_SCHEMES):
        raise ValueError(f"a zmq address starts with one of {', '.join(_SCHEMES)}; got {address!r}")


async def _terminate(context: zmq.Context[Any]) -> None:
    """Terminate a context without blocking the event loop: ``term`` waits for lingering
    sockets to flush, so it runs in a short-lived thread of its own."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()

    def notify() -> None:
        if not finished.done():
            finished.set_result(None)

    def term() -> None:
        try:
            context.term()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop may be gone already
                loop.call_soon_threadsafe(notify)

    thread = threading.Thread(target=term, name="actorline-zmq-term", daemon=True)
    thread.start()
    await finished
    thread.join()
