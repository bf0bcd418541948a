"""Request options of vLLM and OpenAI that change what is generated, through the real HTTP
front end with the official ``openai`` client (the shared server of
:mod:`tests.pipeline.server.http.conftest`), and their translation and refusals (pure: no
engine): vLLM's legacy ``guided_*`` aliases of ``structured_outputs``."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from pipeline.engine.prompts import check_prompt
from pipeline.server.http.errors import ApiError
from pipeline.server.http.requests import plan_chat, plan_completion
from pipeline.server.http.schema import ChatCompletionRequest, CompletionRequest
from stages.errors import InvalidRequestError
from stages.structured.params import StructuredOutputsParams
from tests.pipeline.server.http.conftest import MODEL

MESSAGES: Any = [{"role": "user", "content": "Hi"}]


def chat_plan(**fields: Any) -> Any:
    return plan_chat(ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields}))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("guided_json", {"type": "string"}, StructuredOutputsParams(json='{"type": "string"}')),
        ("guided_regex", "[0-9]+", StructuredOutputsParams(regex="[0-9]+")),
        ("guided_choice", ["yes", "no"], StructuredOutputsParams(choice=("yes", "no"))),
        ("guided_grammar", 'start: "x"', StructuredOutputsParams(grammar='start: "x"')),
    ],
)
def test_guided_fields_are_aliases_of_structured_outputs(
    field: str, value: Any, expected: StructuredOutputsParams
) -> None:
    plan = chat_plan(**{field: value})
    ((_, params),) = plan.choices
    assert params.structured_outputs == expected
    assert plan.deprecated == (field,)
    completion = plan_completion(CompletionRequest.model_validate({"prompt": "a", field: value}))
    assert completion.choices[0][1].structured_outputs == expected


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "give one of"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "not both"),
        ({"guided_json": {}, "response_format": {"type": "json_object"}}, "guided_json",
         "not both"),
        # the engine's validation core names the key the alias stands for
        ({"guided_choice": "yes"}, "structured_outputs.choice", "list of strings"),
    ],
)  # fmt: skip
def test_guided_fields_refused_with_another_constraint(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(ApiError) as caught:
        plan = chat_plan(**fields)
        for prompt, params in plan.choices:
            try:
                check_prompt(prompt, params)
            except InvalidRequestError as error:
                raise ApiError.from_error(error) from None
    assert caught.value.status == 400
    assert caught.value.param == param
    assert words in str(caught.value)


def test_guided_choice_over_http_constrains_and_warns(client: openai.OpenAI) -> None:
    """``guided_choice`` through the real server: every answer is one of the choices, and the
    response carries the deprecation ``Warning`` header (whole and streamed)."""
    choices = ["red", "green", "blue"]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=1,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert "guided_choice" in raw.headers["warning"]
    chat = raw.parse()
    assert [choice.message.content in choices for choice in chat.choices] == [True] * 3
    with client.completions.with_streaming_response.create(
        model=MODEL, prompt="Colour:", max_tokens=8, stream=True,
        extra_body={"guided_regex": "(yes|no)"},
    ) as streamed:  # fmt: skip
        assert "guided_regex" in streamed.headers["warning"]
        text = "".join(chunk.choices[0].text for chunk in streamed.parse() if chunk.choices)
    assert text in ("yes", "no")
