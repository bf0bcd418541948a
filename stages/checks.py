"""Field checks for values that enter the engine: what every stage and every transport can
carry (pure logic, no IO).

A request crosses process boundaries as msgpack (zmq and gRPC links), is read by a Rust
tokenizer and is stored in int64 tensors, so every value must fit all of them: integers in
int64 (msgpack carries [-2**63, 2**64), protobuf's int64 and torch's long only the signed half),
text that encodes as UTF-8 (a lone surrogate such as ``"\\ud800"`` does not: neither msgpack nor
the tokenizer takes it), and exact types (a bool is not an int, a str is not a number). Each
check raises :class:`~stages.errors.InvalidRequestError` naming the field, so every front end
refuses the same input the same way (docs/architecture.md, "Failure: one request or the
pipeline").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from stages.errors import InvalidRequestError

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "check_bool",
    "check_bounded_string",
    "check_int",
    "check_number",
    "check_text",
    "check_token_ids",
    "describe",
]

#: the integer range every transport and every tensor carries (int64)
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: characters of a value quoted in an error message
_QUOTED = 40
#: the lone surrogates Python's "surrogateescape" makes of bytes that are not UTF-8
_ESCAPED_BYTES = (0xDC80, 0xDCFF)


def describe(value: object) -> str:
    """A short description of ``value`` for an error message (its type, and a bounded repr;
    a huge integer is named by its size, not printed)."""
    if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
        sign = "a negative" if value < 0 else "an"
        return f"{sign} integer of {abs(value).bit_length()} bits"
    text = repr(value)
    if len(text) > _QUOTED:
        text = text[: _QUOTED - 3] + "..."
    return f"{text} ({type(value).__name__})"


def _fail(
    field: str, problem: str, request_id: str | None, *, where: str | None = None
) -> InvalidRequestError:
    """The error for ``field``; ``where`` (e.g. ``stop[2]``) names the part of it at fault."""
    return InvalidRequestError(f"{where or field} {problem}", field=field, request_id=request_id)


def _bound(value: int) -> str:
    if value == INT64_MAX:
        return "2**63 - 1"
    if value == INT64_MIN:
        return "-2**63"
    return str(value)


def check_int(
    field: str,
    value: object,
    *,
    minimum: int = INT64_MIN,
    maximum: int = INT64_MAX,
    request_id: str | None = None,
) -> int:
    """``value`` if it is an ``int`` (not a bool) in ``[minimum, maximum]``.

    Raises:
        InvalidRequestError: naming ``field``.
    """
    if type(value) is not int:
        raise _fail(field, f"must be an integer, got {describe(value)}", request_id)
    if not minimum <= value <= maximum:
        if value < minimum and minimum != INT64_MIN and maximum == INT64_MAX:
            bound = f">= {minimum}"  # what the field means; int64's top is no news to anyone
        else:
            bound = f"in [{_bound(minimum)}, {_bound(maximum)}]"
        raise _fail(field, f"must be {bound}, got {describe(value)}", request_id)
    return value


def check_number(field: str, value: object, *, request_id: str | None = None) -> float:
    """``value`` as a float, if it is a finite ``int`` or ``float`` (not a bool, not a str).

    Raises:
        InvalidRequestError: naming ``field``.
    """
    if type(value) is int:
        if not INT64_MIN <= value <= INT64_MAX:
            raise _fail(field, f"must be a finite number, got {describe(value)}", request_id)
        return float(value)
    if type(value) is not float or not math.isfinite(value):
        raise _fail(field, f"must be a finite number, got {describe(value)}", request_id)
    return value


def check_bool(field: str, value: object, *, request_id: str | None = None) -> bool:
    """``value`` if it is a bool.

    Raises:
        InvalidRequestError: naming ``field``.
    """
    if type(value) is not bool:
        raise _fail(field, f"must be a boolean, got {describe(value)}", request_id)
    return value


def check_bounded_string(
    field: str, value: object, *, max_length: int, what: str, request_id: str | None = None
) -> str:
    """``value`` if it is a str of at most ``max_length`` characters; ``what`` says what the
    string holds, for the message (``"a Jinja template"``, ``"a JSON object"``). Unlike
    :func:`check_text` the message names the limit and the size even for a wrong type, and
    the text's content is not checked (its parser does that).

    Raises:
        InvalidRequestError: naming ``field``.
    """
    if not isinstance(value, str) or len(value) > max_length:
        size = f"{len(value):,} characters" if isinstance(value, str) else describe(value)
        raise _fail(
            field, f"must be {what} of at most {max_length:,} characters, got {size}", request_id
        )
    return value


def check_text(
    field: str,
    value: object,
    *,
    max_length: int | None = None,
    allow_empty: bool = True,
    request_id: str | None = None,
    where: str | None = None,
) -> str:
    """``value`` if it is a str that encodes as UTF-8 (no lone surrogates), not empty unless
    ``allow_empty``, of at most ``max_length`` characters. ``where`` names the part of
    ``field`` that ``value`` is, for the message (``stop[2]``, ``messages[0].content``).

    Raises:
        InvalidRequestError: naming ``field`` (and the position of a bad character).
    """
    if not isinstance(value, str):
        raise _fail(field, f"must be a string, got {describe(value)}", request_id, where=where)
    if not value and not allow_empty:
        raise _fail(field, "must not be empty", request_id, where=where)
    if max_length is not None and len(value) > max_length:
        raise _fail(
            field,
            f"may be at most {max_length} characters, got {len(value)}",
            request_id,
            where=where,
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        problem = f"a lone surrogate U+{code:04X} at index {error.start} (it has no UTF-8 form)"
        if _ESCAPED_BYTES[0] <= code <= _ESCAPED_BYTES[1]:
            # NOTE: Python decodes command lines, file names and the environment with
            # "surrogateescape": a byte that is not UTF-8 becomes U+DC80..U+DCFF.
            problem = (
                f"U+{code:04X} at index {error.start}, which stands for the byte "
                f"0x{code - 0xDC00:02X} that is not UTF-8 (a lone surrogate has no UTF-8 form)"
            )
        raise _fail(
            field, f"is not valid Unicode text: {problem}", request_id, where=where
        ) from None
    return value


def check_token_ids(
    field: str,
    value: object,
    *,
    vocab_size: int | None = None,
    allow_empty: bool = False,
    request_id: str | None = None,
) -> tuple[int, ...]:
    """``value`` as a tuple of token ids: a list or tuple of ints (not bools) in
    ``[0, vocab_size)`` (``[0, 2**63)`` while the vocabulary is not known).

    Raises:
        InvalidRequestError: naming ``field`` (the message gives the first bad id's index).
    """
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise _fail(field, f"must be a list of token ids, got {describe(value)}", request_id)
    if not value and not allow_empty:
        raise _fail(field, "must not be empty", request_id)
    limit = INT64_MAX + 1 if vocab_size is None else vocab_size
    for index, token_id in enumerate(value):
        if type(token_id) is not int:
            raise _fail(
                field,
                f"must be a token id (an integer), got {describe(token_id)}",
                request_id,
                where=f"{field}[{index}]",
            )
        if not 0 <= token_id < limit:
            span = "[0, 2**63)" if vocab_size is None else f"the vocabulary [0, {vocab_size})"
            raise _fail(
                field,
                f"is {describe(token_id)}, outside {span}",
                request_id,
                where=f"{field}[{index}]",
            )
    return tuple(value)
