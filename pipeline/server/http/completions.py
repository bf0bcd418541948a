"""``/v1/completions`` answers: the whole response, and its stream of chunks (each carries
one choice's new text, its ``index`` and the logprobs of its own new tokens; a choice's last
chunk carries its ``finish_reason``). Choices carry vLLM's ``stop_reason``: the stop string
or token id that ended them, else null. With vLLM's ``return_token_ids`` each choice carries
``prompt_token_ids`` and ``token_ids`` (``vllm/entrypoints/openai/completion/protocol.py``,
``CompletionResponseChoice``); in a stream a choice's first chunk carries its prompt's, and
each chunk its new tokens."""

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
            **(_token_ids(output, output.token_ids) if answer.token_ids else {}),
        }
        for index, output in enumerate(outputs)
    ]
    return answer.response(choices, outputs)


def _token_ids(output: RequestOutput, new: Sequence[int], prompt: bool = True) -> dict[str, Any]:
    """A choice's ``prompt_token_ids`` (with ``prompt``, else null) and ``token_ids``
    (``new``)."""
    prompt_ids = output.prompt_token_ids
    return {
        "prompt_token_ids": list(prompt_ids) if prompt and prompt_ids is not None else None,
        "token_ids": list(new),
    }


async def completion_events(answer: Answer, choices: Choices) -> AsyncGenerator[str, None]:
    """The stream's events (``[DONE]`` excluded)."""
    cursors = [LogprobsCursor() for _ in range(len(choices))]
    sent = [-1] * len(choices)  # per choice, the tokens sent (-1: no chunk yet)
    async with contextlib.aclosing(choices.outputs()) as outputs:
        async for index, output in outputs:
            if output.delta or output.finished:
                cursor = cursors[index]
                choice, cursor.offset = _choice(
                    answer, index, output, output.delta, cursor.take(output), cursor.offset
                )
                if answer.token_ids:
                    new = output.token_ids[max(sent[index], 0) :]
                    choice |= _token_ids(output, new, prompt=sent[index] < 0)
                    sent[index] = len(output.token_ids)
                yield answer.chunk(choice, output)
    if answer.include_usage:
        yield answer.usage_chunk(choices.latest)
