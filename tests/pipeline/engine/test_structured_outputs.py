"""Structured outputs through the LLM façade on the real default model (SmolLM2-135M): a dozen
JSON schemas at temperature 0 and 0.8 give JSON that validates, regexes and choices match, a
grammar the model cannot finish ends at max_tokens on a valid prefix, free requests batched
with constrained ones get the tokens they get alone, bad constraints are typed errors that
leave the engine serving, and all of it survives preemption, prefix caching, seeds, stop
strings and streaming. One engine serves the module; its KV cache is small on purpose, so
the big batch is preempted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from pipeline import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from stages.structured.llguidance import LLGuidanceBackend
from stages.tokenize import load_tokenizer

# NOTE: the time bound is for a loaded 2-core machine; on a quiet one the module takes ~1 min.
pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON,
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"],
        "additionalProperties": False,
    },
    "array of numbers": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "maximum": 100},
                "minItems": 2,
                "maxItems": 5,
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "company": {"type": "string", "maxLength": 30},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["company", "address"],
        "additionalProperties": False,
    },
    "formats": {
        "type": "object",
        "properties": {
            "email": {"type": "string", "format": "email"},
            "born": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["email", "born", "id"],
        "additionalProperties": False,
    },
    "array of objects": {
        "type": "array",
        "items": PERSON,
        "minItems": 1,
        "maxItems": 3,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "any of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "nullable and const": {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "note": {"type": ["string", "null"], "maxLength": 40},
        },
        "required": ["version", "note"],
        "additionalProperties": False,
    },
    "integer range": {
        "type": "object",
        "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
        },
        "required": ["year", "month"],
        "additionalProperties": False,
    },
    "string lengths": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 3, "maxLength": 6},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["code", "tags"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "pages": {"type": "integer", "minimum": 1},
            "isbn": {"type": "string", "pattern": "^[0-9]{13}$"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}


def ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{what} Answer in JSON only."}]


def json_params(schema: dict[str, Any], temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=200,
        temperature=temperature,
        seed=seed if temperature else None,
        structured_outputs=StructuredOutputsParams(json=schema),  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # NOTE: 64 blocks of 16 tokens hold about half of the 24-request batch below at its
    # longest, so it is preempted (and resumed) on the way.
    with LLM("smollm2-135m", transport="memory", num_blocks=64) as engine:
        yield engine


def test_json_schemas_validate_at_temperature_0_and_0_8(llm: LLM) -> None:
    names = list(SCHEMAS)
    assert len(names) >= 10
    prompts = [ask(f"Give an example of {name}.") for name in names]
    params = [json_params(SCHEMAS[n], 0.0, 0) for n in names]
    params += [json_params(SCHEMAS[n], 0.8, i) for i, n in enumerate(names)]
    outputs = llm.generate(prompts * 2, params, use_tqdm=False)
    for index, output in enumerate(outputs):
        name = names[index % len(names)]
        assert output.finish_reason == "stop", (name, output.text)
        jsonschema.validate(json.loads(output.text), SCHEMAS[name])
    stats = llm.engine.stats
    assert stats is not None and stats.num_preemptions > 0


def test_disable_additional_properties_closes_an_open_schema(llm: LLM) -> None:
    """A schema that says nothing of additionalProperties lets this model add keys until
    max_tokens (JSON Schema allows them); closed, the same request ends with the schema's
    keys alone."""
    open_schema = {key: value for key, value in PERSON.items() if key != "additionalProperties"}
    prompt = ask("Give me a person as JSON.")

    def params(closed: bool) -> SamplingParams:
        constraint = StructuredOutputsParams(
            json=open_schema,  # type: ignore[arg-type]
            disable_additional_properties=closed,
        )
        return SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=constraint)

    free, closed = llm.generate([prompt, prompt], [params(False), params(True)], use_tqdm=False)
    assert free.finish_reason == "length", free.text  # keys without end
    assert closed.finish_reason == "stop", closed.text
    answer = json.loads(closed.text)
    jsonschema.validate(answer, PERSON)  # PERSON itself is closed
    assert set(answer) == {"name", "age"}


def test_regex_choice_json_object_and_grammar_match(llm: LLM) -> None:
    cases = [
        (
            ask("What is a phone number?"),
            StructuredOutputsParams(regex=r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
        ),
        (ask("Is the sky blue?"), StructuredOutputsParams(choice=("yes", "no"))),
        (ask("Pick a fruit."), StructuredOutputsParams(choice=("apple", "banana", "cherry"))),
        (
            ask("Write Bob, aged 30, as a JSON object with the keys name and age."),
            StructuredOutputsParams(json_object=True),
        ),
        (
            ask("Add two numbers."),
            StructuredOutputsParams(grammar='root ::= [1-9] " + " [1-9] " = " [0-9]+'),
        ),
    ]
    outputs = llm.generate(
        [prompt for prompt, _ in cases],
        [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=c) for _, c in cases],
        use_tqdm=False,
    )
    texts = [o.text for o in outputs]
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", texts[0]), texts[0]
    assert texts[1] in ("yes", "no") and texts[2] in ("apple", "banana", "cherry")
    assert isinstance(json.loads(texts[3]), dict)
    assert re.fullmatch(r"[1-9] \+ [1-9] = [0-9]+", texts[4]), texts[4]
    assert all(o.finish_reason == "stop" for o in outputs), texts


def test_an_unfinished_grammar_ends_at_max_tokens_on_a_valid_prefix(llm: LLM) -> None:
    """The model would end with EOS long before; the grammar forbids it until 300 'words'."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 300}
    (output,) = llm.generate(
        [ask("List three colors.")],
        SamplingParams(
            max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
        ),  # type: ignore[arg-type]
        use_tqdm=False,
    )
    assert output.finish_reason == "length" and len(output.token_ids) == 24
    tokenizer = load_tokenizer("smollm2-135m")
    backend = LLGuidanceBackend(tokenizer, 49152, [2])
    matcher = backend.compile(StructuredOutputsParams(json=json.dumps(schema))).matcher()
    assert all(matcher.accept_token(t) for t in output.token_ids)
    assert not matcher.is_terminated()


def test_free_requests_batched_with_constrained_ones_get_the_same_tokens(llm: LLM) -> None:
    free_prompts = [ask("Tell me about the ocean."), ask("Write a haiku about rain.")]
    free = SamplingParams(max_tokens=16, temperature=0.0)
    alone = llm.generate(free_prompts, free, use_tqdm=False)
    mixed = llm.generate(
        [free_prompts[0], ask("Who is Ada?"), free_prompts[1], ask("Is it day?")],
        [
            free,
            json_params(PERSON, 0.0, 0),
            free,
            SamplingParams(
                max_tokens=4,
                temperature=0.0,
                structured_outputs=StructuredOutputsParams(choice=("yes", "no")),
            ),
        ],
        use_tqdm=False,
    )
    assert [o.token_ids for o in alone] == [mixed[0].token_ids, mixed[2].token_ids]
    jsonschema.validate(json.loads(mixed[1].text), PERSON)


def test_bad_constraints_are_typed_errors_and_the_engine_keeps_serving(llm: LLM) -> None:
    bad = [
        (StructuredOutputsParams(json='{"type": "strin"}'), "structured_outputs.json"),
        (
            StructuredOutputsParams(json='{"type": "array", "uniqueItems": true}'),
            "structured_outputs.json",
        ),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
        (StructuredOutputsParams(regex="(a)\\1"), "structured_outputs.regex"),
        (StructuredOutputsParams(regex="[0-9]+", choice=("a",)), "structured_outputs"),
        (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
    ]
    for constraint, field in bad:
        with pytest.raises(InvalidRequestError) as caught:
            llm.generate(
                [ask("Hi.")],
                SamplingParams(max_tokens=8, structured_outputs=constraint),
                use_tqdm=False,
            )
        assert caught.value.field == field, (constraint, caught.value)
    (output,) = llm.generate([ask("Who is Ada?")], json_params(PERSON, 0.0, 0), use_tqdm=False)
    jsonschema.validate(json.loads(output.text), PERSON)


def test_seeds_prefix_cache_stop_strings_and_streaming(llm: LLM) -> None:
    prompt = ask("Give me a person with a name and an age.")
    seeded = [json_params(PERSON, 1.0, 7), json_params(PERSON, 1.0, 7), json_params(PERSON, 0.0, 0)]
    first = llm.generate([prompt] * 3, seeded, use_tqdm=False)
    assert first[0].token_ids == first[1].token_ids  # same seed, same tokens
    again = llm.generate([prompt], seeded[2], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first[2].token_ids
    for output in (*first, again):
        jsonschema.validate(json.loads(output.text), PERSON)
    # a stop string cuts the constrained output like any other
    stopped = SamplingParams(
        max_tokens=200,
        temperature=0.0,
        stop=[","],
        structured_outputs=StructuredOutputsParams(json=PERSON),  # type: ignore[arg-type]
    )
    (cut,) = llm.generate([prompt], stopped, use_tqdm=False)
    assert cut.finish_reason == "stop" and cut.stop_reason == ","
    assert first[2].text.startswith(cut.text) and "," not in cut.text

    async def stream() -> tuple[str, str]:
        text, final = "", ""
        async for output in llm.engine.generate(prompt, seeded[2]):
            text += output.delta
            final = output.text
        return text, final

    text, final = llm._loop.run(stream())
    assert text == final == first[2].text
