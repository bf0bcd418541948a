"""Tests for transports/_byte_links.py: inbound frames (decode, count, skip) and the
silence watchdog."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

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
    # NOTE: the peer is heard every 0.1 s against a 2 s timeout, so only a 1.9 s stall of
    # this loop could fire the watchdog early; the waits are polls with a 30 s hang guard.
    timeout, heard_every = 2.0, 0.1

    async def wait_until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, "the watchdog never checked"
            await asyncio.sleep(0.01)

    async def main() -> None:
        lost: list[float] = []
        counts = False
        watchdog = SilenceWatchdog(timeout, lambda: counts, lost.append)
        watchdog.start()
        started = watchdog.last_heard
        # a check that finds silence that does not count starts the wait over
        await wait_until(lambda: watchdog.last_heard != started)
        assert lost == []  # silent, but the silence did not count
        counts = True
        # hearing the peer keeps postponing the verdict, across at least one check
        for _ in range(round(1.25 * timeout / heard_every)):
            watchdog.last_heard = time.monotonic()
            await asyncio.sleep(heard_every)
        assert lost == []
        await wait_until(lambda: bool(lost))
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
