"""Helpers of the example tests: where the examples are, how to run one as a script, and an
event-loop runner with a deadline."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "EXAMPLES",
    "REPOSITORY",
    "RUN_TIMEOUT",
    "example_command",
    "example_env",
    "run",
    "wait_until",
]

T = TypeVar("T")
REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLES = REPOSITORY / "examples"
#: seconds a test's coroutine (or example process) may run
RUN_TIMEOUT = 240.0
#: seconds between two checks of a condition being waited for
POLL_SECONDS = 0.02


def run(coroutine: Coroutine[Any, Any, T], timeout: float = RUN_TIMEOUT) -> T:
    """Run ``coroutine`` in a new event loop, failing after ``timeout`` seconds."""

    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


def example_command(name: str, *arguments: str) -> list[str]:
    """``python examples/<name>.py ARGUMENTS`` with this interpreter."""
    return [sys.executable, str(EXAMPLES / f"{name}.py"), *arguments]


def example_env(*extra_paths: Path) -> dict[str, str]:
    """The environment of an example process: actorline (and ``extra_paths``) importable."""
    paths = [*map(str, extra_paths), str(REPOSITORY)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``condition()`` until it holds.

    Raises:
        AssertionError: it did not hold within ``timeout`` seconds (naming ``what``).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(POLL_SECONDS)
