"""The in-memory reference transport (transports/memory.py): the conformance kit, plus the
channel's own non-blocking and failure paths."""

from __future__ import annotations

import asyncio

import pytest

from transports.errors import EndOfStream, LinkClosedError, PeerLostError
from transports.memory import MemoryChannel, MemoryTransport, WouldBlock
from transports.testing import LinkFactory, conformance_tests

MEMORY = LinkFactory(MemoryTransport)

test_conformance = conformance_tests(MEMORY)


def test_nowait_calls_raise_would_block_at_the_bounds() -> None:
    channel: MemoryChannel[int] = MemoryChannel(2)
    with pytest.raises(WouldBlock):
        channel.receive_nowait()
    channel.send_nowait(1)
    channel.send_nowait(2)
    with pytest.raises(WouldBlock):
        channel.send_nowait(3)
    assert channel.statistics().queued == 2
    assert [channel.receive_nowait(), channel.receive_nowait()] == [1, 2]


def test_fail_delivers_what_is_queued_then_raises_on_both_ends() -> None:
    async def main() -> None:
        channel: MemoryChannel[int] = MemoryChannel(4)
        await channel.send(1)
        channel.fail(PeerLostError("gone"))
        assert await channel.receive() == 1
        with pytest.raises(PeerLostError):
            await channel.receive()
        with pytest.raises(PeerLostError):
            await channel.send(2)

    asyncio.run(main())


def test_addresses_are_checked_and_unique() -> None:
    async def main() -> None:
        transport = MemoryTransport()
        receiver = await transport.listen("memory://unique-test")
        with pytest.raises(ValueError, match="already in use"):
            await transport.listen("memory://unique-test")
        with pytest.raises(ValueError, match="memory://"):
            await transport.listen("ipc:///tmp/x")
        sender = await transport.connect(receiver.address)
        await sender.aclose()
        with pytest.raises(EndOfStream):
            await receiver.receive()
        await receiver.aclose()
        with pytest.raises(LinkClosedError, match="nothing listens"):
            await transport.connect(receiver.address)

    asyncio.run(main())
