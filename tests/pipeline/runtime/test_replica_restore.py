"""``RunningPipeline.restore_replica`` with real processes: a replica killed and cut off runs
again on a fresh host process, linked afresh to the main host; the stage linked to it hears
``ReplicaRestored`` and its messages reach the replica again, while the other replica served
throughout; it can be lost and restored again; a live replica, or one whose fresh host fails
to start, is refused with a typed error and stays as it was (docs/architecture.md §4.7)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from pipeline import Pipeline, StageFailedError
from pipeline.runtime.replicas import ReplicaRestored
from tests.pipeline.runtime.test_replicas import Front, Task, Worker, receive
from tests.pipeline.runtime.test_running import run
from tests.processes import process_alive

pytestmark = [pytest.mark.usefixtures("no_child_left"), pytest.mark.slow]


class RestoringFront(Front):
    """A Front that routes to a restored replica again."""

    def __init__(self, config: tuple[str, ...]) -> None:
        super().__init__(config)
        self.restored: list[ReplicaRestored] = []

    async def on_replica_restored(self, restored: ReplicaRestored) -> None:
        self.restored.append(restored)
        self.live.append(f"worker_{restored.replica}")


class FailsOnce(Worker):
    """A worker whose start fails while a marker file exists."""

    def __init__(self, marker: str) -> None:
        super().__init__(0.0)
        self.marked = os.path.exists(marker)  # (built in the host process, at each start)

    async def start(self) -> None:
        if self.marked:
            raise RuntimeError("cannot start: marker present")


def restorable(marker: str = "") -> Pipeline:
    pipeline = Pipeline("restorable")
    workers = ("worker_a", "worker_b")
    pipeline.add("front", RestoringFront, workers)
    pipeline.add("worker_a", Worker, 0.0, host="host_a")
    pipeline.add("worker_b", FailsOnce, marker, host="host_b")
    for worker in workers:
        pipeline.connect("front.work", worker)
        pipeline.connect(f"{worker}.out", "front.back")
    pipeline.replica_set("workers", {"a": ("host_a",), "b": ("host_b",)})
    return pipeline.entry("tasks", "front.in").exit("done", "front.out")


async def lose_b(running) -> None:  # type: ignore[no-untyped-def]
    front = running.stage("front")
    lost = len(front.lost)
    pid = running.pids["host_b"]
    os.kill(pid, signal.SIGKILL)
    while len(front.lost) == lost:  # noqa: ASYNC110 - the stage's own state, polled
        await asyncio.sleep(0.01)
    assert not process_alive(pid)


def test_a_lost_replica_is_restored_and_served_again_and_a_failed_restore_leaves_it_lost(
    tmp_path: Path,
) -> None:
    """One pipeline: replica b is lost and restored twice, served meanwhile by a; then lost a
    third time while its fresh host cannot start: the restore fails with the stage's error
    and leaves it lost (a serving on), and once it can start again it is restored. (Formerly
    test_a_restore_whose_host_fails_to_start_leaves_the_replica_lost, a pipeline of its
    own.)"""
    marker = tmp_path / "marker"

    async def body() -> None:
        async with await restorable(str(marker)).start() as running:
            front = running.stage("front")
            with pytest.raises(ValueError, match="replica b of 'workers' is not lost"):
                await running.restore_replica("workers", "b")
            with pytest.raises(KeyError):
                await running.restore_replica("workers", "c")
            assert running.unrestorable("workers", "b") == ""
            for round_ in (1, 2):  # lost and restored twice
                old = running.pids["host_b"]
                await lose_b(running)
                await running.send("tasks", Task(10 * round_, replica="a"))
                (done,) = await receive(running, 1)
                assert done.replica == "worker_a" and not done.error  # a serves meanwhile
                await running.restore_replica("workers", "b")
                assert running.pids["host_b"] not in (None, old)
                while len(front.restored) < round_:  # noqa: ASYNC110 - the stage's state
                    await asyncio.sleep(0.01)
                assert [r.restored for r in front.restored] == list(range(1, round_ + 1))
                assert all(status.alive for status in running.replicas())
                await running.send("tasks", Task(10 * round_ + 1, replica="b"))
                (done,) = await receive(running, 1)
                assert (done.task_id, done.replica, done.error) == (10 * round_ + 1, "worker_b", "")
            assert running.failure is None
            # a restore whose fresh host fails to start leaves the replica lost
            await lose_b(running)
            marker.write_text("")
            with pytest.raises(StageFailedError, match="cannot start: marker present"):
                await running.restore_replica("workers", "b")
            assert [s.alive for s in running.replicas()] == [True, False]
            assert len(front.restored) == 2 and running.failure is None
            await running.send("tasks", Task(1, replica="a"))
            (done,) = await receive(running, 1)
            assert done.replica == "worker_a" and not done.error
            marker.unlink()
            await running.restore_replica("workers", "b")  # it can be tried again
            await running.send("tasks", Task(2, replica="b"))
            (done,) = await receive(running, 1)
            assert (done.replica, done.error) == ("worker_b", "")

    run(body)


def test_a_replica_linked_to_a_spawned_host_is_restored_too() -> None:
    # the stage linked to the replica runs on a spawned host (as an engine's execute stage
    # linked to its draft host, docs/speculative.md): that host listens and connects afresh
    # and its stage hears ReplicaRestored, so its tasks reach the replica again
    pipeline = Pipeline("restorable_from_a_hub")
    workers = ("worker_a", "worker_b")
    pipeline.add("front", RestoringFront, workers, host="hub")
    pipeline.add("worker_a", Worker, 0.0, host="host_a")
    pipeline.add("worker_b", Worker, 0.0, host="host_b")
    for worker in workers:
        pipeline.connect("front.work", worker)
        pipeline.connect(f"{worker}.out", "front.back")
    pipeline.replica_set("workers", {"a": ("host_a",), "b": ("host_b",)})
    pipeline.entry("tasks", "front.in").exit("done", "front.out")

    async def body() -> None:
        async with await pipeline.start() as running:
            assert running.unrestorable("workers", "b") == ""
            for round_ in (1, 2):  # lost and restored twice
                old = running.pids["host_b"]
                assert old is not None
                os.kill(old, signal.SIGKILL)
                while [s.alive for s in running.replicas()] != [True, False]:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                await running.restore_replica("workers", "b")
                assert running.pids["host_b"] not in (None, old)
                # by turn over the live workers: b is among them again only if front heard
                for task_id in (10 * round_, 10 * round_ + 1):
                    await running.send("tasks", Task(task_id))
                done = await receive(running, 2)
                assert sorted(d.replica for d in done) == ["worker_a", "worker_b"]
                assert not any(d.error for d in done)
            assert running.failure is None

    run(body)
