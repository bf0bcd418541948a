"""Tests of stages/structured/params.py: vLLM's shape, exactly one constraint, named fields,
and the codec carries it."""

from __future__ import annotations

import json

import pytest

from stages.errors import InvalidRequestError
from stages.params import SamplingParams, validate_sampling
from stages.structured.params import (
    MAX_CHOICES,
    MAX_SPEC_CHARS,
    StructuredOutputsParams,
    closed_objects,
    validate_structured_outputs,
)
from transports.codec import Codec


def test_a_schema_given_as_a_dict_is_kept_as_its_json_text_in_order() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    params = StructuredOutputsParams(json=schema)  # type: ignore[arg-type]
    assert params.json == json.dumps(schema)
    assert list(json.loads(params.json)["properties"]) == ["b", "a"]
    assert params.kind == "json"
    assert StructuredOutputsParams(choice=["x", "y"]).choice == ("x", "y")  # type: ignore[arg-type]
    validate_structured_outputs(params)


def test_closed_objects_closes_every_object_schema_that_lists_properties() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "string"},  # a property named so is not a schema keyword
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
        },
        "anyOf": [{"properties": {"z": {}}}, {"type": "object"}],
        "$defs": {"d": {"patternProperties": {"^a": {}}}},
    }
    closed = json.loads(closed_objects(json.dumps(schema)))
    assert closed["additionalProperties"] is False
    inner = closed["properties"]
    assert "additionalProperties" not in inner["properties"]
    assert inner["inner"]["additionalProperties"] is False
    assert inner["open"]["additionalProperties"] is True  # its own word is kept
    assert inner["list"]["items"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["anyOf"][1]  # no properties listed
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed_objects("true") == "true"
    with pytest.raises(ValueError):
        closed_objects("{not json")


def test_keys_tell_constraints_apart() -> None:
    keys = {
        StructuredOutputsParams(json='{"type": "string"}').key,
        StructuredOutputsParams(json='{"type": "string"}', disable_any_whitespace=True).key,
        StructuredOutputsParams(json='{"type": "string"}', disable_additional_properties=True).key,
        StructuredOutputsParams(regex='{"type": "string"}').key,
        StructuredOutputsParams(grammar='{"type": "string"}').key,
        StructuredOutputsParams(choice=("a,b",)).key,
        StructuredOutputsParams(choice=("a", "b")).key,
        StructuredOutputsParams(json_object=True).key,
    }
    assert len(keys) == 8


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        (StructuredOutputsParams(), "structured_outputs", "got none"),
        (
            StructuredOutputsParams(json="{}", regex="a+"),
            "structured_outputs",
            "got json and regex",
        ),
        (
            StructuredOutputsParams(json_object=True, choice=("a",)),
            "structured_outputs",
            "got json_object and choice",
        ),
        (StructuredOutputsParams(json="{nope"), "structured_outputs.json", "not valid JSON"),
        (StructuredOutputsParams(json="[1, 2]"), "structured_outputs.json", "object or boolean"),
        (StructuredOutputsParams(json=3), "structured_outputs.json", "JSON schema"),  # type: ignore[arg-type]
        (StructuredOutputsParams(json="  "), "structured_outputs.json", "empty"),
        (StructuredOutputsParams(regex=""), "structured_outputs.regex", "empty"),
        (StructuredOutputsParams(regex="a\x00"), "structured_outputs.regex", "NUL"),
        (StructuredOutputsParams(grammar=["start"]), "structured_outputs.grammar", "string"),  # type: ignore[arg-type]
        (StructuredOutputsParams(choice=()), "structured_outputs.choice", "at least one"),
        (StructuredOutputsParams(choice=("a", 2)), "structured_outputs.choice", "strings"),  # type: ignore[arg-type]
        (StructuredOutputsParams(choice="ab"), "structured_outputs.choice", "strings"),  # type: ignore[arg-type]
        (
            StructuredOutputsParams(choice=("c",) * (MAX_CHOICES + 1)),
            "structured_outputs.choice",
            "at most",
        ),
        (
            StructuredOutputsParams(regex="a" * (MAX_SPEC_CHARS + 1)),
            "structured_outputs.regex",
            "at most",
        ),
        (
            StructuredOutputsParams(json_object=1),  # type: ignore[arg-type]
            "structured_outputs.json_object",
            "boolean",
        ),
        (
            StructuredOutputsParams(regex="a", disable_any_whitespace="no"),  # type: ignore[arg-type]
            "structured_outputs.disable_any_whitespace",
            "boolean",
        ),
        ("json", "structured_outputs", "StructuredOutputsParams"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_field(
    params: object, field: str, words: str
) -> None:
    with pytest.raises(InvalidRequestError, match=words) as caught:
        validate_sampling(SamplingParams(structured_outputs=params), request_id="r1")  # type: ignore[arg-type]
    assert caught.value.field == field
    assert caught.value.request_id == "r1"


def test_deeply_nested_json_is_an_invalid_schema_not_a_crash() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InvalidRequestError) as caught:
        validate_structured_outputs(StructuredOutputsParams(json=deep[:MAX_SPEC_CHARS]))
    assert caught.value.field == "structured_outputs.json"


def test_the_codec_carries_structured_outputs() -> None:
    codec = Codec()
    for constraint in (
        StructuredOutputsParams(json='{"type": "object"}', disable_any_whitespace=True),
        StructuredOutputsParams(choice=("yes", "no")),
        StructuredOutputsParams(json_object=True),
        None,
    ):
        params = SamplingParams(max_tokens=3, structured_outputs=constraint)
        payload, buffers = codec.encode(params)
        assert codec.decode(payload, buffers) == params
