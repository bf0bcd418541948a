"""Tool-call and reasoning parsers (pure): each format read whole and streamed piece by
piece (the same calls; content and arguments only grow), malformed regions kept as content;
the tool checks of the validation core, the grammar of ``required`` / a named function, and
the chat rendering with the model's template (and the default preamble for a template that
ignores tools)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import tomllib

import plugins
from pipeline.engine.prompts import check_prompt
from stages.errors import InvalidRequestError
from stages.messages import ChatMessage, ToolCall, ToolSpec
from stages.params import SamplingParams
from stages.reasoning_parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from stages.structured.params import StructuredOutputsParams
from stages.tokenize import load_tokenizer, render_messages, template_renders_tools
from stages.tool_parsers import parser_for
from stages.tools import BUILTIN_PARSERS, ToolUse, load_parser, tool_constraint

WEATHER = ToolSpec(
    "get_weather",
    "the weather in a city",
    json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)
TIME = ToolSpec("get_time", "", json.dumps({"type": "object", "properties": {}}))

# (parser, output, content, calls)
CASES: list[tuple[str, str, str, list[tuple[str, Any]]]] = [
    (
        "hermes",
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"when": {"day": 1}}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}'
        "</tool_call>",
        "Let me check. \n",
        [("get_weather", {"city": "Paris", "when": {"day": 1}}), ("get_time", {})],
    ),
    (
        "hermes",
        'a <tool_call>{"arguments": {"x": "}{"}, "name": "f"}</tool_call> b',
        "a  b",
        [("f", {"x": "}{"})],
    ),
    ("hermes", "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    ("hermes", "x <tool_ca", "x <tool_ca", []),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        "",
        [("f", {"x": 1}), ("g", {})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"s": "a\\"b"}}',
        "",
        [("f", {"s": 'a"b'})],
    ),
    ("llama3_json", 'hello {"name": "f"}', 'hello {"name": "f"}', []),
    (
        "mistral",
        'ok [TOOL_CALLS][{"name": "f", "arguments": {"x": "]"}}, {"name": "g", "arguments": {}}]',
        "ok ",
        [("f", {"x": "]"}), ("g", {})],
    ),
    ("mistral", "ok [TOOL_CALLS] nothing", "ok [TOOL_CALLS] nothing", []),
    ("generic", '[{"name": "f", "arguments": {"x": 1}}]', "", [("f", {"x": 1})]),
    (
        "generic",
        'Sure <tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>',
        "Sure ",
        [("f", {"x": [1, 2]})],
    ),
    ("generic", "plain words", "plain words", []),
    (
        "json_list",
        '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {"y": "z"}}]',
        "",
        [("f", {"x": 1}), ("g", {"y": "z"})],
    ),
]


def read(parser: Any, text: str, step: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """Feed ``text`` ``step`` characters at a time, then finish; each state seen."""
    states = []
    for start in range(0, len(text), step):
        parser.feed(text[start : start + step])
        states.append((parser.content, [(call.name, call.arguments) for call in parser.calls]))
    parser.finish()
    states.append((parser.content, [(call.name, call.arguments) for call in parser.calls]))
    return states


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_each_format_read_whole_and_streamed(
    name: str, text: str, content: str, calls: list[tuple[str, Any]], step: int
) -> None:
    states = read(parser_for(name), text, step)
    final_content, final_calls = states[-1]
    assert final_content == content
    assert [(call_name, json.loads(arguments)) for call_name, arguments in final_calls] == calls
    # streamed: content and each call's arguments only grow, names never change
    for (before, before_calls), (after, after_calls) in itertools.pairwise(states):
        assert after.startswith(before)
        assert len(after_calls) >= len(before_calls)
        for (old_name, old_arguments), (new_name, new_arguments) in zip(before_calls, after_calls):
            assert new_name == old_name
            assert new_arguments.startswith(old_arguments)


def test_a_call_appears_with_its_name_and_its_arguments_grow() -> None:
    parser = parser_for("hermes")
    parser.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [(call.name, call.arguments) for call in parser.calls] == [("get_weather", '{"ci')]
    first_id = parser.calls[0].id
    assert first_id.startswith("call_") and len(first_id) == 29
    parser.feed('ty": "Paris"}')  # the trailing } may close the outer object: held back
    assert parser.calls[0].arguments == '{"city": "Paris"'
    parser.feed("}</tool_call>")
    assert parser.calls[0].arguments == '{"city": "Paris"}'
    assert parser.calls[0].id == first_id


def test_the_named_function_parser_takes_the_whole_output_as_arguments() -> None:
    states = read(parser_for("named", function="get_weather"), ' {"city": "Paris"} ', 2)
    assert states[-1] == ("", [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        (Qwen3ReasoningParser, "<think>\nhmm</think>\n\nHello", "\nhmm", "\n\nHello"),
        (Qwen3ReasoningParser, "Hello <think>x</think>", "", "Hello <think>x</think>"),
        (Qwen3ReasoningParser, "<thi", "", "<thi"),
        (DeepSeekR1ReasoningParser, "step 1</think>answer", "step 1", "answer"),
        (DeepSeekR1ReasoningParser, "<think>a</think>b", "a", "b"),
        (DeepSeekR1ReasoningParser, "still thinking </thi", "still thinking </thi", ""),
    ],
)
@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_reasoning_parsers(
    parser: type[Any], text: str, reasoning: str, content: str, step: int
) -> None:
    made = parser()
    seen = [("", "")]
    for start in range(0, len(text), step):
        made.feed(text[start : start + step])
        seen.append((made.reasoning, made.content))
    made.finish()
    seen.append((made.reasoning, made.content))
    assert seen[-1] == (reasoning, content)
    for (r0, c0), (r1, c1) in itertools.pairwise(seen):
        assert r1.startswith(r0) and c1.startswith(c0)


def test_parsers_are_plugins_registered_in_pyproject() -> None:
    """The built-in table (for an install whose metadata predates the groups) is exactly
    what pyproject.toml registers, and each loads and fits its group's protocol."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    points = project["project"]["entry-points"]
    for group, table in BUILTIN_PARSERS.items():
        assert points[group] == table
        for name in table:
            assert load_parser(group, name).name == name
    with pytest.raises(plugins.PluginNotFoundError, match="no-such"):
        load_parser(plugins.TOOL_PARSERS, "no-such")


def messages(*extra: ChatMessage) -> list[ChatMessage]:
    return [ChatMessage("user", "Weather in Paris?"), *extra]


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        (ToolUse((WEATHER, ToolSpec("bad name!", "", ""))), "tools[1].function.name"),
        (ToolUse((WEATHER, WEATHER)), "tools[1].function.name"),
        (ToolUse((ToolSpec("f", "", "[1]"),)), "tools[0].function.parameters"),
        (ToolUse((ToolSpec("f", "", "{nope"),)), "tools[0].function.parameters"),
        (ToolUse((WEATHER,), "get_time"), "tool_choice"),
        (ToolUse((), "required"), "tool_choice"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tools: ToolUse, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt(messages(), SamplingParams(), tools=tools)
    assert caught.value.field == field
    assert field in str(caught.value)


def test_tools_need_chat_messages_and_no_other_constraint() -> None:
    with pytest.raises(InvalidRequestError, match="needs chat messages"):
        check_prompt("Hi", SamplingParams(), tools=ToolUse((WEATHER,)))
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt(messages(), constrained, tools=ToolUse((WEATHER,), "required"))
    assert caught.value.field == "tool_choice"


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (ChatMessage("tool", "42"), "messages[1].tool_call_id"),
        (ChatMessage("user", "", (ToolCall("c", "f", "{}"),)), "messages[1].tool_calls"),
        (
            ChatMessage("assistant", "", (ToolCall("c", "f", "not json"),)),
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_messages_are_refused_naming_the_field(message: ChatMessage, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt(messages(message), SamplingParams())
    assert caught.value.field == field


def test_the_required_and_named_grammars() -> None:
    required = tool_constraint((WEATHER, TIME), "required", parallel=False)
    assert required is not None and required.json is not None
    schema = json.loads(required.json)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], good * 2,
                [{"name": "get_weather", "parameters": {}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = tool_constraint((WEATHER, TIME), "get_weather", parallel=True)
    assert named is not None and json.loads(named.json or "") == json.loads(WEATHER.parameters)
    assert tool_constraint((WEATHER,), "auto", parallel=True) is None


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function.name }};{% endfor %}</tools>"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}[call {{ call.function.name }} "
    "{{ call.function.arguments.city }}]{% endfor %}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_that_renders_tools_gets_them(default_model_dir: Path) -> None:
    """transformers hands ``tools`` to the template; a call's arguments reach it as a dict."""
    tokenizer = load_tokenizer(str(default_model_dir))
    tokenizer.chat_template = TOOL_TEMPLATE
    assert template_renders_tools(tokenizer)
    history = messages(
        ChatMessage("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Rome"}'),)),
        ChatMessage("tool", "sunny", tool_call_id="c1"),
    )
    text = tokenizer.decode(render_messages(tokenizer, history, (WEATHER, TIME)))
    assert text == (
        "<tools>get_weather;get_time;</tools><user>Weather in Paris?</user>"
        "<assistant>[call get_weather Rome]</assistant><tool>sunny</tool><assistant>"
    )


def test_a_template_that_ignores_tools_gets_the_default_preamble(
    default_model_dir: Path,
) -> None:
    """SmolLM2's template ignores tools: they go in a system preamble, calls and results in
    the Hermes format."""
    tokenizer = load_tokenizer(str(default_model_dir))
    assert not template_renders_tools(tokenizer)
    history = messages(
        ChatMessage("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Rome"}'),)),
        ChatMessage("tool", "sunny", tool_call_id="c1"),
    )
    text = tokenizer.decode(render_messages(tokenizer, history, (WEATHER,)))
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather", "description": "the weather in a city"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in (
        text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
