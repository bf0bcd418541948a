"""Tests of stages/params.py: vLLM's spellings of SamplingParams are accepted."""

from __future__ import annotations

import pytest

from stages.errors import InvalidRequestError
from stages.params import (
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    SamplingParams,
    validate_sampling,
)


def test_none_stop_lists_mean_none_as_in_vllm() -> None:
    params = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    assert params.stop == () and params.stop_token_ids == ()
    validate_sampling(params, vocab_size=100)


def test_stop_takes_one_string_or_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)  # type: ignore[arg-type]
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)  # type: ignore[arg-type]
    assert SamplingParams(stop=None).replace(stop="x").stop == ("x",)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"stop": [3]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_LENGTH + 1)]}, "stop"),
        # positive, yet 0 in float32: an empty nucleus, a division by zero
        ({"top_p": 1e-300}, "top_p"),
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ],
)
def test_bad_values_are_refused(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        validate_sampling(SamplingParams(**fields))  # type: ignore[arg-type]
    assert caught.value.field == field


def test_the_largest_stop_lists_allowed_pass() -> None:
    validate_sampling(SamplingParams(stop=("y" * MAX_STOP_STRING_LENGTH,) * MAX_STOP_STRINGS))
    validate_sampling(SamplingParams(top_p=1.2e-38, repetition_penalty=1.2e-38))
