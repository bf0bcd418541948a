"""A small demonstration pipeline with a feedback edge: Collatz trajectories.

Three stages: ``split`` turns a :class:`Job` into one :class:`Item` per start value; ``step``
applies one Collatz step; ``check`` sends items that have not reached 1 back to ``step`` (the
feedback edge) and, once every item of a job is done, emits a :class:`JobResult` carrying the
step counts as a tensor. Used by the runtime's acceptance tests and ``actorline demo``.

NOTE: items circle between ``step`` and ``check`` until they reach 1, and every mailbox is
bounded: were more items in the cycle than its mailboxes hold, both stages would wait for room
in each other's full mailbox for ever. So ``split`` keeps at most ``window`` items in flight:
``check`` sends a :class:`Credit` back to ``split`` for every item done, and ``split`` queues
the values of a job and emits the next one for each credit. Its handlers never wait for the
window, so ``split`` keeps draining its own mailbox (jobs and credits), and a job of any size
runs in mailboxes of the default capacity.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import numpy as np

from pipeline.runtime.graph import Pipeline
from pipeline.runtime.stage import Stage, handles
from transports.codec import message

__all__ = [
    "Credit",
    "Item",
    "Job",
    "JobResult",
    "SplitConfig",
    "collatz_pipeline",
    "collatz_steps",
]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """Compute the Collatz step count of every value. ``delay``: seconds to sleep per step
    (to keep calls pending in tests)."""

    job_id: str
    values: tuple[int, ...]
    delay: float = 0.0


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    job_id: str
    index: int
    total: int
    value: int
    steps: int
    delay: float


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class JobResult:
    job_id: str
    steps: np.ndarray  # [len(values)] int64


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class Credit:
    """``check`` finished an item: ``split`` may put another one into the cycle."""

    job_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class SplitConfig:
    """``window``: the most items in flight around the step ⇄ check cycle. It must stay
    below the mailbox capacities of ``step`` and ``check`` (1024 by default)."""

    window: int = 256

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


class Split(Stage):
    """Turns jobs into items, at most ``SplitConfig.window`` of them in flight at a time."""

    inputs = ("in", "credit")
    outputs = ("out",)

    def __init__(self, config: SplitConfig | None = None) -> None:
        super().__init__(config)
        self._window = (config or SplitConfig()).window
        self._in_flight = 0
        # jobs whose items are not all in flight yet: [job, index of its next item]
        self._queued: collections.deque[tuple[Job, int]] = collections.deque()

    @handles(Job)
    async def on_job(self, job: Job) -> None:
        if job.values:
            self._queued.append((job, 0))
            await self._fill_window()

    @handles(Credit)
    async def on_credit(self, credit: Credit) -> None:
        self._in_flight -= 1
        await self._fill_window()

    async def _fill_window(self) -> None:
        """Emit queued items while fewer than ``window`` are in flight."""
        queued = self._queued
        while queued and self._in_flight < self._window:
            job, index = queued.popleft()
            if index + 1 < len(job.values):
                queued.appendleft((job, index + 1))
            self._in_flight += 1
            total = len(job.values)
            await self.emit("out", Item(job.job_id, index, total, job.values[index], 0, job.delay))

    def idle(self) -> bool:
        return not self._queued


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
    """Sends unfinished items round again; for each finished one a credit back to split."""

    inputs = ("in",)
    outputs = ("out", "again", "credit")

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
        await self.emit("credit", Credit(item.job_id))

    def idle(self) -> bool:
        return not self._done


def collatz_pipeline(window: int = 256) -> Pipeline:
    """The demo graph: entry ``jobs`` → split → step ⇄ check → exit ``results``, and
    check → split for credits (at most ``window`` items in flight, see the module notes).

    A value of 1 needs no step but still passes ``step`` once, so its count is 3 (1→4→2→1).
    """
    pipeline = Pipeline("collatz")
    pipeline.add("split", Split, SplitConfig(window)).add("step", Step).add("check", Check)
    pipeline.connect("split", "step").connect("step", "check")
    pipeline.connect("check.again", "step")
    pipeline.connect("check.credit", "split.credit")
    pipeline.entry("jobs", "split.in").exit("results", "check.out")
    return pipeline


def collatz_steps(value: int) -> int:
    """The step count the pipeline computes for ``value`` (reference for tests)."""
    steps = 0
    while True:
        value = value // 2 if value % 2 == 0 else 3 * value + 1
        steps += 1
        if value == 1:
            return steps
