"""Tests of stages/tokenize.py: which prompts have tokens (as vLLM: whitespace does, "" not)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.errors import InvalidRequestError
from stages.messages import GenerateRequest
from stages.params import SamplingParams
from stages.tokenize import TokenizeConfig, TokenizeStage, load_tokenizer


@pytest.fixture(scope="module")
def stage(tiny_model_dir: Path) -> TokenizeStage:
    stage = TokenizeStage(TokenizeConfig(str(tiny_model_dir)))
    stage.tokenizer = load_tokenizer(str(tiny_model_dir))
    return stage


@pytest.mark.parametrize("prompt", [" ", "\n", "\n\n", " \t "])
def test_a_whitespace_prompt_is_tokenized(stage: TokenizeStage, prompt: str) -> None:
    ids = stage.encode(GenerateRequest("r", SamplingParams(), prompt=prompt))
    assert ids and ids == tuple(stage.tokenizer.encode(prompt, add_special_tokens=True))


def test_an_empty_prompt_is_refused_naming_the_prompt(stage: TokenizeStage) -> None:
    with pytest.raises(InvalidRequestError, match="empty") as caught:
        stage.encode(GenerateRequest("r", SamplingParams(), prompt=""))
    assert caught.value.field == "prompt"


def test_a_prompt_without_tokens_is_refused() -> None:
    # SmolLM2's byte-level tokenizer gives every non-empty text a token; tokenizers that
    # normalize characters away (e.g. SentencePiece dropping controls) can return none.
    class NoTokens:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return []

    bare = TokenizeStage(TokenizeConfig("unused"))
    bare.tokenizer = NoTokens()
    with pytest.raises(InvalidRequestError, match="no tokens") as caught:
        bare.encode(GenerateRequest("r", SamplingParams(), prompt="\u200b"))
    assert caught.value.field == "prompt"
