"""A whole answer written a slice at a time (:mod:`pipeline.server.http.whole`): the bytes are
exactly what rendering it whole gives, and writing a large one (16 choices of 300 tokens with
20 alternatives each: 8 MiB as chat logprobs, 3 MiB as completions') never holds the event
loop for long, where rendering it whole holds it for the whole render."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.responses import JSONResponse

from pipeline.server.http import chat, completions
from pipeline.server.http.answers import Answer
from pipeline.server.http.logprobs import TokenTexts
from pipeline.server.http.whole import JsonAnswer, LazyArray
from stages.messages import Logprobs, RequestOutput
from stages.tokenize import load_tokenizer

#: a generous bound on the longest the loop may go without a turn while the answer is written
#: (the writer yields every 5 ms); what the test relies on is the count of turns, not a time
MAX_STALL = 1.0
#: the fewest turns the loop must get while a large answer is written (it yields per slice)
MIN_TURNS = 10


def _outputs(choices: int, tokens: int, top: int, vocab: int) -> list[RequestOutput]:
    """Finished outputs with logprobs, as the engine sends them (seeded token ids)."""
    rng = random.Random(0)
    outputs = []
    for index in range(choices):
        ids = tuple(rng.randrange(vocab) for _ in range(tokens))
        entries = tuple(
            Logprobs(
                token_id,
                -rng.random() * 5,
                1,
                tuple(rng.randrange(vocab) for _ in range(top)),
                tuple(sorted((-rng.random() * 9 for _ in range(top)), reverse=True)),
            )
            for token_id in ids
        )
        outputs.append(RequestOutput(f"r-{index}", "text", "", ids, "length", None, entries, 3, 0))
    return outputs


def _materialized(value: Any) -> Any:
    """``value`` with every LazyArray made a list (what rendering it whole would take)."""
    if isinstance(value, LazyArray):
        return [_materialized(item) for item in value.items]
    if isinstance(value, dict):
        return {key: _materialized(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_materialized(item) for item in value]
    return value


async def _write(answer: JsonAnswer) -> tuple[bytes, list[dict[str, Any]], float, int]:
    """Write ``answer`` through an ASGI ``send`` that keeps what it is given, while a task
    counts the turns the loop gave it and measures the longest it went without one: the body,
    the messages, that gap, the turns."""
    messages: list[dict[str, Any]] = []
    done = asyncio.Event()
    worst = 0.0
    turns = 0

    async def tick() -> None:
        nonlocal worst, turns
        while not done.is_set():
            began = time.perf_counter()
            await asyncio.sleep(0)
            turns += 1
            worst = max(worst, time.perf_counter() - began)

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    # NOTE: what is alive now (the outputs, the rendered answer) is taken out of the cyclic
    # collector's reach, as the server's GC policy does with its long-lived heap
    # (pipeline/runtime/gc_policy.py): a full collection's pause grows with the heap, whoever
    # allocates, and is not the writer's to measure
    gc.collect()
    gc.freeze()
    try:
        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        await answer({"type": "http"}, receive, send)
        done.set()
        await ticker
    finally:
        gc.unfreeze()
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return body, messages, worst, turns


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_large_answer_is_written_in_slices_as_json_renders_it(
    tiny_model_dir: Path, kind: str
) -> None:
    texts = TokenTexts(load_tokenizer(str(tiny_model_dir)))
    outputs = _outputs(16, 300, 20, 49152)
    answer = Answer.create("cmpl-1", "x", "m", texts, False, 16)
    respond = chat.chat_response if kind == "chat" else completions.completion_response
    content = respond(answer, outputs)
    whole = _materialized(respond(answer, outputs))
    began = time.perf_counter()
    rendered = JSONResponse(whole).body  # what the server did: the loop held for all of it
    render_seconds = time.perf_counter() - began

    body, messages, worst, turns = asyncio.run(_write(JsonAnswer(content)))

    assert body == rendered
    assert len(body) > 2 * 2**20
    start = messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"application/json") in start["headers"]
    assert not any(name == b"content-length" for name, _ in start["headers"])  # chunked
    assert len(messages) > 10 and messages[-1]["more_body"] is False
    assert turns >= MIN_TURNS, (turns, len(messages))  # other work ran while it was written
    assert worst < max(MAX_STALL, render_seconds), (worst, render_seconds)
    assert json.loads(body)["choices"][15]["index"] == 15


def test_a_small_answer_is_sent_whole_with_its_length() -> None:
    content = {"a": [1, 2, LazyArray(iter(range(3)))], "b": LazyArray(iter(())), "c": "é"}
    body, messages, _, _ = asyncio.run(_write(JsonAnswer(content)))
    assert body == '{"a":[1,2,[0,1,2]],"b":[],"c":"é"}'.encode()
    assert (b"content-length", str(len(body)).encode()) in messages[0]["headers"]
    assert len(messages) == 2


def test_a_nan_is_refused_as_json_renders_it() -> None:
    with pytest.raises(ValueError):
        asyncio.run(_write(JsonAnswer({"x": LazyArray(iter([float("nan")]))})))
