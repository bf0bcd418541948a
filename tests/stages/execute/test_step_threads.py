"""The contention fallback in a real model runner (stages.execute.step_threads): with two busy
processes beside it on the cores, a governor that takes any run-queue wait for contention
tries one thread mid-run (and keeps it or not, as the steps' times say), the step results say
each change, and the greedy tokens are the ones the same requests get at a fixed two threads
(every element of a step is computed by the same code in the same order at any thread count,
tests/stages/execute/test_step_graph.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import torch

from stages.execute.contention import ThreadGovernor
from stages.execute.runner import ModelRunner
from stages.execute.step_threads import StepThreads
from stages.messages import SchedulerStep, StepResult
from tests.stages.execute.driving import drive
from tests.stages.execute.test_runner import load_runner, make_requests, random_prompts


class _Governed:
    """A runner whose steps go through ``threads`` (what ExecuteStage.execute_step does)."""

    def __init__(self, runner: ModelRunner, threads: StepThreads) -> None:
        self.runner = runner
        self.threads = threads
        self.info = runner.info

    def execute(self, step: SchedulerStep) -> StepResult:
        return self.threads.run(self.runner.execute, step)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Two processes spinning on the cores while the test runs: oversubscribed for sure."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for process in busy:
        process.kill()
        process.wait()


@pytest.mark.usefixtures("two_threads")
def test_one_thread_is_tried_mid_run_with_the_same_tokens(
    tiny_model_dir: Path, busy_cores: None
) -> None:
    prompts = random_prompts((7, 12, 5), seed=36)
    fixed = drive(load_runner(tiny_model_dir, num_blocks=64, block_size=4),
                  make_requests(prompts))  # fmt: skip

    governor = ThreadGovernor(2, window=1e-6, high=1e-9, low=0.0, confirm=1)
    threads = StepThreads("auto", governor=governor)
    assert threads.governor is governor and threads.threads == 2
    governed = _Governed(load_runner(tiny_model_dir, num_blocks=64, block_size=4), threads)
    report = drive(cast(ModelRunner, governed), make_requests(prompts))

    # one thread was tried (kept or not: that is the steps' times' to say)
    assert governor.changes >= 1
    reported = [result.threads for result in report.results if result.threads]
    assert reported[0] == 2  # the first step says the count it ran on
    assert reported[1] == 1  # and each change
    assert len(reported) == governor.changes + 1
    assert torch.get_num_threads() == governor.current
    assert report.outputs == fixed.outputs


def test_other_policies_and_one_thread_only_run_the_steps(tiny_model_dir: Path) -> None:
    for policy in ("active", "passive", ""):
        assert StepThreads(policy).governor is None
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert StepThreads("auto").governor is None  # nothing to fall back to
    finally:
        torch.set_num_threads(before)
