"""``/v1/chat/completions`` answers: the whole response, and its stream of chunks. A stream
starts with one ``{"role": "assistant", "content": ""}`` chunk per choice, then carries each
choice's new text as ``delta.content`` (with the logprobs of its own new tokens), and a
choice's last chunk carries its ``finish_reason`` and vLLM's ``stop_reason``.

A request whose output the parse stage read (docs/serving.md, "Tool calling") answers with
``message.reasoning_content`` and ``message.tool_calls`` (ids ``call_...``, arguments as
JSON text; ``content`` null when the model only called); its stream carries
``delta.reasoning_content`` and ``delta.tool_calls``: a call's first delta has its ``index``,
``id``, ``type`` and name, the next ones its arguments as they are generated.

With vLLM's ``return_token_ids`` the response carries ``prompt_token_ids`` and each choice its
``token_ids`` (``vllm/entrypoints/openai/chat_completion/protocol.py``,
``ChatCompletionResponse``, ``ChatCompletionResponseChoice``); in a stream the opening chunks
carry ``prompt_token_ids`` and every later chunk its choice's new ``token_ids``. vLLM's
``prompt_logprobs`` (the rendered prompt's scores) sit at a whole answer's top level."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from pipeline.server.http.answers import Answer
from pipeline.server.http.choices import Choices
from pipeline.server.http.echo import lazy_prompt_logprobs
from pipeline.server.http.logprobs import LogprobsCursor, chat_logprobs, lazy_chat_logprobs
from stages.messages import Logprobs, RequestOutput, ToolCall

__all__ = ["SentParts", "chat_events", "chat_response"]

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


def _logprobs(answer: Answer, entries: Sequence[Logprobs]) -> dict[str, Any] | None:
    return chat_logprobs(entries, answer.texts) if answer.texts is not None and entries else None


def _message(output: RequestOutput) -> dict[str, Any]:
    """A whole answer's message: content, and the reasoning and calls the parse stage read."""
    message: dict[str, Any] = {"role": "assistant", "content": output.text}
    if output.reasoning:
        message["reasoning_content"] = output.reasoning
    if output.tool_calls:
        message["tool_calls"] = [_call(call) for call in output.tool_calls]
        if not output.text.strip():
            message["content"] = None
    return message


def _call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def chat_response(answer: Answer, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The whole response from every choice's last output (its logprobs made as they are
    written: :mod:`~pipeline.server.http.whole`)."""
    choices = [
        {
            "index": index,
            "message": _message(output),
            "logprobs": lazy_chat_logprobs(output.logprobs, answer.texts)
            if answer.texts is not None and output.logprobs
            else None,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
            **({"token_ids": list(output.token_ids)} if answer.token_ids else {}),
        }
        for index, output in enumerate(outputs)
    ]
    response = answer.response(choices, outputs)
    if answer.token_ids:
        response["prompt_token_ids"] = _prompt_token_ids(outputs[0] if outputs else None)
    if answer.prompt_logprobs is not None and outputs:
        # vLLM's place: the response's top level (every choice has the same prompt)
        response["prompt_logprobs"] = lazy_prompt_logprobs(outputs[0], answer.prompt_logprobs)
    return response


def _prompt_token_ids(output: RequestOutput | None) -> list[int] | None:
    ids = output.prompt_token_ids if output is not None else None
    return list(ids) if ids is not None else None


def _chunk(
    answer: Answer,
    index: int,
    delta: dict[str, Any],
    entries: Sequence[Logprobs],
    last: RequestOutput | None = None,
    output: RequestOutput | None = None,
    *,
    started: bool = True,
    token_ids: Sequence[int] | None = None,
) -> str:
    """A chunk of choice ``index``: ``delta`` with the logprobs of ``entries``; ``last``:
    the finished output whose reasons it carries (None: not the choice's last chunk);
    ``output``: the choice's latest, for continuous usage (``started``: :meth:`Answer.chunk`);
    ``token_ids``: its new tokens, when the answer carries them (the opening chunk: none, and
    the prompt's beside the choice)."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": _logprobs(answer, entries),
        "finish_reason": last.finish_reason if last else None,
        "stop_reason": last.stop_reason if last else None,
    }
    extra = None
    if answer.token_ids:
        choice["token_ids"] = list(token_ids or ())
        if not started:
            extra = {"prompt_token_ids": _prompt_token_ids(output)}
    return answer.chunk(choice, last or output, started=started, extra=extra)


class SentParts:
    """What a stream has sent of one choice's reasoning and calls (their outputs are
    cumulative: each chunk carries what is new)."""

    __slots__ = ("arguments", "reasoning")

    def __init__(self) -> None:
        self.reasoning = 0
        self.arguments: list[int] = []  # per call, the characters of arguments sent

    def delta(self, output: RequestOutput) -> dict[str, Any]:
        """The new content, reasoning and call parts of ``output``."""
        delta: dict[str, Any] = {}
        if len(output.reasoning) > self.reasoning:
            delta["reasoning_content"] = output.reasoning[self.reasoning :]
            self.reasoning = len(output.reasoning)
        if output.delta:
            delta["content"] = output.delta
        calls = []
        for index, call in enumerate(output.tool_calls):
            if index == len(self.arguments):
                self.arguments.append(len(call.arguments))
                calls.append({"index": index, **_call(call)})
            elif len(call.arguments) > self.arguments[index]:
                new = call.arguments[self.arguments[index] :]
                self.arguments[index] = len(call.arguments)
                calls.append({"index": index, "function": {"arguments": new}})
        if calls:
            delta["tool_calls"] = calls
        return delta


async def chat_events(answer: Answer, choices: Choices) -> AsyncGenerator[str, None]:
    """The stream's events (``[DONE]`` excluded)."""
    cursors = [LogprobsCursor() for _ in range(len(choices))]
    sent = [SentParts() for _ in range(len(choices))]
    tokens = [0] * len(choices)  # per choice, the token ids sent

    def new_tokens(index: int, output: RequestOutput) -> Sequence[int]:
        new = output.token_ids[tokens[index] :]
        tokens[index] = len(output.token_ids)
        return new

    for index in range(len(choices)):
        first = choices.latest[index] if choices.latest else None
        yield _chunk(answer, index, {"role": "assistant", "content": ""}, (), None, first,
                     started=False)  # fmt: skip
    async with contextlib.aclosing(choices.outputs()) as outputs:
        async for index, output in outputs:
            delta = sent[index].delta(output)
            if delta:
                yield _chunk(
                    answer, index, delta, cursors[index].take(output), None, output,
                    token_ids=new_tokens(index, output),
                )  # fmt: skip
            if output.finished:
                yield _chunk(
                    answer, index, {}, cursors[index].take(output), output,
                    token_ids=new_tokens(index, output),
                )  # fmt: skip
    if answer.include_usage:
        yield answer.usage_chunk(choices.latest)
