"""``echo`` and vLLM's ``prompt_logprobs`` on the real HTTP front end, with the official
``openai`` client (the shared server of :mod:`tests.pipeline.server.http.conftest`, the tiny
model): the echoed prompt's scores are HF's log-softmax of the same model, shaped as OpenAI and
vLLM shape them (the first token's null), whole and streamed, with ``max_tokens`` 0 as
lm-evaluation-harness sends it; and the plan's translation and refusals (pure)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

from pipeline.server.http.errors import ApiError
from pipeline.server.http.requests import plan_chat, plan_completion
from pipeline.server.http.schema import ChatCompletionRequest, CompletionRequest
from tests.pipeline.engine.test_prompt_logprobs import hf_logprobs
from tests.pipeline.server.http.conftest import API_KEY, MODEL
from tests.pipeline.server.serving import ServeProcess

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, tokenizer: Any) -> tuple[list[int], torch.Tensor]:
    ids = tokenizer.encode(PROMPT)
    return ids, hf_logprobs(tiny_model_dir, ids)


def post(serve: ServeProcess, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        serve.base_url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def check_prompt_part(
    logprobs: Any, ids: list[int], table: torch.Tensor, tokenizer: Any, top: int
) -> None:
    """The first ``len(ids)`` entries of a completion's ``logprobs`` are the prompt's: its
    tokens, null for the first, HF's logprobs and top alternatives for the others."""
    assert logprobs.tokens[: len(ids)] == [tokenizer.decode([i]) for i in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(ids)):
        row = table[position - 1]
        score = row[ids[position]].item()
        assert logprobs.token_logprobs[position] == pytest.approx(score, abs=1e-4)
        best = row.topk(top)
        shown = logprobs.top_logprobs[position]
        assert sorted(shown.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)
    assert logprobs.text_offset[0] == 0


def test_echo_with_max_tokens_zero_as_lm_eval_sends_it(
    client: openai.OpenAI, expected: tuple[list[int], torch.Tensor], tokenizer: Any
) -> None:
    ids, table = expected
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    (choice,) = answer.choices
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == len(ids)
    check_prompt_part(choice.logprobs, ids, table, tokenizer, 1)
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), 0)


def test_echo_with_generation_and_token_prompts(
    client: openai.OpenAI, expected: tuple[list[int], torch.Tensor], tokenizer: Any
) -> None:
    """The prompt's entries, then exactly what the same request without echo answers; the
    same prompt twice (the second in the prefix cache) scores the same; a prompt of token ids
    echoes its decoded text."""
    ids, table = expected
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, logprobs=2, max_tokens=4, temperature=0
    ).choices[0]
    for prompt in (PROMPT, PROMPT, ids):
        (choice,) = client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0
        ).choices
        prompt_text = PROMPT if isinstance(prompt, str) else tokenizer.decode(ids)
        assert choice.text == prompt_text + plain.text
        assert choice.logprobs is not None and plain.logprobs is not None
        check_prompt_part(choice.logprobs, ids, table, tokenizer, 2)
        assert choice.logprobs.tokens[len(ids) :] == plain.logprobs.tokens
        assert choice.logprobs.token_logprobs[len(ids) :] == pytest.approx(
            plain.logprobs.token_logprobs, abs=1e-5
        )
    (no_logprobs,) = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, temperature=0
    ).choices
    assert no_logprobs.text == PROMPT + plain.text and no_logprobs.logprobs is None


def test_streamed_echo_sends_the_prompt_first(
    client: openai.OpenAI, expected: tuple[list[int], torch.Tensor], tokenizer: Any
) -> None:
    ids, table = expected
    whole = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Hi"], echo=True, logprobs=1, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=[PROMPT, "Hi"], echo=True, logprobs=1, max_tokens=5,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    for index, expected_choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        prompt = PROMPT if index == 0 else "Hi"
        assert mine[0].text.startswith(prompt)
        assert "".join(part.text for part in mine) == expected_choice.text
        tokens = [t for part in mine if part.logprobs for t in part.logprobs.tokens]
        offsets = [o for part in mine if part.logprobs for o in part.logprobs.text_offset]
        assert expected_choice.logprobs is not None
        assert tokens == expected_choice.logprobs.tokens
        assert offsets == expected_choice.logprobs.text_offset
        assert mine[0].logprobs is not None and mine[0].logprobs.token_logprobs[0] is None
        if index == 0:
            check_prompt_part(mine[0].logprobs, ids, table, tokenizer, 1)
    only = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts = [c.choices[0].text for c in only if c.choices]
    assert "".join(texts) == PROMPT
    assert only[-1].usage is not None and only[-1].usage.completion_tokens == 0


def test_vllm_prompt_logprobs_field(
    openai_serve: ServeProcess, expected: tuple[list[int], torch.Tensor], tokenizer: Any
) -> None:
    ids, table = expected
    status, answer = post(
        openai_serve,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2},
    )
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert choice["logprobs"] is None and choice["text"] != ""
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for position in range(1, len(ids)):
        entry = scores[position]
        token = entry[str(ids[position])]
        assert next(iter(entry)) == str(ids[position])  # the prompt's token first
        score = table[position - 1][ids[position]].item()
        assert token["logprob"] == pytest.approx(score, abs=1e-4)
        assert token["decoded_token"] == tokenizer.decode([ids[position]])
        # then the top 2 (one fewer where the prompt's token is one of them), ranks 1 and 2
        top_ranks = [alternative["rank"] for alternative in list(entry.values())[1:]]
        assert len(entry) in (2, 3) and set(top_ranks) <= {1, 2}
        assert top_ranks == sorted(top_ranks)
    status, chat = post(
        openai_serve,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
         "prompt_logprobs": 0},
    )  # fmt: skip
    assert status == 200, chat
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "stream": True, "prompt_logprobs": 1},
         "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
         "stream": True, "prompt_logprobs": 0}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
         "echo": True}, "echo"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(
    openai_serve: ServeProcess, path: str, body: dict[str, Any], param: str
) -> None:
    status, answer = post(openai_serve, path, {"model": MODEL, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


def test_plan_of_echo() -> None:
    def plan(**fields: Any) -> Any:
        return plan_completion(CompletionRequest.model_validate({"prompt": "a", **fields}))

    only = plan(echo=True, max_tokens=0, logprobs=1)
    ((_, params),) = only.choices
    assert (only.echo, only.echo_only, params.max_tokens, params.prompt_logprobs) == (
        True, True, 1, 1,
    )  # fmt: skip
    ((_, params),) = plan(echo=True, logprobs=3, prompt_logprobs=0).choices
    assert (params.logprobs, params.prompt_logprobs) == (3, 0)
    ((_, params),) = plan(echo=True).choices
    assert params.prompt_logprobs is None  # no logprobs asked: nothing to score
    ((_, params),) = plan(echo=False, logprobs=1).choices
    assert params.prompt_logprobs is None
    chat = plan_chat(
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 2}
        )
    )
    assert chat.prompt_logprobs == 2 and chat.choices[0][1].prompt_logprobs == 2
    with pytest.raises(ApiError) as caught:
        plan(stream=True, prompt_logprobs=0)
    assert caught.value.param == "prompt_logprobs"
