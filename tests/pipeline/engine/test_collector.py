"""The output collector of one request (pipeline/engine/collector.py): outputs a lagging
caller has not read yet merge into one, which keeps the scheduler's times of the first token."""

from __future__ import annotations

import asyncio

from pipeline.engine.collector import OutputCollector
from stages.messages import RequestOutput


def test_merged_outputs_keep_the_first_tokens_scheduler_times() -> None:
    collector = OutputCollector("caller-id")
    collector.put(RequestOutput("id#1", "a", "a", (1,), scheduler_times=(0.5, 0.25, "")))
    collector.put(RequestOutput("id#1", "ab", "b", (1, 2)))
    merged = asyncio.run(collector.get())
    assert (merged.request_id, merged.text, merged.delta) == ("caller-id", "ab", "ab")
    assert merged.token_ids == (1, 2)
    assert merged.scheduler_times == (0.5, 0.25, "")
    assert merged.metrics is not None and merged.metrics.time_to_first_token is not None
    collector.put(RequestOutput("id#1", "abc", "c", (1, 2, 3), finish_reason="length"))
    last = asyncio.run(collector.get())
    assert last.delta == "c" and last.scheduler_times is None  # reported once
    assert last.metrics is not None and last.metrics.total_time is not None
