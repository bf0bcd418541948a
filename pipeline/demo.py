"""A small demonstration pipeline with a feedback edge: Collatz trajectories.

Three stages: ``split`` turns a :class:`Job` into one :class:`Item` per start value; ``step``
applies one Collatz step; ``check`` sends items that have not reached 1 back to ``step`` (the
feedback edge) and, once every item of a job is done, emits a :class:`JobResult` carrying the
step counts as a tensor. Used by the runtime's acceptance tests and ``actorline demo``.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from pipeline.graph import Pipeline
from pipeline.stage import Stage, handles
from transports.codec import message

__all__ = ["Item", "Job", "JobResult", "collatz_pipeline", "collatz_steps"]


@message(60)
@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """Compute the Collatz step count of every value. ``delay``: seconds to sleep per step
    (to keep calls pending in tests)."""

    job_id: str
    values: tuple[int, ...]
    delay: float = 0.0


@message(61)
@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    job_id: str
    index: int
    total: int
    value: int
    steps: int
    delay: float


@message(62)
@dataclasses.dataclass(frozen=True, slots=True)
class JobResult:
    job_id: str
    steps: np.ndarray  # [len(values)] int64


class Split(Stage):
    inputs = ("in",)
    outputs = ("out",)

    @handles(Job)
    async def on_job(self, job: Job) -> None:
        for index, value in enumerate(job.values):
            await self.emit("out", Item(job.job_id, index, len(job.values), value, 0, job.delay))


class Step(Stage):
    """One Collatz step. Raises on values below 1 (the demo of a failing stage)."""

    inputs = ("in",)
    outputs = ("out",)

    @handles(Item)
    async def on_item(self, item: Item) -> None:
        if item.value < 1:
            raise ValueError(f"Collatz is undefined for {item.value}")
        if item.delay:
            await asyncio.sleep(item.delay)
        value = item.value // 2 if item.value % 2 == 0 else 3 * item.value + 1
        await self.emit("out", dataclasses.replace(item, value=value, steps=item.steps + 1))


class Check(Stage):
    inputs = ("in",)
    outputs = ("out", "again")

    def __init__(self, config: object = None) -> None:
        super().__init__(config)
        self._done: dict[str, dict[int, int]] = {}

    @handles(Item)
    async def on_item(self, item: Item) -> None:
        if item.value != 1:
            await self.emit("again", item)
            return
        done = self._done.setdefault(item.job_id, {})
        done[item.index] = item.steps
        if len(done) == item.total:
            del self._done[item.job_id]
            steps = np.array([done[i] for i in range(item.total)], dtype=np.int64)
            await self.emit("out", JobResult(item.job_id, steps))

    def idle(self) -> bool:
        return not self._done


def collatz_pipeline() -> Pipeline:
    """The demo graph: entry ``jobs`` → split → step ⇄ check → exit ``results``.

    A value of 1 needs no step but still passes ``step`` once, so its count is 3 (1→4→2→1).
    """
    pipeline = Pipeline("collatz")
    pipeline.add("split", Split).add("step", Step).add("check", Check)
    pipeline.connect("split", "step").connect("step", "check")
    pipeline.connect("check.again", "step")
    pipeline.entry("jobs", "split").exit("results", "check.out")
    return pipeline


def collatz_steps(value: int) -> int:
    """The step count the pipeline computes for ``value`` (reference for tests)."""
    steps = 0
    while True:
        value = value // 2 if value % 2 == 0 else 3 * value + 1
        steps += 1
        if value == 1:
            return steps
