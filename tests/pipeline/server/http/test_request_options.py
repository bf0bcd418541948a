"""Request options of vLLM and OpenAI that change what is generated, through the real HTTP
front end with the official ``openai`` client (the shared server of
:mod:`tests.pipeline.server.http.conftest`), and their translation and refusals (pure: no
engine): vLLM's legacy ``guided_*`` aliases of ``structured_outputs``; OpenAI's
``logit_bias``, vLLM's ``allowed_token_ids`` and ``bad_words``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import openai
import pytest
from transformers import AutoTokenizer

from pipeline.engine.prompts import check_prompt
from pipeline.server.http.errors import ApiError
from pipeline.server.http.requests import plan_chat, plan_completion
from pipeline.server.http.schema import ChatCompletionRequest, CompletionRequest
from stages.errors import InvalidRequestError
from stages.structured.params import StructuredOutputsParams
from stages.tokenize import bad_words_token_ids
from tests.pipeline.server.http.conftest import API_KEY, MODEL
from tests.pipeline.server.serving import ServeProcess, bearer

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


# ---------------------------------------------------------------- logit_bias, token rules


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def one_token(tokenizer: Any, text: str) -> int:
    """The id of the one token that spells ``text``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1 and tokenizer.decode(ids) == text, (text, ids)
    return int(ids[0])


def greedy_text(client: openai.OpenAI, max_tokens: int, **extra: Any) -> str:
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    return completion.choices[0].text


PROMPT = "The colour of the sky is"


def test_logit_bias_bans_and_forces_over_http(client: openai.OpenAI, tokenizer: Any) -> None:
    """-100 on the greedy token changes it; +100 on a token makes every token that one."""
    first = greedy_text(client, 1)
    greedy_id = one_token(tokenizer, first)
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0,
        logit_bias={str(greedy_id): -100},
    )  # fmt: skip
    assert banned.choices[0].text != first
    forced_id = one_token(tokenizer, " blue")
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=2,
        logit_bias={str(forced_id): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == " blue" * 5
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"5": 101})
    assert caught.value.body["param"] == "logit_bias"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"1000000": 1})
    assert "vocabulary" in caught.value.message


def test_allowed_token_ids_restrict_every_token_over_http(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    allowed = [one_token(tokenizer, "a"), one_token(tokenizer, "b")]
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=4, seed=5,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )  # fmt: skip
    texts = [choice.text for choice in completion.choices]
    assert all(len(text) == 8 and set(text) <= {"a", "b"} for text in texts), texts
    assert completion.usage is not None and completion.usage.completion_tokens == 32
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"allowed_token_ids": []})
    assert caught.value.body["param"] == "allowed_token_ids"  # type: ignore[index]


def test_bad_words_are_not_generated_over_http(client: openai.OpenAI, tokenizer: Any) -> None:
    """Among the allowed tokens "a" and "b", the bad word "a" leaves only "b" (sampled)."""
    allowed = [one_token(tokenizer, "a"), one_token(tokenizer, "b")]
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=9,
        extra_body={"allowed_token_ids": allowed, "bad_words": ["a"], "ignore_eos": True},
    )  # fmt: skip
    assert [choice.text for choice in completion.choices] == ["bbbbbb"] * 3
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"bad_words": [" "]})
    assert caught.value.body["param"] == "bad_words"  # type: ignore[index]


def test_bad_words_tokenize_as_vllms(tokenizer: Any) -> None:
    """vLLM's rule (``update_from_tokenizer``): the word without leading spaces, and with one
    space where that is as many tokens but others."""
    a, spaced_a = one_token(tokenizer, "a"), one_token(tokenizer, " a")
    assert bad_words_token_ids(tokenizer, ["a", "  a"]) == ((a,), (spaced_a,))
    bare = tuple(tokenizer.encode("coincides", add_special_tokens=False))
    assert len(bare) > 1 and len(tokenizer.encode(" coincides", add_special_tokens=False)) == 1
    assert bad_words_token_ids(tokenizer, [" coincides"]) == (bare,)


def test_token_rules_over_grpc(openai_serve: ServeProcess, tokenizer: Any) -> None:
    """The Generation service carries them too: allowed ids with one banned by a bad word
    and another biased down; a logit bias outside [-100, 100] is INVALID_ARGUMENT naming it."""
    from pipeline.server import generation_pb2 as pb
    from pipeline.server import generation_pb2_grpc

    a, b, c = (one_token(tokenizer, letter) for letter in "abc")
    params = pb.SamplingParams(
        max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=[a, b, c],
        bad_words=["a"], logit_bias={c: -100.0},
    )  # fmt: skip
    metadata = bearer(API_KEY)

    async def main() -> tuple[list[Any], grpc.aio.AioRpcError]:
        assert openai_serve.address is not None
        async with grpc.aio.insecure_channel(openai_serve.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(text=PROMPT, sampling_params=params)
            responses = [r async for r in stub.Generate(request, metadata=metadata)]
            bad = pb.GenerateRequest(
                text=PROMPT, sampling_params=pb.SamplingParams(logit_bias={a: 200.0})
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(bad, metadata=metadata):
                    pass
            return responses, caught.value

    responses, refused = asyncio.run(main())
    assert "".join(r.delta for r in responses) == "bbbbb"
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias" in (refused.details() or "")


# ---------------------------------------------------------------- truncate_prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    """The prompt's last k tokens are the prompt: usage counts k, and the answer is the one
    of those k tokens sent alone (greedy); chat truncates the rendered template."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    assert len(ids) > 3
    truncated = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0,
        extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True},
    )  # fmt: skip
    alone = client.completions.create(
        model=MODEL, prompt=ids[-3:], max_tokens=4, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert truncated.usage is not None and truncated.usage.prompt_tokens == 3
    assert truncated.choices[0].text == alone.choices[0].text
    longer = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": 1000}
    )
    assert longer.usage is not None and longer.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"truncate_prompt_tokens": 2}
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 0}
        )
    assert caught.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


# ---------------------------------------------------------------- continuous usage


def test_continuous_usage_stats_on_every_chunk(client: openai.OpenAI) -> None:
    """Each chunk carries its choice's usage so far (the chat's opening chunk: no tokens
    yet); the counts grow to the final usage chunk's, which is unchanged."""
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, n=2, seed=1, stream=True,
            stream_options=options, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    *body, final = chunks
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == 10
    seen = {0: 0, 1: 0}
    for chunk in body:
        (choice,) = chunk.choices
        assert chunk.usage is not None
        assert chunk.usage.prompt_tokens == final.usage.prompt_tokens
        assert chunk.usage.completion_tokens >= seen[choice.index]
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        seen[choice.index] = chunk.usage.completion_tokens
    assert seen == {0: 5, 1: 5}
    chat = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, stream=True, stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    counts = [chunk.usage.completion_tokens for chunk in chat[:-1] if chunk.usage]
    assert len(counts) == len(chat) - 1 and counts[0] == 0 and counts[-1] == 3
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt=PROMPT, stream=True,
            stream_options={"continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )  # fmt: skip
    assert caught.value.body["param"] == "stream_options.continuous_usage_stats"  # type: ignore[index]
