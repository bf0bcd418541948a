"""The runtime's acceptance tests: one pipeline with a feedback edge, run in one process and
split across processes over zmq and grpc (with and without zstd), supervision (SIGKILL, a
stage that raises), and clean shutdown (no child process, socket or ipc file left behind)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline import (
    Caller,
    GraphError,
    HostDiedError,
    Pipeline,
    PipelineClosedError,
    RunningPipeline,
    Stage,
    StageFailedError,
    StartOptions,
)
from pipeline.demo import Job, JobResult, collatz_pipeline, collatz_steps
from pipeline.runtime.gc_policy import YOUNG_THRESHOLD
from pipeline.runtime.stage import handles
from pipeline.runtime.zygote import zygote_pids
from tests.processes import child_processes, process_alive
from transports.compression import Compression

JOBS = [Job(f"job-{i}", tuple(range(1 + 7 * i, 30 + 7 * i))) for i in range(6)]
EXPECTED = {job.job_id: [collatz_steps(v) for v in job.values] for job in JOBS}

ZSTD_EVERYTHING = Compression(threshold=0, compress_buffers=True)
VARIANTS = {
    "memory": (None, StartOptions(transport="zmq")),  # one host: every link is in memory
    "zmq": ("worker", StartOptions(transport="zmq")),
    "grpc": ("worker", StartOptions(transport="grpc")),
    # NOTE: a zero threshold tries zstd on every frame and buffer (a frame keeps it only if it
    # shrinks; the demo's small items do not, see test_zstd_really_compresses_the_traffic)
    "zmq+zstd": ("worker", StartOptions(transport="zmq", compression=ZSTD_EVERYTHING)),
    "grpc+zstd": ("worker", StartOptions(transport="grpc", compression=ZSTD_EVERYTHING)),
    # hosts linked over zmq tcp, as on separate machines (docs/architecture.md §5.3)
    "zmq+tcp": ("worker", StartOptions(transport_settings={"zmq": {"tcp_interface": "127.0.0.1"}})),
}


def child_pids() -> set[str]:
    """Live children of this process as "pid: command line", other than those that existed
    before the test (fixtures of other tests)."""
    return {f"{pid}: {command}" for pid, command in child_processes().items()} - BEFORE_TEST


BEFORE_TEST: set[str] = set()


@pytest.fixture(autouse=True)
def snapshot_children() -> None:
    global BEFORE_TEST
    BEFORE_TEST = set()
    BEFORE_TEST = child_pids()


def open_sockets() -> int:
    """Sockets this process has open, but for its socket to each zygote (which lives as long
    as the process: pipeline.runtime.zygote)."""
    count = -len(zygote_pids())
    for fd in Path("/proc/self/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            pass
    return count


def run(body: Callable[[], Awaitable[Any]], timeout: float = 120) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(body(), timeout)

    return asyncio.run(bounded())


async def run_jobs(
    pipeline: Pipeline,
    options: StartOptions,
    wire_bytes: list[int] | None = None,
    jobs: list[Job] = JOBS,
) -> dict[str, list[int]]:
    """Run ``jobs``; ``wire_bytes`` gets the bytes the cross-host links sent."""
    async with await pipeline.start(options) as running:
        caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
        results = await asyncio.gather(*(caller.call(job) for job in jobs))
        await caller.aclose()
        if wire_bytes is not None:
            hosts = await running.statistics()
            wire_bytes.append(sum(link.bytes_sent for h in hosts for link in h.links_out.values()))
    for result in results:
        assert isinstance(result, JobResult) and result.steps.dtype == np.int64
    return {result.job_id: result.steps.tolist() for result in results}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_same_results_in_every_placement(variant: str) -> None:
    host, options = VARIANTS[variant]
    pipeline = collatz_pipeline()
    if host is not None:
        pipeline.place("step", host)
    sockets_before = open_sockets()
    assert run(lambda: run_jobs(pipeline, options)) == EXPECTED
    assert child_pids() == set()
    # NOTE: grpc keeps a few process-wide sockets (its poller) after the first use
    if "grpc" not in variant:
        assert open_sockets() <= sockets_before


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_zstd_really_compresses_the_traffic(transport: str) -> None:
    """The same jobs with and without zstd: the same results, fewer bytes on the wire. (The
    demo's items are too small to shrink; long job ids, which every item carries, do.)"""
    pipeline = collatz_pipeline().place("step", "worker")
    jobs = [dataclasses.replace(job, job_id=job.job_id + " padding" * 40) for job in JOBS]
    expected = {job.job_id: EXPECTED[job.job_id.split(" ")[0]] for job in jobs}
    plain: list[int] = []
    compressed: list[int] = []
    options = StartOptions(transport=transport)
    assert run(lambda: run_jobs(pipeline, options, plain, jobs)) == expected
    options = StartOptions(transport=transport, compression=ZSTD_EVERYTHING)
    assert run(lambda: run_jobs(pipeline, options, compressed, jobs)) == expected
    assert 0 < compressed[0] < plain[0] * 0.5, (compressed, plain)


async def pending_slow_calls(
    running: RunningPipeline, count: int
) -> tuple[Caller, list[asyncio.Future[Any]]]:
    """A caller with ``count`` calls pending inside the worker host (each takes a while)."""
    caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
    calls = [
        asyncio.ensure_future(caller.call(Job(f"slow-{i}", (27, 97), delay=0.05)))
        for i in range(count)
    ]
    await asyncio.sleep(0.5)
    assert not any(call.done() for call in calls)
    return caller, calls


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_sigkill_fails_every_pending_call_quickly(transport: str) -> None:
    pipeline = collatz_pipeline().place("step", "worker")

    async def body() -> None:
        running = await pipeline.start(transport=transport)
        caller, calls = await pending_slow_calls(running, 5)
        killed_at = time.monotonic()
        os.kill(running.pids["worker"], signal.SIGKILL)
        results = await asyncio.gather(*calls, return_exceptions=True)
        elapsed = time.monotonic() - killed_at
        assert all(isinstance(r, HostDiedError) for r in results), results
        assert "killed by signal 9" in str(results[0])
        assert elapsed < 2.0
        with pytest.raises(HostDiedError):
            await running.send("jobs", Job("late", (3,)))
        await running.stop()
        await caller.aclose()

    run(body)
    assert child_pids() == set()


@pytest.mark.parametrize("host", [None, "worker"])
def test_a_stage_that_raises_surfaces_to_the_caller(host: str | None) -> None:
    pipeline = collatz_pipeline()
    if host:
        pipeline.place("step", host)

    async def body() -> None:
        async with await pipeline.start() as running:
            caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
            good = await caller.call(Job("good", (6,)))
            assert good.steps.tolist() == [8]
            with pytest.raises(StageFailedError) as failure:
                await caller.call(Job("bad", (5, -3)))
            error = failure.value
            assert error.stage == "step" and error.remote_type == "ValueError"
            assert "Collatz is undefined for -3" in str(error)
            if host is None:
                assert isinstance(error.__cause__, ValueError)
            else:
                assert "raise ValueError" in error.remote_traceback
            with pytest.raises(StageFailedError):
                await caller.call(Job("after", (4,)))
            await caller.aclose()

    run(body)
    assert child_pids() == set()


class FailsToStart(Stage):
    async def start(self) -> None:
        raise RuntimeError("no model here")


def test_start_failure_raises_and_cleans_up() -> None:
    pipeline = collatz_pipeline().insert("broken", FailsToStart, after="step", host="worker")

    async def body() -> None:
        with pytest.raises(StageFailedError, match=r"stage 'broken'.*RuntimeError: no model here"):
            await pipeline.start()

    run(body)
    assert child_pids() == set()


def test_graceful_stop_drains_in_flight_work() -> None:
    pipeline = collatz_pipeline().place("step", "worker")

    async def body() -> None:
        running = await pipeline.start()
        for i in range(3):
            await running.send("jobs", Job(f"j{i}", (27,), delay=0.002))
        await running.stop(graceful=True, timeout=30)
        got = []
        while True:
            try:
                got.append(await running.receive("results"))
            except PipelineClosedError:
                break
        assert sorted(r.job_id for r in got) == ["j0", "j1", "j2"]
        with pytest.raises(PipelineClosedError):
            await running.send("jobs", Job("late", (3,)))

    run(body)
    assert child_pids() == set()


def test_forced_stop_does_not_wait() -> None:
    pipeline = collatz_pipeline().place("step", "worker")

    async def body() -> None:
        running = await pipeline.start()
        await running.send("jobs", Job("forever", (27,), delay=1.0))
        started = time.monotonic()
        await running.stop(graceful=False)
        assert time.monotonic() - started < 8

    run(body)
    assert child_pids() == set()


def test_statistics_cover_stages_and_links() -> None:
    pipeline = collatz_pipeline().place("step", "worker")

    async def body() -> None:
        async with await pipeline.start() as running:
            caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
            await caller.call(Job("one", (7,)))
            snapshots = await running.statistics()
            await caller.aclose()
        by_host = {s.host: s for s in snapshots}
        assert set(by_host) == {"main", "worker"}
        worker = by_host["worker"]
        (step,) = worker.stages
        assert step.name == "step" and step.handled == collatz_steps(7)
        assert step.mailbox.capacity == Stage.mailbox_capacity
        sent = sum(s.messages_sent for s in by_host["main"].links_out.values())
        received = sum(s.messages_received for s in worker.links_in.values())
        assert sent == received == collatz_steps(7)

    run(body)


class GcProbe(Stage):
    """Answers a job with its process's garbage-collector state: [objects frozen, young
    threshold]."""

    @handles(Job)
    async def on_job(self, job: Job) -> None:
        state = np.array([gc.get_freeze_count(), gc.get_threshold()[0]], dtype=np.int64)
        await self.emit("out", JobResult(job.job_id, state))


def _gc_probe_pipeline() -> Pipeline:
    pipeline = Pipeline("gc-probe").add("probe", GcProbe, host="worker")
    return pipeline.entry("jobs", "probe").exit("results", "probe.out")


@pytest.mark.parametrize("tune_gc", [True, False])
def test_gc_policy_freezes_host_processes_and_raises_the_threshold_while_running(
    tune_gc: bool,
) -> None:
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()

    async def body() -> None:
        options = StartOptions(tune_gc=tune_gc)
        async with await _gc_probe_pipeline().start(options) as running:
            caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
            frozen, threshold = (await caller.call(Job("probe", ()))).steps.tolist()
            await caller.aclose()
            if tune_gc:
                # the host process froze its start-up heap; this one froze nothing
                assert frozen > 1000 and threshold == YOUNG_THRESHOLD
                assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD)
            else:
                assert frozen == 0 and threshold == before[0]
                assert gc.get_threshold() == before
            assert gc.get_freeze_count() == frozen_before

    run(body)
    assert gc.get_threshold() == before  # put back once the pipeline stopped
    assert child_pids() == set()


def _ipc_paths_by_host(hosts: Any) -> dict[str, set[Path]]:
    """The ipc files each host listens on, from a statistics snapshot."""
    return {
        host.host: {
            Path(link.address.removeprefix("ipc://"))
            for link in host.links_in.values()
            if link.address.startswith("ipc://")
        }
        for host in hosts
    }


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "graceful"])
def test_no_ipc_file_or_directory_is_left_behind(kill: bool) -> None:
    """The module's promise: once a zmq pipeline stopped, no ipc file (nor the directory
    holding it) remains, even when a host process was SIGKILLed and could not clean up."""
    pipeline = collatz_pipeline().place("step", "worker")
    used: set[Path] = set()

    async def body() -> None:
        running = await pipeline.start(transport="zmq")
        caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
        paths = _ipc_paths_by_host(await running.statistics())
        assert paths["worker"], paths  # the worker listens on ipc links
        for files in paths.values():
            used.update(files)
            used.update(path.parent for path in files)
        assert all(path.exists() for path in used)
        if kill:
            call = asyncio.ensure_future(caller.call(Job("slow", (27,), delay=0.05)))
            await asyncio.sleep(0.3)
            os.kill(running.pids["worker"], signal.SIGKILL)
            with pytest.raises(HostDiedError):
                await call
        else:
            result = await caller.call(Job("quick", (6,)))
            assert result.steps.tolist() == [8]
        await running.stop()
        await caller.aclose()

    run(body)
    assert [path for path in used if path.exists()] == []
    assert child_pids() == set()


_KILLED_PARENT = """
import asyncio, sys, time
from pipeline.demo import collatz_pipeline

async def main():
    running = await collatz_pipeline().place("step", "worker").start(transport="zmq")
    hosts = await running.statistics()
    dirs = {link.address[len("ipc://"):].rsplit("/", 1)[0]
            for host in hosts for link in host.links_in.values()}
    print(running.pids["worker"], *sorted(dirs), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_killed_parents_ipc_directories_are_removed_by_its_orphaned_hosts(
    tmp_path: Path,
) -> None:
    """SIGKILL the process that started a zmq pipeline: it cannot clean up, so its spawned
    host, seeing its parent gone, removes the parent's ipc directory and its own as it exits."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PARENT],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        assert parent.stdout is not None
        worker, *directories = parent.stdout.readline().split()
        assert len(directories) == 2, directories  # the parent's and the worker's
        assert all(Path(d).is_dir() and Path(d).parent == tmp_path for d in directories)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15
    while process_alive(int(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(int(worker)), "the orphaned host did not exit"
    assert sorted(tmp_path.glob("actorline-zmq-*")) == []


def test_zmq_links_across_hosts_can_use_tcp() -> None:
    """With the zmq transport's ``tcp_interface`` setting every cross-host link (the spawned
    host's and the caller's) binds a tcp port on that interface instead of an ipc path."""
    pipeline = collatz_pipeline().place("step", "worker")
    _, options = VARIANTS["zmq+tcp"]

    async def body() -> None:
        async with await pipeline.start(options) as running:
            caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
            result = await caller.call(Job("tcp", (27, 97)))
            assert result.steps.tolist() == [collatz_steps(27), collatz_steps(97)]
            hosts = await running.statistics()
            await caller.aclose()
        addresses = {h.host: [link.address for link in h.links_in.values()] for h in hosts}
        assert addresses["main"] and addresses["worker"], addresses
        for bound in addresses.values():
            assert all(a.startswith("tcp://127.0.0.1:") for a in bound), addresses

    run(body)
    assert child_pids() == set()


def test_a_stage_that_cannot_be_pickled_to_its_host_is_named() -> None:
    class Local(Stage):  # defined in a function: a spawned process cannot import it
        @handles(Job)
        async def on_job(self, job: Job) -> None:
            await self.emit("out", job)

    pipeline = collatz_pipeline().insert("local", Local, after="step", host="worker")

    async def body() -> None:
        with pytest.raises(GraphError, match=r"stage 'local' cannot run on host 'worker'.*module"):
            await pipeline.start()

    run(body)
    assert child_pids() == set()
