"""The request bodies' models: strict types, fail-fast lists, and the ``param`` and message a
body that does not fit is refused with."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from pipeline.server.http.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    describe_problem,
)


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **fields})


def test_types_are_strict() -> None:
    """A bool is not an int and a string is not a number; an int is a float, as in JSON."""
    for fields in ({"max_tokens": True}, {"top_p": "0.5"}, {"n": 1.0}, {"stream": 1}):
        with pytest.raises(pydantic.ValidationError):
            completion(**fields)
    assert completion(temperature=1).temperature == 1.0


@pytest.mark.parametrize(
    ("model", "body", "param", "message"),
    [
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt",
         "prompt: must be one of: str, list[str], list[int], list[list[int]]"),
        (CompletionRequest, {"prompt": "x", "stop": [1]}, "stop", "stop: must be one of: str"),
        (ChatCompletionRequest, {"messages": [{"role": 1}]}, "messages[0].role",
         "messages[0].role: Input should be a valid string"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": 3}]}]},
         "messages[0].content", "messages[0].content: must be one of: str"),
        (CompletionRequest, {"prompt": "x", "top_p": "high"}, "top_p",
         "top_p: Input should be a valid number"),
    ],
)  # fmt: skip
def test_a_body_that_does_not_fit_names_the_field(
    model: type[pydantic.BaseModel], body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        model.model_validate({"model": "m", **body})
    named, said = describe_problem(caught.value.errors())
    assert named == param and said.startswith(message)


def test_a_long_list_of_the_wrong_items_is_refused_at_its_first() -> None:
    """fail-fast: one error, not one per item and union member."""
    with pytest.raises(pydantic.ValidationError) as caught:
        CompletionRequest.model_validate({"model": "m", "prompt": [1] * 100_000 + ["x"]})
    assert len(caught.value.errors()) <= 4  # one per member of the union
