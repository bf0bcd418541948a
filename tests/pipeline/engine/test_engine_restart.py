"""``restart_engine``: an AsyncEngine whose engine process is SIGKILLed or SIGSTOPped fails the
requests it held with EngineDeadError, starts a fresh engine and serves the next request
(docs/architecture.md §4.7); a crash loop gives up with EngineCrashLoopError; the restart
policy's arithmetic; ``generate``/``abort`` on another event loop raise WrongEventLoopError at
once; the new options refuse bad values."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline import AsyncEngine, EngineDeadError, EngineOptions, SamplingParams
from pipeline.engine.errors import EngineCrashLoopError, WrongEventLoopError
from pipeline.engine.options import MAX_RESTART_BACKOFF
from pipeline.engine.restarts import RestartPolicy

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FOREVER = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
#: seconds a request in flight may take to fail once the engine is killed (frozen: plus the
#: heartbeat timeout)
FAILS_WITHIN = 5.0
#: seconds a fresh tiny engine may take to serve on a loaded 2-core machine
HEALS_WITHIN = 60.0
#: a heartbeat timeout short enough for a test to wait on
HEARTBEAT_TIMEOUT = 3.0


async def complete(engine: AsyncEngine, prompt: str, params: SamplingParams) -> Any:
    last = None
    async for output in engine.generate(prompt, params):
        last = output
    return last


class Watch:
    """Events of an engine's deaths and restarts, from its callbacks."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.died = asyncio.Event()
        self.restarted = asyncio.Event()
        self.failures: list[BaseException] = []
        engine.add_failure_callback(self._died)
        engine.add_restart_callback(self.restarted.set)

    def _died(self, error: BaseException) -> None:
        self.failures.append(error)
        self.died.set()

    async def serving_again(self) -> float:
        """Wait until the engine died, then until a fresh one serves; the seconds it took
        from the call."""
        started = time.monotonic()
        await asyncio.wait_for(self.died.wait(), FAILS_WITHIN + HEARTBEAT_TIMEOUT)
        await asyncio.wait_for(self.restarted.wait(), HEALS_WITHIN)
        self.died.clear()
        self.restarted.clear()
        return time.monotonic() - started


def no_traceback(records: list[logging.LogRecord]) -> None:
    assert not [r.getMessage() for r in records if r.exc_info is not None]


async def kill_under_a_request(
    engine: AsyncEngine, signum: int, request_id: str | None = None
) -> EngineDeadError:
    """Send ``signum`` to the engine process while a request runs; the request's error."""
    stream = engine.generate("forever", FOREVER, request_id=request_id)
    await anext(stream)  # it runs

    async def rest() -> None:
        async for _ in stream:
            pass

    pending = asyncio.ensure_future(rest())
    pid = engine.running.pids["engine"]
    assert pid is not None
    os.kill(pid, signum)
    started = time.monotonic()
    try:
        with pytest.raises(EngineDeadError) as caught:
            await asyncio.wait_for(pending, FAILS_WITHIN + HEARTBEAT_TIMEOUT)
    finally:
        if signum == signal.SIGSTOP:
            with_process_gone(pid)
    assert time.monotonic() - started < FAILS_WITHIN + HEARTBEAT_TIMEOUT
    return caught.value


def with_process_gone(pid: int) -> None:
    """Resume a stopped process (the teardown SIGKILLs it; this only makes sure)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_a_killed_then_a_frozen_engine_is_restarted(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One engine, killed (SIGKILL) and, once it serves again, frozen (SIGSTOP: the heartbeat
    finds it). Each time the request in flight gets EngineDeadError (frozen: "unresponsive"),
    one sent while the fresh engine starts gets it at once, and once the engine serves again
    the same prompt gets the same greedy answer as before, from a new engine process. The
    ERROR line that reports the killed engine's death names the request of its latest step,
    and the WARNING with the requests in flight names it too (formerly two engines, one per
    signal, and test_the_line_reporting_a_dead_engine_names_its_request in
    test_replica_restart.py, a third engine without restart_engine: the line is the
    pipeline's, logged with or without it)."""

    async def body() -> None:
        async with AsyncEngine(
            str(tiny_model_dir),
            num_blocks=64,
            restart_engine=True,
            restart_backoff=0.2,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        ) as engine:
            watch = Watch(engine)
            before = await complete(engine, "Hello there", GREEDY)
            for restarts, signum in enumerate((signal.SIGKILL, signal.SIGSTOP), start=1):
                old_pid = engine.running.pids["engine"]
                error = await kill_under_a_request(engine, signum, f"the-long-one-{restarts}")
                if signum == signal.SIGSTOP:
                    assert error.unresponsive and error.unresponsive_for == HEARTBEAT_TIMEOUT
                else:
                    assert "killed by signal 9" in str(error)
                assert engine.restarting and watch.failures[-1:] == [engine.failure]
                assert len(watch.failures) == restarts
                refused = time.monotonic()
                with pytest.raises(EngineDeadError, match=r"; the engine is restarting$"):
                    await complete(engine, "while restarting", GREEDY)
                assert time.monotonic() - refused < 1.0
                healed = await watch.serving_again()
                assert engine.failure is None and not engine.restarting
                assert engine.restarts == restarts
                assert engine.running.pids["engine"] != old_pid
                started = time.monotonic()
                after = await complete(engine, "Hello there", GREEDY)
                assert after.token_ids == before.token_ids and after.text == before.text
                assert time.monotonic() - started < 30.0
                logging.getLogger(__name__).info("healed in %.1f s", healed)

    with caplog.at_level(logging.INFO, logger="actorline"):
        asyncio.run(asyncio.wait_for(body(), 180))
    no_traceback(caplog.records)
    messages = [r.getMessage() for r in caplog.records]
    for restarts in (1, 2):
        assert any(
            m.startswith(f"the engine ended with 1 request(s) in flight: the-long-one-{restarts}")
            for m in messages
        ), messages
        assert any(m.startswith(f"the engine serves again (restart {restarts}") for m in messages)
    # the killed engine's death: one ERROR line, naming the request of its latest step
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    died = [e for e in errors if e.startswith("pipeline 'llm' failed: host 'engine' died")]
    assert len(died) == 1, errors
    assert "its latest step had request(s) the-long-one-1#" in died[0], died


@pytest.mark.slow
def test_a_crash_loop_gives_up(caplog: pytest.LogCaptureFixture) -> None:
    """restart_limit 2: the first death restarts, the second within the window gives up with
    EngineCrashLoopError, which every later call raises; no restart follows."""

    async def body() -> None:
        async with AsyncEngine(
            null_model=True, restart_engine=True, restart_backoff=0.0, restart_limit=2
        ) as engine:
            watch = Watch(engine)
            os.kill(engine.running.pids["engine"] or 0, signal.SIGKILL)
            await watch.serving_again()
            assert engine.restarts == 1
            await complete(engine, "fine", GREEDY)
            os.kill(engine.running.pids["engine"] or 0, signal.SIGKILL)
            await asyncio.wait_for(watch.died.wait(), FAILS_WITHIN)
            given_up = watch.failures
            assert isinstance(engine.failure, EngineCrashLoopError) and not engine.restarting
            assert isinstance(given_up[-1], EngineCrashLoopError)
            with pytest.raises(EngineCrashLoopError, match="died 2 times within 120 s"):
                await complete(engine, "after", GREEDY)
            await asyncio.sleep(0.5)
            assert engine.restarts == 1 and engine.failure is given_up[-1]

    with caplog.at_level(logging.INFO, logger="actorline"):
        asyncio.run(asyncio.wait_for(body(), 120))
    no_traceback(caplog.records)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors[-1].startswith("the engine died 2 times within 120 s"), errors


def test_stop_restarting_cancels_the_restart_under_way() -> None:
    """What a server that shuts down calls first (``actorline serve`` on SIGTERM): the restart
    under way is cancelled, no restart follows, and the engine closes."""

    async def body() -> None:
        async with AsyncEngine(null_model=True, restart_engine=True) as engine:
            watch = Watch(engine)
            os.kill(engine.running.pids["engine"] or 0, signal.SIGKILL)
            await asyncio.wait_for(watch.died.wait(), FAILS_WITHIN)
            assert engine.restarting
            await engine.stop_restarting()
            assert not engine.restarting
            await asyncio.sleep(0.5)
            assert engine.restarts == 0 and engine.failure is not None

    asyncio.run(asyncio.wait_for(body(), 60))


@pytest.mark.slow
def test_without_restart_engine_a_dead_engine_stays_dead() -> None:
    async def body() -> None:
        async with AsyncEngine(null_model=True) as engine:
            watch = Watch(engine)
            os.kill(engine.running.pids["engine"] or 0, signal.SIGKILL)
            await asyncio.wait_for(watch.died.wait(), FAILS_WITHIN)
            await asyncio.sleep(1.0)
            assert not engine.restarting and engine.restarts == 0
            with pytest.raises(EngineDeadError, match="killed by signal 9"):
                await complete(engine, "after", GREEDY)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_second_event_loop_gets_a_typed_error_at_once(tiny_model_dir: Path) -> None:
    """The engine runs on a loop in another thread; generate and abort called on this
    thread's own loop raise WrongEventLoopError naming the rule instead of hanging, and the
    engine goes on serving its own loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = AsyncEngine(str(tiny_model_dir), transport="memory", num_blocks=64)
    try:
        asyncio.run_coroutine_threadsafe(engine.start(), loop).result(120)

        async def elsewhere() -> None:
            started = time.monotonic()
            with pytest.raises(WrongEventLoopError, match="bound to its loop") as caught:
                await complete(engine, "Hello", GREEDY)
            assert "AsyncEngine.generate()" in str(caught.value)
            with pytest.raises(WrongEventLoopError, match=r"AsyncEngine\.abort\(\)"):
                await engine.abort("any")
            assert time.monotonic() - started < 1.0

        asyncio.run(asyncio.wait_for(elsewhere(), 10))
        answer = asyncio.run_coroutine_threadsafe(complete(engine, "Hello", GREEDY), loop).result(
            60
        )
        assert len(answer.token_ids) == GREEDY.max_tokens
    finally:
        asyncio.run_coroutine_threadsafe(engine.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_restart_policy_backs_off_and_gives_up() -> None:
    policy = RestartPolicy(backoff=1.0, limit=4, window=60.0)
    assert policy.died(0.0) == 1.0
    assert policy.died(1.0) == 2.0
    assert policy.died(2.0) == 4.0
    assert policy.died(3.0) is None  # the 4th death within 60 s
    spaced = RestartPolicy(backoff=1.0, limit=2, window=10.0)
    assert [spaced.died(t) for t in (0.0, 10.0, 20.0)] == [1.0, 1.0, 1.0]  # each alone
    capped = RestartPolicy(backoff=20.0, limit=10, window=60.0)
    assert [capped.died(t) for t in (0.0, 1.0, 2.0)] == [20.0, *[MAX_RESTART_BACKOFF] * 2]
    with pytest.raises(ValueError):
        RestartPolicy(backoff=1.0, limit=0, window=1.0)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("restart_engine", "yes", "restart_engine must be a boolean"),
        ("restart_limit", 0, "restart_limit must be an integer >= 1"),
        ("restart_window", 0, "restart_window must be a number of seconds > 0"),
        ("restart_backoff", -1.0, "restart_backoff must be a number of seconds >= 0"),
        ("heartbeat_timeout", float("inf"), "heartbeat_timeout must be a number of seconds > 0"),
    ],
)
def test_bad_restart_options_are_refused(option: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineOptions(**{option: value})
    assert EngineOptions().restart_engine is False  # the API's default; serve turns it on


@pytest.mark.slow
def test_a_restart_that_cannot_start_counts_as_a_death(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The model's files are gone when the engine dies: the fresh engine fails to start, which
    counts as a second death within the window, so restart_limit 2 gives up with the failed
    start as the last death."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)

    async def body() -> None:
        async with AsyncEngine(
            str(model), num_blocks=64, restart_engine=True, restart_backoff=0.0, restart_limit=2
        ) as engine:
            watch = Watch(engine)
            shutil.rmtree(model)
            os.kill(engine.running.pids["engine"] or 0, signal.SIGKILL)
            while not (watch.failures and isinstance(watch.failures[-1], EngineCrashLoopError)):
                await asyncio.wait_for(watch.died.wait(), HEALS_WITHIN)
                watch.died.clear()
            assert engine.restarts == 0 and not engine.restarting
            assert "died 2 times" in str(engine.failure)
            with pytest.raises(EngineCrashLoopError):
                await complete(engine, "after", GREEDY)

    with caplog.at_level(logging.INFO, logger="actorline"):
        asyncio.run(asyncio.wait_for(body(), 180))
    no_traceback(caplog.records)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(e.startswith("the engine did not restart: ") for e in errors), errors
