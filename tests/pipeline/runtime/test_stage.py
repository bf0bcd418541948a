"""Stage dispatch: by message type, by port, through base classes; unknown types fail."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pipeline import Stage, UnhandledMessageError, handles


@dataclasses.dataclass(frozen=True)
class Base:
    value: int


@dataclasses.dataclass(frozen=True)
class Derived(Base):
    pass


class Recorder(Stage):
    outputs = ()
    inputs = ("in", "control")

    def __init__(self, config: object = None) -> None:
        super().__init__(config)
        self.seen: list[tuple[str, object]] = []

    @handles(Base)
    async def on_base(self, message: Base) -> None:
        self.seen.append(("base", message))

    @handles(int, str)
    async def on_scalar(self, message: object) -> None:
        self.seen.append(("scalar", message))

    @handles(int, port="control")
    async def on_control(self, message: int) -> None:
        self.seen.append(("control", message))


def test_dispatch_by_type_port_and_base_class() -> None:
    stage = Recorder()

    async def run() -> None:
        await stage.handle(Base(1), "in")
        await stage.handle(Derived(2), "in")
        await stage.handle(3, "in")
        await stage.handle("x", "in")
        await stage.handle(4, "control")
        with pytest.raises(UnhandledMessageError, match="no handler for float on port 'in'"):
            await stage.handle(1.5, "in")

    asyncio.run(run())
    assert stage.seen == [
        ("base", Base(1)),
        ("base", Derived(2)),
        ("scalar", 3),
        ("scalar", "x"),
        ("control", 4),
    ]


def test_ports_must_be_distinct_tuples() -> None:
    with pytest.raises(TypeError, match="distinct names"):

        class Bad(Stage):
            inputs = ("in", "in")


def test_emit_outside_a_pipeline_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="not running in a pipeline"):
        asyncio.run(Recorder().emit("out", 1))


def test_run_in_thread_uses_one_worker_thread() -> None:
    import threading

    stage = Recorder()

    async def run() -> set[int]:
        return {await stage.run_in_thread(threading.get_ident) for _ in range(5)}

    assert len(asyncio.run(run())) == 1
    stage._shutdown_executor()


def test_shutting_the_worker_thread_down_does_not_wait_for_a_running_job() -> None:
    import threading

    stage = Recorder()
    started = threading.Event()
    release = threading.Event()
    finished = threading.Event()

    def job() -> None:
        started.set()
        release.wait(30)
        finished.set()

    async def run() -> None:
        running = asyncio.ensure_future(stage.run_in_thread(job))
        assert await asyncio.to_thread(started.wait, 30)  # the job runs on the worker thread
        running.cancel()  # what a forced stop does to the stage's task
        stage._shutdown_executor()  # returns at once: the job still runs
        assert not finished.is_set()
        release.set()
        assert await asyncio.to_thread(finished.wait, 30)

    asyncio.run(asyncio.wait_for(run(), 60))


def test_emitting_on_a_port_the_stage_lacks_fails_the_pipeline() -> None:
    from pipeline import Pipeline, StageFailedError

    class Misspelt(Stage):
        @handles(int)
        async def on_int(self, message: int) -> None:
            await self.emit("ot", message)

    async def body() -> None:
        pipeline = Pipeline().add("m", Misspelt).entry("in", "m").exit("out", "m")
        running = await pipeline.start(transport="memory")
        try:
            await running.send("in", 1)
            with pytest.raises(StageFailedError, match=r"emitted on 'ot'.*outputs \('out',\)"):
                await asyncio.wait_for(running.receive("out"), 10)
        finally:
            await running.stop()

    asyncio.run(body())
