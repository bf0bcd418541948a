"""The garbage-collector policy of a running pipeline (``StartOptions.tune_gc``).

A pipeline allocates a burst of short-lived objects per message (decoded messages, outputs,
futures and handles of the tasks they wake). With CPython's default youngest-generation
threshold (700 net allocations) a streaming frontend collects hundreds of times a second, and
each collection also walks the survivors of the bursts in flight: in the framework-ceiling
benchmark that was 0.13-0.29 s of young collections per 1-1.5 s run. At 20,000 the bursts
mostly die by reference counting before a collection sees them (0.01-0.05 s per run), for a
few MB more of uncollected cyclic garbage at worst.

- In a spawned host process (all ours) the heap built at start-up (modules, the model, the
  tokenizer) is also frozen once its stages have started: ``gc.freeze()`` takes it out of
  every later full collection, which otherwise walked it in 0.15-0.2 s. vLLM does the same
  in its engine-core process (vllm/utils/gc_utils.py, ``freeze_gc_heap``).
- In the calling process, which is the user's, only the threshold is raised, while at least
  one pipeline runs, and put back after the last one stops (unless someone else changed it
  meanwhile). Nothing is frozen there: objects frozen are never collected, so an engine
  stopped later would leak whatever cycles it leaves behind.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "freeze_startup_heap", "raise_young_threshold", "restore_threshold"]

#: the youngest generation's collection threshold while a pipeline runs
YOUNG_THRESHOLD = 20_000

_raised = 0  # pipelines of this process that raised the threshold and still run
_previous: tuple[int, ...] | None = None


def freeze_startup_heap() -> None:
    """Collect, then freeze everything alive, and raise the young threshold (for a process
    that hosts pipeline stages and nothing else)."""
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    if threshold[0] < YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, *threshold[1:])


def raise_young_threshold() -> None:
    """Raise the youngest generation's threshold for one more running pipeline."""
    global _raised, _previous
    threshold = gc.get_threshold()
    if _raised == 0:
        _previous = threshold
    _raised += 1
    if threshold[0] < YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, *threshold[1:])


def restore_threshold() -> None:
    """One pipeline that called :func:`raise_young_threshold` stopped: after the last one,
    put the previous thresholds back if ours are still in place."""
    global _raised, _previous
    if _raised == 0:
        return
    _raised -= 1
    if _raised == 0 and _previous is not None:
        current = gc.get_threshold()
        if current[0] == max(_previous[0], YOUNG_THRESHOLD) and current[1:] == _previous[1:]:
            gc.set_threshold(*_previous)
        _previous = None
