"""The contention fallback's decision (stages.execute.contention.ThreadGovernor): fed traces
recorded by ``python -m benchmarks.contention_trace gguf --threads 2|1 --load 2`` on a 2-core
machine at load 16 (one decode stream of the default model at a fixed thread count: as the
machine was, with two busy processes beside it, as it was again; ``data/contention-*.jsonl``),
replayed so that each window comes from the trace of the thread count the governor chose;
and machines written out (a step's time and run-queue wait at each thread count) to pin the
tries, the holds and the return."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from stages.execute.contention import ThreadGovernor, run_queue_wait_seconds

DATA = Path(__file__).parent / "data"


def _windows(threads: int) -> list[dict[str, float]]:
    lines = (DATA / f"contention-{threads}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _started(governor: ThreadGovernor) -> ThreadGovernor:
    """``governor`` past its first look (the counter's baseline, at 0)."""
    assert governor.step(0.0)
    assert governor.decide(0.0) is None
    return governor


def _feed(governor: ThreadGovernor, step_seconds: float, wait: float, clock: list[float]) -> int:
    """One window, one step of ``step_seconds`` whose threads waited ``wait`` on run queues;
    the thread count after it."""
    assert governor.step(step_seconds)
    clock[0] += wait
    governor.decide(clock[0])
    return governor.current


def _run(
    governor: ThreadGovernor, windows: int, machine: dict[int, tuple[float, float]]
) -> list[int]:
    """``windows`` windows on a machine where a step at n threads takes ``machine[n][0]``
    seconds and waits ``machine[n][1]`` per thread-second on run queues."""
    clock = [0.0]
    counts = []
    for _ in range(windows):
        seconds, share = machine[governor.current]
        counts.append(_feed(governor, seconds, share * seconds * governor.current, clock))
    return counts


def test_under_a_recorded_fair_share_load_two_threads_keep_their_lead() -> None:
    """Replayed at load 16 (the other sessions' tests on the two cores, then two busy
    processes more): contended throughout, so one thread is tried, and loses (~1 s a step
    against ~0.45 s at two threads: the scheduler shares the cores per thread); the tries
    then come rarer and rarer."""
    traces = {2: _windows(2), 1: _windows(1)}
    governor = _started(ThreadGovernor(2))
    clock = [0.0]
    counts = []
    for index in range(4 * len(traces[2])):
        trace = traces[governor.current]
        window = trace[index % len(trace)]
        counts.append(_feed(governor, window["step_seconds"], window["run_queue_wait"], clock))
    assert governor.changes >= 2  # tried, and came back
    assert counts[-1] == 2
    assert counts.count(1) <= len(counts) // 8, counts
    tries = [i for i in range(1, len(counts)) if counts[i] == 1 and counts[i - 1] == 2]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps == sorted(gaps), gaps  # the holds grow


def test_recorded_waits_are_what_the_thresholds_were_set_from() -> None:
    """Every recorded window at load 16 waits more than ``high`` per thread-second."""
    governor = ThreadGovernor(2)
    for threads in (1, 2):
        shares = [
            w["run_queue_wait"] / (w["step_seconds"] * w["threads"])
            for w in _windows(threads)
            if w["run_queue_wait"] > 0
        ]
        assert sorted(shares)[len(shares) // 2] >= governor.high, shares


def test_quiet_windows_keep_every_thread() -> None:
    governor = _started(ThreadGovernor(2, window=1e-3))
    assert set(_run(governor, 50, {2: (0.25, 0.004)})) == {2}
    assert governor.changes == 0 and not governor.contended


def test_where_two_threads_collapse_one_is_kept() -> None:
    """A descheduled partner holding every phase up: 5x slower at two threads."""
    governor = _started(
        ThreadGovernor(2, window=1e-3, confirm=2, probe=2, hold=1000, max_hold=1000)
    )
    counts = _run(governor, 40, {2: (0.1, 0.5), 1: (0.02, 0.3)})
    assert counts[:4] == [2, 1, 1, 1]  # two contended windows, then one thread for good
    assert set(counts[4:]) == {1} and governor.contended
    assert governor.last_share == pytest.approx(0.3)


def test_a_quiet_machine_brings_every_thread_back() -> None:
    governor = _started(ThreadGovernor(2, window=1e-3, confirm=1, probe=1, quiet=3, hold=1000))
    assert _run(governor, 2, {2: (0.1, 0.5), 1: (0.02, 0.3)}) == [1, 1]
    assert _run(governor, 3, {1: (0.02, 0.0), 2: (0.01, 0.0)}) == [1, 1, 2]
    assert not governor.contended and governor.changes == 2


def test_one_thread_is_tried_again_later_and_later() -> None:
    """Where one thread keeps being faster, every thread is tried again after a hold that
    doubles; where it keeps losing, the next try of one thread waits twice as long."""
    governor = _started(ThreadGovernor(2, window=1e-3, confirm=1, probe=1, hold=2, max_hold=8))
    counts = _run(governor, 60, {2: (0.1, 0.5), 1: (0.02, 0.3)})
    runs_at_one = [len(run) for run in "".join(map(str, counts)).split("2") if run]
    assert runs_at_one[:4] == [3, 5, 9, 9], counts  # the try, then holds of 2, 4, 8, 8
    governor = _started(ThreadGovernor(2, window=1e-3, confirm=1, probe=1, hold=2, max_hold=8))
    counts = _run(governor, 60, {2: (0.1, 0.5), 1: (0.5, 0.3)})
    runs_at_two = [len(run) for run in "".join(map(str, counts)).split("1") if run]
    assert runs_at_two[:4] == [2, 4, 8, 8], counts  # holds of 2, 4, 8, 8


def test_one_thread_has_nothing_to_fall_back_to() -> None:
    governor = ThreadGovernor(1)
    assert not governor.step(10.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"threads": 0}, "threads must be an integer >= 1"),
        ({"threads": 2, "window": 0}, "window must be > 0"),
        ({"threads": 2, "low": 0.3, "high": 0.2}, "need 0 <= low < high"),
        ({"threads": 2, "confirm": 0}, "confirm must be an integer >= 1"),
        ({"threads": 2, "keep": 0}, "keep must be in"),
    ],
)
def test_bad_settings_are_refused_by_name(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThreadGovernor(**fields)  # type: ignore[arg-type]


def test_the_run_queue_counter_reads_this_process() -> None:
    first = run_queue_wait_seconds()
    assert first is not None and first >= 0  # Linux with schedstat (the CI machines)
    assert run_queue_wait_seconds("/no/such/dir") is None
