"""``/v1/completions`` answers: the whole response, and its stream of chunks (each carries
one choice's new text, its ``index`` and the logprobs of its own new tokens; a choice's last
chunk carries its ``finish_reason``). Choices carry vLLM's ``stop_reason``: the stop string
or token id that ended them, else null. With vLLM's ``return_token_ids`` each choice carries
``prompt_token_ids`` and ``token_ids`` (``vllm/entrypoints/openai/completion/protocol.py``,
``CompletionResponseChoice``); in a stream a choice's first chunk carries its prompt's, and
each chunk its new tokens. With ``echo`` a choice starts
with its prompt (a stream's first chunk of each choice carries it), with vLLM's
``prompt_logprobs`` it carries the prompt's scores (:mod:`~pipeline.server.http.echo`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from pipeline.server.http.answers import Answer
from pipeline.server.http.choices import Choices
from pipeline.server.http.echo import echo_only_output, lazy_prompt_logprobs, prompt_entries
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
    unscored_first: int | None = None,
) -> tuple[dict[str, Any], int]:
    """Choice ``index`` with ``text`` and the logprobs of ``entries`` (text offsets from
    ``offset``; ``unscored_first``: an echoed prompt's first token before them), and the
    offset after them."""
    logprobs = None
    if answer.texts is not None and (entries or unscored_first is not None):
        logprobs, offset = completion_logprobs(entries, answer.texts, offset, unscored_first)
    return _fields(index, output, text, logprobs), offset


def _fields(index: int, output: RequestOutput, text: str, logprobs: Any) -> dict[str, Any]:
    """A choice's fields that every completion answer has."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
    }


def _whole_choice(answer: Answer, index: int, output: RequestOutput) -> dict[str, Any]:
    """Choice ``index`` of a whole response (an echo's prompt text found already:
    :meth:`~pipeline.server.http.echo.Echo.prepare`)."""
    echo = answer.echo
    text = output.text if echo is None else echo.texts[index] + output.text
    logprobs = None
    texts = answer.texts
    if texts is not None:
        lead = prompt_entries(output) if echo is not None else None
        if lead is not None:
            first, scored = lead
            entries = [*scored, *(output.logprobs or ())]
            logprobs = lazy_completion_logprobs(entries, texts, unscored_first=first)
        elif output.logprobs:
            logprobs = lazy_completion_logprobs(output.logprobs, texts)
    choice = _fields(index, output, text, logprobs)
    if answer.prompt_logprobs is not None:
        choice["prompt_logprobs"] = lazy_prompt_logprobs(output, answer.prompt_logprobs)
    if answer.token_ids:
        choice |= _token_ids(output, output.token_ids)
    return choice


def completion_response(answer: Answer, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The whole response from every choice's last output (its logprobs made as they are
    written: :mod:`~pipeline.server.http.whole`)."""
    if answer.echo is not None and answer.echo.only:
        outputs = [echo_only_output(output) for output in outputs]
    choices = [_whole_choice(answer, index, output) for index, output in enumerate(outputs)]
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
    echo = answer.echo
    echoed = [echo is None] * len(choices)
    async with contextlib.aclosing(choices.outputs()) as outputs:
        async for index, output in outputs:
            if echo is not None and echo.only:
                output = choices.latest[index] = echo_only_output(output)
            if not echoed[index]:
                # the choice's first chunk: its prompt, then what it generated so far
                assert echo is not None
                echoed[index] = True
                cursor = cursors[index]
                lead = prompt_entries(output)
                first, scored = (None, ()) if lead is None else lead
                text = await echo.text(index, output) + output.delta
                choice, cursor.offset = _choice(
                    answer, index, output, text, [*scored, *cursor.take(output)], 0, first
                )
            elif output.delta or output.finished:
                cursor = cursors[index]
                choice, cursor.offset = _choice(
                    answer, index, output, output.delta, cursor.take(output), cursor.offset
                )
            else:
                continue
            if answer.token_ids:
                new = output.token_ids[max(sent[index], 0) :]
                choice |= _token_ids(output, new, prompt=sent[index] < 0)
                sent[index] = len(output.token_ids)
            yield answer.chunk(choice, output)
    if answer.include_usage:
        yield answer.usage_chunk(choices.latest)
