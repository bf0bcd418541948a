"""OpenAI's Responses API (``POST /v1/responses``), stateless: a body is translated into the
chat-completions body it means and planned by
:func:`~pipeline.server.http.requests.plan_chat` (the same engine requests, the same tool
plumbing, checked once by the engine's validation core); its answer is the ``response``
object (:mod:`~pipeline.server.http.response_output`).

The translation (docs/serving.md, "Responses API"):

- ``instructions`` → a first ``system`` message; ``input`` a string → one ``user`` message;
  ``input`` a list of items → ``message`` items (roles ``user``, ``system``, ``developer``,
  ``assistant``; content a string or ``input_text`` / ``output_text`` parts), consecutive
  ``function_call`` items → the ``tool_calls`` (``call_id`` the id) of one assistant message
  (the assistant message just before them, if there is one),
  ``function_call_output`` → a ``tool`` message;
- ``max_output_tokens`` → ``max_completion_tokens``; ``temperature``, ``top_p``,
  ``parallel_tool_calls``, ``stream`` as they are; ``tools`` (flat function tools) and
  ``tool_choice`` (``{"type": "function", "name"}``) → chat's nested forms;
  ``text.format`` → ``response_format``.

Nothing is stored: ``store: true``, ``previous_response_id``, ``conversation`` and
``background: true`` are 400s naming the field, as is any field not served (the same rule as
the other endpoints: nothing sent is silently ignored). A refusal planning or checking the
chat body names the Responses field (``max_output_tokens``, ``tools[0].strict``; ``input``
for a message's).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.server.http.errors import ApiError
from pipeline.server.http.requests import Plan, check_extras, plan_chat
from pipeline.server.http.schema import ChatCompletionRequest

__all__ = [
    "RESPONSES_ACCEPTED_AT",
    "FunctionToolBody",
    "ResponsesRequest",
    "TextBody",
    "echoed",
    "parse_responses_body",
    "plan_responses",
    "renamed",
    "responses_param",
]

_BODY = ConfigDict(extra="allow", strict=True)

#: Responses fields not implemented, accepted only at the values that ask for nothing this
#: server lacks (OpenAI's defaults or a no-op); any other value is a 400 naming the field
RESPONSES_ACCEPTED_AT: dict[str, tuple[object, ...]] = {
    "store": (False, None),  # nothing is stored: a later request cannot refer to this one
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (False, None),
    "include": ([], None),
    "metadata": ({}, None),
    "reasoning": (None,),
    "truncation": ("disabled", None),
    "service_tier": ("auto", "default", None),
    "top_logprobs": (0, None),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "stream_options": (None,),
}
#: roles of a message item (``developer`` is OpenAI's new ``system``)
_ROLES = ("user", "system", "developer", "assistant")
#: content part types of a message item, all text
_TEXT_PARTS = ("input_text", "output_text")


class FunctionToolBody(BaseModel):
    """A function tool in the Responses shape (flat: no nested ``function``)."""

    model_config = _BODY

    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextBody(BaseModel):
    """``text``: the answer's ``format`` (``text``, ``json_object``, or ``json_schema`` with
    ``name``, ``schema``, ``description``, ``strict``)."""

    model_config = _BODY

    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (None: not given). ``input`` items are plain JSON
    objects, translated item by item (:func:`plan_responses`)."""

    model_config = _BODY

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionToolBody] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextBody | None = None
    stream: bool = False
    #: accepted and ignored, as on the other endpoints: rate limits follow the API key
    user: str | None = None


def _location(location: Sequence[int | str]) -> str | None:
    """The ``param`` of a validation error's location (union members' names dropped)."""
    param = ""
    for part in location:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in ("str", "list[dict[str,any]]", "dict[str,any]", "function-after"):
            param += f".{part}" if param else part
    return param or None


def parse_responses_body(raw: Any) -> ResponsesRequest:
    """The Responses body of the JSON value ``raw``.

    Raises:
        ApiError: 400 naming the first field that does not fit.
    """
    if not isinstance(raw, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_value")
    try:
        return ResponsesRequest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _location(first["loc"])
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        raise ApiError(400, message, param=param, code="invalid_value") from None


def _refuse(param: str, problem: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {problem}", param=param, code=code)


def _text_of(content: Any, where: str) -> str:
    """The text of a message item's ``content``: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where}.content", "must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _refuse(
                at, f"only input_text and output_text parts are supported, got {kind!r:.40}",
                "unsupported_value",
            )  # fmt: skip
        text = part.get("text")
        if not isinstance(text, str):
            raise _refuse(f"{at}.text", "must be a string")
        # NOTE: an output_text part echoed back carries annotations and logprobs; empty
        # ones say nothing
        extras = {k: v for k, v in part.items() if k not in ("type", "text")}
        check_extras(extras, {"annotations": ([], None), "logprobs": ([], None)}, f"{at}.")
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _refuse(f"{where}.{key}", f"must be a string, got {type(value).__name__}")
    return value


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``.

    Raises:
        ApiError: 400 naming an input item of an unknown type or shape.
    """
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    if not body.input:
        raise _refuse("input", "must not be empty")
    # item fields that only echo what this server answered (ids and statuses)
    echoed: dict[str, tuple[object, ...]] = {"id": (), "status": ()}
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _refuse(
                    f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r:.40}"
                )
            _check_item(item, ("type", "role", "content"), where, echoed)
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            _check_item(item, ("type", "call_id", "name", "arguments"), where, echoed)
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            # NOTE: an answer's text and calls are one assistant turn (as chat's message)
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _check_item(item, ("type", "call_id", "output"), where, echoed)
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text}
            )
        else:
            raise _refuse(
                f"{where}.type",
                "only message, function_call and function_call_output items are supported, "
                f"got {kind!r:.40}",
                "unsupported_value",
            )
    return messages


def _check_item(
    item: dict[str, Any],
    known: tuple[str, ...],
    where: str,
    echoed: dict[str, tuple[object, ...]] | None = None,
) -> None:
    """Refuse an item's fields beside ``known`` (``echoed``: accepted at any value)."""
    extras = {key: value for key, value in item.items() if key not in known}
    for key in echoed or {}:
        extras.pop(key, None)
    check_extras(extras, {}, f"{where}.")


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if body.tools is None:
        return None
    tools = []
    for index, tool in enumerate(body.tools):
        check_extras(tool.model_extra, {}, f"tools[{index}].")
        if tool.type != "function":
            raise _refuse(
                f"tools[{index}].type",
                f"only function tools are supported, got {tool.type!r:.40}",
                "unsupported_value",
            )
        function = tool.model_dump(exclude={"type"}, exclude_none=True)
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    check_extras({k: v for k, v in choice.items() if k not in ("type", "name")}, {}, "tool_choice.")
    if choice.get("type") != "function":
        raise _refuse("tool_choice.type", f"must be 'function', got {choice.get('type')!r:.40}")
    return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}


def _response_format(text: TextBody | None) -> dict[str, Any] | None:
    if text is None:
        return None
    check_extras(text.model_extra, {"verbosity": ("medium", None)}, "text.")
    spec = text.format
    if spec is None or spec.get("type") != "json_schema":
        return spec  # text, json_object, or a bad type the chat plan refuses
    schema = {key: value for key, value in spec.items() if key != "type"}
    return {"type": "json_schema", "json_schema": schema}


def plan_responses(body: ResponsesRequest) -> Plan:
    """The plan of a ``/v1/responses`` body: the chat body it means, planned as chat
    completions are.

    Raises:
        ApiError: 400 naming the Responses field that is invalid or asks for what is not
            served.
    """
    check_extras(body.model_extra, RESPONSES_ACCEPTED_AT)
    chat: dict[str, Any] = {"messages": _messages(body), "stream": body.stream}
    fields = {
        "model": body.model,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": _tools(body),
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
    }
    chat.update({name: value for name, value in fields.items() if value is not None})
    try:
        return plan_chat(ChatCompletionRequest.model_validate(chat))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = responses_param(_location(first["loc"]))
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        raise ApiError(400, message, param=param, code="invalid_value") from None
    except ApiError as exc:
        raise renamed(exc) from None


#: chat-completions params → the Responses field they came from (first match wins)
_RENAMES = (
    (re.compile(r"^max_completion_tokens|^max_tokens"), "max_output_tokens"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^response_format\.json_schema$"), "text.format"),
    (re.compile(r"^response_format\.json_schema\.|^response_format\."), "text.format."),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^messages(\[\d+\])?.*"), "input"),
    (re.compile(r"^prompt$|^prompt_token_ids$"), "input"),
)


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat-completions ``param`` names (None stays None)."""
    if param is None:
        return None
    for pattern, replacement in _RENAMES:
        renamed_param, count = pattern.subn(replacement, param, count=1)
        if count:
            return renamed_param
    return param


def renamed(error: ApiError) -> ApiError:
    """``error`` naming the Responses field where it named a chat-completions one."""
    param = responses_param(error.param)
    if param == error.param or error.param is None or param is None:
        return error
    message = error.message.replace(error.param, param, 1)
    return ApiError(
        error.status, message, error_type=error.error_type, param=param, code=error.code,
        headers=error.headers,
    )  # fmt: skip


def echoed(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings a ``response`` object carries back (OpenAI's fields)."""
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "parallel_tool_calls": True
        if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "text": {
            "format": (body.text.format if body.text and body.text.format else {"type": "text"})
        },
        "store": False,
        "metadata": {},
        "previous_response_id": None,
        "reasoning": None,
        "truncation": "disabled",
        "user": body.user,
    }
