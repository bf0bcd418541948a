"""OpenAI's Responses API (``/v1/responses``) through the real server (the shared ``actorline
serve`` of :mod:`tests.pipeline.server.http.conftest`, the tiny random model) with the
official ``openai`` client: text answers equal to chat completions' at temperature 0,
``responses.stream``'s events in order and reassembling to the whole answer, function tools
(required, named, streamed) whose arguments follow their schemas, a tool-result round trip
rendered as chat completions render it, structured outputs, LangChain's
``use_responses_api=True``, and 400s naming the Responses field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.pipeline.server.http.conftest import API_KEY, MODEL
from tests.pipeline.server.http.test_tools import TOOLS
from tests.pipeline.server.serving import ServeProcess, bearer

#: the chat tools in the Responses shape (flat)
FLAT_TOOLS: Any = [{"type": "function", **tool["function"]} for tool in TOOLS]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in FLAT_TOOLS}
QUESTION = "What is the weather in Paris?"
#: the tool whose arguments the tiny random model finishes within 60 tokens (an enum; JSON's
#: whitespace between an object's tokens stays allowed, and a random model takes it often)
TIME_TOOL = FLAT_TOOLS[1]


def check_calls(items: Any, names: set[str]) -> list[Any]:
    calls = [item for item in items if item.type == "function_call"]
    assert calls, f"no function_call item in {items}"
    for call in calls:
        assert call.call_id.startswith("call_") and call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_a_text_answer_is_the_chat_completion_of_the_same_messages(
    client: openai.OpenAI,
) -> None:
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hello there", max_output_tokens=12,
        temperature=0.0,
    )  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0.0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello there"}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"


def test_a_stream_has_the_events_in_order_and_the_whole_answer(client: openai.OpenAI) -> None:
    fields: Any = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 16,
                   "temperature": 0.0}  # fmt: skip
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert final.status == whole.status
    assert [event.sequence_number for event in events] == list(range(len(events)))
    message = [
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    assert kinds[2:-1] == message
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert final.id == events[0].response.id


@pytest.mark.slow
def test_a_required_or_named_function_is_called_with_arguments_that_follow_its_schema(
    client: openai.OpenAI,
) -> None:
    required = client.responses.create(
        model=MODEL, input=QUESTION, tools=[TIME_TOOL], tool_choice="required",
        max_output_tokens=100, temperature=1.0, parallel_tool_calls=False,
    )  # fmt: skip
    check_calls(required.output, {"get_time"})
    named = client.responses.create(
        model=MODEL, input=QUESTION, tools=FLAT_TOOLS, max_output_tokens=60, temperature=1.0,
        tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
    )  # fmt: skip
    (call,) = check_calls(named.output, {"get_time"})
    assert named.status == "completed" and named.output == [call]


@pytest.mark.slow
def test_a_streamed_call_reassembles_to_its_final_item(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input=QUESTION, tools=FLAT_TOOLS, max_output_tokens=100, temperature=1.0,
        tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    (call,) = check_calls(final.output, {"get_time"})
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done[0].arguments == call.arguments
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"] and added[0].name == "get_time"


def test_a_tool_result_round_trip_is_rendered_as_chat_completions_render_it(
    client: openai.OpenAI,
) -> None:
    arguments = '{"city": "Paris", "days": 1}'
    response = client.responses.create(
        model=MODEL, tools=FLAT_TOOLS, max_output_tokens=4, temperature=0.0,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        ],
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_tokens=4, temperature=0.0,
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
    )  # fmt: skip
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens > 100
    assert response.output_text == (chat.choices[0].message.content or "")


def test_text_format_json_schema_is_enforced(client: openai.OpenAI) -> None:
    # a top-level string: the random model finishes it (tests/.../test_structured.py)
    schema = {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}
    response = client.responses.create(
        model=MODEL, input="A code?", max_output_tokens=24, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "code", "schema": schema,
                         "strict": True}},
    )  # fmt: skip
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"colour": "blue"}, "colour"),
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].name"),
        ({"tools": [{"type": "web_search", "name": "w"}]}, "tools[0].type"),
        ({"tools": [{**FLAT_TOOLS[0], "strict": True}]}, "tools[0].strict"),
        ({"tools": [{**FLAT_TOOLS[0], "colour": 1}]}, "tools[0].colour"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_the_field(
    openai_serve: ServeProcess, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, **fields}
    answer = httpx.post(
        f"{openai_serve.http_url}/responses", json=body, headers=bearer(API_KEY), timeout=30
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param) or param in error["message"], error


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="Hi", max_output_tokens=1)


def test_langchain_use_responses_api(openai_serve: ServeProcess) -> None:
    """LangChain's ``ChatOpenAI(use_responses_api=True)``: invoke and stream answer the
    openai client's text; a named tool call, then its result (LangChain sends the call and
    the answer's items back) and a text answer (sent back in the next turn)."""
    import langchain_openai  # installed by the dev extra (pyproject.toml)
    from langchain_core.messages import HumanMessage, ToolMessage

    chat = langchain_openai.ChatOpenAI(
        base_url=openai_serve.http_url, api_key=API_KEY, model=MODEL, max_tokens=8,
        temperature=0.0, use_responses_api=True,
    )  # fmt: skip
    message = chat.invoke("Hello there")
    expected = openai.OpenAI(base_url=openai_serve.http_url, api_key=API_KEY).responses.create(
        model=MODEL, input="Hello there", max_output_tokens=8, temperature=0.0
    )
    assert message.text == expected.output_text
    streamed = "".join(chunk.text for chunk in chat.stream("Hello there"))
    assert streamed == expected.output_text
    longer = chat.model_copy(update={"max_tokens": 100, "temperature": 1.0})
    called = longer.bind_tools(TOOLS, tool_choice="get_time").invoke(QUESTION)
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_time", called
    jsonschema.validate(called.tool_calls[0]["args"], SCHEMAS["get_time"])
    history: Any = [
        HumanMessage(QUESTION),
        called,
        ToolMessage("12:00", tool_call_id=called.tool_calls[0]["id"]),
    ]
    answer = chat.bind_tools(TOOLS).invoke(history)
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0
    again = chat.bind_tools(TOOLS).invoke([*history, answer, HumanMessage("And tomorrow?")])
    assert again.usage_metadata is not None
    assert again.usage_metadata["input_tokens"] > answer.usage_metadata["input_tokens"]


@pytest.mark.slow
def test_reasoning_items_whole_and_streamed(reasoning_serve: ServeProcess) -> None:
    """``actorline serve --reasoning-parser deepseek_r1`` (a random model writes no
    ``</think>``, so all it writes is reasoning): one ``reasoning`` item whose
    ``reasoning_text`` the stream's deltas reassemble (greedy, so the same text)."""
    with openai.OpenAI(base_url=reasoning_serve.http_url, api_key="none", max_retries=0) as client:
        fields: Any = dict(model=MODEL, input=QUESTION, max_output_tokens=10,
                           temperature=0.0)  # fmt: skip
        whole = client.responses.create(**fields)
        (item,) = whole.output
        assert item.type == "reasoning" and item.content and item.content[0].text
        with client.responses.stream(**fields) as stream:
            events = list(stream)
            final = stream.get_final_response()
        deltas = "".join(
            getattr(event, "delta", "") for event in events
            if event.type == "response.reasoning_text.delta"
        )  # fmt: skip
        assert deltas == item.content[0].text
        assert [i.type for i in final.output] == ["reasoning"]
        assert final.output[0].content[0].text == deltas
