"""Tests of stages/tokenize.py: which prompts have tokens (as vLLM: whitespace does, "" not)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from stages.errors import InvalidRequestError
from stages.messages import GenerateRequest
from stages.params import SamplingParams
from stages.tokenize import (
    LARGE_INPUT,
    TokenizeConfig,
    TokenizeStage,
    load_tokenizer,
    longest_token_chars,
)
from tests.conftest import imported_after


def test_a_plain_tokenizer_loads_as_autotokenizer_would_without_importing_torch(
    tiny_model_dir: Path,
) -> None:
    """A tokenizer saved as transformers' plain tokenizers-backed class loads as that class
    directly (AutoTokenizer's import pulls in torch: docs/performance.md §3), and is the
    tokenizer AutoTokenizer gives: the same class, ids, text and chat template."""
    from transformers import AutoTokenizer

    ours, theirs = (
        load_tokenizer(str(tiny_model_dir)),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    assert type(ours) is type(theirs)
    texts = ["Hello, world!", "  leading spaces\n\ttabs", "émoji 🙂 ünïcode", "<|im_start|>x"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.all_special_ids == theirs.all_special_ids
    script = f"from stages.tokenize import load_tokenizer\nload_tokenizer({str(tiny_model_dir)!r})"
    assert imported_after(script, ["torch"], timeout=120) == []


@pytest.fixture(scope="module")
def stage(tiny_model_dir: Path) -> TokenizeStage:
    stage = TokenizeStage(TokenizeConfig(str(tiny_model_dir)))
    stage.tokenizer = load_tokenizer(str(tiny_model_dir))
    return stage


@pytest.mark.parametrize("prompt", [" ", "\n", "\n\n", " \t "])
def test_a_whitespace_prompt_is_tokenized(stage: TokenizeStage, prompt: str) -> None:
    ids = stage.encode(GenerateRequest("r", SamplingParams(), prompt=prompt))
    assert ids and ids == tuple(stage.tokenizer.encode(prompt, add_special_tokens=True))


# NOTE: an empty prompt is refused once, where the request enters the engine (the test moved
# to tests/stages/test_validation.py); tokenize refuses a prompt without tokens (below).


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


class _ThreadRecorder:
    """The real tokenizer, noting which thread each encode ran on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.threads: list[str] = []

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def test_large_inputs_are_tokenized_off_the_event_loop(tiny_model_dir: Path) -> None:
    """A multi-megabyte prompt is tokenized on the stage's worker thread, so the frontend's
    loop keeps serving others meanwhile; small prompts stay on the loop (no hop). Both get
    their answer: the large one refused as too long, the small one generated."""
    from pipeline import AsyncEngine, PromptTooLongError

    async def body() -> list[str]:
        async with AsyncEngine(str(tiny_model_dir), transport="memory") as engine:
            stage = engine.running.stage("tokenize")
            assert isinstance(stage, TokenizeStage)
            recorder = _ThreadRecorder(stage.tokenizer)
            stage.tokenizer = recorder

            async def last(prompt: str) -> Any:
                params = SamplingParams(max_tokens=2, temperature=0.0)
                outputs = [output async for output in engine.generate(prompt, params)]
                return outputs[-1]

            huge = "word " * (LARGE_INPUT // 2)
            results = await asyncio.gather(last(huge), last("Hello"), return_exceptions=True)
            assert isinstance(results[0], PromptTooLongError), results[0]
            assert results[1].finished
            return recorder.threads

    threads = asyncio.run(asyncio.wait_for(body(), 120))
    main = threading.main_thread().name
    assert len(threads) == 2
    assert threads[0] != main and threads[0].startswith("actorline-tokenize")
    assert threads[1] == main


def test_the_vocabulary_bounds_the_characters_of_a_token(stage: TokenizeStage) -> None:
    # SmolLM2's byte-level BPE: no normalizer, so its longest entry is the bound, and no
    # text of that many characters plus one fits in one token.
    chars = longest_token_chars(stage.tokenizer)
    assert chars is not None and chars == max(map(len, stage.tokenizer.get_vocab()))
    longest = max(stage.tokenizer.get_vocab(), key=len)
    text = stage.tokenizer.convert_tokens_to_string([longest])
    assert len(text) <= chars
    assert len(stage.tokenizer.encode(text + "x", add_special_tokens=False)) >= 2


def test_text_longer_than_the_model_can_hold_is_refused_without_tokenizing(
    tiny_model_dir: Path,
) -> None:
    """Once the engine reports its length, text with more characters than max_model_len
    tokens can cover is refused as too long (naming the field) before the tokenizer sees it;
    text within the bound is tokenized as before (and refused by admit if its tokens do not
    fit). Other requests are served meanwhile."""
    from pipeline import AsyncEngine, PromptTooLongError

    async def body() -> None:
        async with AsyncEngine(str(tiny_model_dir), transport="memory") as engine:
            stage = engine.running.stage("tokenize")
            assert isinstance(stage, TokenizeStage)
            assert engine.info is not None
            token_chars = longest_token_chars(stage.tokenizer)
            assert token_chars is not None
            for _ in range(100):  # the info reaches tokenize right after the caller's exit
                if stage.max_prompt_chars is not None:
                    break
                await asyncio.sleep(0.01)
            assert stage.max_prompt_chars == engine.info.max_model_len * token_chars
            recorder = _ThreadRecorder(stage.tokenizer)
            stage.tokenizer = recorder
            params = SamplingParams(max_tokens=2, temperature=0.0)

            async def last(prompt: Any) -> Any:
                return [output async for output in engine.generate(prompt, params)][-1]

            over = "a" * (stage.max_prompt_chars + 1)
            chat = [{"role": "user", "content": over}]
            within = "a" * stage.max_prompt_chars
            results = await asyncio.gather(
                last(over), last(chat), last(within), last("Hello"), return_exceptions=True
            )
            for refused, field in zip(results[:2], ("prompt", "messages")):
                assert isinstance(refused, PromptTooLongError), refused
                assert refused.field == field and "characters" in str(refused)
            assert isinstance(results[2], PromptTooLongError)  # its tokens, counted by admit
            assert results[3].finished
            # only the text within the bound and "Hello" met the tokenizer
            assert len(recorder.threads) == 2

    asyncio.run(asyncio.wait_for(body(), 120))
