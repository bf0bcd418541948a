"""Tests of stages/validation.py, the validation core: every vector of the hostile review is
refused by name, and whatever it accepts every transport can carry (a property test)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.engine.prompts import make_request
from stages.errors import InvalidRequestError, PromptTooLongError
from stages.messages import ChatMessage, EngineRequest, GenerateRequest
from stages.params import SamplingParams, validate_sampling
from stages.structured.params import StructuredOutputsParams
from stages.validation import (
    MAX_REQUEST_ID_LENGTH,
    check_request_id,
    resolve_max_tokens,
    validate_generate_request,
)
from tests.hostile import FIELD_VALUES, JUNK, PROMPTS, SAMPLING, TEXT, sampling_params
from transports.codec import Codec

VOCAB = 49_152


def request(**fields: Any) -> GenerateRequest:
    values: dict[str, Any] = {"request_id": "r", "params": SamplingParams(), "prompt": "hi"}
    values.update(fields)
    return GenerateRequest(**values)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        # integers outside what msgpack (and int64 tensors) carry
        ({"params": SamplingParams(max_tokens=2**70)}, "max_tokens", "71 bits"),
        ({"params": SamplingParams(priority=2**64)}, "priority", "65 bits"),
        ({"params": SamplingParams(priority=-(2**63) - 1)}, "priority", "must be in"),
        ({"params": SamplingParams(top_k=2**70)}, "top_k", "must be in"),
        ({"params": SamplingParams(seed=2**63)}, "seed", "must be in"),
        ({"params": SamplingParams(stop_token_ids=(2**70,))}, "stop_token_ids", r"\[0\]"),
        ({"prompt": None, "prompt_token_ids": (1, 2**70)}, "prompt_token_ids", r"\[1\]"),
        # lone surrogates: no UTF-8 form
        ({"prompt": "a\ud800"}, "prompt", "lone surrogate U\\+D800 at index 1"),
        (
            {"prompt": None, "messages": (ChatMessage("user", "\udfff"),)},
            "messages",
            r"messages\[0\]\.content",
        ),
        (
            {"prompt": None, "messages": (ChatMessage("\ud800", "x"),)},
            "messages",
            r"messages\[0\]\.role",
        ),
        ({"params": SamplingParams(stop=("ok", "\ud800"))}, "stop", r"stop\[1\]"),
        ({"request_id": "\ud800"}, "request_id", "lone surrogate"),
        (
            {"params": SamplingParams(structured_outputs=StructuredOutputsParams(regex="a\ud800"))},
            "structured_outputs.regex",
            "lone surrogate U\\+D800 at index 1",
        ),
        (
            {
                "params": SamplingParams(
                    structured_outputs=StructuredOutputsParams(choice=("x", "\udfff"))
                )
            },
            "structured_outputs.choice",
            r"structured_outputs\.choice\[1\] is not valid Unicode",
        ),
        (
            {
                "params": SamplingParams(
                    structured_outputs=StructuredOutputsParams(json={"\ud800": 1})
                )
            },
            "structured_outputs.json",
            "lone surrogate",
        ),
        ({"tenant": "\ud800"}, "tenant", "lone surrogate"),
        # types: a bool is not an int, a str is not a number
        ({"params": SamplingParams(max_tokens=True)}, "max_tokens", "must be an integer"),
        ({"params": SamplingParams(temperature="0.5")}, "temperature", "finite number"),  # type: ignore[arg-type]
        ({"params": SamplingParams(top_p=float("nan"))}, "top_p", "finite number"),
        ({"params": SamplingParams(ignore_eos=1)}, "ignore_eos", "boolean"),  # type: ignore[arg-type]
        ({"prompt": None, "messages": (ChatMessage(5, "x"),)}, "messages", "must be a string"),  # type: ignore[arg-type]
        ({"chat_template": "yes"}, "chat_template", "boolean"),
        ({"tenant": None}, "tenant", "must be a string"),
        ({"params": None}, "params", "SamplingParams"),
        # shapes
        ({"prompt": None}, "prompt", "exactly one of"),
        ({"prompt_token_ids": (1,)}, "prompt", "exactly one of"),
        ({"prompt": None, "messages": ()}, "messages", "non-empty"),
        ({"prompt": None, "prompt_token_ids": ()}, "prompt_token_ids", "must not be empty"),
        ({"prompt": None, "prompt_token_ids": (VOCAB,)}, "prompt_token_ids", "vocabulary"),
        ({"request_id": "x" * (MAX_REQUEST_ID_LENGTH + 40)}, "request_id", "at most"),
    ],
)
def test_every_vector_is_refused_naming_its_field(
    fields: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        validate_generate_request(request(**fields), vocab_size=VOCAB)
    assert caught.value.field == field and caught.value.request_id in ("r", None)


def test_a_callers_request_id() -> None:
    assert check_request_id("abc") == "abc"
    for bad in ("", None, 7, "x" * (MAX_REQUEST_ID_LENGTH + 1), "\udc80"):
        with pytest.raises(InvalidRequestError) as caught:
            check_request_id(bad)
        assert caught.value.field == "request_id"


def test_valid_requests_of_every_form_pass() -> None:
    for fields in (
        {"prompt": "\U0001f600 \x00 tab\t"},
        {"prompt": None, "messages": (ChatMessage("user", ""),)},
        {"prompt": None, "prompt_token_ids": (0, VOCAB - 1)},
        {"params": SamplingParams(max_tokens=None, seed=2**63 - 1, priority=-(2**63))},
    ):
        validate_generate_request(request(**fields), vocab_size=VOCAB)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=PROMPTS,
    fields=SAMPLING,
    request_id=st.one_of(TEXT, JUNK),
    tenant=st.one_of(TEXT, JUNK),
    chat_template=st.one_of(st.booleans(), JUNK),
)
def test_what_the_core_accepts_every_link_carries(
    prompt: Any, fields: dict[str, Any], request_id: Any, tenant: Any, chat_template: Any
) -> None:
    """Any value in any field: the core refuses it with an InvalidRequestError, or the request
    and its tokenized form encode on the wire (where 2**70 and "\\ud800" used to fail)."""
    try:
        made = make_request(request_id, prompt, sampling_params(fields), tenant, chat_template)
        validate_generate_request(made, vocab_size=VOCAB)
    except InvalidRequestError as error:
        assert isinstance(error.field, str) and error.field
        assert str(error)
        return
    codec = Codec()
    codec.encode(made)
    ids = made.prompt_token_ids or (1,)
    codec.encode(EngineRequest(made.request_id, ids, made.params, made.tenant, 0.0, made.prompt))


@pytest.mark.parametrize("field", sorted(FIELD_VALUES))
def test_what_validate_sampling_accepts_every_link_carries_field_by_field(field: str) -> None:
    """Each SamplingParams field alone, with any of its hostile values: refused by name or
    carried by the codec."""

    @settings(max_examples=60, deadline=None)
    @given(value=FIELD_VALUES[field])
    def check(value: Any) -> None:
        params = sampling_params({field: value})
        try:
            validate_sampling(params, vocab_size=VOCAB)
        except InvalidRequestError as error:
            assert error.field is not None and error.field.split(".")[0] == field
            return
        Codec().encode(EngineRequest("r", (1,), params))

    check()


# -- moved from tests/stages/test_admit.py and test_tokenize.py: the stages no longer check
# -- these again; the core refuses them once, where the request enters the engine


@pytest.mark.parametrize(
    ("ids", "params", "field"),
    [
        ((5.0, 6, 7), SamplingParams(), "prompt_token_ids"),
        ((5, True), SamplingParams(), "prompt_token_ids"),
        ((5, 6, 7), SamplingParams(temperature=-0.5), "temperature"),
        ((5, 6, 7), SamplingParams(top_p=1.5), "top_p"),
        ((5, 6, 7), SamplingParams(max_tokens=0), "max_tokens"),
        ((5, 6, 7), SamplingParams(logprobs=99), "logprobs"),
        ((5, 6, 7), SamplingParams(presence_penalty=3.0), "presence_penalty"),
        ((5, 6, 7), SamplingParams(min_tokens=20, max_tokens=10), "min_tokens"),
    ],
)
def test_the_core_refuses_what_admit_used_to_check_again(
    ids: tuple[Any, ...], params: SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        validate_generate_request(
            request(request_id="x", prompt=None, prompt_token_ids=ids, params=params),
            vocab_size=1000,
        )
    assert (caught.value.field, caught.value.request_id) == (field, "x")


@pytest.mark.parametrize("bad", [5.0, True, "5", None, 5.5])
def test_a_token_id_that_is_not_an_int_is_refused_before_it_reaches_execute(bad: Any) -> None:
    # A float id passed min/max checks and crashed execute's block hashing, killing the engine.
    made = request(request_id="x", prompt=None, prompt_token_ids=(7, bad, 9))
    with pytest.raises(InvalidRequestError, match="integer") as caught:
        validate_generate_request(made, vocab_size=1000)
    assert caught.value.field == "prompt_token_ids" and caught.value.request_id == "x"


def test_an_empty_prompt_is_refused_naming_the_prompt() -> None:
    with pytest.raises(InvalidRequestError, match="empty") as caught:
        validate_generate_request(request(prompt=""))
    assert caught.value.field == "prompt"


# -- the one rule of a request's token limit


def test_max_tokens_none_is_what_the_model_length_leaves() -> None:
    params = SamplingParams(max_tokens=None)
    assert resolve_max_tokens(params, prompt_tokens=10, max_model_len=64) == 54
    assert resolve_max_tokens(params, prompt_tokens=63, max_model_len=64) == 1
    # an explicit max_tokens is kept as given (the scheduler stops at the model's length)
    given_ = SamplingParams(max_tokens=100)
    assert resolve_max_tokens(given_, prompt_tokens=10, max_model_len=64) == 100


@pytest.mark.parametrize("max_tokens", [None, 5])
def test_a_prompt_that_leaves_no_room_is_too_long_naming_both_numbers(
    max_tokens: int | None,
) -> None:
    params = SamplingParams(max_tokens=max_tokens)
    with pytest.raises(PromptTooLongError) as caught:
        resolve_max_tokens(params, prompt_tokens=64, max_model_len=64, request_id="r")
    assert "64 tokens" in str(caught.value) and "length is 64" in str(caught.value)
    assert (caught.value.field, caught.value.request_id) == ("prompt", "r")


def test_min_tokens_over_the_resolved_limit_is_refused_naming_both() -> None:
    unset = SamplingParams(max_tokens=None, min_tokens=10)
    with pytest.raises(InvalidRequestError) as caught:
        resolve_max_tokens(unset, prompt_tokens=60, max_model_len=64)
    assert caught.value.field == "min_tokens" and "(10)" in str(caught.value)
    assert "(4)" in str(caught.value)
    # the tenant's budget caps it too, and min_tokens is checked against the capped limit
    with pytest.raises(InvalidRequestError) as caught:
        resolve_max_tokens(unset, prompt_tokens=10, max_model_len=64, budget=15.0)
    assert caught.value.field == "min_tokens" and "(5)" in str(caught.value)
    explicit = SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(InvalidRequestError, match=r"min_tokens \(4\).*max_tokens \(3\)"):
        resolve_max_tokens(explicit, prompt_tokens=1, max_model_len=64)


def test_a_tenant_budget_caps_max_tokens_none_and_refuses_a_prompt_over_it() -> None:
    params = SamplingParams(max_tokens=None)
    assert resolve_max_tokens(params, prompt_tokens=10, max_model_len=64, budget=20.0) == 10
    assert resolve_max_tokens(params, prompt_tokens=10, max_model_len=64, budget=1e9) == 54
    # an explicit max_tokens is not capped: admit refuses it if it costs more than the burst
    explicit = SamplingParams(max_tokens=40)
    assert resolve_max_tokens(explicit, prompt_tokens=10, max_model_len=64, budget=20.0) == 40
    with pytest.raises(InvalidRequestError) as caught:
        resolve_max_tokens(params, prompt_tokens=30, max_model_len=64, budget=20.0, tenant="t")
    assert caught.value.field == "prompt" and "30 tokens" in str(caught.value)
    assert "tenant t" in str(caught.value)
