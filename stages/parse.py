"""The parse stage: a chat request's output read for reasoning and tool calls, after
stop-check (docs/architecture.md §2.8).

Ports: ``in`` takes the :class:`~stages.messages.EngineRequest` of each request (from
tokenize's ``track``; one with ``parsing`` set is followed), the
:class:`~stages.messages.RequestOutputs` of stop-check and the caller's
:class:`~stages.messages.AbortRequests`; ``out`` sends the outputs on, those of followed
requests rewritten: ``text``/``delta`` the content only, ``reasoning`` and ``tool_calls``
cumulative (:class:`~stages.messages.RequestOutput`), and a request that called a tool and
stopped finishes with ``"tool_calls"``. Outputs of other requests pass through untouched.

Each followed request gets its own reasoning parser (then) tool-call parser, plugins of
``actorline.reasoning_parsers`` and ``actorline.tool_parsers`` named on the request
(:class:`~stages.messages.OutputParsing`); ``tool_choice: "required"`` and a named function
use the parsers of the JSON their grammar enforces (:mod:`stages.tool_parsers`).

A request whose parsing fails (a plugin raised) fails alone: its output carries the error as
a rejection, and the others go on (docs/architecture.md §7.2).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import plugins
from pipeline.runtime.stage import Stage, handles, recoverable
from stages.messages import (
    AbortRequests,
    EngineRequest,
    OutputParsing,
    RequestOutput,
    RequestOutputs,
    RequestRejected,
)
from stages.recovery import rejection
from stages.tool_parsers import JsonListToolParser, NamedFunctionParser
from stages.tools import load_parser

__all__ = ["ParseStage"]


class _Followed:
    """A followed request's parsers and what it has sent so far."""

    __slots__ = ("content", "fed", "parallel", "reasoning", "tools")

    def __init__(self, parsing: OutputParsing) -> None:
        self.reasoning: Any = None
        if parsing.reasoning_parser:
            self.reasoning = load_parser(plugins.REASONING_PARSERS, parsing.reasoning_parser)()
        self.tools: Any = None
        if parsing.tool_choice == "function":
            self.tools = NamedFunctionParser(parsing.function)
        elif parsing.tool_choice == "required":
            self.tools = JsonListToolParser()
        elif parsing.tool_parser:
            self.tools = load_parser(plugins.TOOL_PARSERS, parsing.tool_parser)()
        self.content = ""  # the content sent so far
        self.fed = 0  # the reasoning parser's content the tool parser has read
        self.parallel = parsing.parallel

    def read(self, output: RequestOutput) -> RequestOutput:
        """``output`` with its text read: content, reasoning and calls so far."""
        text = output.delta
        reasoning = ""
        if self.reasoning is not None:
            self.reasoning.feed(text)
            if output.finished:
                self.reasoning.finish()
            reasoning = self.reasoning.reasoning
            text = self.reasoning.content[self.fed :]
            self.fed = len(self.reasoning.content)
        calls: tuple[Any, ...] = ()
        if self.tools is not None:
            self.tools.feed(text)
            if output.finished:
                self.tools.finish()
            content = self.tools.content
            calls = tuple(self.tools.calls if self.parallel else self.tools.calls[:1])
        else:
            content = self.content + text
        delta = content[len(self.content) :]
        self.content = content
        finish_reason = output.finish_reason
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return dataclasses.replace(
            output,
            text=content,
            delta=delta,
            reasoning=reasoning,
            tool_calls=calls,
            finish_reason=finish_reason,
        )


class ParseStage(Stage):
    inputs = ("in",)
    outputs = ("out",)

    def __init__(self, config: object = None) -> None:
        super().__init__(config)
        self._followed: dict[str, _Followed] = {}

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        if request.parsing is not None:
            self._followed[request.request_id] = _Followed(request.parsing)

    @handles(RequestOutputs)
    async def on_outputs(self, batch: RequestOutputs) -> None:
        followed = self._followed
        if not followed:
            await self.emit("out", batch)
            return
        outputs: list[RequestOutput] = []
        failed: list[RequestRejected] = list(batch.rejected)
        for rejected in batch.rejected:
            followed.pop(rejected.request_id, None)
        for output in batch.outputs:
            state = followed.get(output.request_id)
            if state is None:
                outputs.append(output)
                continue
            try:
                outputs.append(state.read(output))
            except Exception as error:
                if not recoverable(error):
                    raise
                self.contained(error, batch, output.request_id)
                del followed[output.request_id]
                failed.append(rejection(self.name, output.request_id, error, abort=True))
                continue
            if output.finished:
                del followed[output.request_id]
        await self.emit("out", RequestOutputs(tuple(outputs), tuple(failed), stats=batch.stats))

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        # NOTE: a final "abort" output may still come from stop-check; it passes through
        for request_id in abort.request_ids:
            self._followed.pop(request_id, None)

    async def recover(self, message: Any, port: str, error: Exception) -> bool:
        """A request whose parsers could not be made (an unknown plugin) is answered with a
        typed error; the engine runs it on until its caller's stream is closed."""
        if isinstance(message, EngineRequest):
            await self.emit(
                "out",
                RequestOutputs((), rejected=(rejection(self.name, message.request_id, error),)),
            )
            return True
        return False
