"""What the engine host notes before each step, for the line that reports its death
(docs/architecture.md §4.7; the note itself is :mod:`pipeline.runtime.crash_note`)."""

from __future__ import annotations

from pipeline.runtime.crash_note import note
from stages.messages import SchedulerStep

__all__ = ["NOTED_IDS", "note_step"]

#: request ids a step's note names, at most (then "and N more")
NOTED_IDS = 8


def note_step(step: SchedulerStep) -> None:
    """Note the requests ``step`` computes, before running it. The note stays until the
    next step's (clearing it after each step would double the cost), hence "latest": a death
    between steps names the step before."""
    chunks = step.chunks
    if not chunks:
        return
    ids = [chunk.request_id for chunk in chunks[:NOTED_IDS]]
    more = len(chunks) - len(ids)
    tail = f" and {more} more" if more > 0 else ""
    note(f"its latest step had request(s) {', '.join(ids)}{tail}")
