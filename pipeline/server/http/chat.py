"""``/v1/chat/completions`` answers: the whole response, and its stream of chunks. A stream
starts with one ``{"role": "assistant", "content": ""}`` chunk per choice, then carries each
choice's new text as ``delta.content`` (with the logprobs of its own new tokens), and a
choice's last chunk carries its ``finish_reason`` and vLLM's ``stop_reason``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from pipeline.server.http.answers import Answer
from pipeline.server.http.choices import Choices
from pipeline.server.http.logprobs import LogprobsCursor, chat_logprobs, lazy_chat_logprobs
from stages.messages import Logprobs, RequestOutput

__all__ = ["chat_events", "chat_response"]

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


def _logprobs(answer: Answer, entries: Sequence[Logprobs]) -> dict[str, Any] | None:
    return chat_logprobs(entries, answer.texts) if answer.texts is not None and entries else None


def chat_response(answer: Answer, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The whole response from every choice's last output (its logprobs made as they are
    written: :mod:`~pipeline.server.http.whole`)."""
    choices = [
        {
            "index": index,
            "message": {"role": "assistant", "content": output.text},
            "logprobs": lazy_chat_logprobs(output.logprobs, answer.texts)
            if answer.texts is not None and output.logprobs
            else None,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }
        for index, output in enumerate(outputs)
    ]
    return answer.response(choices, outputs)


def _chunk(
    answer: Answer,
    index: int,
    delta: dict[str, str],
    entries: Sequence[Logprobs],
    last: RequestOutput | None = None,
) -> str:
    """A chunk of choice ``index``: ``delta`` with the logprobs of ``entries``; ``last``:
    the finished output whose reasons it carries (None: not the choice's last chunk)."""
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": _logprobs(answer, entries),
        "finish_reason": last.finish_reason if last else None,
        "stop_reason": last.stop_reason if last else None,
    }
    return answer.chunk(choice)


async def chat_events(answer: Answer, choices: Choices) -> AsyncGenerator[str, None]:
    """The stream's events (``[DONE]`` excluded)."""
    cursors = [LogprobsCursor() for _ in range(len(choices))]
    for index in range(len(choices)):
        yield _chunk(answer, index, {"role": "assistant", "content": ""}, ())
    async with contextlib.aclosing(choices.outputs()) as outputs:
        async for index, output in outputs:
            if output.delta:
                yield _chunk(answer, index, {"content": output.delta}, cursors[index].take(output))
            if output.finished:
                yield _chunk(answer, index, {}, cursors[index].take(output), output)
    if answer.include_usage:
        yield answer.usage_chunk(choices.latest)
