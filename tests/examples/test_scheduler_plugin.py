"""examples/scheduler_plugin: the ``actorline-lpf`` package installed for real (pip, into a
private directory), listed by ``actorline plugins`` and the registry, loaded by name in the
engine's spawned process, and visibly ordering the queue longest prompt first."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import plugins
from pipeline import AsyncEngine, SamplingParams
from stages.policies import load_policy
from tests.examples.running import EXAMPLES, RUN_TIMEOUT, example_env, run, wait_until

POLICY = "lpf"
#: seconds pip may take to build and install the package
INSTALL_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install --no-deps --target SITE examples/scheduler_plugin`` (from a copy, so the
    build leaves nothing in the repository); nothing is installed into the venv."""
    root = tmp_path_factory.mktemp("lpf")
    source, site = root / "source", root / "site"
    shutil.copytree(EXAMPLES / "scheduler_plugin", source)
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
            "--no-index", "--quiet", "--target", str(site), str(source),
        ],
        check=True, capture_output=True, timeout=INSTALL_TIMEOUT,
    )  # fmt: skip
    assert (site / "actorline_lpf" / "policy.py").is_file()
    return site


@pytest.fixture
def installed(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The plugin importable in this process (and in processes it spawns) for one test."""
    monkeypatch.syspath_prepend(str(plugin_site))
    yield plugin_site


def test_actorline_plugins_lists_it(plugin_site: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from pipeline.cli import main; sys.exit(main())",
         "plugins"],
        capture_output=True, text=True, env=example_env(plugin_site), timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    group = lines.index(next(line for line in lines if line.startswith(plugins.SCHEDULERS)))
    entry = next(line for line in lines[group:] if line.split()[:1] == [POLICY])
    assert entry.split() == [POLICY, "actorline_lpf:LongestPromptFirstPolicy"]


def test_registry_finds_and_checks_it(installed: Path) -> None:
    assert POLICY in plugins.available(plugins.SCHEDULERS)
    policy = load_policy(POLICY)
    assert policy.name == POLICY
    assert type(policy).__module__ == "actorline_lpf.policy"


@dataclasses.dataclass(frozen=True)
class View:
    """A request as a policy sees it (the RequestView protocol)."""

    request_id: str
    num_prompt_tokens: int
    arrival_index: int
    tenant: str = ""
    priority: int = 0
    num_output_tokens: int = 0
    max_tokens: int = 16
    num_computed_tokens: int = 0
    num_preemptions: int = 0

    @property
    def arrival_time(self) -> float:
        return float(self.arrival_index)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def test_policy_orders_longest_prompt_first(installed: Path) -> None:
    policy = load_policy(POLICY)
    views = [View("a", 5, 0), View("b", 40, 1), View("c", 20, 2), View("d", 40, 3)]
    assert [v.request_id for v in policy.order_waiting(views)] == ["b", "d", "c", "a"]
    assert policy.select_victim(views).request_id == "a"
    assert policy.select_victim([View("x", 7, 0), View("y", 7, 1)]).request_id == "y"


@pytest.mark.slow
def test_engine_schedules_with_it(installed: Path, tiny_model_dir: Path) -> None:
    """One request at a time: while a long request runs, three queue up (shortest prompt
    sent first); once it is aborted they run longest prompt first (fcfs would run them in
    the order sent)."""
    lengths = {"short": 5, "medium": 20, "long": 40}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def body() -> list[str]:
        engine = AsyncEngine(str(tiny_model_dir), scheduler=POLICY, max_num_seqs=1)
        async with engine:
            blocker = engine.generate(
                list(range(100, 110)),
                SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
            )
            first = await anext(blocker)
            finished: list[str] = []

            async def queued(name: str) -> None:
                prompt = list(range(1000, 1000 + lengths[name]))
                async for output in engine.generate(prompt, params, request_id=name):
                    if output.finished:
                        assert output.finish_reason == "length"
                        finished.append(name)

            tasks = []
            for name in lengths:  # short, medium, long
                tasks.append(asyncio.create_task(queued(name)))
                await asyncio.sleep(0.05)
            await wait_until(
                lambda: engine.stats is not None and engine.stats.num_waiting == len(lengths),
                "the three requests to queue",
            )
            await engine.abort(first.request_id)
            async for _ in blocker:
                pass
            await asyncio.gather(*tasks)
            return finished

    assert run(body(), RUN_TIMEOUT) == ["long", "medium", "short"]
