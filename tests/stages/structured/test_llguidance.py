"""Tests of stages/structured/llguidance.py on SmolLM2's real tokenizer: every constraint kind
compiles, unsupported features are refused with llguidance's reason, matchers accept,
terminate and roll back, and bitmasks allow exactly the right tokens."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from stages.structured.backend import (
    BITMASK_DTYPE,
    GrammarCompileError,
    bitmask_width,
    load_grammar_backend,
)
from stages.structured.llguidance import LLGuidanceBackend
from stages.structured.params import StructuredOutputsParams

EOS = 2


def allowed(backend: LLGuidanceBackend, matcher: Any) -> set[int]:
    bitmask = np.zeros((1, bitmask_width(backend.vocab_size)), BITMASK_DTYPE)
    backend.fill_bitmask([matcher], bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[0]
    return set(np.flatnonzero(bits).tolist())


def feed(matcher: Any, tokenizer: Any, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token), (text, token)


def test_the_plugin_group_finds_the_builtin_backend() -> None:
    assert load_grammar_backend("llguidance") is LLGuidanceBackend


@pytest.mark.parametrize(
    ("params", "text"),
    [
        (
            StructuredOutputsParams(
                json=json.dumps(
                    {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                        "required": ["name", "n"],
                    }
                )
            ),
            '{"name": "Ada", "n": 3}',
        ),
        (StructuredOutputsParams(json_object=True), '{"anything": [1, true, null]}'),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), "555-1234"),
        (StructuredOutputsParams(choice=("red", "green", "blue")), "green"),
        (StructuredOutputsParams(grammar='start: "yes" | "no"'), "no"),
        (StructuredOutputsParams(grammar='root ::= "a" [0-9] "b"'), "a4b"),
    ],
)
def test_each_kind_compiles_accepts_a_match_and_then_allows_only_eos(
    llguidance_backend: LLGuidanceBackend,
    tokenizer: Any,
    params: StructuredOutputsParams,
    text: str,
) -> None:
    matcher = llguidance_backend.compile(params).matcher()
    feed(matcher, tokenizer, text)
    if params.kind in ("regex", "choice", "grammar"):
        # nothing can follow: only the end of sequence is allowed, then the grammar is done
        assert allowed(llguidance_backend, matcher) == {EOS}
    else:
        assert EOS in allowed(llguidance_backend, matcher)  # JSON may end (or take whitespace)
    assert matcher.accept_token(EOS)
    assert matcher.is_terminated()
    assert matcher.accept_token(17)  # ignored once the grammar is done


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (StructuredOutputsParams(json='{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (StructuredOutputsParams(json='{"not": {"type": "string"}}'), "not"),
        (StructuredOutputsParams(json='{"type": "strin"}'), "strin"),
        (StructuredOutputsParams(json='{"type": "string", "format": "credit-card"}'), "format"),
        (StructuredOutputsParams(json='{"$ref": "#/$defs/missing"}'), "missing"),
        (
            StructuredOutputsParams(json='{"type": "integer", "minimum": 5, "maximum": 2}'),
            "minimum",
        ),
        (StructuredOutputsParams(regex="(?=a)b"), "look-around"),
        (StructuredOutputsParams(regex="([a-z"), "unclosed"),
        (StructuredOutputsParams(grammar="start: ((("), "Expected"),
    ],
)
def test_what_llguidance_does_not_implement_is_refused_with_its_reason(
    llguidance_backend: LLGuidanceBackend, params: StructuredOutputsParams, reason: str
) -> None:
    with pytest.raises(GrammarCompileError, match=reason):
        llguidance_backend.compile(params)


def test_disable_additional_properties_allows_no_other_key(
    llguidance_backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    comma = tokenizer.encode(",", add_special_tokens=False)
    assert len(comma) == 1
    for closed, comma_allowed in ((False, True), (True, False)):
        params = StructuredOutputsParams(json=schema, disable_additional_properties=closed)
        matcher = llguidance_backend.compile(params).matcher()
        feed(matcher, tokenizer, '{"n": 3')
        assert (comma[0] in allowed(llguidance_backend, matcher)) is comma_allowed, closed


def test_the_mask_follows_the_grammar_and_rollback_undoes_tokens(
    llguidance_backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    compiled = llguidance_backend.compile(StructuredOutputsParams(choice=("cat", "dog")))
    matcher = compiled.matcher()
    first = allowed(llguidance_backend, matcher)
    cat, dog = tokenizer.encode("cat")[0], tokenizer.encode("dog")[0]
    assert {cat, dog} <= first and EOS not in first
    assert tokenizer.encode("fish")[0] not in first
    assert matcher.accept_token(cat)
    assert allowed(llguidance_backend, matcher) == {EOS}
    matcher.rollback(1)
    assert allowed(llguidance_backend, matcher) == first
    # a token the grammar refuses: the matcher then allows only EOS
    assert not matcher.accept_token(tokenizer.encode("fish")[0])
    assert allowed(llguidance_backend, matcher) == {EOS}
    # matchers of one compiled grammar are independent
    other = compiled.matcher()
    assert allowed(llguidance_backend, other) == first


def test_a_batch_of_matchers_fills_one_row_each(
    llguidance_backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    compiled = llguidance_backend.compile(StructuredOutputsParams(regex=r"[ab]+"))
    matchers = [compiled.matcher() for _ in range(3)]
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    matchers[1].accept_token(a)
    bitmask = np.zeros((3, bitmask_width(llguidance_backend.vocab_size)), BITMASK_DTYPE)
    llguidance_backend.fill_bitmask(matchers, bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    assert bits[0, EOS] == 0 and bits[1, EOS] == 1 and bits[2, EOS] == 0  # "" is no match
    assert bits[0, a] == bits[1, a] == 1
    assert np.array_equal(bitmask[0], bitmask[2])
