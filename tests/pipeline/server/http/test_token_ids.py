"""vLLM's ``return_token_ids`` through the real HTTP front end (the shared server of
:mod:`tests.pipeline.server.http.conftest`) with the official ``openai`` client: completions
carry ``prompt_token_ids`` and ``token_ids`` on each choice, chat carries
``prompt_token_ids`` on the response and ``token_ids`` on each choice (vLLM's placement,
``vllm/entrypoints/openai/*/protocol.py``); streamed, the prompt's once and each chunk's new
tokens, which add up to the whole answer's. The ids agree with the tokenizer and with the
text; without the field no answer carries them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.pipeline.server.http.conftest import MODEL

pytestmark = pytest.mark.slow

FIELDS = {"return_token_ids": True, "ignore_eos": True}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_completions_carry_prompt_and_answer_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    answer = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Hi"], max_tokens=4, n=2, seed=3, extra_body=FIELDS
    )
    assert len(answer.choices) == 4
    for index, choice in enumerate(answer.choices):
        extra = choice.model_extra or {}
        prompt = PROMPT if index < 2 else "Hi"
        assert extra["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=True)
        assert len(extra["token_ids"]) == 4
        assert tokenizer.decode(extra["token_ids"]) == choice.text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_completion_stream_sends_the_prompt_once_and_new_tokens(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, seed=5, temperature=1.0, extra_body=FIELDS
    )
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, seed=5, temperature=1.0, stream=True,
        extra_body=FIELDS,
    )  # fmt: skip
    prompts, tokens = [], []
    for chunk in stream:
        extra = chunk.choices[0].model_extra or {}
        prompts.append(extra["prompt_token_ids"])
        tokens.extend(extra["token_ids"])
    assert prompts[0] == tokenizer.encode(PROMPT, add_special_tokens=True)
    assert all(ids is None for ids in prompts[1:])
    assert tokens == (whole.choices[0].model_extra or {})["token_ids"]


def test_chat_carries_prompt_ids_on_the_response(client: openai.OpenAI, tokenizer: Any) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, extra_body=FIELDS
    )
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert (answer.model_extra or {})["prompt_token_ids"] == expected
    choice_ids = (answer.choices[0].model_extra or {})["token_ids"]
    assert len(choice_ids) == 5 and answer.usage is not None
    assert answer.usage.completion_tokens == 5

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True,
        extra_body=FIELDS,
    )  # fmt: skip
    chunks = list(stream)
    assert (chunks[0].model_extra or {})["prompt_token_ids"] == expected
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]]
    assert streamed == choice_ids  # greedy: the same tokens
