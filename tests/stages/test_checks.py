"""Tests of stages/checks.py: what every stage and transport can carry, refused by name."""

from __future__ import annotations

import math

import pytest

from stages.checks import (
    INT64_MAX,
    INT64_MIN,
    check_bool,
    check_bounded_string,
    check_int,
    check_number,
    check_text,
    check_token_ids,
    describe,
)
from stages.errors import InvalidRequestError


def test_int64_is_what_msgpack_and_tensors_share() -> None:
    assert check_int("n", INT64_MAX) == INT64_MAX and check_int("n", INT64_MIN) == INT64_MIN
    for outside in (INT64_MAX + 1, INT64_MIN - 1, 2**70, -(2**70)):
        with pytest.raises(InvalidRequestError, match="n must be in") as caught:
            check_int("n", outside)
        assert caught.value.field == "n"


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, [1]])
def test_an_int_is_an_int(value: object) -> None:
    with pytest.raises(InvalidRequestError, match="must be an integer"):
        check_int("n", value)


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, "0.5", True, None, 2**70, complex(1, 0)]
)
def test_a_number_is_finite_and_not_a_bool_or_a_string(value: object) -> None:
    with pytest.raises(InvalidRequestError, match="must be a finite number") as caught:
        check_number("x", value)
    assert caught.value.field == "x"


def test_numbers_that_pass() -> None:
    assert check_number("x", 3) == 3.0 and check_number("x", -0.5) == -0.5
    assert check_bool("b", True) is True
    with pytest.raises(InvalidRequestError, match="must be a boolean"):
        check_bool("b", 1)


@pytest.mark.parametrize(("text", "index"), [("\ud800", 0), ("ok\udfff", 2), ("\ud83d", 0)])
def test_a_lone_surrogate_has_no_utf8_form(text: str, index: int) -> None:
    with pytest.raises(InvalidRequestError, match=f"lone surrogate .* at index {index}") as caught:
        check_text("prompt", text)
    assert caught.value.field == "prompt"


def test_a_byte_python_escaped_is_named() -> None:
    """A command line's byte that is not UTF-8 reaches Python as U+DC80..U+DCFF."""
    text = b"a\xffb".decode("utf-8", "surrogateescape")
    with pytest.raises(InvalidRequestError, match=r"U\+DCFF at index 1, .* the byte 0xFF"):
        check_text("prompt", text)


def test_text_that_passes_and_where_names_the_part() -> None:
    # a surrogate pair written as one character is fine; so are controls and NUL
    assert check_text("t", "\U0001f600 \x00\x1b[31m") == "\U0001f600 \x00\x1b[31m"
    with pytest.raises(InvalidRequestError, match=r"^messages\[3\]\.role must not be empty$"):
        check_text("messages", "", allow_empty=False, where="messages[3].role")
    with pytest.raises(InvalidRequestError, match="at most 4 characters, got 5"):
        check_text("t", "12345", max_length=4)
    with pytest.raises(InvalidRequestError, match="must be a string, got b'x' \\(bytes\\)"):
        check_text("t", b"x")


def test_a_bounded_string_names_its_limit_and_size() -> None:
    assert check_bounded_string("t", "abc", max_length=3, what="a template") == "abc"
    with pytest.raises(InvalidRequestError) as caught:
        check_bounded_string("t", "abcd", max_length=3, what="a template", request_id="r1")
    assert str(caught.value) == "t must be a template of at most 3 characters, got 4 characters"
    assert caught.value.field == "t" and caught.value.request_id == "r1"
    with pytest.raises(InvalidRequestError, match=r"at most 3 characters, got 7 \(int\)"):
        check_bounded_string("t", 7, max_length=3, what="a template")


def test_token_ids() -> None:
    assert check_token_ids("ids", [0, 5], vocab_size=6) == (0, 5)
    assert check_token_ids("ids", (), allow_empty=True) == ()
    cases = [
        ([], None, "must not be empty"),
        ("abc", None, "must be a list of token ids"),
        ([1, True], None, r"ids\[1\] must be a token id"),
        ([1, -1], None, r"ids\[1\] is -1 \(int\), outside \[0, 2\*\*63\)"),
        ([2**64], None, r"ids\[0\] is an integer of 65 bits"),
        ([3, 6], 6, r"ids\[1\] is 6 \(int\), outside the vocabulary \[0, 6\)"),
    ]
    for value, vocab_size, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            check_token_ids("ids", value, vocab_size=vocab_size)
        assert caught.value.field == "ids"


def test_describe_bounds_what_it_quotes() -> None:
    assert describe(2**1000) == "an integer of 1001 bits"
    assert len(describe("x" * 10_000)) < 60
