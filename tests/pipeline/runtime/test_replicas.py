"""Replica sets with real processes: a failure on one replica's hosts (SIGKILL, a stage that
raises) is contained to it: its hosts are killed, the stage linked to it hears ReplicaLost
after everything the replica sent, what is still sent to it is dropped, the other replica
goes on and the pipeline stays up, until the last replica fails. Also targeted sends
(``emit(port, message, to=stage)``) and the graph's checks of replica sets."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from pipeline import GraphError, HostDiedError, Pipeline, Stage, StageFailedError
from pipeline.runtime.replicas import ReplicaLost
from pipeline.runtime.stage import handles
from tests.pipeline.runtime.test_running import run
from tests.processes import process_alive
from transports.codec import message

pytestmark = pytest.mark.usefixtures("no_child_left")

PROMPTLY = 20.0


@message(960)
@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    task_id: int
    replica: str = ""  # which replica should take it ("": the front picks by turn)


@message(961)
@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    task_id: int
    replica: str  # the worker stage that did it
    error: str = ""


class Front(Stage):
    """Sends each task to one worker (``to=``), passes results on, and answers the tasks a
    lost replica held with an error result."""

    inputs = ("in", "back")
    outputs = ("work", "out")

    def __init__(self, config: tuple[str, ...]) -> None:
        super().__init__(config)
        self.live = list(config)
        self.held: dict[int, str] = {}
        self.lost: list[ReplicaLost] = []
        self._turn = 0

    @handles(Task, port="in")
    async def on_task(self, task: Task) -> None:
        worker = (
            f"worker_{task.replica}" if task.replica else self.live[self._turn % len(self.live)]
        )
        self._turn += 1
        self.held[task.task_id] = worker
        await self.emit("work", task, to=worker)

    @handles(Done, port="back")
    async def on_done(self, done: Done) -> None:
        self.held.pop(done.task_id, None)
        await self.emit("out", done)

    async def on_replica_lost(self, lost: ReplicaLost) -> None:
        self.lost.append(lost)
        worker = f"worker_{lost.replica}"
        self.live.remove(worker)
        for task_id in [t for t, w in self.held.items() if w == worker]:
            del self.held[task_id]
            await self.emit("out", Done(task_id, worker, error=lost.message))


class Worker(Stage):
    """Answers a task, after ``delay`` seconds; task id -1 makes it raise."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay)

    @handles(Task)
    async def on_task(self, task: Task) -> None:
        if task.task_id < 0:
            raise RuntimeError("a broken worker")
        if self.config:
            await asyncio.sleep(self.config)
        await self.emit("out", Done(task.task_id, self.name))


def replicated(delay: float = 0.0) -> Pipeline:
    pipeline = Pipeline("replicated")
    workers = ("worker_a", "worker_b")
    pipeline.add("front", Front, workers)
    for worker in workers:
        pipeline.add(worker, Worker, delay, host=f"host_{worker[-1]}")
        pipeline.connect("front.work", worker)
        pipeline.connect(f"{worker}.out", "front.back")
    pipeline.replica_set("workers", {"a": ("host_a",), "b": ("host_b",)})
    return pipeline.entry("tasks", "front.in").exit("done", "front.out")


async def receive(running, count: int) -> list[Done]:  # type: ignore[no-untyped-def]
    return [await asyncio.wait_for(running.receive("done"), PROMPTLY) for _ in range(count)]


def test_a_killed_replica_fails_alone_and_is_cut_off() -> None:
    async def body() -> None:
        async with await replicated(delay=1.5).start() as running:
            front = running.stage("front")
            assert isinstance(front, Front)
            for task_id in range(4):  # two each, by turn
                await running.send("tasks", Task(task_id))
            pid = running.pids["host_b"]
            assert pid is not None
            while len(front.held) < 4:  # noqa: ASYNC110 - the stage's own state, polled
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            done = sorted(await receive(running, 4), key=lambda d: d.task_id)
            # b's two tasks end with its error; a's two finish normally
            assert [(d.replica, bool(d.error)) for d in done] == [
                ("worker_a", False),
                ("worker_b", True),
                ("worker_a", False),
                ("worker_b", True),
            ]
            assert "killed by signal 9" in done[1].error
            (lost,) = front.lost
            assert (lost.replica_set, lost.replica, lost.hosts) == ("workers", "b", ("host_b",))
            assert lost.error_type == "HostDiedError" and lost.exitcode == -signal.SIGKILL
            assert running.failure is None
            statuses = {status.replica: status for status in running.replicas()}
            assert statuses["a"].alive and not statuses["b"].alive
            assert isinstance(statuses["b"].error, HostDiedError)
            assert not process_alive(pid)
            # the live replica serves on; a send still aimed at the lost one is dropped
            await running.send("tasks", Task(10))
            await running.send("tasks", Task(11, replica="b"))
            await running.send("tasks", Task(12, replica="a"))
            late = await receive(running, 2)
            assert sorted((d.task_id, d.replica) for d in late) == [
                (10, "worker_a"),
                (12, "worker_a"),
            ]
            hosts = {stats.host for stats in await running.statistics()}
            assert hosts == {"main", "host_a"}
            assert await running.wait_idle(PROMPTLY)  # the cut links count for nothing

    run(body)


def test_a_stage_failing_on_a_replica_is_contained_until_the_last_replica_fails() -> None:
    async def body() -> None:
        running = await replicated().start()
        try:
            front = running.stage("front")
            assert isinstance(front, Front)
            await running.send("tasks", Task(-1, replica="a"))
            (failed,) = await receive(running, 1)
            assert failed.replica == "worker_a" and "a broken worker" in failed.error
            assert front.lost[0].error_type == "StageFailedError"
            assert running.failure is None
            await running.send("tasks", Task(1))
            (ok,) = await receive(running, 1)
            assert ok.replica == "worker_b" and not ok.error
            pid = running.pids["host_b"]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(HostDiedError):
                await asyncio.wait_for(running.receive("done"), PROMPTLY)
            assert isinstance(running.failure, HostDiedError)
            assert running.failure.host == "host_b"
            assert isinstance(running.replicas()[0].error, StageFailedError)
        finally:
            await running.stop()

    run(body)


def test_the_last_replica_of_an_expendable_set_is_contained_too() -> None:
    # a helper the pipeline works on without (the LLM engine's draft host): losing all of
    # it is contained, the stage linked to it is told, and the rest of the pipeline runs on
    async def body() -> None:
        pipeline = replicated()
        pipeline.replica_set("workers", {"a": ("host_a",), "b": ("host_b",)}, expendable=True)
        assert "replica set workers (a: host_a, b: host_b), expendable" in pipeline.describe()
        async with await pipeline.start() as running:
            front = running.stage("front")
            assert isinstance(front, Front)
            await running.send("tasks", Task(-1, replica="a"))
            await receive(running, 1)
            pid = running.pids["host_b"]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            while len(front.lost) < 2:  # noqa: ASYNC110 - the stage's own state, polled
                await asyncio.sleep(0.01)
            assert running.failure is None
            assert [status.alive for status in running.replicas()] == [False, False]
            assert {stats.host for stats in await running.statistics()} == {"main"}

    run(body)


def test_emit_to_a_stage_the_port_is_not_linked_to_fails_the_sender() -> None:
    class Misdirect(Stage):
        @handles(Task)
        async def on_task(self, task: Task) -> None:
            await self.emit("out", Done(task.task_id, ""), to="nowhere")

    async def body() -> None:
        pipeline = Pipeline("misdirect").add("source", Misdirect).add("sink", Worker)
        pipeline.connect("source", "sink").entry("tasks", "source").exit("done", "sink.out")
        async with await pipeline.start(transport="memory") as running:
            await running.send("tasks", Task(1))
            with pytest.raises(StageFailedError) as failure:
                await asyncio.wait_for(running.receive("done"), PROMPTLY)
            assert failure.value.remote_type == "GraphError"
            assert "to 'nowhere', which that port is not linked to" in str(failure.value)
            assert "['sink']" in str(failure.value)

    run(body)


def test_replica_sets_are_checked() -> None:
    pipeline = replicated()
    with pytest.raises(GraphError, match="named twice"):
        pipeline.replica_set("bad", {"x": ("host_a",), "y": ("host_a",)})
    with pytest.raises(GraphError, match="no replica"):
        pipeline.replica_set("empty", {})
    with pytest.raises(GraphError, match="sequence of host names"):
        pipeline.replica_set("bad", {"x": "host_a"})
    twin = pipeline.copy().replica_set("main", {"m": ("main",)})
    with pytest.raises(GraphError, match="names the main host"):
        twin.validate()
    twin = pipeline.copy().replica_set("other", {"z": ("host_z",)})
    with pytest.raises(GraphError, match="no stage is placed"):
        twin.validate()
    twin = pipeline.copy().replica_set("again", {"a": ("host_a",)})
    with pytest.raises(GraphError, match="in replica sets 'workers' and 'again'"):
        twin.validate()
    assert "replica set workers (a: host_a, b: host_b)" in pipeline.describe()
    pipeline.validate()
