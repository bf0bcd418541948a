"""Structured concurrency, checked on the source (docs/architecture.md §4.1): every background
task in the packages is spawned through a :class:`transports.tasks.TaskSet` its owner closes,
so no module but ``transports/tasks.py`` starts a task itself (``create_task``,
``ensure_future``, ``asyncio.Task(...)``), nor hands a coroutine to another loop to run
(``run_coroutine_threadsafe``).

The benchmarks and the tests may start tasks as they like; ``pipeline/bench`` is a package and
follows the rule.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plugins", "transports", "pipeline", "stages")
#: the one module allowed to start tasks
HELPER = ROOT / "transports" / "tasks.py"
#: calls that start a task (as a method, ``loop.create_task``, or a function,
#: ``asyncio.ensure_future``, or imported bare, ``from asyncio import create_task``)
SPAWNING = ("create_task", "ensure_future", "run_coroutine_threadsafe")


def bare_spawns(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` starts a task without a TaskSet: ``line: call`` for each."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        task_class = (
            name == "Task"
            and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "asyncio"
        )
        if name in SPAWNING or task_class:
            found.append(f"{node.lineno}: {ast.unparse(func)}(...)")
    return found


def test_no_task_is_started_outside_the_helper() -> None:
    wrong = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == HELPER or "_pb2" in path.name:
                continue
            for spawn in bare_spawns(path.read_text(), str(path)):
                wrong.append(f"{path.relative_to(ROOT)}:{spawn}")
    assert not wrong, (
        "start background tasks through a TaskSet (transports/tasks.py) that their owner "
        "closes:\n" + "\n".join(wrong)
    )


def test_the_scan_catches_every_form_of_a_bare_task() -> None:
    source = textwrap.dedent(
        """
        import asyncio
        from asyncio import create_task, ensure_future

        async def main(loop, work):
            asyncio.create_task(work())
            asyncio.get_running_loop().create_task(work())
            loop.create_task(work())
            asyncio.ensure_future(work())
            create_task(work())
            ensure_future(work())
            asyncio.Task(work())
            asyncio.run_coroutine_threadsafe(work(), loop)
            tasks.spawn(work(), name="fine")
            await asyncio.gather(work(), work())
        """
    )
    assert [spawn.split(":")[0] for spawn in bare_spawns(source)] == [
        "6", "7", "8", "9", "10", "11", "12", "13",
    ]  # fmt: skip


def test_the_scan_covers_the_helper_only_by_exemption() -> None:
    # The helper itself starts tasks, so the scan would catch it: the exemption is real.
    assert bare_spawns(HELPER.read_text())
