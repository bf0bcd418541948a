"""The listener bounds' value (:mod:`pipeline.server.limits`): its checks, the connection cap
lowered to fit the descriptor limit, and the logprobs cap's refusal."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest

from pipeline.server.limits import (
    RESERVED_DESCRIPTORS,
    ListenerLimits,
    check_logprob_entries,
    connection_cap,
)
from stages.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_connections", 0),
        ("max_connections", True),
        ("max_streams", 1.5),
        ("max_streams_per_connection", -1),
        ("max_logprob_entries", 0),
        ("header_timeout", 0),
        ("body_timeout", float("inf")),
        ("keep_alive_timeout", float("nan")),
        ("grpc_idle_timeout", "5"),
        ("header_timeout", True),
    ],
)
def test_a_bound_out_of_range_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        ListenerLimits(**{field: value})  # type: ignore[arg-type]


@pytest.fixture
def descriptors_1024() -> Iterator[None]:
    """This process's soft descriptor limit at 1,024 for the test (the hard one is kept)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_connection_cap_fits_the_descriptor_limit(descriptors_1024: None) -> None:
    room = (1024 - RESERVED_DESCRIPTORS) // 2
    assert connection_cap(ListenerLimits()) == room == 448
    assert connection_cap(ListenerLimits(max_connections=100)) == 100
    assert connection_cap(ListenerLimits(), listeners=1) == 1024 - RESERVED_DESCRIPTORS


def test_the_logprobs_cap_names_the_count_and_the_bound() -> None:
    check_logprob_entries(64, 100, None, 1024, 10)  # no logprobs asked: nothing to count
    check_logprob_entries(2, 10, 4, 1024, 100)  # 2 x 10 x 5 = 100: at the bound
    with pytest.raises(InvalidRequestError) as refused:
        check_logprob_entries(2, 10, 5, 1024, 100)
    assert refused.value.field == "logprobs"
    assert "120 logprobs" in str(refused.value) and "at most 100" in str(refused.value)
    with pytest.raises(InvalidRequestError, match="model's 1024 tokens"):
        check_logprob_entries(1, None, 0, 1024, 1000)


def test_the_logprobs_cap_counts_the_prompts_scores() -> None:
    """With prompt_logprobs the prompt and the output count as up to the model's length,
    with the larger top count (-1, the whole vocabulary, as the most allowed: 20)."""
    check_logprob_entries(2, 1, None, 100, 400, prompt_logprobs=1)  # 2 x 100 x 2 = 400
    with pytest.raises(InvalidRequestError) as refused:
        check_logprob_entries(2, 1, None, 100, 399, prompt_logprobs=1)
    assert refused.value.field == "prompt_logprobs"
    with pytest.raises(InvalidRequestError) as refused:
        check_logprob_entries(1, 1, 3, 100, 399, prompt_logprobs=0)  # 100 x (1 + 3)
    assert refused.value.field == "logprobs"
    with pytest.raises(InvalidRequestError, match="1 \\+ 20 top"):
        check_logprob_entries(1, 1, None, 100, 2000, prompt_logprobs=-1)
