"""The bookkeeping of disaggregated prefill and decode's direct link (stages/kv_transfer.py
KvInbox, stages/execute/kv_links.py): where a prefill engine's blocks go, and a decode
engine's blocks held from their arrival until their request's first step takes them or the
router releases them. The engines' whole trip is tests/stages/test_disaggregate.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from stages.execute.kv_links import KvLinks
from stages.kv_transfer import PREFILL_SUFFIX, KvArrived, KvBlocks, KvInbox, KvRelease
from stages.messages import EngineRequest, SchedulerStep
from stages.params import SamplingParams
from transports.codec import Codec

BLOCK = 4
PROMPT = tuple(range(10))  # two full blocks before the last token


def blocks_of(request_id: str, num_blocks: int = 2) -> KvBlocks:
    data = np.arange(2 * 1 * num_blocks * BLOCK * 1 * 2, dtype=np.float32)
    return KvBlocks(request_id, PROMPT[: num_blocks * BLOCK], BLOCK, "float32",
                    data.reshape(2, 1, num_blocks, BLOCK, 1, 2))  # fmt: skip


def request(request_id: str, **fields: str) -> EngineRequest:
    return EngineRequest(request_id, PROMPT, SamplingParams(max_tokens=1), **fields)  # type: ignore[arg-type]


def test_the_inbox_holds_blocks_until_taken_or_released_and_says_what_else_it_holds() -> None:
    inbox = KvInbox()
    first = inbox.put(blocks_of("a"), "execute_1")
    assert first == KvArrived("a", "execute_1", 2, 2 * 2 * BLOCK * 2 * 4, 0, 0)
    second = inbox.put(blocks_of("b", 1), "execute_1")
    assert (second.held, second.held_bytes) == (1, first.nbytes)
    assert len(inbox) == 2 and inbox.nbytes == first.nbytes + second.nbytes
    taken = inbox.take("a")
    assert taken is not None and taken.request_id == "a" and inbox.take("a") is None
    assert inbox.release(("b", "never-came")) == 1
    assert len(inbox) == 0 and inbox.nbytes == 0
    assert (inbox.received, inbox.taken, inbox.released) == (2, 1, 1)


def test_blocks_that_come_twice_keep_the_later(caplog: pytest.LogCaptureFixture) -> None:
    inbox = KvInbox()
    inbox.put(blocks_of("a", 1), "execute_1")
    with caplog.at_level(logging.WARNING, "actorline.execute"):
        again = inbox.put(blocks_of("a", 2), "execute_1")
    assert "came twice" in caplog.text
    assert (again.held, len(inbox), inbox.released) == (0, 1, 1)
    taken = inbox.take("a")
    assert taken is not None and taken.num_blocks == 2


def test_the_notes_travel_through_the_codec() -> None:
    codec = Codec()
    for note in (KvArrived("a", "execute_1", 3, 1024, 2, 4096), KvRelease(("a", "b"))):
        payload, buffers = codec.encode(note)
        assert codec.decode(payload, buffers) == note


def test_a_prefill_engine_sends_each_requests_blocks_where_it_named_under_the_callers_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    links = KvLinks()
    prefill = "r" + PREFILL_SUFFIX
    step = SchedulerStep(1, new_requests=(request(prefill, kv_to="execute_2"),))
    assert links.join(step) is step  # nothing to join: the step as it was
    (to, moved), = links.addressed([blocks_of(prefill)])  # fmt: skip
    assert to == "execute_2" and moved.request_id == "r" and moved.num_blocks == 2
    # sent once: a request that named nowhere (or was sent already) is dropped, said so
    with caplog.at_level(logging.WARNING, "actorline.execute"):
        assert links.addressed([blocks_of(prefill)]) == []
    assert "nowhere to go" in caplog.text
    # a prefill that finishes (aborted) before its export is forgotten
    gone = "g" + PREFILL_SUFFIX
    links.join(SchedulerStep(2, new_requests=(request(gone, kv_to="execute_2"),)))
    links.join(SchedulerStep(3, finished=(gone,)))
    assert links.addressed([blocks_of(gone)]) == []


def test_a_decode_engine_joins_a_request_with_its_held_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    links = KvLinks()
    arrived = links.arrived(blocks_of("r"), "execute_1")
    assert arrived.request_id == "r" and arrived.stage == "execute_1"
    plain = request("plain")
    step = SchedulerStep(1, new_requests=(plain, request("r", kv_from="execute")))
    joined = links.join(step)
    assert joined.new_requests[0] is plain
    moved = joined.new_requests[1].kv_blocks
    assert moved is not None and moved.request_id == "r" and len(links.inbox) == 0
    # a request whose blocks are not here (released, never came) computes its whole prompt
    with caplog.at_level(logging.WARNING, "actorline.execute"):
        alone = links.join(SchedulerStep(2, new_requests=(request("s", kv_from="execute"),)))
    assert alone.new_requests[0].kv_blocks is None
    assert "are not here" in caplog.text
    links.arrived(blocks_of("t"), "execute_1")
    assert links.release(KvRelease(("t",))) == 1 and len(links.inbox) == 0
