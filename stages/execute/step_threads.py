"""The execute stage's steps under the contention fallback (:mod:`stages.execute.contention`):
time each step on the stage's worker thread, and set torch's thread count there when the
governor says (``torch.set_num_threads`` sets the calling thread's OpenMP team size, and every
native kernel takes ``torch.get_num_threads()`` threads, so the whole step follows).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from pipeline.runtime.omp_policy import wait_policy_in_effect
from stages.execute.contention import ThreadGovernor, run_queue_wait_seconds
from stages.messages import SchedulerStep, StepResult

__all__ = ["StepThreads"]

logger = logging.getLogger("actorline.execute")


class StepThreads:
    """Runs the steps of one execute stage (each call on its worker thread), falling back to
    one thread while the machine is oversubscribed where ``policy`` is ``"auto"`` and torch
    has more than one thread (otherwise it only runs them)."""

    def __init__(self, policy: str, governor: ThreadGovernor | None = None) -> None:
        threads = torch.get_num_threads()
        self.wait_policy = wait_policy_in_effect()
        self.governor: ThreadGovernor | None = None
        self._reported = False
        if governor is not None:
            self.governor = governor
        elif policy == "auto" and threads > 1:
            self.governor = ThreadGovernor(threads)
        logger.info(
            "execute: OpenMP wait policy %s, %d threads%s", self.wait_policy, threads,
            ", one while the machine is oversubscribed" if self.governor else "",
        )  # fmt: skip

    @property
    def threads(self) -> int:
        """The thread count the steps run on now."""
        return torch.get_num_threads()

    def run(
        self, function: Callable[[SchedulerStep], StepResult], step: SchedulerStep
    ) -> StepResult:
        """``function(step)``, timed; then the thread count for the next step (on this
        thread: call it on the stage's worker thread). The result says the thread count
        (``StepResult.threads``) with the first step and where it changed."""
        governor = self.governor
        if governor is None:
            return self._report(function(step), 0)
        start = time.perf_counter()
        result = function(step)
        if governor.step(time.perf_counter() - start):
            waited = run_queue_wait_seconds()
            if waited is None:
                logger.info("execute: no run-queue counter here; the thread count stays")
                self.governor = None
                return self._report(result, 0)
            threads = governor.decide(waited)
            if threads is not None:
                torch.set_num_threads(threads)
                result = self._report(result, threads)
                logger.info(
                    "execute: %s: steps on %d thread%s now (run-queue wait %.0f%% of the "
                    "steps' thread time)",
                    "machine oversubscribed" if governor.contended else "machine quiet again",
                    threads, "" if threads == 1 else "s", 100 * (governor.last_share or 0.0),
                )  # fmt: skip
        return self._report(result, 0)

    def _report(self, result: StepResult, changed: int) -> StepResult:
        if changed or not self._reported:
            self._reported = True
            return dataclasses.replace(result, threads=changed or torch.get_num_threads())
        return result
