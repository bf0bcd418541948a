"""Spawned hosts for scripts that are no file (pipeline/runtime/processes.py): a script read
from stdin (``python - <<EOF``) runs its engine as Python's interactive mode would (the host
does not import the main module), and a stage that only the main script defines is refused
with a message that says why, before any process starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: seconds a script may take (it starts an engine process)
SCRIPT_TIMEOUT = 180


def run_from_stdin(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-"],
        input=textwrap.dedent(script),
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
    )


def test_an_engine_runs_from_a_script_read_from_stdin() -> None:
    result = run_from_stdin(
        """
        from pipeline import LLM, SamplingParams

        with LLM(null_model=True) as llm:
            [output] = llm.generate(["hi"], SamplingParams(max_tokens=3), use_tqdm=False)
        print(output.finish_reason, len(output.token_ids))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "length 3"


def test_an_async_engine_runs_from_a_script_read_from_stdin() -> None:
    """``AsyncEngine`` in the default (zmq) topology: its engine host is a spawned process,
    which must not re-import the ``<stdin>`` main module; two requests run and the engine
    closes cleanly, leaving no process."""
    result = run_from_stdin(
        """
        import asyncio
        from pipeline import AsyncEngine, SamplingParams
        from tests.processes import child_processes

        async def main():
            async with AsyncEngine(null_model=True) as engine:
                assert engine.running.pids, "the engine runs in a process of its own"
                for prompt in ("hi", [1, 2, 3]):
                    async for output in engine.generate(prompt, SamplingParams(max_tokens=3)):
                        pass
                    print(output.finish_reason, len(output.token_ids))
            print("children:", len(child_processes()))

        asyncio.run(main())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == ["length 3", "length 3", "children: 0"]
    assert "Traceback" not in result.stderr, result.stderr


def test_a_stage_defined_in_a_script_from_stdin_is_refused_by_name() -> None:
    """Its host could not import it: not HostDiedError (exit code 1) from the host, but a
    GraphError naming the stage and why, and no process is left."""
    result = run_from_stdin(
        """
        import asyncio
        from pipeline import GraphError, Pipeline, Stage, handles
        from pipeline.demo import Job
        from tests.processes import child_processes

        class Echo(Stage):
            @handles(Job)
            async def on_job(self, job):
                await self.emit("out", job)

        pipeline = Pipeline("p").add("echo", Echo, host="worker")
        pipeline.entry("in", "echo").exit("out", "echo.out")

        async def main():
            try:
                await pipeline.start()
            except GraphError as error:
                print(error)
            print("children:", len(child_processes()))

        asyncio.run(main())
        """
    )
    assert result.returncode == 0, result.stderr
    refusal, children = result.stdout.strip().splitlines()
    assert refusal == (
        "stage 'echo' cannot run on host 'worker': Echo is defined in the main script, which a "
        "spawned host cannot import (it was read from stdin, or typed at the interactive "
        "prompt); define it in a module, or run the stage on the main host"
    )
    assert children == "children: 0"
