"""Protobuf ↔ Python conversions: sampling parameters (every field, defaults when unset),
prompts of each shape, and engine outputs as stream responses."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.server import generation_pb2 as pb
from pipeline.server.convert import (
    SAMPLING_FIELDS,
    finish_reason_name,
    model_info_to_proto,
    prompt_from_proto,
    request_to_proto,
    response_from_output,
    sampling_from_proto,
    sampling_to_proto,
)
from stages.errors import InvalidRequestError
from stages.messages import ChatMessage, EngineInfo, Logprobs, RequestOutput
from stages.params import SamplingParams
from stages.structured.params import StructuredOutputsParams

INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)


def test_every_sampling_field_has_a_proto_field_with_presence() -> None:
    proto_fields = dict(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert not proto_fields.pop("until_model_len").has_presence  # max_tokens=None
    assert set(proto_fields) == set(SAMPLING_FIELDS)
    for name, field in proto_fields.items():
        repeated = name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids",
                            "bad_words")  # fmt: skip
        assert field.has_presence != repeated, name


@given(
    bias=st.dictionaries(INT64, FLOATS, max_size=4),
    allowed=st.lists(INT64, max_size=4),
    words=st.lists(st.text(max_size=5), max_size=3),
)
def test_token_rules_round_trip(
    bias: dict[int, float], allowed: list[int], words: list[str]
) -> None:
    """``logit_bias`` (a map), ``allowed_token_ids`` (none: empty) and ``bad_words``."""
    params = SamplingParams(logit_bias=bias, allowed_token_ids=allowed or None, bad_words=words)
    message = pb.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    assert sampling_from_proto(message) == params


def test_unset_fields_are_the_vllm_defaults() -> None:
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()
    assert sampling_to_proto(SamplingParams()).ByteSize() == 0
    # an explicit value equal to the default is still that value
    explicit = pb.SamplingParams(temperature=1.0, max_tokens=16)
    assert sampling_from_proto(explicit) == SamplingParams()


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(json='{"type": "object"}', disable_any_whitespace=True),
        StructuredOutputsParams(json='{"type": "object"}', disable_additional_properties=True),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex="[0-9]+"),
        StructuredOutputsParams(choice=("yes", "no", "")),
        StructuredOutputsParams(grammar='start: "a"'),
    ],
)
def test_structured_outputs_travel_in_a_oneof(constraint: StructuredOutputsParams) -> None:
    params = SamplingParams(structured_outputs=constraint)
    message = sampling_to_proto(params)
    assert message.structured_outputs.WhichOneof("constraint") == constraint.kind
    assert sampling_from_proto(pb.SamplingParams.FromString(message.SerializeToString())) == params


def test_a_constraint_the_oneof_cannot_carry_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        sampling_to_proto(
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", grammar="b"))
        )
    assert caught.value.field == "structured_outputs"
    # an empty oneof arrives as a constraint with none set: the engine names it
    empty = sampling_from_proto(pb.SamplingParams(structured_outputs=pb.StructuredOutputs()))
    assert empty.structured_outputs == StructuredOutputsParams()


def test_max_tokens_none_travels_as_until_model_len() -> None:
    message = sampling_to_proto(SamplingParams(max_tokens=None, temperature=0.0))
    assert message.until_model_len and not message.HasField("max_tokens")
    assert sampling_from_proto(message) == SamplingParams(max_tokens=None, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="not both") as caught:
        sampling_from_proto(pb.SamplingParams(max_tokens=5, until_model_len=True))
    assert caught.value.field == "until_model_len"


@settings(deadline=None)
@given(
    max_tokens=INT64,
    temperature=FLOATS,
    top_p=FLOATS,
    top_k=INT64,
    min_p=FLOATS,
    penalty=FLOATS,
    seed=st.none() | INT64,
    stop=st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.lists(INT64, max_size=3),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    logprobs=st.none() | INT64,
    priority=INT64,
)
def test_sampling_parameters_round_trip(
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    penalty: float,
    seed: int | None,
    stop: list[str],
    stop_token_ids: list[int],
    flags: tuple[bool, bool, bool],
    logprobs: int | None,
    priority: int,
) -> None:
    """Any value the proto can carry arrives unchanged, valid or not (the engine validates)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=penalty,
        presence_penalty=-penalty,
        frequency_penalty=penalty / 2,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=flags[0],
        min_tokens=max_tokens // 2,
        logprobs=logprobs,
        include_stop_str_in_output=flags[1],
        skip_special_tokens=flags[2],
        priority=priority,
    )
    wire = pb.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    assert sampling_from_proto(wire) == params


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"seed": -(2**64)}, "seed"),
        ({"top_p": "x"}, "top_p"),
    ],
)
def test_unsendable_values_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        sampling_to_proto(dataclasses.replace(SamplingParams(), **changes))  # type: ignore[arg-type]
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("plain text", "plain text"),
        ([5, 6, 7], [5, 6, 7]),
        ([{"role": "user", "content": "hi"}], [ChatMessage("user", "hi")]),
        ([{"content": "no role"}], [ChatMessage("user", "no role")]),
        ([ChatMessage("system", "s"), ChatMessage("user", "u")], None),
    ],
)
def test_prompts_round_trip(prompt: object, expected: object) -> None:
    request = request_to_proto(prompt, request_id="r1", chat_template=True)  # type: ignore[arg-type]
    wire = pb.GenerateRequest.FromString(request.SerializeToString())
    assert prompt_from_proto(wire) == (prompt if expected is None else expected)
    assert wire.request_id == "r1" and wire.chat_template
    assert not wire.HasField("sampling_params")


@pytest.mark.parametrize(
    ("prompt", "field"),
    [([], "prompt"), (b"x", "prompt"), ([1, "a"], "prompt"), ([2**40], "prompt_token_ids")],
)
def test_prompts_of_another_shape_are_refused(prompt: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        request_to_proto(prompt)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_a_request_without_input_names_the_input() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        prompt_from_proto(pb.GenerateRequest())
    assert caught.value.field == "input"


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.GenerateRequest(messages=pb.ChatMessages()), "messages"),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids"),
    ],
)
def test_an_empty_input_list_names_its_proto_field(
    request_: pb.GenerateRequest, field: str
) -> None:
    wire = pb.GenerateRequest.FromString(request_.SerializeToString())
    assert wire.WhichOneof("input") == field  # set, though empty
    with pytest.raises(InvalidRequestError, match="at least one") as caught:
        prompt_from_proto(wire)
    assert caught.value.field == field


def test_responses_carry_only_the_new_tokens_and_finish_on_the_last() -> None:
    logprobs = tuple(Logprobs(t, -0.5 * t, 1, (t, 9), (-0.5 * t, -3.0)) for t in (4, 5, 6))
    running = RequestOutput("engine-id", "ab", "b", (4, 5), None, None, logprobs[:2], 7, 3)
    response = response_from_output(running, "client-id", 1)
    assert (response.request_id, response.delta, list(response.token_ids)) == (
        "client-id",
        "b",
        [5],
    )
    assert [entry.token_id for entry in response.logprobs] == [5]
    assert list(response.logprobs[0].top_token_ids) == [5, 9]
    assert response.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert not response.HasField("usage") and response.WhichOneof("stop_reason") is None

    done = RequestOutput("engine-id", "abc", "c", (4, 5, 6), "stop", "END", logprobs, 7, 3)
    last = response_from_output(done, "client-id", 2)
    assert list(last.token_ids) == [6] and finish_reason_name(last.finish_reason) == "stop"
    assert last.stop_string == "END"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (
        7,
        3,
        3,
    )
    by_token = response_from_output(dataclasses.replace(done, stop_reason=2), "c", 3)
    assert by_token.stop_token_id == 2 and len(by_token.token_ids) == 0


def test_model_info_reports_the_kv_capacity() -> None:
    info = EngineInfo("m", 49152, 2048, (2,), 100, 16, "float32", "cpu", 1 << 20, True)
    message = model_info_to_proto(info, "priority")
    assert (message.kv_cache_blocks, message.block_size, message.kv_cache_tokens) == (100, 16, 1600)
    assert (message.draft_model, message.draft_kv_cache_blocks, message.draft_host) == ("", 0, "")
    # a draft model's own KV cache (docs/speculative.md)
    drafting = dataclasses.replace(
        info,
        draft_model="d",
        draft_num_blocks=100,
        draft_kv_cache_bytes=1 << 18,
        draft_host="engine_draft",
    )
    message = model_info_to_proto(drafting, "priority")
    assert (message.draft_model, message.draft_kv_cache_blocks) == ("d", 100)
    assert (message.draft_kv_cache_bytes, message.draft_host) == (1 << 18, "engine_draft")
    assert (message.scheduler, message.max_model_len, list(message.eos_token_ids)) == (
        "priority",
        2048,
        [2],
    )
