"""The background-task helper (transports/tasks.py): a task lives while its owner does, and
closing the set cancels and waits for what still runs."""

from __future__ import annotations

import asyncio

import pytest

from transports.tasks import TaskSet


def test_a_spawned_task_runs_is_held_and_let_go_once_done() -> None:
    async def main() -> None:
        tasks = TaskSet("owner")
        release = asyncio.Event()

        async def work() -> int:
            await release.wait()
            return 7

        task = tasks.spawn(work(), name="work")
        await asyncio.sleep(0)
        assert len(tasks) == 1 and task.get_name() == "work"
        assert tasks.statistics().names == ("work",)
        release.set()
        assert await task == 7
        await asyncio.sleep(0)  # the done callbacks run
        stats = tasks.statistics()
        assert (stats.owner, stats.running, stats.spawned, stats.names) == ("owner", 0, 1, ())
        unnamed = tasks.spawn(asyncio.sleep(0))
        assert unnamed.get_name() == "owner:1"
        await unnamed

    asyncio.run(main())


def test_aclose_cancels_and_waits_for_what_runs() -> None:
    async def main() -> None:
        tasks = TaskSet("owner")
        unwound: list[str] = []

        async def forever(name: str) -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await asyncio.sleep(0)  # unwinding takes a step of its own
                unwound.append(name)

        spawned = [tasks.spawn(forever(name), name=name) for name in ("a", "b")]
        await asyncio.sleep(0)
        assert await tasks.aclose() == set()
        assert sorted(unwound) == ["a", "b"]
        assert all(task.cancelled() for task in spawned)
        assert len(tasks) == 0
        assert await tasks.aclose() == set()  # idempotent, and the set stays usable
        assert await tasks.spawn(asyncio.sleep(0, "again")) == "again"

    asyncio.run(main())


def test_aclose_returns_a_task_that_ignores_its_cancellation() -> None:
    async def main() -> None:
        tasks = TaskSet("owner")
        release = asyncio.Event()

        async def stubborn() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await release.wait()

        task = tasks.spawn(stubborn())
        await asyncio.sleep(0)
        assert await tasks.aclose(timeout=0.05) == {task}
        release.set()
        await task

    asyncio.run(main())


def test_cancel_spares_the_calling_task() -> None:
    async def main() -> None:
        tasks = TaskSet("supervisor")

        async def teardown() -> bool:
            other = tasks.spawn(asyncio.Event().wait())
            await asyncio.sleep(0)
            cancelled = tasks.cancel()
            await asyncio.sleep(0)
            return cancelled == [other] and other.cancelled()

        assert await tasks.spawn(teardown(), name="teardown")

    asyncio.run(main())


def test_on_done_runs_after_the_set_let_go_and_failures_stay_with_the_awaiter() -> None:
    async def main() -> None:
        tasks = TaskSet("owner")
        seen: list[tuple[int, str]] = []

        async def fail() -> None:
            raise ValueError("broken")

        def done(task: asyncio.Task[None]) -> None:
            seen.append((len(tasks), type(task.exception()).__name__))

        task = tasks.spawn(fail(), on_done=done)
        with pytest.raises(ValueError, match="broken"):
            await task
        await asyncio.sleep(0)
        assert seen == [(0, "ValueError")]

    asyncio.run(main())


def test_as_a_context_manager_leaving_cancels_what_runs_and_passes_the_error_on() -> None:
    async def main() -> None:
        outcome: list[str] = []

        async def slow() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                outcome.append("cancelled")
                raise

        with pytest.raises(RuntimeError, match="body failed"):
            async with TaskSet("scope") as tasks:
                tasks.spawn(slow())
                await asyncio.sleep(0)
                raise RuntimeError("body failed")
        assert outcome == ["cancelled"]

    asyncio.run(main())


def test_spawn_without_a_running_loop_closes_the_coroutine() -> None:
    async def work() -> None:
        raise AssertionError("never runs")

    coroutine = work()
    with pytest.raises(RuntimeError):
        TaskSet("owner").spawn(coroutine)
    assert coroutine.cr_frame is None  # closed: no "never awaited" warning


def test_spawn_onto_another_loop_from_its_callback() -> None:
    loop = asyncio.new_event_loop()
    try:
        tasks = TaskSet("loop thread")
        results: list[asyncio.Task[int]] = []

        async def answer() -> int:
            return 42

        loop.call_soon(lambda: results.append(tasks.spawn(answer(), loop=loop)))
        loop.run_until_complete(asyncio.sleep(0.01))
        assert results[0].result() == 42
    finally:
        loop.close()
