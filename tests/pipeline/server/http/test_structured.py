"""``response_format`` and vLLM's ``structured_outputs`` extra → the request's constraint
(pure: no engine), the 400s that name their field, and ``response_format`` JSON schemas sent
with the official ``openai`` client to the real HTTP front end (the shared server of
:mod:`tests.pipeline.server.http.conftest`) answered with JSON that validates."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from pipeline.engine.prompts import check_prompt
from pipeline.server.http.errors import ApiError
from pipeline.server.http.requests import plan_chat, plan_completion
from pipeline.server.http.schema import ChatCompletionRequest, CompletionRequest
from stages.errors import InvalidRequestError
from stages.structured.params import StructuredOutputsParams
from tests.pipeline.server.http.conftest import MODEL

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}, "required": ["b"]}


def chat_constraint(**fields: Any) -> StructuredOutputsParams | None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    )
    ((_, params),) = plan_chat(body).choices
    return params.structured_outputs


def refusal(**fields: Any) -> ApiError:
    """The 400 of a chat body: from its translation (the plan), or from the engine's
    validation core that checks each choice once before any starts (HttpService.check)."""
    with pytest.raises(ApiError) as caught:
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
        )
        for prompt, params in plan_chat(body).choices:
            try:
                check_prompt(prompt, params)
            except InvalidRequestError as error:
                raise ApiError.from_error(error) from None
    assert caught.value.status == 400
    return caught.value


def test_response_format_forms() -> None:
    assert chat_constraint(response_format={"type": "text"}) is None
    assert chat_constraint(response_format={"type": "json_object"}) == StructuredOutputsParams(
        json_object=True
    )
    constraint = chat_constraint(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "thing", "strict": True, "schema": SCHEMA},
        }
    )
    assert constraint is not None and json.loads(constraint.json or "") == SCHEMA
    assert list(json.loads(constraint.json or "")["properties"]) == ["b", "a"]  # order kept


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"json": SCHEMA}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"json": '{"type": "string"}'}, StructuredOutputsParams(json='{"type": "string"}')),
        ({"regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ({"choice": ["a", "b"]}, StructuredOutputsParams(choice=("a", "b"))),
        ({"grammar": 'start: "x"'}, StructuredOutputsParams(grammar='start: "x"')),
        (
            {"json_object": True, "disable_any_whitespace": True},
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        ),
        (
            {"json": '{"type": "object"}', "disable_additional_properties": True},
            StructuredOutputsParams(json='{"type": "object"}', disable_additional_properties=True),
        ),
    ],
)
def test_the_structured_outputs_extra(extra: dict[str, Any], expected: Any) -> None:
    assert chat_constraint(structured_outputs=extra) == expected
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "Hi", "structured_outputs": extra}
    )
    ((_, params),) = plan_completion(body).choices
    assert params.structured_outputs == expected


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema",
            "unknown key",
        ),
        ({"structured_outputs": ["regex"]}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "not valid JSON"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_malformed_constraints_are_400s_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    error = refusal(**fields)
    assert error.param == param and words in str(error)


#: schemas the tiny random model can finish within a few tokens: JSON's whitespace between an
#: object's or array's tokens is allowed (no ``disable_any_whitespace`` in ``response_format``)
#: and a random model takes it as often as anything else, so these are top-level values
SERVED_SCHEMAS: dict[str, dict[str, Any]] = {
    "a date string": {"type": "string", "format": "date"},
    "a patterned string": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "an integer range or an enum": {
        "anyOf": [{"type": "integer", "minimum": 10, "maximum": 99}, {"enum": ["north", None]}]
    },
}


def valid(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` is JSON valid under ``schema``, string formats checked."""
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
    return validator.is_valid(json.loads(text))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SERVED_SCHEMAS))
def test_a_json_schema_response_format_over_http_validates(
    client: openai.OpenAI, name: str
) -> None:
    """``response_format={"type": "json_schema", ...}`` through the real server: the answer
    parses and validates, sampled (temperature 1, two seeded choices, streamed and not)."""
    schema = SERVED_SCHEMAS[name]
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": name.replace(" ", "_"), "strict": True, "schema": schema},
    }
    messages: Any = [{"role": "user", "content": "Answer in JSON."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=1.0, n=2, seed=3,
        response_format=response_format,
    )  # fmt: skip
    assert len(chat.choices) == 2
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice
        assert valid(choice.message.content or "", schema), choice.message.content
    texts = ["", ""]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=1.0, n=2, seed=4,
        response_format=response_format, stream=True,
    )  # fmt: skip
    for chunk in stream:
        for streamed in chunk.choices:
            texts[streamed.index] += streamed.delta.content or ""
    assert all(valid(text, schema) for text in texts), texts
