"""From request bodies to engine requests (pure: no engine, no server): each choice's prompt
and sampling parameters, the defaults of each endpoint, seeds per choice, and the 400s that
name their field."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.engine.prompts import check_prompt
from pipeline.server.http.errors import ApiError
from pipeline.server.http.requests import SEED_RANGE, plan_chat, plan_completion
from pipeline.server.http.schema import (
    MAX_CHOICES,
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
)
from stages.errors import InvalidRequestError
from stages.messages import ChatMessage

MESSAGES = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def refused(make: Any, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        plan = plan_chat if make is chat else plan_completion
        plan(make(**fields))
    assert caught.value.status == 400
    return caught.value


def test_completion_defaults_to_16_tokens_and_chat_to_the_model_length() -> None:
    ((prompt, params),) = plan_completion(completion()).choices
    assert prompt == "Hi" and params.max_tokens == 16 and params.logprobs is None
    ((messages, params),) = plan_chat(chat()).choices
    assert messages == (ChatMessage("user", "Hi"),) and params.max_tokens is None
    # max_completion_tokens wins over the older max_tokens
    ((_, params),) = plan_chat(chat(max_tokens=5, max_completion_tokens=7)).choices
    assert params.max_tokens == 7


def test_sampling_fields_and_vllm_extensions_reach_the_parameters() -> None:
    plan = plan_completion(
        completion(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1,
                   presence_penalty=0.5, frequency_penalty=-0.5, min_tokens=2, ignore_eos=True,
                   stop="END", stop_token_ids=[7], seed=3, logprobs=2)
    )  # fmt: skip
    ((_, params),) = plan.choices
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 5, 0.1)
    assert (params.repetition_penalty, params.presence_penalty) == (1.1, 0.5)
    assert (params.frequency_penalty, params.min_tokens, params.ignore_eos) == (-0.5, 2, True)
    assert params.stop == ("END",) and params.stop_token_ids == (7,)
    assert params.seed == 3 and params.logprobs == plan.logprobs == 2


def test_choice_j_of_each_prompt_samples_with_seed_plus_j() -> None:
    plan = plan_completion(completion(prompt=["a", "b"], n=3, seed=SEED_RANGE - 2))
    assert plan.per_prompt == 3
    assert [prompt for prompt, _ in plan.choices] == ["a"] * 3 + ["b"] * 3
    assert [params.seed for _, params in plan.choices] == [SEED_RANGE - 2, SEED_RANGE - 1, 0] * 2
    unseeded = plan_chat(chat(n=2))
    assert [params.seed for _, params in unseeded.choices] == [None, None]


def test_the_four_prompt_forms() -> None:
    assert [p for p, _ in plan_completion(completion(prompt="x")).choices] == ["x"]
    assert [p for p, _ in plan_completion(completion(prompt=["x", "y"])).choices] == ["x", "y"]
    assert [p for p, _ in plan_completion(completion(prompt=[5, 6])).choices] == [[5, 6]]
    assert [p for p, _ in plan_completion(completion(prompt=[[5], [6]])).choices] == [[5], [6]]


def test_chat_roles_and_text_parts() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    ((prompt, _),) = plan_chat(chat(messages=messages)).choices
    assert prompt == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "ab"),
        ChatMessage("assistant", ""),
    )


def test_chat_logprobs_need_logprobs_true() -> None:
    assert plan_chat(chat(logprobs=True)).logprobs == 0
    assert plan_chat(chat(logprobs=True, top_logprobs=3)).logprobs == 3
    assert plan_chat(chat()).logprobs is None
    assert refused(chat, top_logprobs=2).param == "top_logprobs"
    assert refused(chat, logprobs=True, top_logprobs=21).param == "top_logprobs"


def test_usage_chunk_only_with_stream_options() -> None:
    assert plan_chat(chat(stream=True, stream_options={"include_usage": True})).include_usage
    assert not plan_chat(chat(stream=True)).include_usage
    assert refused(chat, stream_options={"include_usage": True}).param == "stream_options"


@pytest.mark.parametrize(
    ("make", "fields", "param"),
    [
        (completion, {"n": 0}, "n"),
        (completion, {"n": MAX_N + 1}, "n"),
        (completion, {"prompt": ["x"] * 5, "n": MAX_N}, "n"),
        (completion, {"prompt": ["x"] * (MAX_CHOICES + 1)}, "prompt"),
        (completion, {"prompt": []}, "prompt"),
        (completion, {"best_of": 2}, "best_of"),
        (completion, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (completion, {"suffix": "x"}, "suffix"),
        (chat, {"messages": []}, "messages"),
        (chat, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        (chat, {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        (chat, {"tool_choice": "sometimes"}, "tool_choice"),
        (chat, {"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)  # fmt: skip
def test_a_refusal_names_its_field(make: Any, fields: dict[str, Any], param: str) -> None:
    assert refused(make, **fields).param == param


@pytest.mark.parametrize(
    ("make", "fields", "param"),
    [
        (completion, {"temperature": -1.0}, "temperature"),
        (completion, {"logprobs": 21}, "logprobs"),
        (completion, {"seed": -1, "n": 2}, "seed"),
        (chat, {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_a_sampling_value_is_a_400_from_the_engines_core_naming_its_field(
    make: Any, fields: dict[str, Any], param: str
) -> None:
    """The plan translates the body; the engine's validation core checks each choice, once
    (HttpService.check, docs/architecture.md §7.1), and its error is the 400. A seed out of
    range is passed on as it is (not wrapped into range) for the core to refuse."""
    plan = plan_chat(make(**fields)) if make is chat else plan_completion(make(**fields))
    with pytest.raises(InvalidRequestError) as caught:
        for prompt, params in plan.choices:
            check_prompt(prompt, params)
    answer = ApiError.from_error(caught.value)
    assert (answer.status, answer.param) == (400, param)
