"""``/v1/completions`` answers: the whole response, and its stream of chunks (each carries
one choice's new text, its ``index`` and the logprobs of its own new tokens; a choice's last
chunk carries its ``finish_reason``). Choices carry vLLM's ``stop_reason``: the stop string
or token id that ended them, else null."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from pipeline.server.http.answers import Answer
from pipeline.server.http.choices import Choices
from pipeline.server.http.logprobs import (
    LogprobsCursor,
    completion_logprobs,
    lazy_completion_logprobs,
)
from stages.messages import Logprobs, RequestOutput

__all__ = ["completion_events", "completion_response"]

OBJECT = "text_completion"


def _choice(
    answer: Answer,
    index: int,
    output: RequestOutput,
    text: str,
    entries: Sequence[Logprobs],
    offset: int,
) -> tuple[dict[str, Any], int]:
    """Choice ``index`` with ``text`` and the logprobs of ``entries`` (text offsets from
    ``offset``), and the offset after them."""
    logprobs = None
    if answer.texts is not None and entries:
        logprobs, offset = completion_logprobs(entries, answer.texts, offset)
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
    }
    return choice, offset


def completion_response(answer: Answer, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The whole response from every choice's last output (its logprobs made as they are
    written: :mod:`~pipeline.server.http.whole`)."""
    choices = [
        {
            "index": index,
            "text": output.text,
            "logprobs": lazy_completion_logprobs(output.logprobs, answer.texts)
            if answer.texts is not None and output.logprobs
            else None,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }
        for index, output in enumerate(outputs)
    ]
    return answer.response(choices, outputs)


async def completion_events(answer: Answer, choices: Choices) -> AsyncGenerator[str, None]:
    """The stream's events (``[DONE]`` excluded)."""
    cursors = [LogprobsCursor() for _ in range(len(choices))]
    async with contextlib.aclosing(choices.outputs()) as outputs:
        async for index, output in outputs:
            if output.delta or output.finished:
                cursor = cursors[index]
                choice, cursor.offset = _choice(
                    answer, index, output, output.delta, cursor.take(output), cursor.offset
                )
                yield answer.chunk(choice, output)
    if answer.include_usage:
        yield answer.usage_chunk(choices.latest)
