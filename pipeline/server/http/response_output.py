"""``/v1/responses`` answers: the ``response`` object, and its stream of semantic events.

A response's ``output`` items come in the order the parse stage reads them
(docs/serving.md, "Tool calling"): a ``reasoning`` item (``content`` of ``reasoning_text``)
where the reasoning parser found reasoning, a ``message`` item (one ``output_text`` part)
where the model wrote text, then one ``function_call`` item per call (``call_id`` the call's
``call_...`` id, ``arguments`` JSON text). ``status`` is ``completed``, or ``incomplete``
(``incomplete_details.reason: "max_output_tokens"``) when the token limit cut the answer.

A stream is OpenAI's event sequence, each event ``event: <type>`` and ``data: {...}`` with
a ``sequence_number`` counting from 0: ``response.created``, ``response.in_progress``, then
per item ``response.output_item.added``, its deltas (``response.reasoning_text.delta``;
``response.content_part.added`` and ``response.output_text.delta``;
``response.function_call_arguments.delta``), their ``.done`` events and
``response.output_item.done``, and last ``response.completed`` carrying the whole response
(its ``status`` ``incomplete`` when the token limit cut it). An item is closed when the next
one starts (the parse stage writes reasoning, then text, then calls).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from pipeline.server.http.choices import Choices
from stages.messages import RequestOutput, ToolCall

__all__ = ["ResponseShape", "response_events", "whole_response"]

OBJECT = "response"


class ResponseShape:
    """What every form of one response shares: its id, creation time, model and the
    request's settings echoed back (``instructions``, ``tools``, ``tool_choice``, ...)."""

    __slots__ = ("created_at", "echoed", "id", "model")

    def __init__(self, request_id: str, model: str, echoed: dict[str, Any]) -> None:
        self.id = request_id
        self.model = model
        self.created_at = int(time.time())
        self.echoed = echoed

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        last: RequestOutput | None,
    ) -> dict[str, Any]:
        """The ``response`` object in ``status`` with ``output``; ``last``: the finished
        engine output (its usage and finish reason; None: still running)."""
        incomplete = last is not None and last.finish_reason == "length"
        return {
            "id": self.id,
            "object": OBJECT,
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output,
            "usage": None if last is None else _usage(last),
            **self.echoed,
        }


def _usage(output: RequestOutput) -> dict[str, Any]:
    prompt = output.num_prompt_tokens
    generated = len(output.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def _status(output: RequestOutput) -> str:
    return "incomplete" if output.finish_reason == "length" else "completed"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def _call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": arguments, "status": status}  # fmt: skip


def whole_response(shape: ResponseShape, output: RequestOutput) -> dict[str, Any]:
    """The whole (not streamed) response from the engine's last ``output``."""
    status = _status(output)
    items: list[dict[str, Any]] = []
    if output.reasoning:
        items.append(_reasoning_item(_new_id("rs"), output.reasoning, status))
    # NOTE: as a stream opens them: a message where text was written, else only when there
    # is no other item (an empty answer is one empty message)
    if output.text or not (output.reasoning or output.tool_calls):
        items.append(_message_item(_new_id("msg"), output.text, status))
    for call in output.tool_calls:
        items.append(_call_item(_new_id("fc"), call, call.arguments, status))
    return shape.response(status, items, output)


class _EventWriter:
    """The events of one stream, numbered, and the items it opened and closed."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the items closed so far, in order
        self.open: dict[str, Any] | None = None  # the item being written
        self.open_key: tuple[str, int] | None = None  # its kind (and call index)
        self.text = ""  # what the open item has written (its text or arguments)

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def start(self, key: tuple[str, int], item: dict[str, Any]) -> list[str]:
        """Close the open item (if any) and open ``item``: its added events."""
        events = self.close("completed")
        self.open, self.open_key, self.text = item, key, ""
        index = len(self.items)
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            events.append(
                self.event("response.content_part.added", item_id=item["id"], output_index=index,
                           content_index=0, part=_text_part(""))
            )  # fmt: skip
        return events

    def delta(self, text: str) -> str:
        """An event carrying ``text``, new in the open item."""
        assert self.open is not None
        self.text += text
        where = {"item_id": self.open["id"], "output_index": len(self.items)}
        kind = self.open["type"]
        if kind == "reasoning":
            return self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)
        if kind == "message":
            return self.event("response.output_text.delta", **where, content_index=0, delta=text,
                              logprobs=[])  # fmt: skip
        return self.event("response.function_call_arguments.delta", **where, delta=text)

    def close(self, status: str) -> list[str]:
        """Close the open item (if any): its done events."""
        item = self.open
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        events = []
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], self.text, status)
            events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=self.text))  # fmt: skip
        elif item["type"] == "message":
            done = _message_item(item["id"], self.text, status)
            events.append(self.event("response.output_text.done", **where, content_index=0,
                                     text=self.text, logprobs=[]))  # fmt: skip
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=_text_part(self.text)))  # fmt: skip
        else:
            done = {**item, "arguments": self.text, "status": status}
            events.append(self.event("response.function_call_arguments.done", **where,
                                     name=item["name"], arguments=self.text))  # fmt: skip
        events.append(self.event("response.output_item.done", output_index=where["output_index"],
                                 item=done))  # fmt: skip
        self.items.append(done)
        self.open = self.open_key = None
        return events


def _parts(writer: _EventWriter, output: RequestOutput, sent: dict[str, int]) -> list[str]:
    """The events of what ``output`` has new: its reasoning, its text, its calls (each
    cumulative in ``output``; ``sent`` counts what was sent of each)."""
    events: list[str] = []
    if len(output.reasoning) > sent["reasoning"]:
        if writer.open_key != ("reasoning", 0):
            events += writer.start(
                ("reasoning", 0), _reasoning_item(_new_id("rs"), "", "in_progress")
            )
        events.append(writer.delta(output.reasoning[sent["reasoning"] :]))
        sent["reasoning"] = len(output.reasoning)
    if output.delta:
        if writer.open_key is None or writer.open_key[0] != "message":
            # NOTE: text after a call opens a message of its own (numbered by the items)
            key = ("message", len(writer.items))
            events += writer.start(key, _message_item(_new_id("msg"), None, "in_progress"))
        events.append(writer.delta(output.delta))
    for index, call in enumerate(output.tool_calls):
        key = ("call", index)
        sent_arguments = sent.get(f"call{index}")
        if sent_arguments is None:
            events += writer.start(key, _call_item(_new_id("fc"), call, "", "in_progress"))
            sent_arguments = sent[f"call{index}"] = 0
        if len(call.arguments) > sent_arguments:
            # NOTE: a call's arguments grow only while it is the last one
            if writer.open_key == key:
                events.append(writer.delta(call.arguments[sent_arguments:]))
            sent[f"call{index}"] = len(call.arguments)
    return events


async def response_events(shape: ResponseShape, choices: Choices) -> AsyncGenerator[str, None]:
    """The stream's events (the trailing ``[DONE]`` of :class:`~pipeline.server.http.sse.
    EventStream` excluded: the openai client stops at it)."""
    writer = _EventWriter(shape)
    running = shape.response("in_progress", [], None)
    yield writer.event("response.created", response=running)
    yield writer.event("response.in_progress", response=running)
    sent: dict[str, int] = {"reasoning": 0}
    async with contextlib.aclosing(choices.outputs()) as outputs:
        async for _, output in outputs:
            for item in _parts(writer, output, sent):
                yield item
            if output.finished:
                status = _status(output)
                if not writer.items and writer.open is None:
                    # NOTE: an empty answer is still one (empty) message, as whole_response
                    for item in writer.start(
                        ("message", 0), _message_item(_new_id("msg"), None, "in_progress")
                    ):
                        yield item
                for item in writer.close(status):
                    yield item
                final = shape.response(status, writer.items, output)
                # NOTE: response.completed also when the token limit cut the answer (its
                # status says "incomplete"), as vLLM streams
                # (vllm/entrypoints/openai/serving_responses.py): the openai client's
                # responses.stream finishes only on response.completed
                yield writer.event("response.completed", response=final)
