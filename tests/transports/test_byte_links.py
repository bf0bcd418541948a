"""Tests for transports/_byte_links.py: inbound frames (decode, count, skip) and the
silence watchdog."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from transports._byte_links import InboundFrames, SilenceWatchdog
from transports.framing import FrameCodec, FrameKind
from transports.testing import KitPing

LOGGER = logging.getLogger("actorline.transports.test")


def test_hello_names_the_peer_and_data_is_counted() -> None:
    inbound = InboundFrames(FrameCodec(), LOGGER, "ipc:///tmp/x")
    assert "unnamed" in inbound.peer
    hello = FrameCodec.control(FrameKind.HELLO, "stage-a")
    assert inbound.accept(hello, len(hello[0])) == (FrameKind.HELLO, "stage-a")
    assert inbound.hello_received and "stage-a" in inbound.peer
    frames = FrameCodec().encode(KitPing(3))
    assert inbound.accept(frames, 40) == (FrameKind.DATA, KitPing(3))
    assert inbound.messages_received == 1
    assert inbound.bytes_received == len(hello[0]) + 40


def test_a_bad_frame_is_logged_with_the_peer_counted_and_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inbound = InboundFrames(FrameCodec(), LOGGER, "ipc:///tmp/x")
    hello = FrameCodec.control(FrameKind.HELLO, "stage-b")
    inbound.accept(hello, len(hello[0]))
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert inbound.accept([b"not an actorline frame"], 22) is None
    assert inbound.decode_errors == 1 and inbound.messages_received == 0
    (record,) = caplog.records
    assert "NotMsgpackError" in record.getMessage() and "stage-b" in record.getMessage()


def test_the_watchdog_fires_only_after_silence_that_counts() -> None:
    timeout = 0.2

    async def main() -> None:
        lost: list[float] = []
        counts = False
        watchdog = SilenceWatchdog(timeout, lambda: counts, lost.append)
        watchdog.start()
        await asyncio.sleep(3 * timeout)
        assert lost == []  # silent, but the silence did not count
        counts = True
        for _ in range(4):  # hearing the peer keeps postponing the verdict
            watchdog.last_heard = time.monotonic()
            await asyncio.sleep(timeout / 2)
        assert lost == []
        await asyncio.sleep(3 * timeout)
        assert len(lost) == 1 and lost[0] >= timeout
        watchdog.stop()

    asyncio.run(main())


def test_a_stopped_watchdog_never_fires() -> None:
    async def main() -> None:
        lost: list[float] = []
        watchdog = SilenceWatchdog(0.05, lambda: True, lost.append)
        watchdog.start()
        watchdog.stop()
        watchdog.stop()
        await asyncio.sleep(0.2)
        assert lost == []

    asyncio.run(main())
