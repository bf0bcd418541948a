"""ZeroMQ links (transports/zmq.py): the whole conformance kit over ipc and over tcp, plus
what is particular to ZMQ (addresses, ipc files, heartbeat edge cases, the size limit libzmq
enforces, one sender per receiver)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import socket
import struct
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tests.transports.flooding import flood_until_held
from transports.base import LinkOptions
from transports.errors import (
    EncodeError,
    EndOfStream,
    LinkClosedError,
    PeerLostError,
    TransportError,
)
from transports.framing import FrameCodec, FrameKind
from transports.testing import KitPayload, KitPing, LinkFactory, conformance_tests
from transports.zmq import ZmqTransport, frame_limit

# NOTE: a DEALER/ROUTER link buffers SNDHWM + RCVHWM messages plus what the kernel holds: about
# 200 KiB for a unix socket; tcp autotuning may grow to tcp_rmem + tcp_wmem (36 MiB here).
ZMQ_IPC = LinkFactory(
    ZmqTransport, queues_per_link=2, transit_bytes=1 << 20, detects_closed_receiver=False
)
ZMQ_TCP = dataclasses.replace(ZMQ_IPC, listen_address="tcp://127.0.0.1:0", transit_bytes=40 << 20)

test_conformance = conformance_tests(ZMQ_IPC)
# Every check runs over both; the two about a sender noticing its receiver go are skipped
# for both (a DEALER cannot tell), with that reason.
test_conformance_over_tcp = conformance_tests(ZMQ_TCP)

OPTIONS = LinkOptions(capacity=8, heartbeat_interval=0.1, heartbeat_timeout=1.0)
SLACK = 1.5


def run(coroutine: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coroutine, 60))


def test_tcp_port_zero_binds_a_free_port_and_reports_it() -> None:
    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen("tcp://127.0.0.1:0")
            match = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", receiver.address)
            assert match is not None and int(match[1]) > 0
            sender = await transport.connect(receiver.address, name="tcp-test")
            await sender.send(KitPing(1))
            assert await receiver.receive() == KitPing(1)
            await sender.aclose()
            with pytest.raises(EndOfStream):
                await receiver.receive()
            with pytest.raises(TransportError, match="cannot bind"):
                await transport.listen(receiver.address)  # the port is taken
            await receiver.aclose()

    run(main())


def test_an_explicit_ipc_path_exists_while_listening_and_is_removed_on_close(
    tmp_path: Path,
) -> None:
    path = tmp_path / "link.ipc"

    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen(f"ipc://{path}")
            assert receiver.address == f"ipc://{path}"
            assert path.exists()
            sender = await transport.connect(receiver.address)
            await sender.send(KitPing(2))
            assert await receiver.receive() == KitPing(2)
            await receiver.aclose()
            assert not path.exists()

    run(main())


def test_fresh_ipc_addresses_live_in_a_private_directory_removed_with_the_transport(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes it

    async def main() -> None:
        transport = ZmqTransport(OPTIONS)
        first, second = await transport.listen(), await transport.listen()
        directory = Path(first.address.removeprefix("ipc://")).parent
        assert directory.parent == tmp_path
        assert Path(second.address.removeprefix("ipc://")).parent == directory
        assert first.address != second.address and directory.is_dir()
        await transport.aclose()
        assert not directory.exists()
        with pytest.raises(LinkClosedError):
            await transport.listen()

    run(main())
    assert list(tmp_path.iterdir()) == []  # nor a new directory for the refused listen


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("interface", "bound"),
    [("127.0.0.1", r"tcp://127\.0\.0\.1"), ("::1", r"tcp://\[::1\]"), ("[::1]", r"tcp://\[::1\]")],
)
def test_a_tcp_interface_makes_fresh_addresses_free_tcp_ports(interface: str, bound: str) -> None:
    if "::" in interface and not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")

    async def main() -> None:
        async with ZmqTransport(OPTIONS, tcp_interface=interface) as transport:
            first, second = await transport.listen(), await transport.listen()
            for receiver in (first, second):
                match = re.fullmatch(bound + r":(\d+)", receiver.address)
                assert match is not None and int(match[1]) > 0, receiver.address
            assert first.address != second.address
            sender = await transport.connect(second.address, name="tcp-interface")
            await sender.send(KitPing(7))
            assert await second.receive() == KitPing(7)
            await sender.aclose()
            assert transport._private_dir is None  # no ipc directory was made

    run(main())


@pytest.mark.parametrize("interface", ["", "127.0.0.1:5555", "tcp://127.0.0.1", "a b"])
def test_a_tcp_interface_must_be_an_address_or_host_name(interface: str) -> None:
    with pytest.raises(ValueError, match="tcp_interface"):
        ZmqTransport(OPTIONS, tcp_interface=interface)


def test_addresses_of_other_schemes_are_refused() -> None:
    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            with pytest.raises(ValueError, match="ipc://"):
                await transport.listen("http://127.0.0.1:80")
            with pytest.raises(ValueError, match="ipc://"):
                await transport.connect("grpc://127.0.0.1:1/link")

    run(main())


def test_no_heartbeat_timeout_before_a_sender_says_hello() -> None:
    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(receiver.receive(), 2.5 * OPTIONS.heartbeat_timeout)
            await receiver.aclose()

    run(main())


def test_a_peer_that_falls_silent_after_hello_is_lost_within_the_timeout() -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            silent = context.socket(zmq.DEALER)
            silent.connect(receiver.address)
            await silent.send_multipart(FrameCodec.control(FrameKind.HELLO, "silent-peer"))
            await silent.send_multipart(FrameCodec().encode(KitPing(1)))
            assert await receiver.receive() == KitPing(1)
            started = time.monotonic()
            with pytest.raises(PeerLostError, match="silent-peer"):
                await receiver.receive()
            assert time.monotonic() - started < OPTIONS.heartbeat_timeout + SLACK
            with pytest.raises(PeerLostError):
                await receiver.receive()
            assert receiver.statistics().waiting_receivers == 0
            await receiver.aclose()
            silent.close(linger=0)
        context.term()

    run(main())


def test_a_consumer_busy_elsewhere_does_not_declare_its_peer_lost() -> None:
    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            sender = await transport.connect(receiver.address)
            await asyncio.sleep(2.5 * OPTIONS.heartbeat_timeout)  # not receiving meanwhile
            await sender.send(KitPing(3))
            assert await receiver.receive() == KitPing(3)
            await sender.aclose()
            with pytest.raises(EndOfStream):
                await receiver.receive()
            await receiver.aclose()

    run(main())


async def _two_waiting_receives(receiver: Any) -> tuple[asyncio.Task[Any], asyncio.Task[Any]]:
    """Two receives on ``receiver``, started one after the other, both waiting on its socket."""
    first = asyncio.create_task(receiver.receive())
    await asyncio.sleep(0.05)
    second = asyncio.create_task(receiver.receive())
    await asyncio.sleep(0.05)
    return first, second


def test_receives_waiting_together_each_get_a_message() -> None:
    # (which gets which is not promised: a receive that reads the sender's HELLO waits again
    # behind the other)
    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            sender = await transport.connect(receiver.address)
            first, second = await _two_waiting_receives(receiver)
            await sender.send(KitPing(1))
            await sender.send(KitPing(2))
            got = await asyncio.wait_for(asyncio.gather(first, second), 10)
            assert sorted(got, key=lambda ping: ping.seq) == [KitPing(1), KitPing(2)]

    run(main())


def test_a_cancelled_receive_hands_its_wake_up_to_the_next_one() -> None:
    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            sender = await transport.connect(receiver.address)
            first, second = await _two_waiting_receives(receiver)
            await sender.send(KitPing(7))
            await asyncio.sleep(0)  # the message may wake the first waiter before it goes
            first.cancel()
            assert await asyncio.wait_for(second, 10) == KitPing(7)
            with contextlib.suppress(asyncio.CancelledError):
                await first

    run(main())


def test_a_link_neither_waited_on_nor_read_does_not_spin() -> None:
    # The receiver watches ZMQ's notification fd with a level-triggered reader from its first
    # wait on: were the fd left signalled (ZMQ_EVENTS not read), the loop would call back
    # without end, while a receive waits and while messages arrive that nobody reads yet.
    async def idle_cpu_share() -> float:
        cpu, began = time.process_time(), time.monotonic()
        await asyncio.sleep(0.6)
        return (time.process_time() - cpu) / (time.monotonic() - began)

    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            sender = await transport.connect(receiver.address)
            waiting = asyncio.create_task(receiver.receive())
            assert await idle_cpu_share() < 0.5
            assert not waiting.done()
            await sender.send(KitPing(1))
            assert await asyncio.wait_for(waiting, 10) == KitPing(1)
            # a receive that waited and went (so ZMQ signals the next arrival), then messages
            # that nobody receives yet
            waiting = asyncio.create_task(receiver.receive())
            await asyncio.sleep(0.05)
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            for seq in (2, 3):
                await sender.send(KitPing(seq))
            assert await idle_cpu_share() < 0.5
            assert [await receiver.receive() for _ in range(2)] == [KitPing(2), KitPing(3)]

    run(main())


def test_closing_the_sender_interrupts_a_send_waiting_for_room() -> None:
    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            sender = await transport.connect(receiver.address)
            flood = await flood_until_held(sender, 64 * 1024)
            await sender.aclose()
            with pytest.raises(LinkClosedError):
                await asyncio.wait_for(flood.task, 10)
            await receiver.aclose()

    run(main())


def test_inproc_links_work_within_one_transport() -> None:
    async def main() -> None:
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen("inproc://kit-inproc")
            assert receiver.address == "inproc://kit-inproc"
            sender = await transport.connect(receiver.address, name="inproc")
            await sender.send(KitPayload(1, bytes(100_000)))
            assert await receiver.receive() == KitPayload(1, bytes(100_000))
            await sender.aclose()
            with pytest.raises(EndOfStream):
                await receiver.receive()
            await receiver.aclose()

    run(main())


# -- the size limit libzmq enforces (ZMQ_MAXMSGSIZE) -------------------------------------------

SMALL = dataclasses.replace(OPTIONS, max_message_bytes=1 << 20)
LIMIT = frame_limit(SMALL.max_message_bytes)


def test_an_oversized_frame_is_refused_by_libzmq_and_the_link_still_delivers() -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        async with ZmqTransport(SMALL) as transport:
            receiver = await transport.listen("tcp://127.0.0.1:0")
            rogue = context.socket(zmq.DEALER)
            rogue.connect(receiver.address)
            await rogue.send(bytes(8 * LIMIT))  # libzmq drops it and disconnects the peer
            sender = await transport.connect(receiver.address, name="well-behaved")
            for seq in range(3):
                await sender.send(KitPing(seq))
            assert [await receiver.receive() for _ in range(3)] == [KitPing(s) for s in range(3)]
            statistics = receiver.statistics()
            assert statistics.decode_errors == 0
            assert statistics.bytes_received == sender.statistics().bytes_sent
            # The sender refuses what the receiver's libzmq would drop...
            with pytest.raises(EncodeError, match="exceeds the link's limit"):
                await sender.send(KitPayload(9, bytes(LIMIT + 1)))
            # ...and the link goes on.
            await sender.send(KitPing(3))
            assert await receiver.receive() == KitPing(3)
            await sender.aclose()
            with pytest.raises(EndOfStream):
                await receiver.receive()
            rogue.close(linger=0)
        context.term()

    run(main())


def _zmtp_dealer_greeting() -> bytes:
    """A ZMTP 3.0 greeting and NULL-mechanism READY of a DEALER, by hand."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
    greeting += bytes(1 + 31)  # as-server, filler
    name, value = b"Socket-Type", b"DEALER"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack("!I", len(value)) + value
    return greeting + bytes([0x04, len(body)]) + body


def test_a_peer_announcing_a_huge_frame_is_cut_off_before_anything_is_buffered() -> None:
    """Without ZMQ_MAXMSGSIZE libzmq would allocate the announced size and wait for the
    bytes; with it the connection is closed as soon as the length arrives."""

    async def main() -> None:
        async with ZmqTransport(SMALL) as transport:
            receiver = await transport.listen("tcp://127.0.0.1:0")
            host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            announced = 512 << 20
            writer.write(_zmtp_dealer_greeting() + b"\x02" + struct.pack("!Q", announced))
            writer.write(bytes(64 << 10))
            await writer.drain()
            with contextlib.suppress(ConnectionError):  # closed (EOF) or reset: both fine
                await asyncio.wait_for(reader.read(), 10)  # until the receiver hangs up
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            # The link is intact for its real sender.
            sender = await transport.connect(receiver.address, name="well-behaved")
            await sender.send(KitPing(1))
            assert await receiver.receive() == KitPing(1)
            assert receiver.statistics().decode_errors == 0
            await sender.aclose()
            with pytest.raises(EndOfStream):
                await receiver.receive()

    run(main())


# -- one sender per receiver -------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_a_second_peer_can_neither_end_nor_feed_the_link(
    scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        async with ZmqTransport(OPTIONS) as transport:
            receiver = await transport.listen("tcp://127.0.0.1:0" if scheme == "tcp" else None)
            sender = await transport.connect(receiver.address, name="the-sender")
            await sender.send(KitPing(1))
            assert await receiver.receive() == KitPing(1)
            intruder = context.socket(zmq.DEALER)
            intruder.connect(receiver.address)
            await intruder.send_multipart(FrameCodec.control(FrameKind.HELLO, "intruder"))
            await intruder.send_multipart(FrameCodec().encode(KitPing(99)))
            await intruder.send_multipart(FrameCodec.control(FrameKind.END))
            # A receive waits while it drops the intruder's frames (nothing else comes yet).
            pending = asyncio.ensure_future(receiver.receive())
            for _ in range(500):
                if any("not its sender" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.02)
            assert not pending.done()  # neither the intruder's data nor its END got through
            for seq in (2, 3):
                await sender.send(KitPing(seq))
            assert [await pending, await receiver.receive()] == [KitPing(2), KitPing(3)]
            await sender.aclose()
            with pytest.raises(EndOfStream, match="the-sender"):
                await receiver.receive()
            statistics = receiver.statistics()
            assert statistics.messages_received == 3 and statistics.decode_errors == 0
            assert statistics.bytes_received == sender.statistics().bytes_sent
            intruder.close(linger=0)
        context.term()

    with caplog.at_level(logging.WARNING, logger="actorline.transports.zmq"):
        run(main())
    warnings = [r.getMessage() for r in caplog.records if "not its sender" in r.getMessage()]
    assert len(warnings) == 1 and "the-sender" in warnings[0], warnings
