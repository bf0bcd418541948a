"""Tool calling, engine side (pure logic): the functions a chat request offers the model, the
check of them and of the tool messages of its history (called by the validation core,
:func:`stages.validation.validate_generate_request`), the grammar that enforces
``tool_choice: "required"`` or a named function, the default tool preamble for chat templates
that ignore ``tools``, and how the parse stage reads the output (:class:`OutputParsing`).

``tool_choice`` (as OpenAI and vLLM define it): ``"none"`` (the model answers in text; the
tools are still rendered), ``"auto"`` (the model may call; the calls are parsed from its output
by the model's tool-call parser), ``"required"`` (at least one call: the output is a JSON list
of ``{"name", "parameters"}`` objects, each function's parameters following its schema,
enforced by structured outputs), or a function's name (exactly that function: the output is
its arguments, enforced likewise). The two enforced forms follow vLLM
(``vllm/entrypoints/openai/protocol.py``, ``_get_json_schema_from_tool``), so the answer
always parses whatever the model's own format.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Sequence
from typing import Any

import plugins
from stages.errors import InvalidRequestError
from stages.messages import ChatMessage, GenerateRequest, OutputParsing, ToolCall, ToolSpec
from stages.structured.params import MAX_SPEC_CHARS, StructuredOutputsParams

__all__ = [
    "BUILTIN_PARSERS",
    "MAX_TOOLS",
    "TOOL_CHOICE_MODES",
    "TOOL_PREAMBLE",
    "ToolUse",
    "check_tool_messages",
    "check_tool_use",
    "fallback_messages",
    "load_parser",
    "message_dicts",
    "message_from_dict",
    "output_parsing",
    "template_parser_hint",
    "tool_constraint",
    "tool_dicts",
    "tool_preamble",
    "tool_specs_of",
]

#: the tool_choice values that are not a function's name
TOOL_CHOICE_MODES = ("none", "auto", "required")
#: the most tools one request may offer (OpenAI's limit)
MAX_TOOLS = 128
#: a function's name: OpenAI's rule
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
#: the default preamble's head, for chat templates that ignore ``tools`` (Hermes' words, as
#: llama.cpp's generic format writes its own for templates without tool support)
TOOL_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_PREAMBLE_TAIL = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request says of tools: the functions, ``choice`` (a mode of
    :data:`TOOL_CHOICE_MODES` or a function's name) and whether several calls may be made at
    once. The façade copies it into the :class:`~stages.messages.GenerateRequest`."""

    tools: tuple[ToolSpec, ...] = ()
    choice: str = "auto"
    parallel: bool = True


def check_tool_use(request: GenerateRequest, request_id: str) -> None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``: tools only with
    chat messages, each a function with a valid unique name, text fields, and ``parameters``
    a JSON object schema; a choice that is a mode or one of the tools' names; an enforced
    choice not beside another structured-outputs constraint.

    Raises:
        InvalidRequestError: naming the field (``tools[1].function.name``, ``tool_choice``).
    """

    def fail(field: str, problem: str) -> None:
        raise InvalidRequestError(f"{field}: {problem}", field=field, request_id=request_id)

    tools, choice = request.tools, request.tool_choice
    if not isinstance(tools, tuple) or len(tools) > MAX_TOOLS:
        fail("tools", f"must be a list of at most {MAX_TOOLS} tools")
    if type(request.parallel_tool_calls) is not bool:
        fail("parallel_tool_calls", "must be a boolean")
    if not isinstance(choice, str):
        fail("tool_choice", "must be a string")
    if tools and request.messages is None:
        fail("tools", "needs chat messages (a plain prompt or token ids has no chat template)")
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}].function"
        if not isinstance(tool, ToolSpec):
            fail(f"tools[{index}]", "must be a function tool")
        if not isinstance(tool.name, str) or not _NAME.fullmatch(tool.name):
            fail(
                f"{where}.name", f"must be 1 to 64 letters, digits, _ . or -, got {tool.name!r:.70}"
            )
        if tool.name in names:
            fail(f"{where}.name", f"{tool.name!r} is offered twice")
        names.add(tool.name)
        if not isinstance(tool.description, str):
            fail(f"{where}.description", "must be a string")
        _check_schema(tool.parameters, f"{where}.parameters", fail)
    if not tools:
        if choice not in ("", "none"):
            fail("tool_choice", f"{choice!r:.70} needs tools")
        return
    if choice not in TOOL_CHOICE_MODES and choice not in names:
        fail(
            "tool_choice",
            f"{choice!r:.70} is neither one of {', '.join(TOOL_CHOICE_MODES)} nor a tool's name",
        )
    if choice not in ("none", "auto") and request.params.structured_outputs is not None:
        fail("tool_choice", f"{choice!r:.70} is enforced by a grammar; give no other constraint")


def _check_schema(text: object, field: str, fail: Any) -> None:
    if not isinstance(text, str):
        fail(field, "must be a JSON schema")
    assert isinstance(text, str)
    if not text:
        return
    if len(text) > MAX_SPEC_CHARS:
        fail(field, f"has more than {MAX_SPEC_CHARS} characters")
    try:
        schema = json.loads(text)
    except ValueError as error:
        fail(field, f"is not JSON: {error}")
    if not isinstance(schema, dict):
        fail(field, "must be a JSON schema object")


def check_tool_messages(messages: Sequence[ChatMessage], request_id: str) -> None:
    """The tool parts of chat messages: ``tool_calls`` only in assistant messages, each with
    an id, a name and arguments that are a JSON object (a chat template renders them);
    a ``tool`` message names the call it answers.

    Raises:
        InvalidRequestError: naming ``messages[i].tool_calls[j]...`` or
            ``messages[i].tool_call_id``.
    """

    def fail(field: str, problem: str) -> None:
        raise InvalidRequestError(f"{field}: {problem}", field=field, request_id=request_id)

    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message.tool_call_id, str):
            fail(f"{where}.tool_call_id", "must be a string")
        if not isinstance(message.tool_calls, tuple):
            fail(f"{where}.tool_calls", "must be a list of calls")
        if message.tool_calls and message.role != "assistant":
            fail(f"{where}.tool_calls", "only an assistant message makes tool calls")
        if message.role == "tool" and not message.tool_call_id:
            fail(f"{where}.tool_call_id", "a tool message must name the call it answers")
        for call_index, call in enumerate(message.tool_calls):
            call_where = f"{where}.tool_calls[{call_index}]"
            for name in ("id", "name", "arguments"):
                if not isinstance(getattr(call, name, None), str):
                    fail(f"{call_where}.{name}", "must be a string")
            if not call.name:
                fail(f"{call_where}.function.name", "must not be empty")
            try:
                arguments = json.loads(call.arguments)
            except ValueError as error:
                fail(f"{call_where}.function.arguments", f"is not JSON: {error}")
            if not isinstance(arguments, dict):
                fail(f"{call_where}.function.arguments", "must be a JSON object")


def tool_constraint(
    tools: Sequence[ToolSpec], choice: str, parallel: bool
) -> StructuredOutputsParams | None:
    """The grammar that enforces ``choice`` (None for ``none`` and ``auto``): for
    ``required``, a JSON list of one call (several with ``parallel``), each
    ``{"name": <a tool>, "parameters": <its arguments>}``; for a named function, its
    arguments (vLLM's shapes)."""
    if choice in ("", "none", "auto"):
        return None
    schemas = {tool.name: _parameters(tool) for tool in tools}
    # NOTE: no keys beyond a schema's properties, no whitespace between tokens: a function's
    # arguments are what its schema names (OpenAI's strict mode), in the fewest tokens
    if choice != "required":
        return _closed(schemas[choice])
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in schemas.items()
    ]
    listed: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        listed["maxItems"] = 1
    return _closed(listed)


def _closed(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=json.dumps(schema, ensure_ascii=False),
        disable_any_whitespace=True,
        disable_additional_properties=True,
    )


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    schema = json.loads(tool.parameters) if tool.parameters else {}
    return schema if schema else {"type": "object", "properties": {}}


def tool_preamble(tools: Sequence[ToolSpec]) -> str:
    """The system text that offers ``tools`` to a model whose chat template ignores them:
    each function's signature as OpenAI's tool JSON, and the ``<tool_call>`` format the
    ``generic`` and ``hermes`` parsers read."""
    lines = [
        json.dumps({"type": "function", "function": _tool_json(tool)}, ensure_ascii=False)
        for tool in tools
    ]
    return TOOL_PREAMBLE + "\n".join(lines) + "\n" + _PREAMBLE_TAIL


def _tool_json(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = _parameters(tool)
    return function


def tool_dicts(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """``tools`` as a chat template reads them (OpenAI's tool JSON)."""
    return [{"type": "function", "function": _tool_json(tool)} for tool in tools]


def template_parser_hint(template: str) -> str:
    """The tool-call parser a chat template's text suggests: ``hermes`` for ``<tool_call>``,
    ``mistral`` for ``[TOOL_CALLS]``, ``llama3_json`` for ``<|python_tag|>`` or Llama 3's
    ``"parameters"`` instructions, else ``generic``."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return "generic"


def output_parsing(
    request: GenerateRequest, tool_parser: str, reasoning_parser: str
) -> OutputParsing | None:
    """How the parse stage reads ``request``'s output (None: nothing to parse): tool calls
    when tools are offered and ``tool_choice`` is not ``none``; reasoning with a reasoning
    parser."""
    choice = request.tool_choice or ("auto" if request.tools else "none")
    calls = bool(request.tools) and choice != "none"
    if not calls and not reasoning_parser:
        return None
    if not calls:
        return OutputParsing(reasoning_parser=reasoning_parser)
    # NOTE: an enforced choice's output is the grammar's JSON from its first token: no
    # reasoning to read (a parser that starts in reasoning would take the JSON for it)
    parallel = request.parallel_tool_calls
    if choice == "auto":
        return OutputParsing(tool_parser, choice, "", reasoning_parser, parallel)
    if choice == "required":
        return OutputParsing(tool_parser, choice, parallel=parallel)
    return OutputParsing(tool_parser, "function", choice, parallel=parallel)


def message_from_dict(item: Any) -> ChatMessage:
    """A chat message from OpenAI's dict shape (``role``, ``content``, ``tool_calls`` of
    ``{"id", "function": {"name", "arguments"}}``, ``tool_call_id``). Values of the
    wrong type are kept as they are for the validation core to refuse, naming the field."""
    calls = []
    for call in item.get("tool_calls") or ():
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(call.get("id", ""), function.get("name", ""), arguments))
    content = item.get("content")
    return ChatMessage(
        item.get("role", "user"),
        "" if content is None else content,
        tuple(calls),
        item.get("tool_call_id") or "",
    )


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as a chat template reads them: OpenAI's shape, a call's arguments as a
    dict (as vLLM hands them to templates: ``vllm/entrypoints/chat_utils.py``)."""
    dicts: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.loads(call.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        dicts.append(item)
    return dicts


def fallback_messages(
    messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
) -> list[dict[str, Any]]:
    """``messages`` for a chat template that ignores ``tools``: the tool preamble joined to
    the system message (or one before the first message), an assistant's calls written into
    its content as ``<tool_call>`` lines, and a tool's result as a user message of
    ``<tool_response>`` (Hermes' and Qwen2.5's rendering of them)."""
    preamble = tool_preamble(tools) if tools else ""
    dicts: list[dict[str, Any]] = []
    for message in messages:
        content = message.content
        role = message.role
        if message.tool_calls:
            written = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": call.name, "arguments": json.loads(call.arguments)},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for call in message.tool_calls
            ]
            content = "\n".join([content, *written] if content else written)
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        dicts.append({"role": role, "content": content})
    if preamble:
        if dicts and dicts[0]["role"] == "system":
            dicts[0]["content"] = f"{dicts[0]['content']}\n\n{preamble}"
        else:
            dicts.insert(0, {"role": "system", "content": preamble})
    return dicts


#: the built-in parsers, as pyproject.toml registers them; read when the installed
#: metadata predates a group (an editable install not reinstalled since)
BUILTIN_PARSERS: dict[str, dict[str, str]] = {
    plugins.TOOL_PARSERS: {
        "hermes": "stages.tool_parsers:HermesToolParser",
        "llama3_json": "stages.tool_parsers:Llama3JsonToolParser",
        "mistral": "stages.tool_parsers:MistralToolParser",
        "generic": "stages.tool_parsers:GenericToolParser",
    },
    plugins.REASONING_PARSERS: {
        "deepseek_r1": "stages.reasoning_parsers:DeepSeekR1ReasoningParser",
        "qwen3": "stages.reasoning_parsers:Qwen3ReasoningParser",
    },
}


def load_parser(group: str, name: str) -> Any:
    """The parser class ``name`` of ``group`` (a plugin; a built-in also when the installed
    metadata does not list it yet).

    Raises:
        plugins.PluginError: no such parser, or it does not fit the group's protocol.
    """
    try:
        return plugins.load(group, name)
    except plugins.PluginNotFoundError:
        target = BUILTIN_PARSERS.get(group, {}).get(name)
        if target is None:
            raise
        module, _, attribute = target.partition(":")
        component = getattr(importlib.import_module(module), attribute)
        plugins.check(group, name, component)
        return component


def tool_specs_of(tools: Sequence[Any]) -> tuple[ToolSpec, ...]:
    """Functions given as :class:`~stages.messages.ToolSpec` or OpenAI's tool dicts
    (``{"type": "function", "function": {"name", "description", "parameters"}}``); values
    of the wrong type are kept for the validation core to refuse, naming the field."""
    specs = []
    for tool in tools:
        if isinstance(tool, ToolSpec):
            specs.append(tool)
            continue
        function: dict[str, Any] = tool.get("function", tool) if isinstance(tool, dict) else {}
        parameters = function.get("parameters")
        if isinstance(parameters, dict):
            parameters = json.dumps(parameters, ensure_ascii=False)
        specs.append(
            ToolSpec(function.get("name", ""), function.get("description") or "", parameters or "")
        )
    return tuple(specs)
