"""Prespawned hosts: the next spawned host is the process started ahead (it ran its preload,
bad entries ignored, and then served its stages exactly as a fresh host), and one nobody took is
killed, leaving no process behind."""

from __future__ import annotations

import asyncio

from pipeline import Caller, StartOptions
from pipeline.demo import Job, collatz_pipeline, collatz_steps
from pipeline.runtime import prespawn
from tests.processes import process_alive, wait_until


def test_the_next_host_is_the_prespawned_process() -> None:
    prespawn.prespawn_host(["json", "json:dumps", "no_such_module_actorline", "os:no_such_name"])
    waiting = prespawn._waiting[0].process
    assert waiting.args[-2:] == [
        prespawn.PRELOAD_FLAG,
        "json,json:dumps,no_such_module_actorline,os:no_such_name",
    ]
    prespawn.prespawn_host(["json"])  # one waits at a time
    assert len(prespawn._waiting) == 1

    async def body() -> tuple[int, list[object]]:
        pipeline = collatz_pipeline().place("step", "worker")
        async with await pipeline.start(StartOptions(transport="zmq")) as running:
            caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
            results = await caller.call(Job("job", (6, 7, 27)))
            await caller.aclose()
            return running.pids["worker"], [results]

    pid, (result,) = asyncio.run(asyncio.wait_for(body(), 120))
    assert pid == waiting.pid
    assert result.steps.tolist() == [collatz_steps(v) for v in (6, 7, 27)]  # type: ignore[attr-defined]
    assert prespawn.take_prespawned() is None
    assert wait_until(lambda: not process_alive(pid), 60.0)


def test_an_unused_prespawned_host_is_killed() -> None:
    prespawn.prespawn_host(["json"])
    process = prespawn._waiting[0].process
    prespawn.discard_prespawned()
    assert process.returncode is not None
    assert not process_alive(process.pid)
    assert prespawn.take_prespawned() is None
