"""The translation of a ``/v1/responses`` body (:mod:`pipeline.server.http.responses`): it
plans to exactly the engine requests of the chat body it means, and a refusal names the
Responses field. (Served through the real server: ``test_responses.py``.)"""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.server.http.errors import ApiError
from pipeline.server.http.requests import plan_chat
from pipeline.server.http.responses import parse_responses_body, plan_responses, responses_param
from pipeline.server.http.schema import ChatCompletionRequest

PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}


def test_a_body_plans_to_the_chat_body_it_means() -> None:
    responses_body: Any = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Time? "},
                                         {"type": "input_text", "text": "Now."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_time",
             "arguments": '{"zone": "UTC"}', "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time",
             "arguments": '{"zone": "CET"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
            {"type": "function_call_output", "call_id": "call_2", "output": "13:00"},
            {"type": "message", "role": "assistant", "id": "msg_1",
             "content": [{"type": "output_text", "text": "Noon.", "annotations": []}]},
        ],
        "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "tools": [{"type": "function", "name": "get_time", "parameters": PARAMETERS,
                   "strict": True}],
        "tool_choice": {"type": "function", "name": "get_time"},
        "parallel_tool_calls": False, "store": False,
    }  # fmt: skip
    call = {"type": "function", "function": {"name": "get_time"}}
    chat_body: Any = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Time? Now."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", **call, "function": {"name": "get_time",
                                                      "arguments": '{"zone": "UTC"}'}},
                {"id": "call_2", **call, "function": {"name": "get_time",
                                                      "arguments": '{"zone": "CET"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
            {"role": "tool", "tool_call_id": "call_2", "content": "13:00"},
            {"role": "assistant", "content": "Noon."},
        ],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "tools": [{"type": "function", "function": {"name": "get_time",
                                                    "parameters": PARAMETERS, "strict": True}}],
        "tool_choice": call, "parallel_tool_calls": False,
    }  # fmt: skip
    planned = plan_responses(parse_responses_body(responses_body))
    assert planned == plan_chat(ChatCompletionRequest.model_validate(chat_body))
    assert planned.tools is not None and planned.tools.choice == "get_time"


def test_an_answers_text_and_calls_are_one_assistant_turn() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    planned = plan_responses(parse_responses_body({"input": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look.", "id": "msg_1", "status": "completed"},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
    ]}))  # fmt: skip
    expected = plan_chat(ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]}))  # fmt: skip
    assert planned == expected


def test_a_string_input_and_a_json_schema_format() -> None:
    schema = {"type": "string"}
    planned = plan_responses(parse_responses_body({
        "input": "Hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
    }))  # fmt: skip
    expected = plan_chat(ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }))  # fmt: skip
    assert planned == expected
    assert planned.choices[0][1].structured_outputs is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "store": True}, "store"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
         "input[0].arguments"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x",
                                                   "annotations": [{"a": 1}]}]}]},
         "input[0].content[0].annotations"),
        ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"input": "x", "text": {"verbosity": "high"}}, "text.verbosity"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}, "colour": 1}}},
         "text.format"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "strict": True}]},
         "tools[0].strict"),
        ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_refusals_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        plan_responses(parse_responses_body(body))
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    assert caught.value.message.startswith(param), caught.value.message


@pytest.mark.parametrize(
    ("chat", "responses"),
    [
        ("max_tokens", "max_output_tokens"),
        ("max_completion_tokens", "max_output_tokens"),
        ("tools[3].function.parameters", "tools[3].parameters"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("response_format.type", "text.format.type"),
        ("response_format.json_schema", "text.format"),
        ("messages[2].content", "input"),
        ("temperature", "temperature"),
        (None, None),
    ],
)
def test_chat_params_are_renamed(chat: str | None, responses: str | None) -> None:
    assert responses_param(chat) == responses
