"""gRPC links: one bidirectional stream per link, over grpc.aio.

Each :class:`GrpcTransport` runs at most one grpc.aio server (started by the first
``listen``) serving the generic stream-stream method ``/actorline.link.v1.Link/Stream`` with
bytes in and out, so links need no protobuf. Every ``listen`` registers a *link id*; its
address is ``grpc://HOST:PORT/LINK_ID`` and a sender names the link id in its call
metadata (one sender per link). A link message is its
:class:`~transports.framing.FrameCodec` header frame as it is when there are no
out-of-band buffers, else all frames joined as ``count u32 | length u32 * count | frame
bytes...`` (network byte order; see :func:`split_frames`). A gRPC message carries one link
message, or several small ones that queued up while the previous write was in flight, as
``0xBA | count u32 | length u32 * count | messages...`` (see :func:`split_batch`): gRPC's
cost per message (two completion-queue round trips, about 60 µs of CPU here) is then paid
once per batch.

The sender's ``connect`` waits for the server to accept the link id. HELLO, HEARTBEAT and END
work as in :mod:`transports.zmq`. ``send`` hands the encoded message to the sender's writer
task and waits only while ``capacity`` messages (or :data:`PENDING_BYTES`) are not yet
written; cancelling a waiting ``send`` never touches the call. The receiver's stream
handler reads ahead into a queue of ``capacity`` messages; beyond that HTTP/2 flow control
holds the writer back.

What the sender sees when the link goes away:

- the receiver was closed, or its link id is unknown: ``send`` raises
  :class:`~transports.errors.LinkClosedError` once the closing status has arrived (sends in
  between are lost with the receiver);
- the receiving process died or the connection broke: ``send`` raises
  :class:`~transports.errors.PeerLostError`.

A receiver raises PeerLostError as soon as the stream breaks (the sending process died) and,
as with ZMQ, when nothing arrives for ``heartbeat_timeout`` while nothing is queued.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import grpc
import grpc.aio

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
    TruncatedFrameError,
)
from transports.framing import FRAME_MAGIC, FrameCodec, FrameKind
from transports.memory import MemoryChannel, wake_all, wake_one
from transports.tasks import TaskSet

__all__ = [
    "MAX_FRAMES",
    "GrpcReceiver",
    "GrpcSender",
    "GrpcTransport",
    "join_batch",
    "join_frames",
    "split_batch",
    "split_frames",
]

logger = logging.getLogger("actorline.transports.grpc")

SERVICE = "actorline.link.v1.Link"
METHOD = "Stream"
FULL_METHOD = f"/{SERVICE}/{METHOD}"
#: call metadata key naming the link a sender wants
LINK_ID_KEY = "actorline-link-id"
_ACCEPTED_KEY = "actorline-accepted"
_SCHEME = "grpc://"
_DEFAULT_HOST = "127.0.0.1"

# NOTE: statuses the server ends a stream with, and what the sender makes of them.
_RECEIVER_CLOSED = grpc.StatusCode.ABORTED
_UNKNOWN_LINK = grpc.StatusCode.NOT_FOUND
_LINK_TAKEN = grpc.StatusCode.ALREADY_EXISTS
_PEER_SILENT = grpc.StatusCode.UNAVAILABLE
_CLOSED_BY_RECEIVER = frozenset({grpc.StatusCode.OK, _RECEIVER_CLOSED, _UNKNOWN_LINK, _LINK_TAKEN})

_COUNT = struct.Struct("!I")
#: the most frames one link message has: a header and up to 2**16 - 1 buffers
MAX_FRAMES = 1 << 16
# NOTE: every frame FrameCodec makes starts with this byte (see transports.framing).
_FRAME_MAGIC = bytes([FRAME_MAGIC])
_LENGTH_SIZE = 4
# NOTE: the first byte of a gRPC message carrying several link messages; a single link
# message starts with 0xAC (one frame) or 0 (a frame count), never with this.
_BATCH_MAGIC = bytes([0xBA])
#: small link messages queued behind each other go out as one gRPC message of up to this size
BATCH_BYTES = 256 << 10
#: a link message this large always goes alone
BATCH_ALONE_BYTES = 64 << 10
#: the most link messages in one gRPC message
MAX_BATCH = 4096
#: a sender holds at most this many bytes not yet written (and always one message)
PENDING_BYTES = 8 << 20
#: room for the frame layout and headers on top of ``max_message_bytes``
_ENVELOPE_OVERHEAD = 1 << 16
_GRPC_MAX_MESSAGE_BYTES = 2**31 - 1

_HEARTBEAT_FRAME = FrameCodec.control(FrameKind.HEARTBEAT)[0]
_END_FRAME = FrameCodec.control(FrameKind.END)[0]


def join_frames(frames: Sequence[Buffer]) -> bytes:
    """Pack frames into one gRPC message (see :func:`split_frames` for the layout)."""
    if len(frames) == 1:
        (frame,) = frames
        data = frame if type(frame) is bytes else bytes(frame)
        if data[:1] == _FRAME_MAGIC:  # the common case: a message without buffers
            return data
    lengths = [memoryview(frame).nbytes for frame in frames]
    prefix = struct.pack(f"!I{len(lengths)}I", len(lengths), *lengths)
    return b"".join((prefix, *frames))


def split_frames(data: Buffer) -> list[memoryview]:
    """Split one link message back into frames (memoryviews into ``data``, no copies).

    Layout: a single actorline frame travels as it is (it starts with the frame magic
    0xAC); anything else as ``count u32 | length u32 * count | frame bytes...``, whose first
    byte is 0 since ``count`` is at most :data:`MAX_FRAMES`.

    Raises:
        TruncatedFrameError: the layout is shorter or longer than its lengths declare.
    """
    view = memoryview(data)
    if view[:1] == _FRAME_MAGIC:
        return [view]
    return _split_counted(view, 0, MAX_FRAMES, "frames")


def join_batch(messages: Sequence[bytes]) -> bytes:
    """Pack several link messages (each as :func:`join_frames` makes it) into one gRPC
    message: ``0xBA | count u32 | length u32 * count | message bytes...``."""
    header = struct.pack(f"!cI{len(messages)}I", _BATCH_MAGIC, len(messages), *map(len, messages))
    return b"".join((header, *messages))


def split_batch(data: Buffer) -> list[memoryview]:
    """The link messages in one gRPC message: several if it starts with the batch magic
    0xBA (see :func:`join_batch`), else just ``data`` (memoryviews into it, no copies).

    Raises:
        TruncatedFrameError: a batch shorter or longer than its lengths declare.
    """
    view = memoryview(data)
    if view[:1] != _BATCH_MAGIC:
        return [view]
    return _split_counted(view, 1, MAX_BATCH, "messages")


def _split_counted(view: memoryview, start: int, most: int, what: str) -> list[memoryview]:
    """Split ``count u32 | length u32 * count | parts...`` found at ``start`` in ``view``."""
    total = view.nbytes
    if total < start + _COUNT.size:
        raise TruncatedFrameError(f"a link message of {total} bytes has no {what} count")
    (count,) = _COUNT.unpack_from(view, start)
    offset = start + _COUNT.size + _LENGTH_SIZE * count
    if not 0 < count <= most or offset > total:
        raise TruncatedFrameError(f"a link message of {total} bytes cannot hold {count} {what}")
    lengths = struct.unpack_from(f"!{count}I", view, start + _COUNT.size)
    if sum(lengths) != total - offset:
        raise TruncatedFrameError(
            f"{what} lengths add up to {sum(lengths)} bytes, the message has {total - offset}"
        )
    parts = []
    for length in lengths:
        end = offset + length
        parts.append(view[offset:end])
        offset = end
    return parts


def _message_limit(options: LinkOptions) -> int:
    return min(options.max_message_bytes + _ENVELOPE_OVERHEAD, _GRPC_MAX_MESSAGE_BYTES)


def _size_options(options: LinkOptions) -> list[tuple[str, Any]]:
    limit = _message_limit(options)
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]


class GrpcReceiver(Receiver):
    """The receiving end of a gRPC link.

    The stream handler reads ahead into a queue of ``capacity`` messages (past that, HTTP/2
    flow control holds the sender back), so a sender can hand over ``capacity`` messages of
    any size while the consumer is busy; :meth:`receive` takes them from the queue and
    decodes them.
    """

    def __init__(self, transport: GrpcTransport, link_id: str, address: str) -> None:
        options = transport.options
        self.address = address
        self.link_id = link_id
        self._transport = transport
        self._queue: MemoryChannel[Buffer] = MemoryChannel(options.capacity, name=address)
        self._inbound = InboundFrames(link_frame_codec(transport), logger, address)
        self._timeout = options.heartbeat_timeout
        self._handler: asyncio.Task[Any] | None = None  # gRPC's task serving the stream
        # NOTE: silence only counts with nothing queued: while messages wait for the consumer,
        # flow control may be all that keeps the peer quiet.
        self._watchdog = SilenceWatchdog(
            options.heartbeat_timeout, lambda: not len(self._queue), self._lose
        )
        self._ended = False
        self._lost = False
        self._closed = False

    async def receive(self) -> object:
        """Receive the next message.

        Raises:
            EndOfStream: the sender closed gracefully and everything it sent was delivered.
            PeerLostError: the stream broke, or nothing arrived for ``heartbeat_timeout``.
            LinkClosedError: this receiver was closed.
        """
        inbound = self._inbound
        while True:
            if self._closed:
                raise LinkClosedError(f"receiver {self.address} is closed")
            if self._ended:
                raise EndOfStream(f"{inbound.peer} closed the link")
            data = await self._queue.receive()
            try:
                if data[:1] == _BATCH_MAGIC:  # a batch the stream handler could not split
                    split_batch(data)  # raises why, here: in order, and naming the peer
                frames = split_frames(data)
            except TruncatedFrameError as exc:
                inbound.bytes_received += len(data)
                inbound.reject(exc)
                continue
            decoded = inbound.accept(frames, len(data))
            if decoded is None:
                continue
            kind, message = decoded
            if kind is FrameKind.DATA:
                return message
            if kind is FrameKind.END:
                self._ended = True
                self._watchdog.stop()

    async def _serve(self, context: Any) -> None:
        """The stream handler: accept the stream, then queue what arrives until it ends."""
        await context.send_initial_metadata(((_ACCEPTED_KEY, self.link_id),))
        self._handler = asyncio.current_task()
        self._watchdog.start()
        watchdog = self._watchdog
        queue = self._queue
        read = context.read
        try:
            while True:
                request = await read()
                if request is grpc.aio.EOF:
                    break
                watchdog.last_heard = time.monotonic()
                if request[:1] != _BATCH_MAGIC:
                    await queue.send(request)
                    continue
                try:
                    messages = split_batch(request)
                except TruncatedFrameError:
                    messages = [request]  # receive() rejects it after what came before
                for message in messages:
                    await queue.send(message)
            # The sender half-closed: the call ends (OK) and receive() drains the queue,
            # meeting END before this error unless the sender never said END.
            queue.fail(PeerLostError(f"{self._inbound.peer} ended its stream without END"))
        except asyncio.CancelledError:
            if self._closed:
                _finish(context, _RECEIVER_CLOSED, f"receiver {self.address} was closed")
            elif self._lost:
                _finish(context, _PEER_SILENT, f"{self._inbound.peer} fell silent")
            else:  # gRPC cancelled the call: the connection broke
                queue.fail(PeerLostError(f"the stream from {self._inbound.peer} broke"))
                raise
        except LinkClosedError:  # the receiver closed while the queue was full
            _finish(context, _RECEIVER_CLOSED, f"receiver {self.address} was closed")
        except Exception as exc:  # reading the stream failed
            queue.fail(PeerLostError(f"the stream from {self._inbound.peer} broke: {exc}"))
        finally:
            watchdog.stop()

    def _lose(self, silent_for: float) -> None:
        """The watchdog's verdict: fail the queue and end the call."""
        peer = self._inbound.peer
        logger.warning("%s fell silent for %.1f s; the link is lost", peer, silent_for)
        self._lost = True
        self._queue.fail(
            PeerLostError(
                f"{peer} fell silent for more than {self._timeout} s", silent_for=self._timeout
            )
        )
        if self._handler is not None:
            self._handler.cancel()  # ends the call

    async def aclose(self) -> None:
        """Stop receiving and end the stream (its sender gets LinkClosedError). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.stop()
        self._queue.close_receiving()
        handler = self._handler
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.wait({handler}, timeout=self._timeout)
        self._transport._forget_receiver(self)

    def statistics(self) -> LinkStatistics:
        inbound = self._inbound
        queue = self._queue.statistics(transport=GrpcTransport.name, address=self.address)
        return dataclasses.replace(
            queue,
            messages_sent=0,
            messages_received=inbound.messages_received,
            bytes_received=inbound.bytes_received,
            decode_errors=inbound.decode_errors,
            closed=self._closed,
            codec_seconds=inbound.codec_seconds,
        )


def _finish(context: Any, code: grpc.StatusCode, details: str) -> None:
    context.set_code(code)
    context.set_details(details)


class GrpcSender(Sender):
    """The sending end of a gRPC link: one channel, one bidirectional call, one writer task.

    ``send`` encodes the message in the caller's task and hands the bytes to the link's
    writer task, waiting only while ``capacity`` messages are accepted and not yet written.
    The writer owns the call (gRPC allows one write in flight per call): whatever queued up
    while its last write was in flight goes out as one gRPC message (see :func:`join_batch`),
    so a busy link pays gRPC's per-message cost once per batch rather than once per message.
    """

    def __init__(self, transport: GrpcTransport, address: str, channel: Any, call: Any) -> None:
        options = transport.options
        self.address = address
        self._transport = transport
        self._channel = channel
        self._call = call
        self._capacity = options.capacity
        self._interval = options.heartbeat_interval
        self._close_timeout = options.heartbeat_timeout
        self._limit = _message_limit(options)
        self._framer = link_frame_codec(transport)
        self._pending: collections.deque[bytes] = collections.deque()
        # messages accepted by send() and not yet written (pending + writing), and their bytes
        self._unsent = 0
        self._unsent_bytes = 0
        self._writer_idle: asyncio.Future[None] | None = None
        self._space: collections.deque[asyncio.Future[None]] = collections.deque()
        self._writer: asyncio.Task[None] | None = None
        self._beater: asyncio.Task[None] | None = None
        self._tasks = TaskSet(f"grpc sender to {address}")  # the writer and the beater
        self._error: TransportError | None = None  # why the writer stopped, if it failed
        self._last_activity = time.monotonic()
        self._waiting = 0  # sends waiting for room
        self._closed = False
        self.messages_sent = 0
        self.bytes_sent = 0
        self.codec_seconds = 0.0
        #: gRPC messages written (fewer than the link messages when they were batched)
        self.writes = 0

    async def _open(self, name: str) -> None:
        """Wait for the server to accept the link, say HELLO, start the writer and heartbeats."""
        try:
            metadata = await asyncio.wait_for(self._call.initial_metadata(), self._close_timeout)
        except asyncio.TimeoutError:
            raise LinkClosedError(f"no answer from {self.address}") from None
        if self._call.done() or not any(key == _ACCEPTED_KEY for key, _ in metadata or ()):
            code = await self._call.code()
            details = await self._call.details()
            raise LinkClosedError(f"no receiver at {self.address}: {code.name}: {details}")
        hello = join_frames(FrameCodec.control(FrameKind.HELLO, name))
        await self._write(hello)
        self.bytes_sent += len(hello)
        self._writer = self._tasks.spawn(self._write_loop(), name=f"grpc:write:{self.address}")
        self._beater = self._tasks.spawn(self._beat(), name=f"grpc:beat:{self.address}")

    async def send(self, message: object) -> None:
        """Send one message, waiting while ``capacity`` messages (or :data:`PENDING_BYTES`)
        are not yet written (gRPC flow control holds the writer back while the receiver is
        full).

        Raises:
            LinkClosedError: this sender was closed, or the receiver closed the link.
            PeerLostError: the receiving process died or the connection broke. (NOTE: when
                the receiver closes the link while a write is in flight, gRPC core can end
                the call as INTERNAL instead of the receiver's ABORTED; that also reads as
                PeerLostError.)
            EncodeError: the message cannot be encoded, or is over ``max_message_bytes``.
        """
        began = time.perf_counter()
        frames = self._framer.encode(message)
        self.codec_seconds += time.perf_counter() - began
        await self.send_frames(frames)

    async def send_frames(self, frames: Sequence[Buffer]) -> None:
        """Send frames that are already encoded (by a relay, or a test feeding raw bytes).

        Raises like :meth:`send`.
        """
        self._check_open()
        # NOTE: joining copies out-of-band buffers now, so the caller may reuse its arrays
        # as soon as send returns.
        data = join_frames(frames)
        if len(data) > self._limit:
            # gRPC would end the whole call over it; refuse just this message.
            raise EncodeError(
                f"a link message of {len(data)} bytes exceeds the limit of {self._limit} "
                f"bytes (max_message_bytes)"
            )
        while self._unsent >= self._capacity or (
            self._unsent and self._unsent_bytes + len(data) > PENDING_BYTES
        ):
            waiter = asyncio.get_running_loop().create_future()
            self._space.append(waiter)
            self._waiting += 1
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                wake_one(self._space)  # pass a wake-up we may have had on
                raise
            finally:
                self._waiting -= 1
            self._check_open()
        self._queue(data)
        self.messages_sent += 1

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise LinkClosedError(f"sender to {self.address} is closed")

    def _queue(self, data: bytes) -> None:
        self._pending.append(data)
        self._unsent += 1
        self._unsent_bytes += len(data)
        self.bytes_sent += len(data)
        self._wake_writer()

    async def _write_loop(self) -> None:
        """The writer: write what is pending, batched, until closed and drained; then END."""
        pending = self._pending
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not pending:
                    if self._closed:
                        break
                    self._writer_idle = idle = loop.create_future()
                    await idle
                    continue
                data, count, nbytes = _take_batch(pending)
                await self._write(data)
                self._unsent -= count
                self._unsent_bytes -= nbytes
                for _ in range(count):
                    if not self._space:
                        break
                    wake_one(self._space)
            end = join_frames([_END_FRAME])
            self.bytes_sent += len(end)
            await self._write(end)
            await self._call.done_writing()
            await self._call.code()
        except TransportError as exc:
            if self._error is None:
                self._error = exc
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # done_writing() or code() on a call that had already ended
        finally:
            self._writer_idle = None
            if self._error is None and not self._closed:  # stopped by something unforeseen
                self._error = PeerLostError(f"the writer of the link to {self.address} stopped")
            wake_all(self._space)  # waiting sends see the error or the close

    async def _write(self, data: bytes) -> None:
        """Write one gRPC message."""
        try:
            await self._call.write(data)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            raise await self._failure() from None
        except asyncio.CancelledError:
            # Cancelling the call (aclose() giving up, _abandon()) ends a pending write
            # this way too.
            if cancel_requested() or not self._call.done():
                raise
            raise await self._failure() from None
        self._last_activity = time.monotonic()
        self.writes += 1

    async def _failure(self) -> TransportError:
        """The error that stands for the call having ended."""
        code = await self._call.code()
        details = await self._call.details()
        if self._closed or code in _CLOSED_BY_RECEIVER:
            return LinkClosedError(f"the link to {self.address} is closed: {details or code.name}")
        return PeerLostError(f"the link to {self.address} broke: {code.name}: {details}")

    async def _beat(self) -> None:
        """Queue a heartbeat whenever nothing was written for a heartbeat interval."""
        heartbeat = join_frames([_HEARTBEAT_FRAME])
        while not self._closed and self._error is None:
            delay = self._interval - (time.monotonic() - self._last_activity)
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            self._last_activity = time.monotonic()
            if not self._unsent:  # else a write is queued or held by flow control
                self._queue(heartbeat)

    async def aclose(self) -> None:
        """Write what was sent, then END; half-close the stream and wait (at most
        ``heartbeat_timeout``) until the receiving side has queued everything; then close
        the channel. Sends waiting for room in other tasks raise LinkClosedError.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        wake_all(self._space)
        await self._stop_beating()
        writer = self._writer
        if writer is not None:
            self._wake_writer()
            await asyncio.wait({writer}, timeout=self._close_timeout)
            if not writer.done():
                logger.warning("the receiver at %s did not take the last messages", self.address)
                self._call.cancel()  # the writer's pending write fails at once
                await asyncio.wait({writer}, timeout=self._close_timeout)
                writer.cancel()
                await asyncio.wait({writer})
        await self._channel.close()
        self._transport._forget_sender(self)

    def _wake_writer(self) -> None:
        idle = self._writer_idle
        if idle is not None and not idle.done():
            idle.set_result(None)

    async def _stop_beating(self) -> None:
        beater = self._beater
        if beater is not None:
            beater.cancel()
            await asyncio.wait({beater})

    async def _abandon(self) -> None:
        """Cancel the call without END and close the channel (the transport is aborted)."""
        if self._closed:
            return
        self._closed = True
        self._call.cancel()
        await self._stop_beating()
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.wait({self._writer})
        await self._channel.close()
        self._transport._forget_sender(self)

    def statistics(self) -> LinkStatistics:
        return LinkStatistics(
            transport=GrpcTransport.name,
            address=self.address,
            capacity=self._capacity,
            queued=self._unsent,
            messages_sent=self.messages_sent,
            bytes_sent=self.bytes_sent,
            waiting_senders=self._waiting,
            closed=self._closed,
            codec_seconds=self.codec_seconds,
        )


def _take_batch(pending: collections.deque[bytes]) -> tuple[bytes, int, int]:
    """Take the next gRPC message off ``pending``: (data, link messages, their bytes).

    Small messages queued behind each other go together, up to :data:`BATCH_BYTES`; a
    message of :data:`BATCH_ALONE_BYTES` or more always goes alone (it is not copied again).
    """
    first = pending.popleft()
    size = len(first)
    if size >= BATCH_ALONE_BYTES or not pending or len(pending[0]) >= BATCH_ALONE_BYTES:
        return first, 1, size
    parts = [first]
    while (
        pending
        and size < BATCH_BYTES
        and len(parts) < MAX_BATCH
        and len(pending[0]) < BATCH_ALONE_BYTES
    ):
        part = pending.popleft()
        parts.append(part)
        size += len(part)
    return join_batch(parts), len(parts), size


class GrpcTransport(Transport):
    """gRPC links: one grpc.aio server per transport, one stream per link.

    ``host``: the interface the server binds (default 127.0.0.1); ``listen`` may also name
    ``grpc://HOST:PORT[/LINK_ID]`` (port 0 picks a free port), as long as every listen of
    one transport agrees on host and port.
    """

    name: ClassVar[str] = "grpc"

    def __init__(
        self,
        options: LinkOptions | None = None,
        *,
        codec: Codec | None = None,
        host: str = _DEFAULT_HOST,
    ) -> None:
        super().__init__(options, codec=codec)
        self.host = host
        self._server: Any = None
        self._port = 0
        self._receivers: dict[str, GrpcReceiver] = {}
        self._senders: set[GrpcSender] = set()
        self._closed = False

    @property
    def port(self) -> int:
        """The server's port (0 before the first ``listen``)."""
        return self._port

    async def listen(self, address: str | None = None) -> GrpcReceiver:
        """Register a link on this transport's server, starting the server if needed.

        Raises:
            ValueError: a malformed address, a link id in use, or a host/port other than
                the running server's.
            LinkClosedError: the transport was closed.
        """
        host, port, link_id = self.host, 0, ""
        if address is not None:
            host, port, link_id = _parse_address(address)
        if not link_id:
            link_id = uuid.uuid4().hex
        if link_id in self._receivers:
            raise ValueError(f"link id {link_id!r} is already listening")
        await self._ensure_server(host, port)
        receiver = GrpcReceiver(self, link_id, f"{_SCHEME}{_join_host(host, self._port)}/{link_id}")
        self._receivers[link_id] = receiver
        return receiver

    async def connect(self, address: str, *, name: str = "") -> GrpcSender:
        """Open a channel and a stream to ``grpc://HOST:PORT/LINK_ID``; wait until the
        server accepts the link id, then say HELLO.

        Raises:
            ValueError: a malformed address.
            LinkClosedError: nothing listens there (no server, or no such link id), or the
                transport was closed.
        """
        if self._closed:
            raise LinkClosedError("the grpc transport is closed")
        host, port, link_id = _parse_address(address)
        if not link_id or not port:
            raise ValueError(f"a grpc link address is grpc://HOST:PORT/LINK_ID, got {address!r}")
        channel = grpc.aio.insecure_channel(
            _join_host(host, port),
            # NOTE: a local subchannel pool gives every link its own connection, so one
            # link's flow control never holds back another's.
            options=[*_size_options(self.options), ("grpc.use_local_subchannel_pool", 1)],
        )
        stream = channel.stream_stream(
            FULL_METHOD, request_serializer=None, response_deserializer=None
        )
        call = stream(metadata=((LINK_ID_KEY, link_id),))
        sender = GrpcSender(self, address, channel, call)
        try:
            await sender._open(name or f"pid {os.getpid()}")
        except BaseException:
            call.cancel()
            await channel.close()
            raise
        self._senders.add(sender)
        return sender

    async def _ensure_server(self, host: str, port: int) -> None:
        if self._closed:
            raise LinkClosedError("the grpc transport is closed")
        if self._server is not None:
            if host != self.host or port not in (0, self._port):
                raise ValueError(
                    f"this transport serves on {_join_host(self.host, self._port)}; "
                    f"cannot also listen on {_join_host(host, port)} (use another transport)"
                )
            return
        server = grpc.aio.server(
            # NOTE: without so_reuseport=0 a second server could bind the same port silently.
            options=[*_size_options(self.options), ("grpc.so_reuseport", 0)],
        )
        handler = grpc.stream_stream_rpc_method_handler(self._serve)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),)
        )
        bound = server.add_insecure_port(_join_host(host, port))
        if bound == 0:
            raise TransportError(f"cannot bind a grpc server on {_join_host(host, port)}")
        await server.start()
        self._server, self.host, self._port = server, host, bound

    async def _serve(self, requests: AsyncIterator[bytes], context: Any) -> None:
        link_id = ""
        for key, value in context.invocation_metadata() or ():
            if key == LINK_ID_KEY:
                link_id = value
        receiver = self._receivers.get(link_id)
        if receiver is None or receiver._closed:
            await context.abort(_UNKNOWN_LINK, f"no link {link_id!r} listens here")
            return
        if receiver._handler is not None:
            await context.abort(_LINK_TAKEN, f"link {link_id!r} already has a sender")
            return
        await receiver._serve(context)

    def _forget_receiver(self, receiver: GrpcReceiver) -> None:
        if self._receivers.get(receiver.link_id) is receiver:
            del self._receivers[receiver.link_id]

    def _forget_sender(self, sender: GrpcSender) -> None:
        self._senders.discard(sender)

    async def aclose(self, *, abort: bool = False) -> None:
        """Close links still open (``abort``: without END or waiting for delivery) and stop
        the server, releasing its port. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for sender in list(self._senders):
            await (sender._abandon() if abort else sender.aclose())
        for receiver in list(self._receivers.values()):
            await receiver.aclose()
        server, self._server = self._server, None
        if server is not None:
            # NOTE: grace=None cancels every call, and gRPC core sends each connected peer a
            # GOAWAY "Cancelling all calls" that it always logs at INFO. On a graceful close
            # the receivers above have ended their calls, so a grace period returns at once
            # with a clean GOAWAY; only a forced close cancels.
            await server.stop(grace=None if abort else self.options.heartbeat_timeout)


def _parse_address(address: str) -> tuple[str, int, str]:
    """``grpc://HOST:PORT[/LINK_ID]`` → (host, port, link_id or "")."""
    if not address.startswith(_SCHEME):
        raise ValueError(f"a grpc address starts with {_SCHEME!r}, got {address!r}")
    host_port, _, link_id = address[len(_SCHEME) :].partition("/")
    host, _, port_text = host_port.rpartition(":")
    if not host or not port_text.isdigit():
        raise ValueError(f"a grpc address is grpc://HOST:PORT[/LINK_ID], got {address!r}")
    return host.strip("[]"), int(port_text), link_id


def _join_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
