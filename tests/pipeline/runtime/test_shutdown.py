"""Shutdown cut short and shutdown that takes long, with real processes and sockets: a stop
that is cancelled or times out still leaves no host process, socket or ipc directory behind
and a later stop returns; a spawned host gives each stage's ``stop`` the pipeline's
``stop_timeout``, not a default of its own."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pipeline import Caller, Pipeline, PipelineClosedError, Stage, StartOptions
from pipeline.demo import Job, JobResult
from pipeline.runtime.stage import handles
from tests.pipeline.runtime.test_running import _ipc_paths_by_host, open_sockets, run
from tests.pipeline.runtime.test_supervision import Forward
from tests.processes import child_processes

# Generous bound: it only tells "returns" from "hangs" on a loaded machine.
PROMPTLY = 20.0


pytestmark = pytest.mark.usefixtures("no_child_left")


class HangsInStop(Stage):
    """Answers jobs; its ``stop`` never returns by itself (a stuck flush). With a config (a
    file path), ``stop`` first creates that file: the sign that the stage waits in it."""

    @handles(Job)
    async def on_job(self, job: Job) -> None:
        await asyncio.sleep(job.delay)
        await self.emit("out", JobResult(job.job_id, _empty()))

    async def stop(self) -> None:
        if self.config is not None:
            Path(self.config).touch()  # noqa: ASYNC240 - a tiny local write, before hanging
        await asyncio.sleep(3600)


def _empty() -> Any:
    import numpy as np

    return np.zeros(0, dtype=np.int64)


def _pipeline(second: type[Stage], config: Any = None) -> Pipeline:
    pipeline = Pipeline("shut").add("first", Forward).add("second", second, config, host="worker")
    pipeline.connect("first", "second")
    return pipeline.entry("jobs", "first").exit("results", "second.out")


async def _ipc_files(running: Any) -> set[Path]:
    """The ipc files the hosts listen on, and the directories holding them."""
    files = set().union(*_ipc_paths_by_host(await running.statistics()).values())
    assert files, "the hosts listen on no ipc link"
    return files | {path.parent for path in files}


def _alive(pid: int | None) -> bool:
    return pid in child_processes()


# -- a stop cut short ----------------------------------------------------------------------------


def test_a_stop_that_times_out_leaves_nothing_behind_and_a_second_stop_returns() -> None:
    sockets_before = open_sockets()

    async def body() -> None:
        running = await _pipeline(HangsInStop).start(StartOptions(stop_timeout=30))
        pid = running.pids["worker"]
        paths = await _ipc_files(running)
        assert _alive(pid) and all(path.exists() for path in paths)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(running.stop(), 0.5)  # the worker waits in stop()
        # the cancelled stop turned forced before it gave up: nothing is left
        assert not _alive(pid)
        assert [path for path in paths if path.exists()] == []
        await asyncio.wait_for(running.stop(), PROMPTLY)
        with pytest.raises(PipelineClosedError):
            await running.send("jobs", Job("late", (1,)))

    run(body)
    assert open_sockets() <= sockets_before


def test_a_stop_cancelled_while_draining_leaves_nothing_behind() -> None:
    """Cancelled in its graceful wait for in-flight work, before any host was asked to stop."""

    async def body() -> None:
        running = await _pipeline(HangsInStop).start(StartOptions(stop_timeout=30))
        pid = running.pids["worker"]
        paths = await _ipc_files(running)
        await running.send("jobs", Job("slow", (1,), delay=60))
        stopping = asyncio.ensure_future(running.stop())  # waits for "slow" to drain
        await asyncio.sleep(0.5)
        assert not stopping.done()
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        assert not _alive(pid)
        assert [path for path in paths if path.exists()] == []
        with pytest.raises(PipelineClosedError):
            await running.receive("results")
        await asyncio.wait_for(running.stop(), PROMPTLY)

    run(body)


def test_a_stop_cancelled_twice_is_finished_by_the_next_stop(tmp_path: Path) -> None:
    """The waiting caller is cancelled again while the forced part runs: that part goes on
    in the background, and the next stop waits for it (or finishes it)."""
    in_stop = tmp_path / "in-stop"

    async def body() -> None:
        running = await _pipeline(HangsInStop, str(in_stop)).start(StartOptions(stop_timeout=30))
        pid = running.pids["worker"]
        paths = await _ipc_files(running)
        stopping = asyncio.ensure_future(running.stop(graceful=False))
        deadline = asyncio.get_running_loop().time() + PROMPTLY
        while not in_stop.exists():
            assert asyncio.get_running_loop().time() < deadline, "the worker never stopped"
            assert not stopping.done()
            await asyncio.sleep(0.01)
        # the worker waits in stop()
        stopping.cancel()
        await asyncio.sleep(0)  # the stop is now waiting for the forced part ...
        stopping.cancel()  # ... and is cancelled again
        with pytest.raises(asyncio.CancelledError):
            await stopping
        await asyncio.wait_for(running.stop(), PROMPTLY)
        assert not _alive(pid)
        assert [path for path in paths if path.exists()] == []

    run(body)


# -- a stop that takes long ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlowStopConfig:
    seconds: float
    mark: str  # a file written once stop() has finished


class SlowStop(Stage):
    """Forwards jobs; its ``stop`` takes ``seconds`` (a long flush), then writes ``mark``."""

    @handles(Job)
    async def on_job(self, job: Job) -> None:
        await self.emit("out", JobResult(job.job_id, _empty()))

    async def stop(self) -> None:
        await asyncio.sleep(self.config.seconds)
        await asyncio.to_thread(Path(self.config.mark).write_text, "stopped")


@pytest.mark.slow
def test_a_spawned_stage_gets_the_pipelines_stop_timeout(tmp_path: Path) -> None:
    """6 s is past the 5 s a host used to give each stage whatever the pipeline said."""
    mark = tmp_path / "stopped"

    async def body() -> None:
        pipeline = _pipeline(SlowStop, SlowStopConfig(6.0, str(mark)))
        running = await pipeline.start(StartOptions(stop_timeout=20))
        caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
        await asyncio.wait_for(caller.call(Job("one", (1,))), PROMPTLY)
        await caller.aclose()
        await asyncio.wait_for(running.stop(), 60)
        assert running.failure is None

    run(body)
    assert mark.read_text() == "stopped"
