"""Tool calling through the real server (the shared ``actorline serve`` of
:mod:`tests.pipeline.server.http.conftest`, the tiny random model) with the official
``openai`` client: ``tool_choice`` required and a named function answer with calls whose
arguments parse and follow the function's schema, ``finish_reason == "tool_calls"``, the
streamed deltas reassemble to the same call; a tool-result round trip is accepted and
rendered; bad tools are 400s naming the field. ``auto`` on a model's own format is covered by
the parser tests (a random model calls no tool by itself). LangChain's ``bind_tools`` /
``with_structured_output(method="function_calling")`` and litellm's tools run where those
packages are installed."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import grpc
import grpc.aio
import jsonschema
import openai
import pytest

from tests.pipeline.server.http.conftest import API_KEY, MODEL
from tests.pipeline.server.serving import ServeProcess, bearer

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    """The calls a stream's deltas make (by index) and its finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id:
                    assert not call["id"], "the id comes once, first"
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.slow
def test_a_named_function_is_called_with_arguments_that_follow_its_schema(
    client: openai.OpenAI,
) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    check_calls(calls, {"get_weather"})
    # the same request streamed: the id and name first, then the arguments as generated
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
    )  # fmt: skip
    streamed, finish = streamed_calls(stream)
    assert finish == "tool_calls"
    assert list(streamed) == [0]
    assert streamed[0]["name"] == "get_weather" and streamed[0]["id"].startswith("call_")
    assert streamed[0]["arguments"] == calls[0].function.arguments  # same seed, same call


@pytest.mark.slow
def test_required_makes_at_least_one_call_streamed_alike(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80,
        temperature=1.0, seed=5, parallel_tool_calls=False,
    )  # fmt: skip
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, set(SCHEMAS))
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80,
        temperature=1.0, seed=5, parallel_tool_calls=False, stream=True,
    )  # fmt: skip
    streamed, finish = streamed_calls(stream)
    assert finish == "tool_calls"
    (only,) = streamed.values()
    expected = choice.message.tool_calls[0]
    assert (only["name"], only["arguments"]) == (
        expected.function.name,
        expected.function.arguments,
    )


def test_a_tool_result_round_trip_is_accepted_and_rendered(
    client: openai.OpenAI, openai_serve: ServeProcess
) -> None:
    """The history of a call and its result goes to the model: /tokenize shows it rendered
    (SmolLM2's template ignores tools: the default preamble and Hermes format)."""
    history: Any = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0.0
    )
    assert chat.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert chat.usage is not None
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0.0
    )
    assert plain.usage is not None
    # the preamble, the call and its result make the prompt longer
    assert chat.usage.prompt_tokens > plain.usage.prompt_tokens + 100


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "ok"}},
                    {"type": "function", "function": {"name": "no spaces"}}]},
         "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
         "tools[0].function.strict"),
        ({"tools": [{"type": "function", "function": {"name": "f", "color": 1}}]},
         "tools[0].function.color"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, **body)
    assert caught.value.param == param, caught.value.body


def test_langchain_bind_tools_and_structured_output(openai_serve: ServeProcess) -> None:
    import langchain_openai  # installed by the dev extra (pyproject.toml)

    chat = langchain_openai.ChatOpenAI(
        base_url=openai_serve.http_url, api_key=API_KEY, model=MODEL, max_tokens=60,
        temperature=1.0, seed=2,
    )  # fmt: skip
    bound = chat.bind_tools(TOOLS, tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER_SCHEMA)
    structured = chat.with_structured_output(
        {"title": "get_weather", "description": "weather", **WEATHER_SCHEMA},
        method="function_calling",
    )
    jsonschema.validate(structured.invoke("Paris?"), WEATHER_SCHEMA)


def test_litellm_tools(openai_serve: ServeProcess) -> None:
    # NOTE: litellm fetches a price list from GitHub at import unless told to use its own
    # copy; the machine has no network beyond the package registries
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm  # installed by the dev extra (pyproject.toml)

    response = litellm.completion(
        model=f"openai/{MODEL}", api_base=openai_serve.http_url, api_key=API_KEY,
        messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, seed=3,
    )  # fmt: skip
    calls = response.choices[0].message.tool_calls
    assert calls and calls[0].function.name in SCHEMAS
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


@pytest.mark.slow
def test_a_named_call_over_grpc(openai_serve: ServeProcess) -> None:
    """The same tools over the Generation service: the proto's tools and tool_choice in, the
    calls (cumulative) and FINISH_REASON_TOOL_CALLS out; a bad tool is INVALID_ARGUMENT."""
    from pipeline.server import generation_pb2 as pb
    from pipeline.server import generation_pb2_grpc

    tools = [
        pb.Tool(
            name=tool["function"]["name"], parameters=json.dumps(tool["function"]["parameters"])
        )
        for tool in TOOLS
    ]
    conversation = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather?")])
    params = pb.SamplingParams(max_tokens=60, temperature=1.0, seed=7)

    async def main() -> tuple[list[Any], grpc.aio.AioRpcError]:
        assert openai_serve.address is not None
        async with grpc.aio.insecure_channel(openai_serve.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                messages=conversation, sampling_params=params, tools=tools,
                tool_choice="get_weather",
            )  # fmt: skip
            responses = [r async for r in stub.Generate(request, metadata=bearer(API_KEY))]
            bad = pb.GenerateRequest(
                messages=conversation, sampling_params=params, tool_choice="required"
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(bad, metadata=bearer(API_KEY)):
                    pass
            return responses, caught.value

    responses, refused = asyncio.run(main())
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    (call,) = last.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert "".join(r.delta for r in responses) == ""
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_choice" in (refused.details() or "")


@pytest.mark.slow
def test_a_reasoning_parser_served(reasoning_serve: ServeProcess) -> None:
    """``actorline serve --reasoning-parser deepseek_r1``: the answer's
    ``reasoning_content``, and the stream's ``delta.reasoning_content`` pieces reassembling to
    it (greedy, so the same text)."""
    with openai.OpenAI(base_url=reasoning_serve.http_url, api_key="none", max_retries=0) as client:
        fields: Any = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0.0,
                           extra_body={"ignore_eos": True})  # fmt: skip
        whole = client.chat.completions.create(**fields)
        message = whole.choices[0].message
        reasoning = getattr(message, "reasoning_content", None)
        # deepseek_r1: a random model writes no </think>, so all of it is reasoning
        assert reasoning and message.content == ""
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**fields, stream=True):
            for choice in chunk.choices:
                for key in streamed:
                    streamed[key] += getattr(choice.delta, key, None) or ""
        assert streamed == {"reasoning_content": reasoning, "content": ""}
