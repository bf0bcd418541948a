"""When the engine's threads are oversubscribed, try stepping on one, and keep it where it is
faster (``omp_wait_policy="auto"``; docs/performance.md §13).

A decode step at two threads is one OpenMP region whose phases each wait for the slower thread
(kernels/step_graph.c): on a machine where other work holds the cores, a thread the OS has
descheduled can hold its partner up for a time slice, phase after phase (two threads once ran
at 23 tok/s where one ran at 128, docs/performance.md §13) — or, where the scheduler shares
the cores fairly among many busy processes, two threads get twice one's share and stay ahead
(a recorded run at load 16: 0.45 s a step at two threads, 1 s at one). So the load alone does
not say which is faster; the steps' own times do, once the load says it is worth asking.

What tells that the cores are contended is the time the process's threads spend *runnable but
not running*: Linux counts it per thread (``/proc/self/task/*/schedstat``, its second field,
``run_delay``), ~0 on a quiet machine whatever the threads do (a thread spinning or
sleeping in a wait is running or not runnable). :class:`ThreadGovernor` is the decision
alone, fed the seconds each step took and, when it asks, that counter. Per window of steps: a
run-queue wait of ``high`` or more per thread-second for ``confirm`` windows in a row tries
one thread for ``probe`` windows, kept where its median step is at most ``keep`` times the
last step at every thread. A try that loses waits ``hold`` windows before the next, doubled
each time one loses again; at one thread, ``quiet`` windows of ``low`` or less bring every
thread back at once, and every thread is tried again after the same doubling hold. The steps
of the windows compared are alike in a steady decode (one stream's or a batch's); a step mix
that changes meanwhile only costs a later try.

Pure: no torch, no asyncio (the execute stage applies the thread count it returns).
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["ThreadGovernor", "run_queue_wait_seconds"]


def run_queue_wait_seconds(task_dir: str = "/proc/self/task") -> float | None:
    """Seconds this process's threads have spent waiting on a run queue, summed over the
    threads alive now (``schedstat``'s ``run_delay``); None where the kernel does not count
    it (not Linux, no ``CONFIG_SCHED_INFO``)."""
    total = 0
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"{task_dir}/{task}/schedstat", encoding="ascii") as file:
                fields = file.read().split()
        except OSError:
            continue  # the thread ended meanwhile
        if len(fields) >= 2 and fields[1].isdigit():
            total += int(fields[1])
    return total / 1e9 if tasks else None


@dataclasses.dataclass
class ThreadGovernor:
    """The thread count of the steps: ``threads`` (the engine's own) or one while one is
    faster on an oversubscribed machine (see the module docstring).

    ``window``: seconds of steps between two looks at the run-queue counter. ``high`` /
    ``low``: run-queue wait per thread-second of steps that counts as contended / quiet.
    ``confirm``: contended windows in a row before one thread is tried, for ``probe`` windows;
    it is kept where its steps took at most ``keep`` times the last window's at ``threads``.
    ``quiet``: quiet windows in a row at one thread that bring every thread back; ``hold``:
    windows before the next try after one that lost (and, at one thread, before every thread
    is tried again), doubled each time the same answer comes back, up to ``max_hold``.

    Raises (from the constructor): ValueError for a field out of range.
    """

    threads: int
    window: float = 0.25
    high: float = 0.2
    low: float = 0.05
    confirm: int = 2
    probe: int = 2
    keep: float = 0.85
    quiet: int = 4
    hold: int = 8
    max_hold: int = 256
    #: the thread count in use now
    current: int = dataclasses.field(init=False)
    #: how many times it changed
    changes: int = dataclasses.field(init=False, default=0)
    #: the last window's run-queue wait per thread-second (None before the first)
    last_share: float | None = dataclasses.field(init=False, default=None)
    #: the last window's mean step, seconds (None before the first)
    last_step: float | None = dataclasses.field(init=False, default=None)
    _stepped: float = dataclasses.field(init=False, default=0.0)
    _steps: int = dataclasses.field(init=False, default=0)
    _baseline: float | None = dataclasses.field(init=False, default=None)
    _streak: int = dataclasses.field(init=False, default=0)
    _reference: float = dataclasses.field(init=False, default=0.0)
    _probed: list[float] | None = dataclasses.field(init=False, default=None)
    _wait: int = dataclasses.field(init=False, default=0)
    _hold_full: int = dataclasses.field(init=False, default=0)
    _hold_one: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        if type(self.threads) is not int or self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        if not self.window > 0:
            raise ValueError(f"window must be > 0 seconds, got {self.window!r}")
        if not 0 <= self.low < self.high:
            raise ValueError(f"need 0 <= low < high, got {self.low!r} and {self.high!r}")
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep!r}")
        for name in ("confirm", "probe", "quiet", "hold", "max_hold"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        self.current = self.threads
        self._hold_full = self._hold_one = self.hold

    @property
    def contended(self) -> bool:
        """Whether the steps run on one thread because the machine is oversubscribed."""
        return self.current < self.threads

    def step(self, seconds: float) -> bool:
        """Count a step that took ``seconds``; True when a window is full: read
        :func:`run_queue_wait_seconds` and pass it to :meth:`decide`."""
        if self.threads == 1:
            return False
        self._stepped += max(seconds, 0.0)
        self._steps += 1
        return self._baseline is None or self._stepped >= self.window

    def decide(self, run_queue_wait: float) -> int | None:
        """The thread count to step on from now, where it changes (None: keep the current
        one); ``run_queue_wait``: the process's cumulative run-queue wait in seconds."""
        baseline, self._baseline = self._baseline, run_queue_wait
        stepped, steps = self._stepped, self._steps
        self._stepped, self._steps = 0.0, 0
        if baseline is None or stepped <= 0 or steps == 0:
            return None  # the first look: a baseline
        share = max(run_queue_wait - baseline, 0.0) / (stepped * self.current)
        self.last_share, self.last_step = share, stepped / steps
        if self._wait > 0:
            self._wait -= 1
        if self.contended:
            return self._at_one(share, self.last_step)
        self._streak = self._streak + 1 if share >= self.high else 0
        if self._streak < self.confirm or self._wait > 0:
            return None
        self._reference = self.last_step  # try one thread against this
        self._probed = []
        return self._change(1)

    def _at_one(self, share: float, mean_step: float) -> int | None:
        if self._probed is not None:  # trying one thread
            self._probed.append(mean_step)
            if len(self._probed) < self.probe:
                return None
            faster = sorted(self._probed)[len(self._probed) // 2] <= self.keep * self._reference
            self._probed = None
            if faster:  # keep it; every thread is tried again after a while
                self._hold_full = self.hold
                self._wait = self._hold_one
                self._hold_one = min(self._hold_one * 2, self.max_hold)
                return None
            self._wait = self._hold_full  # one thread lost: wait longer before the next try
            self._hold_full = min(self._hold_full * 2, self.max_hold)
            self._hold_one = self.hold
            return self._change(self.threads)
        self._streak = self._streak + 1 if share <= self.low else 0
        if self._streak >= self.quiet:  # the machine is quiet again
            self._hold_one = self._hold_full = self.hold
            self._wait = 0
            return self._change(self.threads)
        if self._wait > 0:
            return None
        return self._change(self.threads)  # try every thread again

    def _change(self, threads: int) -> int:
        self.current = threads
        self.changes += 1
        self._streak = 0
        return threads
