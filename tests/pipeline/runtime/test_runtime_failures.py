"""Failure paths seen from callers: a caller blocked in ``send`` gets the pipeline's typed error
(at once, not after the teardown), in one process and across processes over zmq; a forced stop
does not block the event loop on a stage's worker thread; one slow ``Caller`` consumer or one
bad answer does not stall or fail the other calls; a frozen (SIGSTOPped) host is noticed by
heartbeats (or by probes when it sends over no link) and ended at stop, leaving no child."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import Any

import pytest

from pipeline import (
    Caller,
    Pipeline,
    PipelineClosedError,
    Stage,
    StageFailedError,
    StartOptions,
)
from pipeline.demo import Job, collatz_pipeline
from pipeline.runtime.errors import CallOverflowError, HostUnresponsiveError
from pipeline.runtime.stage import handles
from tests.pipeline.runtime.test_running import pending_slow_calls
from tests.processes import child_processes

# Generous bounds: these only tell "promptly" from "after a 60 s timeout" on a loaded machine.
PROMPTLY = 20.0
# Short heartbeats so a frozen host is noticed within seconds.
FAST_HEARTBEATS = StartOptions(heartbeat_interval=0.2, heartbeat_timeout=2.0)


pytestmark = pytest.mark.usefixtures("no_child_left")


def run(body: Callable[[], Awaitable[Any]], timeout: float = 120) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(body(), timeout)

    return asyncio.run(bounded())


async def eventually(predicate: Callable[[], bool], timeout: float = PROMPTLY) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- a caller blocked in send ---------------------------------------------------------------------


class Gate(Stage):
    """Mailbox of one; each message waits for ``go`` then raises (when ``fail``) or returns.
    ``stop`` waits for ``release``: a teardown stuck in it shows who waits for the teardown."""

    mailbox_capacity = 1

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.go = asyncio.Event()
        self.release = asyncio.Event()
        self.fail = True

    @handles(object)
    async def on_message(self, message: object) -> None:
        await self.go.wait()
        if self.fail:
            raise RuntimeError("gate broke")

    async def stop(self) -> None:
        await self.release.wait()


def _gate_pipeline() -> Pipeline:
    return Pipeline("gate").add("gate", Gate).entry("in", "gate").exit("out", "gate.out")


async def _blocked_send(running: Any) -> asyncio.Task[None]:
    """Fill the gate (one message handled, one queued) and return a send that waits."""
    await running.send("in", 1)
    await running.send("in", 2)  # returns once the gate took message 1
    blocked = asyncio.ensure_future(running.send("in", 3))
    await asyncio.sleep(0.2)
    assert not blocked.done()  # the mailbox is full and the gate holds message 1
    return blocked


def test_a_blocked_send_gets_the_failure_at_once_not_after_the_teardown() -> None:
    async def body() -> None:
        running = await _gate_pipeline().start(StartOptions(stop_timeout=60))
        gate = running.stage("gate")
        assert isinstance(gate, Gate)
        blocked = await _blocked_send(running)
        gate.go.set()  # the gate raises; the teardown then waits in gate.stop() up to 60 s
        with pytest.raises(StageFailedError, match="gate broke"):
            await asyncio.wait_for(blocked, PROMPTLY)
        assert running.failure is not None and isinstance(running.failure, StageFailedError)
        with pytest.raises(StageFailedError):
            await running.send("in", 4)
        gate.release.set()
        await running.stop()

    run(body)


def test_a_send_blocked_when_the_pipeline_stops_gets_pipeline_closed() -> None:
    async def body() -> None:
        running = await _gate_pipeline().start(StartOptions(stop_timeout=60))
        gate = running.stage("gate")
        assert isinstance(gate, Gate)
        gate.fail = False
        blocked = await _blocked_send(running)
        stopping = asyncio.ensure_future(running.stop(graceful=False))
        with pytest.raises(PipelineClosedError):
            await asyncio.wait_for(blocked, PROMPTLY)
        gate.release.set()
        await stopping
        assert running.failure is None

    run(body)


class RaisesLater(Stage):
    """Mailbox of one; sleeps on its first job, then raises: senders pile up meanwhile."""

    outputs = ()
    mailbox_capacity = 1

    @handles(Job)
    async def on_job(self, job: Job) -> None:
        await asyncio.sleep(1.0)
        raise RuntimeError(f"cannot do {job.job_id}")


def test_a_send_blocked_on_a_cross_host_link_gets_the_failure() -> None:
    pipeline = Pipeline("remote-gate").add("gate", RaisesLater, host="worker")
    pipeline.entry("in", "gate")
    payload = tuple(range(1000, 3000))  # a few KiB per message: the link fills quickly
    total = 100_000

    async def body() -> None:
        running = await pipeline.start(StartOptions(capacity=1, stop_timeout=60))
        sent = 0

        async def flood() -> None:
            nonlocal sent
            for i in range(total):
                await running.send("in", Job(f"j{i}", payload))
                sent += 1

        with pytest.raises(StageFailedError, match="cannot do j0"):
            await asyncio.wait_for(flood(), 60)
        assert sent < total  # it was waiting for room when the stage raised
        await running.stop()

    run(body)


# -- a forced stop does not block the loop on a worker thread ---------------------------------


class Threaded(Stage):
    """Runs a blocking job on its worker thread until ``release`` (at most 30 s)."""

    outputs = ()

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def _job(self) -> None:
        self.started.set()
        self.release.wait(30)
        self.finished.set()

    @handles(object)
    async def on_message(self, message: object) -> None:
        await self.run_in_thread(self._job)


def test_forced_stop_does_not_block_the_loop_on_a_running_thread_job() -> None:
    async def body() -> None:
        pipeline = Pipeline("threaded").add("t", Threaded).entry("in", "t")
        running = await pipeline.start()
        stage = running.stage("t")
        assert isinstance(stage, Threaded)
        await running.send("in", 1)
        await eventually(stage.started.is_set)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        try:
            started = time.monotonic()
            await running.stop(graceful=False)
            assert time.monotonic() - started < PROMPTLY
            assert not stage.finished.is_set()  # stop did not wait for the thread's job
            ticks_after_stop = ticks
            await asyncio.sleep(0.1)
            assert ticks > ticks_after_stop  # the loop runs while the job still runs
        finally:
            ticker.cancel()
            stage.release.set()
        await eventually(stage.finished.is_set)

    run(body)


# -- Caller: one slow consumer, one bad answer ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ask:
    key: str
    answers: int


@dataclasses.dataclass(frozen=True)
class Answer:
    key: str | None  # None: an answer the key function cannot read
    index: int
    last: bool


class Streams(Stage):
    """Answers ``Ask(key, n)`` with n answers; key "poison" is preceded by an unkeyable one."""

    @handles(Ask)
    async def on_ask(self, ask: Ask) -> None:
        if ask.key == "poison":
            await self.emit("out", Answer(None, -1, False))
        for index in range(ask.answers):
            await self.emit("out", Answer(ask.key, index, index == ask.answers - 1))


def _streams_pipeline() -> Pipeline:
    return Pipeline("streams").add("s", Streams).entry("in", "s").exit("out", "s.out")


def _answer_key(message: Ask | Answer) -> Hashable:
    if message.key is None:
        raise ValueError("this answer names no call")
    return message.key


def test_a_slow_consumer_fails_alone_and_does_not_stall_other_calls() -> None:
    cancelled: list[Hashable] = []

    async def on_cancel(key: Hashable) -> None:
        cancelled.append(key)

    async def body() -> None:
        async with await _streams_pipeline().start() as running:
            caller = Caller(
                running,
                "in",
                "out",
                key=_answer_key,
                done=lambda answer: answer.last,
                on_cancel=on_cancel,
                capacity=4,
            )
            slow = caller.stream(Ask("slow", 50))
            first = await anext(slow)  # then this consumer stops reading for a while
            assert first.index == 0
            fast = await asyncio.wait_for(caller.call(Ask("fast", 3)), PROMPTLY)
            assert fast == Answer("fast", 2, True)
            seen = [first.index]
            with pytest.raises(CallOverflowError, match="'slow'"):
                async for answer in slow:
                    seen.append(answer.index)
            assert seen == list(range(len(seen))) and len(seen) <= 1 + 4 + 1
            assert cancelled == ["slow"]
            # the caller still works, also for the key that overflowed
            assert (await caller.call(Ask("slow", 2))).index == 1
            await caller.aclose()

    run(body)


def test_an_answer_whose_key_raises_is_dropped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with await _streams_pipeline().start() as running:
            caller = Caller(running, "in", "out", key=_answer_key, done=lambda a: a.last)
            results = await asyncio.wait_for(
                asyncio.gather(caller.call(Ask("poison", 2)), caller.call(Ask("other", 1))),
                PROMPTLY,
            )
            assert results == [Answer("poison", 1, True), Answer("other", 0, True)]
            await caller.aclose()

    with caplog.at_level(logging.ERROR, logger="actorline.caller"):
        run(body)
    assert any("key raised" in record.getMessage() for record in caplog.records)


# -- a frozen host -----------------------------------------------------------------------------


@contextlib.contextmanager
def frozen(pid: int | None) -> Iterator[None]:
    """SIGSTOP child ``pid``; if a failed test leaves it alive, SIGKILL it (a stopped host
    would never exit on its own)."""
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pid in child_processes():
            os.kill(pid, signal.SIGKILL)


def test_a_frozen_host_fails_pending_calls_and_is_ended_at_stop() -> None:
    pipeline = collatz_pipeline().place("step", "worker")

    async def body() -> None:
        running = await pipeline.start(FAST_HEARTBEATS)
        caller, calls = await pending_slow_calls(running, 3)
        pid = running.pids["worker"]
        frozen_at = time.monotonic()
        with frozen(pid):
            results = await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), PROMPTLY
            )
            elapsed = time.monotonic() - frozen_at
            assert all(isinstance(r, HostUnresponsiveError) for r in results), results
            error = results[0]
            assert isinstance(error, HostUnresponsiveError) and error.host == "worker"
            # it says how long the host did not answer, not that it died
            timeout = FAST_HEARTBEATS.heartbeat_timeout
            assert error.seconds == timeout
            assert str(error).startswith(f"host 'worker' has been unresponsive for {timeout:g} s")
            assert elapsed < FAST_HEARTBEATS.heartbeat_timeout + PROMPTLY
            with pytest.raises(HostUnresponsiveError):
                await running.send("jobs", Job("late", (3,)))
            await asyncio.wait_for(running.stop(), PROMPTLY)
            await caller.aclose()
            assert pid not in child_processes()

    run(body)


class Sink(Stage):
    """Takes jobs and sends nothing on: its host has no outbound link to be heard on."""

    outputs = ()

    @handles(Job)
    async def on_job(self, job: Job) -> None:
        pass


def test_a_frozen_host_that_sends_nothing_is_noticed_by_probes() -> None:
    pipeline = Pipeline("sink").add("sink", Sink, host="worker").entry("in", "sink")

    async def body() -> None:
        running = await pipeline.start(FAST_HEARTBEATS)
        failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        running.add_failure_callback(failed.set_result)
        await running.send("in", Job("one", (1,)))
        pid = running.pids["worker"]
        with frozen(pid):
            error = await asyncio.wait_for(failed, FAST_HEARTBEATS.heartbeat_timeout + PROMPTLY)
            assert isinstance(error, HostUnresponsiveError) and error.host == "worker"
            assert error.seconds == FAST_HEARTBEATS.heartbeat_timeout
            assert "did not answer a probe" in str(error)
            await asyncio.wait_for(running.stop(), PROMPTLY)
            assert pid not in child_processes()

    run(body)
