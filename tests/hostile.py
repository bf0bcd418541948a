"""Hypothesis strategies of what a hostile client sends, shared by the fuzz tests of every
front end (the validation core, the Python API, gRPC, HTTP): integers of any size, floats
with NaN and infinities, text with lone surrogates and control characters, wrong types, empty
and huge lists, for every SamplingParams field and every prompt form."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hypothesis import strategies as st

from stages.params import SamplingParams
from stages.structured.params import StructuredOutputsParams

__all__ = [
    "FIELD_VALUES",
    "FLOATS",
    "INTS",
    "JUNK",
    "PROMPTS",
    "SAMPLING",
    "STRUCTURED",
    "TEXT",
    "sampling_params",
]

#: integers around every bound that matters: small, int64's and uint64's edges, any size
INTS = st.one_of(
    st.integers(-3, 40),
    st.sampled_from(
        [2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**70, -(2**70)]
    ),
    st.integers(),
)
FLOATS = st.one_of(
    st.floats(-3.0, 3.0),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e-300, 1e308]),
    st.floats(),
)
#: any character at all: lone surrogates (no UTF-8 form), controls, NUL, private use; one
#: text in three holds a lone surrogate for sure
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=24),
    st.text(st.characters(exclude_categories=()), max_size=24),
    st.builds(
        lambda before, surrogate, after: before + surrogate + after,
        st.text(max_size=8),
        st.characters(categories=["Cs"]),
        st.text(max_size=8),
    ),
)
#: values of the wrong type for almost any field
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    FLOATS,
    TEXT,
    st.binary(max_size=6),
    st.lists(INTS, max_size=3),
    st.dictionaries(TEXT, INTS, max_size=2),
)
_HUGE_LIST = st.integers(5_000, 20_000).map(lambda n: [1] * n)

#: a structured-output constraint: one kind or several, plausible, hostile or junk
STRUCTURED = st.one_of(
    st.none(),
    st.builds(
        StructuredOutputsParams,
        choice=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),
    ),
    st.builds(StructuredOutputsParams, regex=st.sampled_from(["[a-z]+", "(yes|no)", "[0-9]{1,3}"])),
    st.builds(StructuredOutputsParams, json_object=st.just(True)),
    # one kind, with any text (a lone surrogate has no UTF-8 form)
    st.builds(StructuredOutputsParams, regex=TEXT),
    st.builds(StructuredOutputsParams, grammar=TEXT),
    st.builds(StructuredOutputsParams, json=st.dictionaries(TEXT, st.integers(), max_size=2)),
    st.builds(StructuredOutputsParams, choice=st.lists(TEXT, min_size=1, max_size=3)),
    st.builds(
        StructuredOutputsParams,
        json=st.one_of(st.just({"type": "object"}), st.just({"type": "integer"}), TEXT, JUNK),
        regex=st.one_of(st.none(), TEXT),
        choice=st.one_of(st.none(), st.lists(st.one_of(TEXT, JUNK), max_size=3), JUNK),
        grammar=st.one_of(st.none(), TEXT),
        json_object=st.one_of(st.booleans(), JUNK),
        disable_any_whitespace=st.one_of(st.booleans(), JUNK),
        disable_additional_properties=st.one_of(st.booleans(), JUNK),
    ),
    JUNK,
)

#: per SamplingParams field: plausible values, edge values and junk
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.none(), st.integers(1, 6), INTS, JUNK),
    "temperature": st.one_of(st.floats(0.0, 2.0), FLOATS, JUNK),
    "top_p": st.one_of(st.floats(0.05, 1.0), FLOATS, JUNK),
    "top_k": st.one_of(st.integers(-1, 50), INTS, JUNK),
    "min_p": st.one_of(st.floats(0.0, 1.0), FLOATS, JUNK),
    "repetition_penalty": st.one_of(st.floats(0.5, 2.0), FLOATS, JUNK),
    "presence_penalty": st.one_of(st.floats(-2.0, 2.0), FLOATS, JUNK),
    "frequency_penalty": st.one_of(st.floats(-2.0, 2.0), FLOATS, JUNK),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1), INTS, JUNK),
    "stop": st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=3), st.lists(JUNK, max_size=2)),
    "stop_token_ids": st.one_of(
        st.none(), st.lists(INTS, max_size=4), st.lists(JUNK, max_size=2), _HUGE_LIST, JUNK
    ),
    "ignore_eos": st.one_of(st.booleans(), JUNK),
    "min_tokens": st.one_of(st.integers(0, 4), INTS, JUNK),
    "logprobs": st.one_of(st.none(), st.integers(0, 20), INTS, JUNK),
    "include_stop_str_in_output": st.one_of(st.booleans(), JUNK),
    "skip_special_tokens": st.one_of(st.booleans(), JUNK),
    "priority": st.one_of(st.integers(-5, 5), INTS, JUNK),
    "structured_outputs": STRUCTURED,
    "logit_bias": st.one_of(
        st.none(),
        st.dictionaries(st.integers(0, 60), st.floats(-100.0, 100.0), max_size=3),
        st.dictionaries(INTS, st.one_of(FLOATS, JUNK), max_size=2),
        st.lists(st.lists(st.one_of(INTS, FLOATS, JUNK), max_size=3), max_size=2),
        JUNK,
    ),
    "allowed_token_ids": st.one_of(
        st.none(),
        st.lists(st.integers(0, 60), min_size=1, max_size=4),
        st.lists(INTS, max_size=3),
        st.lists(JUNK, max_size=2),
        _HUGE_LIST,
        JUNK,
    ),
    "truncate_prompt_tokens": st.one_of(st.none(), st.integers(-1, 8), INTS, JUNK),
    "bad_words": st.one_of(st.none(), st.lists(TEXT, max_size=3), st.lists(JUNK, max_size=2), JUNK),
    "prompt_logprobs": st.one_of(st.none(), st.integers(-1, 20), INTS, JUNK),
}
assert set(FIELD_VALUES) == {field.name for field in dataclasses.fields(SamplingParams)}, (
    "every SamplingParams field is fuzzed"
)

#: up to three SamplingParams fields set to hostile values, the others left at their defaults
SAMPLING = st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=3, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: FIELD_VALUES[name] for name in names})
)


def sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """The SamplingParams for ``fields`` (which may hold any value: it is not validated)."""
    return SamplingParams(**fields)


_PLAIN_TEXT = st.text(min_size=1, max_size=24)  # no surrogates: it has tokens
_CHAT_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _PLAIN_TEXT}),
    st.fixed_dictionaries({"role": st.one_of(TEXT, JUNK), "content": st.one_of(TEXT, JUNK)}),
    st.fixed_dictionaries({}, optional={"role": TEXT, "content": TEXT}),
)
#: every prompt form (text, token ids, chat messages, prompt dicts), plausible and hostile
PROMPTS = st.one_of(
    _PLAIN_TEXT,
    TEXT,
    st.lists(st.integers(0, 49_151), min_size=1, max_size=6),
    st.lists(INTS, max_size=6),
    _HUGE_LIST,
    st.lists(_CHAT_MESSAGE, min_size=1, max_size=3),
    st.fixed_dictionaries({"prompt": st.one_of(_PLAIN_TEXT, TEXT, JUNK)}),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(st.lists(INTS, max_size=4), JUNK)}),
    JUNK,
)
