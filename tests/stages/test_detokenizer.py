"""IncrementalDetokenizer against the real SmolLM2 tokenizer (and real tokenizers pipelines
for decoders SmolLM2 does not use: Llama-2 style byte fallback, a non-monotonic decoder, the
pure-Python ByT5 tokenizer)."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers

from stages.detokenizer import (
    DETOKENIZE_METHODS,
    DetokenizerClosedError,
    DetokenizerFactory,
    IncrementalDetokenizer,
    InvalidTokenIdError,
)

METHODS = ("byte_level", "decode_stream", "window")
REPLACEMENT = "\ufffd"

MULTILINGUAL_TEXTS = (
    "Héllo wörld, ça va? Crème brûlée à la française, naïve façade.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",  # noqa: RUF001 (CJK comma)
    "Emoji: 😀🎉 family 👩‍👩‍👧 flags 🇫🇷🇯🇵 and skin tone 👍🏽 done.",
    "Mixed: Ωμέγα, Привет мир, שלום, مرحبا, नमस्ते — “quotes” … ✓",
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def factories(tokenizer: Any) -> dict[str, DetokenizerFactory]:
    return {method: DetokenizerFactory(tokenizer, method=method) for method in METHODS}


@pytest.fixture(scope="module")
def chat_prompt(tokenizer: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say something."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


def stream(detokenizer: IncrementalDetokenizer, token_ids: Sequence[int]) -> list[str]:
    """Push one token at a time; the deltas, then the flush."""
    return [detokenizer.push([token_id]) for token_id in token_ids] + [detokenizer.flush()]


def llama2_style_tokenizer() -> Tokenizer:
    """A real tokenizers pipeline with Llama 2's decoder: '▁' for spaces, byte-fallback
    tokens <0xNN> for characters outside the vocabulary, and Strip of the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ("▁", "H", "e", "l", "o", "w", "r", "d", "▁H", "▁w", "▁He", "▁wo"):
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "H"), ("▁", "w"), ("▁H", "e"), ("▁w", "o")]
    backend = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("text", MULTILINGUAL_TEXTS)
def test_split_characters_never_streamed(
    tokenizer: Any,
    factories: dict[str, DetokenizerFactory],
    chat_prompt: list[int],
    method: str,
    text: str,
) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    # The text really has characters split across tokens (the case under test).
    assert any(REPLACEMENT in tokenizer.decode([token_id]) for token_id in token_ids)
    detokenizer = factories[method].create(chat_prompt)
    deltas = stream(detokenizer, token_ids)
    assert all(REPLACEMENT not in delta for delta in deltas), deltas
    # Decoding token by token would differ (and show U+FFFD): characters really were held.
    assert deltas[:-1] != [tokenizer.decode([token_id]) for token_id in token_ids]
    assert deltas[-1] == ""  # nothing held at the end of complete text
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(token_ids) == text
    assert detokenizer.token_ids == tuple(token_ids)


@pytest.mark.parametrize("method", METHODS)
def test_leading_space_of_first_token_after_prompt(
    tokenizer: Any, factories: dict[str, DetokenizerFactory], method: str
) -> None:
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    output = tokenizer.encode(" Paris, of course.", add_special_tokens=False)
    detokenizer = factories[method].create(prompt)
    first = detokenizer.push(output[:1])
    assert first == " Paris"
    detokenizer.push(output[1:])
    assert detokenizer.flush() == ""
    assert prompt_decode(tokenizer, prompt, output) == detokenizer.text == " Paris, of course."


def prompt_decode(tokenizer: Any, prompt: list[int], output: list[int]) -> str:
    return str(tokenizer.decode(prompt + output))[len(tokenizer.decode(prompt)) :]


@pytest.mark.parametrize("method", METHODS)
def test_prompt_ending_inside_a_character_does_not_leak_into_the_output(
    tokenizer: Any, factories: dict[str, DetokenizerFactory], method: str
) -> None:
    """A raw-id prompt may end with half a character. The output's first bytes complete it,
    but the prompt's text must not be emitted: the output decodes as it would alone (the
    orphan bytes render as U+FFFD, as in ``decode(output)``)."""
    token_ids = tokenizer.encode("Say 😀 ok", add_special_tokens=False)
    split = next(
        index
        for index in range(1, len(token_ids))
        if tokenizer.decode(token_ids[:index]).endswith(REPLACEMENT)
    )
    prompt, output = token_ids[:split], token_ids[split:]
    detokenizer = factories[method].create(prompt)
    text = "".join(stream(detokenizer, output))
    assert text == tokenizer.decode(output)
    assert text.startswith(REPLACEMENT) and text.endswith(" ok") and "Say" not in text


@pytest.mark.parametrize("method", ("decode_stream", "window"))
def test_prompt_priming_keeps_the_space_a_strip_decoder_drops(method: str) -> None:
    backend = llama2_style_tokenizer()
    prompt = backend.encode("Hello").ids
    output = backend.encode("Hello world").ids[len(prompt) :]
    assert backend.decode(output) == "world"  # decoded alone, Strip eats the space
    factory = DetokenizerFactory(backend, method=method)
    assert DetokenizerFactory(backend).method == "decode_stream"
    detokenizer = factory.create(prompt)
    assert backend.id_to_token(output[0]) == "▁wo"
    assert detokenizer.push(output[:1]) == " wo"
    detokenizer.push(output[1:])
    assert detokenizer.flush() == ""
    assert detokenizer.text == " world" == prompt_decode(backend, prompt, output)


@pytest.mark.parametrize("method", ("decode_stream", "window"))
def test_byte_fallback_tokens_held_until_the_character_completes(method: str) -> None:
    backend = llama2_style_tokenizer()
    prompt = backend.encode("Hello").ids
    output = backend.encode("Hello 😀 é").ids[len(prompt) :]
    pieces = [backend.id_to_token(token_id) for token_id in output]
    assert pieces == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁", "<0xC3>", "<0xA9>"]
    detokenizer = DetokenizerFactory(backend, method=method).create(prompt)
    deltas = stream(detokenizer, output)
    assert deltas == [" ", "", "", "", "😀", " ", "", "é", ""]
    assert detokenizer.text == " 😀 é" == prompt_decode(backend, prompt, output)


@pytest.mark.parametrize("method", METHODS)
def test_flush_renders_an_incomplete_character_as_a_full_decode(
    tokenizer: Any, factories: dict[str, DetokenizerFactory], method: str
) -> None:
    token_ids = tokenizer.encode(" ok 😀", add_special_tokens=False)
    cut = token_ids[:-1]  # max_tokens hit inside the emoji
    detokenizer = factories[method].create([])
    deltas = [detokenizer.push([token_id]) for token_id in cut]
    assert all(REPLACEMENT not in delta for delta in deltas)
    tail = detokenizer.flush()
    # The last token holds " " plus the emoji's first bytes: "byte_level" streams the space
    # at once, the other methods hold the whole token.
    assert tail == (REPLACEMENT if method == "byte_level" else " " + REPLACEMENT)
    assert "".join(deltas) + tail == detokenizer.text == tokenizer.decode(cut)
    assert detokenizer.text == " ok " + REPLACEMENT
    assert detokenizer.flush() == ""
    with pytest.raises(DetokenizerClosedError):
        detokenizer.push(token_ids[-1:])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_skipped_or_kept(
    tokenizer: Any,
    factories: dict[str, DetokenizerFactory],
    chat_prompt: list[int],
    method: str,
    skip_special_tokens: bool,
) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    emoji = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(emoji) >= 2
    # A special token in the middle of a split character, then at the end.
    token_ids = [
        *tokenizer.encode("Hi", add_special_tokens=False),
        *emoji[:1],
        end,
        *emoji[1:],
        end,
    ]
    detokenizer = factories[method].create(chat_prompt, skip_special_tokens=skip_special_tokens)
    text = "".join(stream(detokenizer, token_ids))
    expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert text == detokenizer.text == expected
    if skip_special_tokens:
        assert text == "Hi 😀"  # the skipped token does not break the character
    else:
        # A kept token ends the byte run, as in the full decode.
        assert text.startswith("Hi " + REPLACEMENT + "<|im_end|>") and text.endswith("<|im_end|>")


@pytest.mark.parametrize("method", METHODS)
def test_tokens_pushed_several_at_a_time(
    tokenizer: Any, factories: dict[str, DetokenizerFactory], chat_prompt: list[int], method: str
) -> None:
    text = " ".join(MULTILINGUAL_TEXTS)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = factories[method].create(chat_prompt)
    deltas = [detokenizer.push(token_ids[i : i + 3]) for i in range(0, len(token_ids), 3)]
    deltas.append(detokenizer.flush())
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("method", METHODS)
def test_a_detokenizer_is_freed_by_reference_counting(
    tokenizer: Any, factories: dict[str, DetokenizerFactory], chat_prompt: list[int], method: str
) -> None:
    """A request's detokenizer is no reference cycle: it is freed when its request ends,
    not left to the cycle collector (which a raised GC threshold runs rarely)."""
    token_ids = tokenizer.encode(MULTILINGUAL_TEXTS[0], add_special_tokens=False)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            detokenizer = factories[method].create(chat_prompt)
            stream(detokenizer, token_ids)
            del detokenizer
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_requests_are_independent_and_unaffected_by_pauses(
    tokenizer: Any, factories: dict[str, DetokenizerFactory]
) -> None:
    """Two requests from one factory, interleaved; the second gets no tokens for ten steps
    (as when preempted and recomputed) and then several at once: each decodes exactly."""
    first = tokenizer.encode(MULTILINGUAL_TEXTS[1], add_special_tokens=False)
    second = tokenizer.encode(MULTILINGUAL_TEXTS[2], add_special_tokens=False)
    factory = factories["byte_level"]
    one, two = factory.create([]), factory.create([])
    sent = 0
    for step in range(len(first)):
        one.push(first[step : step + 1])
        if not 5 <= step < 15:
            two.push(second[sent : step + 1])
            sent = step + 1
    two.push(second[sent:])
    one.flush(), two.flush()
    assert one.text == MULTILINGUAL_TEXTS[1]
    assert two.text == MULTILINGUAL_TEXTS[2]


def test_auto_method_and_factory_errors(tokenizer: Any) -> None:
    assert DetokenizerFactory(tokenizer).method == "byte_level"
    assert DetokenizerFactory(tokenizer.backend_tokenizer).method == "byte_level"
    assert set(METHODS) < set(DETOKENIZE_METHODS)
    with pytest.raises(ValueError, match="method must be one of"):
        DetokenizerFactory(tokenizer, method="fastest")
    with pytest.raises(ValueError, match="ByteLevel"):
        DetokenizerFactory(llama2_style_tokenizer(), method="byte_level")
    with pytest.raises(TypeError, match="tokenizer must be"):
        DetokenizerFactory(object())
    # A plain tokenizer (not a factory) works too.
    assert IncrementalDetokenizer(tokenizer, [1, 2]).push([19556]) == tokenizer.decode([19556])


@pytest.mark.parametrize("method", METHODS)
def test_invalid_and_out_of_vocabulary_ids(
    tokenizer: Any, factories: dict[str, DetokenizerFactory], method: str
) -> None:
    detokenizer = factories[method].create([])
    with pytest.raises(InvalidTokenIdError, match="-1"):
        detokenizer.push([-1])
    with pytest.raises(InvalidTokenIdError, match="'7'"):
        detokenizer.push(["7"])  # type: ignore[list-item]
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    beyond = len(tokenizer) + 10  # a padded embedding row: decodes to nothing
    assert detokenizer.push([beyond]) == ""
    assert "".join(stream(detokenizer, hello)) == "Hello" == tokenizer.decode([beyond, *hello])
    assert detokenizer.token_ids == (beyond, *hello)


def test_pure_python_tokenizer_uses_the_window_method() -> None:
    from transformers import ByT5Tokenizer

    byt5 = ByT5Tokenizer()  # one token per byte, decoded in Python (no Rust backend)
    factory = DetokenizerFactory(byt5)
    assert factory.method == "window"
    text = "Grüße 😀 日本"
    token_ids = byt5.encode(text, add_special_tokens=False)
    detokenizer = factory.create(byt5.encode("Say: ", add_special_tokens=False))
    deltas = stream(detokenizer, [*token_ids, byt5.eos_token_id])
    assert "".join(deltas) == text
    assert deltas.count("") > 4  # continuation bytes held
    with pytest.raises(ValueError, match="Rust"):
        DetokenizerFactory(byt5, method="decode_stream")


def test_decoder_that_rewrites_earlier_text_restarts_the_stream() -> None:
    """tokenizers' DecodeStream raises "Invalid prefix" when decode(ids + [t]) does not start
    with decode(ids) (here Replace("ab", "X") over fused text). The stream restarts and keeps
    the pending token's text instead of dropping it (vLLM drops it)."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    detokenizer = DetokenizerFactory(backend).create([])
    deltas = stream(detokenizer, [3, 1, 2, 3, 1])
    assert deltas == ["c", "a", "", "bc", "a", ""]
    assert detokenizer.text == "cabca"  # "a" was streamed before the decoder rewrote it


@pytest.fixture(scope="module")
def byte_token_ids(tokenizer: Any) -> list[int]:
    """Ids of SmolLM2's single-byte tokens (lead and continuation bytes included)."""
    table = DetokenizerFactory(tokenizer, method="byte_level").byte_table
    ids = [token_id for token_id, data in enumerate(table) if data and len(data) == 1]
    # Only bytes that never occur in UTF-8 text (0xC0, 0xC1, 0xF5-0xFF, ...) are missing.
    assert len(ids) > 200
    return ids


@st.composite
def token_sequences(draw: st.DrawFn, tokenizer: Any, byte_token_ids: list[int]) -> list[int]:
    """Ids that stress a decoder: single bytes (often invalid or split UTF-8), added and
    special tokens, and any vocabulary id."""
    byte_tokens = st.sampled_from(byte_token_ids)
    any_token = st.integers(min_value=0, max_value=len(tokenizer) - 1)
    added = st.sampled_from(sorted(tokenizer.backend_tokenizer.get_added_tokens_decoder()))
    return draw(st.lists(st.one_of(byte_tokens, byte_tokens, any_token, added), max_size=40))


@pytest.mark.parametrize("method", METHODS)
def test_streaming_equals_full_decode_for_any_tokens(
    tokenizer: Any, factories: dict[str, DetokenizerFactory], byte_token_ids: list[int], method: str
) -> None:
    """Property: for arbitrary token sequences (invalid UTF-8, split characters and special
    tokens included), the streamed text plus the flush equals the Rust full decode."""

    @settings(
        max_examples=200 if method == "byte_level" else 100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(token_ids=token_sequences(tokenizer, byte_token_ids), skip=st.booleans())
    def check(token_ids: list[int], skip: bool) -> None:
        detokenizer = factories[method].create([], skip_special_tokens=skip)
        deltas = stream(detokenizer, token_ids)
        assert "".join(deltas) == tokenizer.backend_tokenizer.decode(
            token_ids, skip_special_tokens=skip
        )

    check()


def test_byte_level_added_tokens_that_are_not_special(
    tokenizer: Any, byte_token_ids: list[int]
) -> None:
    """A non-special added token is kept even when skipping special tokens, and (like any kept
    added token) ends the byte run before it, exactly as the Rust decode does."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.add_tokens(["<tool>"])
    tool = backend.token_to_id("<tool>")
    end = backend.token_to_id("<|im_end|>")
    assert tool is not None and end is not None
    factory = DetokenizerFactory(backend)
    assert factory.method == "byte_level" and tool not in factory.special_ids
    emoji = backend.encode("😀", add_special_tokens=False).ids
    for skip in (True, False):
        for token_ids in (
            [*emoji[:1], tool, *emoji[1:]],
            [*emoji[:1], end, *emoji[1:], tool],
            [tool, byte_token_ids[200], end, tool],
        ):
            detokenizer = factory.create([], skip_special_tokens=skip)
            text = "".join(stream(detokenizer, token_ids))
            assert text == backend.decode(token_ids, skip_special_tokens=skip)
            assert "<tool>" in text
