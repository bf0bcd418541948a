"""The synchronous wrappers' loop thread: an interrupt in the calling thread, wherever it
lands, cancels the coroutine and lets it unwind before the interrupt goes on."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.engine.loop_thread import LoopThread
from pipeline.runtime.errors import PipelineClosedError


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


class _Probe:
    """A coroutine body that waits forever and records how it ended."""

    def __init__(self) -> None:
        self.started = False
        self.unwound = False

    async def wait_forever(self) -> None:
        self.started = True
        try:
            await asyncio.Event().wait()
        finally:
            self.unwound = True


def test_results_and_errors_come_back(loop_thread: LoopThread) -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fail() -> None:
        raise ValueError("bad value")

    assert loop_thread.run(answer()) == 42
    with pytest.raises(ValueError, match="bad value"):
        loop_thread.run(fail())


def test_interrupt_during_the_hand_off_cancels_the_queued_coroutine(
    loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupt lands inside call_soon_threadsafe after the callback was queued (as a
    SIGINT can, while the loop's wake-up byte is written): the coroutine must still be
    cancelled, never left running on the loop with nobody waiting for it."""
    loop: Any = loop_thread.loop
    real_wake = loop._write_to_self
    interrupted = []

    def wake_then_interrupt() -> None:
        real_wake()
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_write_to_self", wake_then_interrupt)
    probe = _Probe()
    with pytest.raises(KeyboardInterrupt):
        loop_thread.run(probe.wait_forever())
    assert interrupted
    assert probe.unwound or not probe.started  # cancelled and unwound, or never run
    tasks = loop_thread.run(_other_tasks())
    assert tasks == []


@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_while_waiting_unwinds_the_coroutine(loop_thread: LoopThread) -> None:
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    probe = _Probe()
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop_thread.run(probe.wait_forever())
    finally:
        timer.cancel()
    assert probe.started and probe.unwound
    assert loop_thread.run(_other_tasks()) == []


def test_a_stopped_loop_refuses_and_closes_the_coroutine() -> None:
    thread = LoopThread()
    thread.stop()
    probe = _Probe()
    coroutine = probe.wait_forever()
    with pytest.raises(PipelineClosedError):
        thread.run(coroutine)
    assert coroutine.cr_frame is None  # closed, not left to warn "never awaited"


async def _other_tasks() -> list[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return [task for task in asyncio.all_tasks() if task is not current]
