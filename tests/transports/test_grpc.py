"""gRPC links (transports/grpc.py): the conformance kit, plus what is particular to gRPC
(link ids on one server, the frame layout, who is told what when a link ends)."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Coroutine
from typing import Any

import grpc
import grpc.aio
import pytest

from tests.transports.flooding import flood_until_held
from transports.base import LinkOptions
from transports.errors import (
    EncodeError,
    EndOfStream,
    LinkClosedError,
    PeerLostError,
    TruncatedFrameError,
)
from transports.framing import FrameCodec, FrameKind
from transports.grpc import (
    FULL_METHOD,
    LINK_ID_KEY,
    GrpcTransport,
    join_batch,
    join_frames,
    split_batch,
    split_frames,
)
from transports.testing import KitPayload, KitPing, LinkFactory, conformance_tests

# NOTE: a gRPC link holds up to `capacity` messages not yet written at the sender, the
# receiver's queue of `capacity`, what is left of the batch its stream handler is queueing (at
# most `capacity` more), and what fits in the HTTP/2 flow-control windows, which BDP probing
# grows to a few MiB.
GRPC = LinkFactory(GrpcTransport, queues_per_link=3, transit_messages=2, transit_bytes=32 << 20)

test_conformance = conformance_tests(GRPC)

OPTIONS = LinkOptions(capacity=8, heartbeat_interval=0.1, heartbeat_timeout=1.0)


def run(coroutine: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coroutine, 60))


def test_join_and_split_frames_round_trip() -> None:
    frames = [b"header", b"", bytes(range(256)) * 40]
    assert [bytes(f) for f in split_frames(join_frames(frames))] == frames
    assert [bytes(f) for f in split_frames(join_frames([b"one"]))] == [b"one"]


def test_a_message_without_buffers_travels_as_its_header_frame() -> None:
    (frame,) = FrameCodec().encode(KitPing(1))
    joined = join_frames([frame])
    assert joined is frame  # no layout, no copy
    (split,) = split_frames(joined)
    assert bytes(split) == frame


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\x00",
        struct.pack("!I", 0),
        struct.pack("!I", 2**32 - 1) + b"tiny",
        struct.pack("!II", 1, 10) + b"short",
        struct.pack("!II", 1, 2) + b"too long",
        struct.pack("!III", 2, 1, 1) + b"x",
        struct.pack("!I", (1 << 16) + 1) + bytes(4 * ((1 << 16) + 1)),
    ],
    ids=[
        "empty",
        "no-count",
        "zero-frames",
        "huge-count",
        "short",
        "long",
        "missing-frame",
        "too-many-frames",
    ],
)
def test_malformed_layouts_are_truncated_frame_errors(data: bytes) -> None:
    with pytest.raises(TruncatedFrameError):
        split_frames(data)


def test_join_and_split_batch_round_trip() -> None:
    messages = [join_frames(FrameCodec().encode(KitPing(seq))) for seq in range(3)]
    messages.append(join_frames([b"header", bytes(range(256))]))
    batch = join_batch(messages)
    assert batch[:1] == b"\xba"
    assert [bytes(m) for m in split_batch(batch)] == messages
    # a gRPC message that is not a batch is one link message, as it is
    assert [bytes(m) for m in split_batch(messages[0])] == [messages[0]]


@pytest.mark.parametrize(
    "data",
    [
        b"\xba",
        b"\xba" + struct.pack("!I", 0),
        b"\xba" + struct.pack("!II", 1, 10) + b"short",
        b"\xba" + struct.pack("!II", 1, 2) + b"too long",
        b"\xba" + struct.pack("!I", 4097) + bytes(4 * 4097),
    ],
    ids=["no-count", "zero-messages", "short", "long", "too-many-messages"],
)
def test_malformed_batches_are_truncated_frame_errors(data: bytes) -> None:
    with pytest.raises(TruncatedFrameError):
        split_batch(data)


def test_messages_queued_behind_a_write_go_out_together_in_order() -> None:
    async def main() -> None:
        options = LinkOptions(capacity=512, heartbeat_interval=5.0, heartbeat_timeout=10.0)
        async with GRPC.open_pair(options) as pair:
            sender, receiver = pair.sender, pair.receiver
            writes_before = sender.writes
            count = 300
            # every 50th message is too large to batch: it goes alone, between batches
            sent = [
                KitPayload(seq, bytes(100_000 if seq % 50 == 7 else seq)) for seq in range(count)
            ]
            for message in sent:  # no await gives the writer a turn in between
                await sender.send(message)
            got = [await receiver.receive() for _ in range(count)]
            assert got == sent
            assert sender.writes - writes_before < count // 10
            await sender.aclose()
            with pytest.raises(EndOfStream):
                await receiver.receive()
            # Every link message was counted at both ends, batched or not.
            assert receiver.statistics().bytes_received == sender.statistics().bytes_sent

    run(main())


def test_links_of_one_transport_share_its_server_and_are_told_apart_by_link_id() -> None:
    async def main() -> None:
        async with GrpcTransport(OPTIONS) as transport:
            first = await transport.listen()
            second = await transport.listen("grpc://127.0.0.1:0/named-link")
            port = transport.port
            assert port > 0
            assert first.address.startswith(f"grpc://127.0.0.1:{port}/")
            assert second.address == f"grpc://127.0.0.1:{port}/named-link"
            to_first = await transport.connect(first.address, name="one")
            to_second = await transport.connect(second.address, name="two")
            await to_second.send(KitPing(2))
            await to_first.send(KitPing(1))
            assert await first.receive() == KitPing(1)
            assert await second.receive() == KitPing(2)
            for sender in (to_first, to_second):
                await sender.aclose()
            for receiver in (first, second):
                with pytest.raises(EndOfStream):
                    await receiver.receive()
                await receiver.aclose()

    run(main())


def test_listen_refuses_a_taken_link_id_another_port_and_malformed_addresses() -> None:
    async def main() -> None:
        async with GrpcTransport(OPTIONS) as transport:
            receiver = await transport.listen("grpc://127.0.0.1:0/taken")
            with pytest.raises(ValueError, match="already listening"):
                await transport.listen(receiver.address)
            with pytest.raises(ValueError, match="cannot also listen"):
                await transport.listen(f"grpc://127.0.0.1:{transport.port + 1}/other")
            for address in ("tcp://127.0.0.1:1", "grpc://no-port/x", "grpc://127.0.0.1:x/y"):
                with pytest.raises(ValueError):
                    await transport.listen(address)
            with pytest.raises(ValueError, match="LINK_ID"):
                await transport.connect(f"grpc://127.0.0.1:{transport.port}")

    run(main())


def test_connect_is_refused_for_an_unknown_link_a_taken_link_and_no_server() -> None:
    async def main() -> None:
        async with GrpcTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            with pytest.raises(LinkClosedError, match="NOT_FOUND"):
                await transport.connect(f"grpc://127.0.0.1:{transport.port}/no-such-link")
            sender = await transport.connect(receiver.address)
            with pytest.raises(LinkClosedError, match="ALREADY_EXISTS"):
                await transport.connect(receiver.address)
            await sender.aclose()
            await receiver.aclose()
            port = transport.port
        async with GrpcTransport(OPTIONS) as other:
            with pytest.raises(LinkClosedError, match="no receiver"):
                await other.connect(f"grpc://127.0.0.1:{port}/gone")

    run(main())


def test_closing_the_receiver_makes_sends_fail() -> None:
    async def main() -> None:
        async with GrpcTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            sender = await transport.connect(receiver.address)
            await receiver.aclose()
            # LinkClosedError ("was closed") as a rule; gRPC core reports the ended call as
            # INTERNAL when a write was in flight, which reads as PeerLostError.
            with pytest.raises((LinkClosedError, PeerLostError), match=r"was closed|INTERNAL"):
                for _ in range(1000):
                    await sender.send(KitPing(0))
                    await asyncio.sleep(0.01)
            await sender.aclose()

    run(main())


def test_a_message_over_the_size_limit_is_refused_by_the_sender() -> None:
    options = LinkOptions(max_message_bytes=1 << 20)

    async def main() -> None:
        async with GrpcTransport(options) as transport:
            receiver = await transport.listen()
            sender = await transport.connect(receiver.address)
            with pytest.raises(EncodeError, match="limit"):
                await sender.send(KitPayload(0, bytes(2 << 20)))
            await sender.send(KitPing(1))  # the link is still fine
            assert await receiver.receive() == KitPing(1)
            await sender.aclose()
            await receiver.aclose()

    run(main())


def test_a_malformed_layout_or_batch_from_a_raw_peer_is_logged_counted_and_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with GrpcTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            link_id = receiver.address.rpartition("/")[2]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{transport.port}") as channel:
                call = channel.stream_stream(FULL_METHOD)(metadata=((LINK_ID_KEY, link_id),))
                await call.write(join_frames(FrameCodec.control(FrameKind.HELLO, "raw-peer")))
                await call.write(struct.pack("!II", 1, 99) + b"short")
                await call.write(b"\xba" + struct.pack("!II", 1, 99) + b"short")
                await call.write(join_frames(FrameCodec().encode(KitPing(5))))
                assert await receiver.receive() == KitPing(5)
                assert receiver.statistics().decode_errors == 2
                await call.write(join_frames(FrameCodec.control(FrameKind.END)))
                await call.done_writing()
                with pytest.raises(EndOfStream):
                    await receiver.receive()
            await receiver.aclose()

    with caplog.at_level(logging.WARNING, logger="actorline.transports.grpc"):
        run(main())
    records = [r for r in caplog.records if "TruncatedFrameError" in r.getMessage()]
    assert len(records) == 2
    assert all("raw-peer" in record.getMessage() for record in records)


def test_closing_the_sender_interrupts_a_send_held_by_flow_control() -> None:
    async def main() -> None:
        async with GrpcTransport(OPTIONS) as transport:
            receiver = await transport.listen()
            sender = await transport.connect(receiver.address)
            # nobody reads: the queue, then flow control, then the sender's own room fill up
            flood = await flood_until_held(sender, 1 << 20)
            await sender.aclose()
            with pytest.raises(LinkClosedError):
                await asyncio.wait_for(flood.task, 10)
            await receiver.aclose()

    run(main())


def test_cancelling_a_send_that_waits_for_room_leaves_the_link_working() -> None:
    async def main() -> None:
        options = LinkOptions(capacity=2, heartbeat_interval=0.1, heartbeat_timeout=2.0)
        async with GRPC.open_pair(options) as pair:
            sender, receiver = pair.sender, pair.receiver
            flood = await flood_until_held(sender, 1 << 16)
            flood.task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await flood.task
            assert sender.statistics().waiting_senders == 0
            got = [await asyncio.wait_for(receiver.receive(), 10) for _ in range(flood.sent)]
            assert [message.seq for message in got] == list(range(flood.sent))
            await sender.send(KitPing(7))  # the call is intact
            assert await asyncio.wait_for(receiver.receive(), 10) == KitPing(7)
            await sender.aclose()
            with pytest.raises(EndOfStream):
                await receiver.receive()

    run(main())
