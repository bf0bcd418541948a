"""The conformance kit: one set of checks that every transport's tests run.

Modelled on trio's ``testing/_check_streams.py``: a transport describes itself with a
:class:`LinkFactory`, and each ``check_*`` coroutine opens real links through it and checks
one part of the contract in :mod:`transports.base` (ordering, payload sizes, tensors,
backpressure, closing, peer loss, bad input, compression, leaks). A check that cannot apply
to a transport raises :class:`CheckNotApplicable` with the reason (memory links, for
example, pass objects and have no bytes to corrupt). In a test module::

    from transports.testing import LinkFactory, conformance_tests
    from transports.zmq import ZmqTransport

    test_conformance = conformance_tests(LinkFactory(ZmqTransport, queues_per_link=2))

Its message types (tags 900-999), sample tensors and the catalogue of bad frames live in
:mod:`transports._kit_samples`; the message types are re-exported here. The peer-loss
checks run a real sender or receiver in a spawned child process and SIGKILL it (see
:meth:`LinkFactory.spawn_peer_sender` and :meth:`LinkFactory.spawn_peer_receiver`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, runtime_checkable

import numpy as np

from transports._kit_samples import (
    KitArrays,
    KitEnvelope,
    KitPayload,
    KitPing,
    assert_same_value,
    bad_frames,
    sample_arrays,
    sample_tensors,
)
from transports.base import LinkOptions, Receiver, Sender, Transport
from transports.codec import Buffer
from transports.compression import Compression
from transports.errors import (
    EndOfStream,
    LinkClosedError,
    PeerLostError,
    TransportError,
)
from transports.framing import FrameCodec
from transports.tasks import TaskSet

__all__ = [
    "CHECKS",
    "KIT_OPTIONS",
    "SENDER_NAME",
    "CheckNotApplicable",
    "FrameSender",
    "KitArrays",
    "KitEnvelope",
    "KitPayload",
    "KitPing",
    "LinkFactory",
    "LinkPair",
    "bad_frames",
    "check_backpressure",
    "check_bad_input",
    "check_close_semantics",
    "check_compression",
    "check_no_leaks",
    "check_ordering",
    "check_payload_sizes",
    "check_peer_loss",
    "check_receiver_close_stops_sender",
    "check_receiver_loss",
    "check_tensors",
    "conformance_tests",
]

#: how the kit's senders introduce themselves; bad-input warnings must name it
SENDER_NAME = "kit-sender"
PEER_PROCESS_NAME = "kit-peer-process"
#: options for most checks: heartbeats short enough that teardown stays quick
KIT_OPTIONS = LinkOptions(capacity=64, heartbeat_interval=0.2, heartbeat_timeout=3.0)
#: the peer-loss check's heartbeats (the receiver must notice within the timeout)
PEER_LOSS_OPTIONS = LinkOptions(capacity=64, heartbeat_interval=0.1, heartbeat_timeout=1.0)
#: how long any single step of a check may wait before the check fails
STEP_TIMEOUT = 30.0
#: upper bound on one whole check
CHECK_TIMEOUT = 120.0
#: slack on top of heartbeat_timeout for a loaded machine to notice a lost peer
DETECTION_SLACK = 1.5
_MiB = 1 << 20


class CheckNotApplicable(Exception):
    """This check does not apply to the transport; the message says why."""


@runtime_checkable
class FrameSender(Protocol):
    """A sender of a byte transport that can send frames encoded elsewhere."""

    async def send_frames(self, frames: Sequence[Buffer]) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class LinkPair:
    """A connected sender and receiver, and the transport that made them."""

    transport: Transport
    sender: Sender
    receiver: Receiver


@dataclasses.dataclass(frozen=True)
class LinkFactory:
    """How the kit opens links of one transport, and what it may expect of them.

    ``transport_class`` and ``transport_kwargs`` must be picklable (the peer-loss check
    builds the transport again in a child process). ``listen_address`` is given to
    ``listen`` (None: the transport picks). Backpressure: a sender may hand over at most
    ``queues_per_link * capacity + transit_messages`` messages plus what fits in
    ``transit_bytes`` (kernel buffers, flow-control windows) before ``send`` waits.
    ``detects_closed_receiver``: whether ``send`` fails once the receiver is closed or its
    process dies.
    """

    transport_class: type[Transport]
    transport_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    listen_address: str | None = None
    queues_per_link: int = 1
    transit_messages: int = 0
    transit_bytes: int = 0
    detects_closed_receiver: bool = True

    @property
    def name(self) -> str:
        return self.transport_class.name

    @property
    def supports_bytes(self) -> bool:
        """Whether messages cross the link as bytes (so bytes can be corrupted)."""
        return self.transport_class.encodes

    def make_transport(self, options: LinkOptions) -> Transport:
        return self.transport_class(options, **self.transport_kwargs)

    def max_in_flight(self, capacity: int, message_bytes: int) -> int:
        """The most messages ``send`` may accept while the receiver reads nothing."""
        spare = math.ceil(self.transit_bytes / max(message_bytes, 1))
        return self.queues_per_link * capacity + self.transit_messages + spare

    @contextlib.asynccontextmanager
    async def open_pair(
        self, options: LinkOptions = KIT_OPTIONS, *, name: str = SENDER_NAME
    ) -> AsyncIterator[LinkPair]:
        """A transport with one connected sender and receiver; all closed on exit."""
        transport = self.make_transport(options)
        try:
            receiver = await transport.listen(self.listen_address)
            try:
                sender = await transport.connect(receiver.address, name=name)
                try:
                    yield LinkPair(transport, sender, receiver)
                finally:
                    await sender.aclose()
                    # Reading up to END lets a byte transport finish flushing at once.
                    await _drain(receiver, options.heartbeat_timeout)
            finally:
                await receiver.aclose()
        finally:
            await transport.aclose()

    async def inject_raw(self, sender: Sender, frames: Sequence[Buffer]) -> None:
        """Send raw frames over ``sender`` (byte transports only)."""
        if not isinstance(sender, FrameSender):
            raise CheckNotApplicable(f"{self.name} senders cannot send raw frames")
        await sender.send_frames(frames)

    @contextlib.contextmanager
    def spawn_peer_sender(
        self, address: str, options: LinkOptions, *, count: int
    ) -> Iterator[BaseProcess]:
        """Run a real sender in a child process: it connects to ``address``, sends ``count``
        :class:`KitPing` messages, then idles (heartbeating) until killed. The process is
        killed and reaped on exit."""
        self._require_processes()
        with _child_process(
            _peer_sender_main,
            self.transport_class,
            dict(self.transport_kwargs),
            options,
            address,
            count,
        ) as process:
            yield process

    @contextlib.asynccontextmanager
    async def spawn_peer_receiver(
        self, options: LinkOptions
    ) -> AsyncIterator[tuple[BaseProcess, str]]:
        """Run a real receiver in a child process (it reads and drops everything); yields
        the process and the receiver's address. The process is killed and reaped on exit."""
        self._require_processes()
        address_in, address_out = multiprocessing.get_context("spawn").Pipe(duplex=False)
        with _child_process(
            _peer_receiver_main,
            self.transport_class,
            dict(self.transport_kwargs),
            options,
            address_out,
        ) as process:
            ready = await asyncio.to_thread(address_in.poll, STEP_TIMEOUT)
            assert ready, "the child process did not report its receiver's address"
            yield process, address_in.recv()

    def _require_processes(self) -> None:
        if not self.supports_bytes:
            raise CheckNotApplicable(
                f"{self.name} links live inside one process: there is no peer process to lose"
            )


@contextlib.contextmanager
def _child_process(target: Callable[..., None], *args: Any) -> Iterator[BaseProcess]:
    """A spawned (not forked: no inherited event loop or sockets) child, killed on exit."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    try:
        yield process
    finally:
        process.kill()
        process.join(STEP_TIMEOUT)


def _peer_sender_main(
    transport_class: type[Transport],
    transport_kwargs: dict[str, Any],
    options: LinkOptions,
    address: str,
    count: int,
) -> None:
    async def run() -> None:
        transport = transport_class(options, **transport_kwargs)
        sender = await transport.connect(address, name=PEER_PROCESS_NAME)
        for seq in range(count):
            await sender.send(KitPing(seq))
        await asyncio.Event().wait()  # heartbeats keep the link alive until we are killed

    asyncio.run(run())


def _peer_receiver_main(
    transport_class: type[Transport],
    transport_kwargs: dict[str, Any],
    options: LinkOptions,
    address_out: Connection,
) -> None:
    async def run() -> None:
        transport = transport_class(options, **transport_kwargs)
        receiver = await transport.listen()
        address_out.send(receiver.address)
        while True:
            await receiver.receive()

    asyncio.run(run())


async def _drain(receiver: Receiver, timeout: float) -> None:
    async def drain() -> None:
        while True:
            await receiver.receive()

    with contextlib.suppress(TransportError, asyncio.TimeoutError):
        await asyncio.wait_for(drain(), timeout)


async def _receive(receiver: Receiver, timeout: float = STEP_TIMEOUT) -> object:
    return await asyncio.wait_for(receiver.receive(), timeout)


@contextlib.contextmanager
def _expect_raises(*errors: type[BaseException]) -> Iterator[None]:
    try:
        yield
    except errors:
        return
    raise AssertionError(f"expected {' or '.join(e.__name__ for e in errors)}, nothing raised")


# -- ordering and payloads ---------------------------------------------------------------------


async def check_ordering(factory: LinkFactory, count: int = 5000) -> None:
    """Thousands of messages arrive in order while sender and receiver run concurrently."""
    async with factory.open_pair() as pair, TaskSet("kit:ordering") as tasks:

        async def produce() -> None:
            for seq in range(count):
                await pair.sender.send(KitPing(seq))

        producer = tasks.spawn(produce(), name="kit:produce")
        received = [await _receive(pair.receiver) for _ in range(count)]
        await producer
        assert received == [KitPing(seq) for seq in range(count)]
        assert pair.sender.statistics().messages_sent == count
        assert pair.receiver.statistics().messages_received == count


PAYLOAD_SIZES = (0, 1, 255, 256, 4096, _MiB, 64 * _MiB)


async def check_payload_sizes(factory: LinkFactory) -> None:
    """Payloads from empty up to 64 MiB (inline bytes and an out-of-band array) arrive intact."""
    rng = np.random.default_rng(0)
    async with factory.open_pair() as pair:
        for seq, size in enumerate(PAYLOAD_SIZES):
            sent = KitPayload(seq, rng.bytes(size))
            await pair.sender.send(sent)
            assert await _receive(pair.receiver) == sent, f"{size}-byte payload changed"
        array = rng.integers(0, 256, size=64 * _MiB, dtype=np.uint8)
        await pair.sender.send(KitArrays("big", (array,), {}))
        got = await _receive(pair.receiver)
        assert isinstance(got, KitArrays)
        assert np.array_equal(got.values[0], array)


# -- tensors and arrays ------------------------------------------------------------------------


async def check_tensors(factory: LinkFactory) -> None:
    """Torch tensors and numpy arrays round-trip bit-exact: several dtypes, non-contiguous
    inputs, 0-d and empty shapes, nested inside messages."""
    tensors, arrays = sample_tensors(), sample_arrays()
    flat = KitArrays("flat", tuple(tensors.values()), dict(arrays))
    nested = KitEnvelope(
        "nested",
        KitArrays("inner", tuple(arrays.values()), dict(tensors)),
        (KitArrays("more", (tensors["bfloat16"],), {"strided": arrays["strided"]}),),
    )
    async with factory.open_pair() as pair:
        await pair.sender.send(flat)
        await pair.sender.send(nested)
        got_flat = await _receive(pair.receiver)
        got_nested = await _receive(pair.receiver)
    assert isinstance(got_flat, KitArrays) and isinstance(got_nested, KitEnvelope)
    for name, sent, got in zip(tensors, flat.values, got_flat.values, strict=True):
        assert_same_value(f"tensor {name}", sent, got)
    for name, value in arrays.items():
        assert_same_value(f"array {name}", value, got_flat.named[name])
    inner = got_nested.inner
    for name, sent, got in zip(arrays, nested.inner.values, inner.values, strict=True):
        assert_same_value(f"nested array {name}", sent, got)
    for name, value in tensors.items():
        assert_same_value(f"nested tensor {name}", value, inner.named[name])
    (more,) = got_nested.more
    assert_same_value("twice nested bfloat16", tensors["bfloat16"], more.values[0])
    assert_same_value("twice nested strided", arrays["strided"], more.named["strided"])


# -- backpressure and closing ------------------------------------------------------------------


async def check_backpressure(factory: LinkFactory, capacity: int = 8) -> None:
    """With a receiver that reads nothing, ``send`` blocks after a bounded number of
    messages (statistics show the waiting sender); reading unblocks it."""
    message_bytes = 16 * 1024
    bound = factory.max_in_flight(capacity, message_bytes)
    total = bound + 3 * capacity
    options = dataclasses.replace(KIT_OPTIONS, capacity=capacity)
    payload = bytes(message_bytes)
    async with factory.open_pair(options) as pair, TaskSet("kit:backpressure") as tasks:
        sent = 0

        async def produce() -> None:
            nonlocal sent
            for seq in range(total):
                await pair.sender.send(KitPayload(seq, payload))
                sent += 1

        producer = tasks.spawn(produce(), name="kit:produce")
        # Wait until the producer is held: its send waits for room (it never finishes: total >
        # bound) and stays waiting, making no progress, for a few polls in a row (a wait that
        # ends as the transport moves messages on to the wire is not yet the limit).
        deadline = time.monotonic() + STEP_TIMEOUT
        last, held = -1, 0
        while held < 5 and not producer.done():
            assert time.monotonic() < deadline, (
                f"no send waited for room within {STEP_TIMEOUT}s ({sent} went through)"
            )
            await asyncio.sleep(0.05)
            waiting = pair.sender.statistics().waiting_senders == 1
            held = held + 1 if waiting and sent == last else 0
            last = sent
        assert not producer.done(), f"all {total} sends went through with nobody reading"
        assert sent <= bound, f"{sent} sends went through; at most {bound} may"
        received = [await _receive(pair.receiver) for _ in range(total)]
        await asyncio.wait_for(producer, STEP_TIMEOUT)
        assert [m.seq for m in received if isinstance(m, KitPayload)] == list(range(total))
        assert pair.sender.statistics().waiting_senders == 0


async def check_close_semantics(factory: LinkFactory) -> None:
    """Sender aclose: the receiver drains then gets EndOfStream (every time). Send after
    the sender's own close, and receive after the receiver's own close (including a receive
    waiting at that moment) raise LinkClosedError. aclose is idempotent."""
    async with factory.open_pair() as pair:
        for seq in range(10):
            await pair.sender.send(KitPing(seq))
        await pair.sender.aclose()
        await pair.sender.aclose()
        assert pair.sender.statistics().closed
        with _expect_raises(LinkClosedError):
            await pair.sender.send(KitPing(99))
        assert [await _receive(pair.receiver) for _ in range(10)] == [KitPing(s) for s in range(10)]
        for _ in range(2):
            with _expect_raises(EndOfStream):
                await _receive(pair.receiver)
        # Everything the sender put on the wire (control frames included) arrived.
        assert pair.receiver.statistics().bytes_received == pair.sender.statistics().bytes_sent
        assert [item async for item in pair.receiver] == []
        await pair.receiver.aclose()
        await pair.receiver.aclose()
        assert pair.receiver.statistics().closed
        with _expect_raises(LinkClosedError):
            await _receive(pair.receiver)
    transport = factory.make_transport(KIT_OPTIONS)
    tasks = TaskSet("kit:close")
    try:
        receiver = await transport.listen(factory.listen_address)
        waiting = tasks.spawn(receiver.receive(), name="kit:receive")
        deadline = time.monotonic() + STEP_TIMEOUT
        while receiver.statistics().waiting_receivers != 1:
            assert not waiting.done(), f"receive returned with nothing sent: {waiting!r}"
            assert time.monotonic() < deadline, f"no receive waited within {STEP_TIMEOUT}s"
            await asyncio.sleep(0.01)
        await receiver.aclose()
        with _expect_raises(LinkClosedError):
            await asyncio.wait_for(waiting, STEP_TIMEOUT)
    finally:
        await tasks.aclose()
        await transport.aclose()


async def check_receiver_close_stops_sender(factory: LinkFactory) -> None:
    """Once the receiver is closed, ``send`` fails (LinkClosedError or PeerLostError)
    instead of queueing forever."""
    if not factory.detects_closed_receiver:
        raise CheckNotApplicable(
            f"a {factory.name} sender cannot see its receiver close; send blocks once full"
        )
    async with factory.open_pair() as pair:
        await pair.sender.send(KitPing(0))
        assert await _receive(pair.receiver) == KitPing(0)
        await pair.receiver.aclose()
        deadline = time.monotonic() + STEP_TIMEOUT
        with _expect_raises(LinkClosedError, PeerLostError):
            while time.monotonic() < deadline:
                await asyncio.wait_for(pair.sender.send(KitPing(1)), STEP_TIMEOUT)
                await asyncio.sleep(0.01)


# -- peer loss ---------------------------------------------------------------------------------


async def check_receiver_loss(factory: LinkFactory) -> None:
    """A real child process holding the receiver is SIGKILLed: the sender's ``send``
    raises PeerLostError (after at most a bounded number of buffered sends)."""
    if not factory.detects_closed_receiver:
        raise CheckNotApplicable(
            f"a {factory.name} sender cannot see its receiver go; send blocks once full"
        )
    options = PEER_LOSS_OPTIONS
    transport = factory.make_transport(options)
    try:
        async with factory.spawn_peer_receiver(options) as (process, address):
            sender = await transport.connect(address, name=SENDER_NAME)
            for seq in range(3):
                await sender.send(KitPing(seq))
            process.kill()
            deadline = time.monotonic() + STEP_TIMEOUT
            with _expect_raises(PeerLostError):
                while time.monotonic() < deadline:
                    await asyncio.wait_for(sender.send(KitPing(0)), STEP_TIMEOUT)
                    await asyncio.sleep(0.01)
            with _expect_raises(PeerLostError, LinkClosedError):
                await sender.send(KitPing(0))
            await asyncio.wait_for(sender.aclose(), STEP_TIMEOUT)
    finally:
        await asyncio.wait_for(transport.aclose(), STEP_TIMEOUT)


async def check_peer_loss(factory: LinkFactory, count: int = 3) -> None:
    """A real child process holding the sender is SIGKILLed: the receiver raises
    PeerLostError within ``heartbeat_timeout`` (while heartbeats kept the idle link alive
    before), and its aclose() does not hang."""
    options = PEER_LOSS_OPTIONS
    transport = factory.make_transport(options)
    try:
        receiver = await transport.listen(factory.listen_address)
        with factory.spawn_peer_sender(receiver.address, options, count=count) as process:
            got = [await _receive(receiver) for _ in range(count)]
            assert got == [KitPing(seq) for seq in range(count)]
            # Idle but alive: heartbeats must keep the link up past the timeout.
            with _expect_raises(asyncio.TimeoutError):
                await asyncio.wait_for(receiver.receive(), 1.5 * options.heartbeat_timeout)
            process.kill()
            started = time.monotonic()
            with _expect_raises(PeerLostError):
                await _receive(receiver, options.heartbeat_timeout + STEP_TIMEOUT)
            elapsed = time.monotonic() - started
            limit = options.heartbeat_timeout + DETECTION_SLACK
            assert elapsed < limit, f"the lost peer was noticed after {elapsed:.2f} s"
            with _expect_raises(PeerLostError):
                await _receive(receiver)
        await asyncio.wait_for(receiver.aclose(), STEP_TIMEOUT)
    finally:
        await asyncio.wait_for(transport.aclose(), STEP_TIMEOUT)


# -- bad input ---------------------------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _captured_warnings(logger_name: str) -> Iterator[_Capture]:
    capture = _Capture()
    logger = logging.getLogger(logger_name)
    logger.addHandler(capture)
    try:
        yield capture
    finally:
        logger.removeHandler(capture)


async def check_bad_input(factory: LinkFactory) -> None:
    """Frames that do not decode are logged (naming the peer and the error type), counted
    in ``decode_errors`` and skipped: the next good message is delivered."""
    if not factory.supports_bytes:
        raise CheckNotApplicable(f"{factory.name} links pass objects: no bytes to corrupt")
    options = dataclasses.replace(KIT_OPTIONS, max_message_bytes=_MiB)
    with _captured_warnings("actorline.transports") as capture:
        async with factory.open_pair(options) as pair:
            for count, (label, frames, error) in enumerate(bad_frames(_MiB), start=1):
                await factory.inject_raw(pair.sender, frames)
                await pair.sender.send(KitPing(count))
                assert await _receive(pair.receiver) == KitPing(count), label
                assert pair.receiver.statistics().decode_errors == count, label
                warning = capture.messages[-1]
                assert error.__name__ in warning, f"{label}: {warning}"
                assert SENDER_NAME in warning, f"{label}: the warning names no peer: {warning}"


# -- compression -------------------------------------------------------------------------------


async def check_compression(factory: LinkFactory) -> None:
    """With Compression() on, a large compressible message goes out smaller and round-trips;
    a small one is sent as it is."""
    if not factory.supports_bytes:
        raise CheckNotApplicable(f"{factory.name} links pass objects: nothing to compress")
    # Long heartbeat intervals keep heartbeat bytes out of the measured byte counts.
    options = LinkOptions(
        compression=Compression(threshold=1024), heartbeat_interval=5.0, heartbeat_timeout=10.0
    )
    big = KitPayload(1, b"actorline compresses this " * 8000)
    small = KitPayload(2, b"x" * 100)
    plain_small = sum(len(frame) for frame in FrameCodec().encode(small))
    async with factory.open_pair(options) as pair:
        before = pair.sender.statistics().bytes_sent
        await pair.sender.send(big)
        after_big = pair.sender.statistics().bytes_sent
        await pair.sender.send(small)
        after_small = pair.sender.statistics().bytes_sent
        assert await _receive(pair.receiver) == big
        assert await _receive(pair.receiver) == small
    assert after_big - before < len(big.data) // 4, f"{after_big - before} bytes on the wire"
    assert after_small - after_big >= plain_small, "a small message was compressed"


# -- leaks -------------------------------------------------------------------------------------


_SETTLE_POLLS = 100
_SETTLE_POLL_SECONDS = 0.05


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


async def _one_cycle(factory: LinkFactory) -> str:
    async with factory.open_pair() as pair:
        await pair.sender.send(KitArrays("leak", (np.zeros(4096, np.float32),), {}))
        await _receive(pair.receiver)
        return pair.receiver.address


async def _assert_released(factory: LinkFactory, address: str) -> None:
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        assert not os.path.exists(rest), f"{rest} was left behind"  # noqa: ASYNC240 - one stat
    elif scheme in ("tcp", "grpc"):
        host, _, port = rest.partition("/")[0].rpartition(":")
        with socket.socket() as probe, _expect_raises(ConnectionRefusedError):
            probe.settimeout(STEP_TIMEOUT)
            probe.connect((host.strip("[]"), int(port)))
    else:
        transport = factory.make_transport(KIT_OPTIONS)
        with _expect_raises(LinkClosedError):
            await transport.connect(address)
        await transport.aclose()


async def check_no_leaks(factory: LinkFactory, cycles: int = 3) -> None:
    """After closing links and the transport, addresses are released (ipc files removed,
    ports closed) and no file descriptors or threads are left behind."""
    if not os.path.isdir("/proc/self/fd"):  # noqa: ASYNC240 - one stat
        raise CheckNotApplicable("counting file descriptors needs /proc")
    # The first cycle may start process-wide helpers (pyzmq's garbage collector thread,
    # gRPC's core threads): those are shared, not leaks.
    await _one_cycle(factory)
    fds, threads = _open_fds(), _threads()
    addresses = [await _one_cycle(factory) for _ in range(cycles)]
    for address in addresses:
        await _assert_released(factory, address)
    for _ in range(_SETTLE_POLLS):  # helper threads may take a moment to exit
        if _open_fds() <= fds and _threads() <= threads:
            break
        await asyncio.sleep(_SETTLE_POLL_SECONDS)
    assert _open_fds() <= fds, f"{_open_fds() - fds} file descriptors leaked"
    assert _threads() <= threads, f"{_threads() - threads} threads leaked"


# -- the pytest helper -------------------------------------------------------------------------

Check = Callable[[LinkFactory], Awaitable[None]]

CHECKS: tuple[Check, ...] = (
    check_ordering,
    check_payload_sizes,
    check_tensors,
    check_backpressure,
    check_close_semantics,
    check_receiver_close_stops_sender,
    check_peer_loss,
    check_receiver_loss,
    check_bad_input,
    check_compression,
    check_no_leaks,
)
_SLOW_CHECKS = frozenset({check_peer_loss, check_receiver_loss, check_payload_sizes})


async def _run_check(check: Check, factory: LinkFactory) -> None:
    await asyncio.wait_for(check(factory), CHECK_TIMEOUT)


def conformance_tests(
    factory: LinkFactory, checks: Sequence[Check] = CHECKS
) -> Callable[[Check], None]:
    """A pytest test function parametrised over ``checks`` (each runs in its own event
    loop); checks that do not apply are skipped with their reason."""
    import pytest

    params = [
        pytest.param(
            check,
            id=check.__name__.removeprefix("check_"),
            marks=[pytest.mark.slow] if check in _SLOW_CHECKS else [],
        )
        for check in checks
    ]

    @pytest.mark.parametrize("check", params)
    def test_conformance(check: Check) -> None:
        try:
            asyncio.run(_run_check(check, factory))
        except CheckNotApplicable as exc:
            pytest.skip(str(exc))

    return test_conformance
