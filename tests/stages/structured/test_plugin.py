"""A third-party grammar backend through the ``actorline.grammars`` entry-point group, and what
docs/structured-outputs.md ("How it runs") promises of compiling: it happens on a worker
thread, off the schedule stage's step loop, so a slow compile never holds up other requests'
steps. The backend is a real installed distribution (``*.dist-info`` on ``sys.path``, as in
tests/plugins/test_registry.py) whose class wraps the built-in llguidance backend and holds
each compile until the test lets it go, as a compile taking seconds would. The engine runs
the null model in this process (``transport="memory"``), so it loads the same class."""

from __future__ import annotations

import asyncio
import re
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import plugins
from pipeline import AsyncEngine, SamplingParams, StructuredOutputsParams
from pipeline.runtime.errors import StageFailedError
from stages.messages import RequestOutput

PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
#: how long the test waits for anything that should happen at once (a loaded 2-core machine)
PATIENCE_S = 120.0


@pytest.fixture
def held_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The class registered as ``held`` in ``actorline.grammars`` by an installed distribution:
    llguidance, but each compile first waits for the class's ``release`` event (set at
    teardown in any case), after setting ``entered`` and recording its thread."""
    package = tmp_path / "heldgrammar_plugins"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            import threading

            from stages.structured.backend import GrammarCompileError
            from stages.structured.llguidance import LLGuidanceBackend

            class HeldBackend(LLGuidanceBackend):
                name = "held"
                entered = threading.Event()
                release = threading.Event()
                finished = threading.Event()
                threads = []

                def compile(self, params):
                    type(self).threads.append(threading.get_ident())
                    type(self).entered.set()
                    if not type(self).release.wait(timeout=600):
                        raise GrammarCompileError("the test never released the compile")
                    try:
                        return super().compile(params)
                    finally:
                        type(self).finished.set()
            """
        )
    )
    dist_info = tmp_path / "heldgrammar_plugins-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: heldgrammar-plugins\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[actorline.grammars]\nheld = heldgrammar_plugins:HeldBackend\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    backend = plugins.load(plugins.GRAMMARS, "held")
    try:
        yield backend
    finally:
        backend.release.set()
        for name in [m for m in sys.modules if m.startswith("heldgrammar_plugins")]:
            del sys.modules[name]


async def final(engine: AsyncEngine, prompt: str, params: SamplingParams) -> RequestOutput:
    last: RequestOutput | None = None
    async for output in engine.generate(prompt, params):
        last = output
    assert last is not None
    return last


def test_a_third_party_backend_is_listed_and_loaded_by_name(held_backend: Any) -> None:
    from stages.structured.llguidance import LLGuidanceBackend

    assert {"held", "llguidance"} <= set(plugins.available(plugins.GRAMMARS))
    assert issubclass(held_backend, LLGuidanceBackend) and held_backend.name == "held"
    described = dict(plugins.describe()[plugins.GRAMMARS])
    assert described["held"] == "heldgrammar_plugins:HeldBackend"


@pytest.mark.slow
def test_a_compile_in_progress_holds_up_no_other_request(
    held_backend: Any, tiny_model_dir: Path
) -> None:
    """The constrained request comes first and its compile starts (and stays pending); a free
    request sent after it runs all its steps meanwhile; then the compile is let go and the
    constrained request completes, matching its regex."""
    constrained = SamplingParams(
        max_tokens=40, structured_outputs=StructuredOutputsParams(regex=PHONE)
    )
    free = SamplingParams(max_tokens=24, ignore_eos=True)

    async def run() -> None:
        async with AsyncEngine(
            str(tiny_model_dir), null_model=True, transport="memory", grammar_backend="held"
        ) as engine:
            loop_thread = threading.get_ident()
            first = asyncio.ensure_future(final(engine, "a phone number", constrained))
            entered = await asyncio.to_thread(held_backend.entered.wait, PATIENCE_S)
            assert entered, "the constrained request's grammar never began compiling"
            # NOTE: the compile is pending until release is set: a step loop that waited on
            # it could never finish the free request, and wait_for would time out.
            second = await asyncio.wait_for(final(engine, "free", free), PATIENCE_S)
            assert second.finish_reason == "length" and len(second.token_ids) == 24
            assert not held_backend.finished.is_set() and not first.done()
            held_backend.release.set()
            output = await asyncio.wait_for(first, PATIENCE_S)
            assert output.finish_reason == "stop", output
            assert re.fullmatch(PHONE, output.text), output.text
            assert held_backend.threads and loop_thread not in held_backend.threads

    asyncio.run(run())


def test_an_unknown_backend_name_fails_start_up_naming_it(tiny_model_dir: Path) -> None:
    async def run() -> None:
        async with AsyncEngine(
            str(tiny_model_dir), null_model=True, transport="memory", grammar_backend="xgramar"
        ):
            pass

    with pytest.raises(StageFailedError) as caught:
        asyncio.run(run())
    cause = caught.value.__cause__
    assert isinstance(cause, plugins.PluginNotFoundError), repr(cause)
    assert (cause.group, cause.name) == (plugins.GRAMMARS, "xgramar")
    assert "llguidance" in cause.available
    assert "no actorline.grammars plugin named 'xgramar'" in str(caught.value)
