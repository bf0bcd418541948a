"""Hosts forked from a zygote (pipeline/runtime/zygote.py): a host is the zygote's child and
gets the requester's exact environment and working directory; the exit status of a killed host
reaches the controller; another OpenMP environment gets its own zygote; ``spawn`` starts a
fresh interpreter; a zygote whose imports started a thread refuses and the host is spawned;
a killed controller leaves neither zygote nor host."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline import HostDiedError, Pipeline, Stage, StartOptions, handles
from pipeline.runtime import processes, zygote
from pipeline.runtime.omp_policy import POLICY_ENV
from pipeline.runtime.settings import host_start
from tests.processes import child_processes, process_alive, wait_until
from transports.codec import message

pytestmark = pytest.mark.usefixtures("no_child_left")


@message(962)
@dataclasses.dataclass(frozen=True, slots=True)
class Where:
    """A question (``answer`` empty: the name of a variable) or its answer (JSON)."""

    name: str
    answer: str = ""


class Probe(Stage):
    """Answers any string with where it runs: pid, parent pid, the variable the string names
    and the working directory."""

    inputs = ("in",)
    outputs = ("out",)

    @handles(Where)
    async def on_name(self, question: Where) -> None:
        name = question.name
        where = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "value": os.environ.get(name),
            "cwd": os.getcwd(),
        }
        await self.emit("out", Where(name, json.dumps(where)))


def _probe_pipeline() -> Pipeline:
    pipeline = Pipeline("probe").add("probe", Probe).place("probe", "worker")
    return pipeline.entry("in", "probe").exit("out", "probe.out")


async def _probe(name: str, options: StartOptions | None = None) -> dict[str, object]:
    async with await _probe_pipeline().start(options or StartOptions(transport="zmq")) as running:
        await running.send("in", Where(name))
        answer: dict[str, object] = json.loads(
            (await asyncio.wait_for(running.receive("out"), 60)).answer
        )
        assert answer["pid"] == running.pids["worker"]
        return answer


def test_hosts_are_forked_by_one_zygote_with_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ACTORLINE_ZYGOTE_TEST", "first")
    first = asyncio.run(_probe("ACTORLINE_ZYGOTE_TEST"))
    zygotes = zygote.zygote_pids()
    assert first["ppid"] in zygotes  # forked: the zygote is its parent, this process the zygote's
    assert first["value"] == "first"
    # a variable read late, another working directory: the same zygote, the caller's values
    monkeypatch.setenv("ACTORLINE_ZYGOTE_TEST", "second")
    monkeypatch.chdir(tmp_path)
    second = asyncio.run(_probe("ACTORLINE_ZYGOTE_TEST"))
    assert second["ppid"] == first["ppid"] and second["pid"] != first["pid"]
    assert (second["value"], second["cwd"]) == ("second", str(tmp_path))
    # another OpenMP wait policy is read as torch loads: a zygote of its own
    third = asyncio.run(_probe("x", StartOptions(transport="zmq", omp_wait_policy="passive")))
    # (another test of this process may have started that zygote already)
    assert third["ppid"] in zygote.zygote_pids() and third["ppid"] != first["ppid"]
    # this process's zygotes are not its leftovers; their hosts would be (none is left)
    assert not set(zygote.zygote_pids()) & set(child_processes())


def test_a_killed_forked_host_reports_its_signal() -> None:
    async def body() -> None:
        async with await _probe_pipeline().start(StartOptions(transport="zmq")) as running:
            pid = running.pids["worker"]
            assert pid in child_processes()  # (the zygote's child counts as this process's)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(HostDiedError) as died:
                await asyncio.wait_for(running.receive("out"), 30)
            assert died.value.exitcode == -signal.SIGKILL
            assert not process_alive(pid)

    asyncio.run(body())


def test_spawn_starts_a_fresh_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACTORLINE_HOST_START", "spawn")
    assert host_start() == "spawn"
    answer = asyncio.run(_probe("ACTORLINE_HOST_START"))
    assert answer["ppid"] == os.getpid() and answer["value"] == "spawn"
    monkeypatch.setenv("ACTORLINE_HOST_START", "vfork")
    with pytest.raises(ValueError, match="ACTORLINE_HOST_START='vfork' is not a host start"):
        host_start()


def test_a_zygote_whose_imports_start_a_thread_refuses_and_the_host_is_spawned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a zygote for an environment of its own, asked to import a module that starts a thread
    monkeypatch.setenv(POLICY_ENV, "active")
    monkeypatch.setattr(
        processes, "preload_of", lambda factories: ("tests.pipeline.runtime.thread_at_import",)
    )
    answer = asyncio.run(_probe("x"))
    assert answer["ppid"] == os.getpid()  # spawned after the refusal
    again = asyncio.run(_probe("x"))
    assert again["ppid"] == os.getpid()  # and this environment's hosts stay spawned


def test_a_killed_controller_leaves_neither_zygote_nor_host() -> None:
    script = textwrap.dedent(
        """
        import asyncio, json, os, sys, time
        from pipeline import StartOptions
        from pipeline.runtime import processes, zygote
        from tests.pipeline.runtime.test_zygote import Where, _probe_pipeline

        async def main():
            running = await _probe_pipeline().start(StartOptions(transport="zmq"))
            await running.send("in", Where("x"))
            answer = json.loads((await asyncio.wait_for(running.receive("out"), 60)).answer)
            [zygote_pid] = zygote.zygote_pids()
            print(answer["pid"], zygote_pid, flush=True)
            time.sleep(600)

        asyncio.run(main())
        """
    )
    controller = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert controller.stdout is not None
        host, zygote_pid = map(int, controller.stdout.readline().split())
        assert process_alive(host) and process_alive(zygote_pid)
        controller.kill()
        controller.wait()
        assert wait_until(lambda: not process_alive(zygote_pid), 30.0)
        assert wait_until(lambda: not process_alive(host), 30.0)
    finally:
        controller.kill()
        controller.wait()
