"""Structured outputs: the constraint a request's output must match, in vLLM's shape.

``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` sets exactly one of
``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of a
list of strings) or ``grammar`` (a Lark grammar, as llguidance reads it, or GBNF, which is
translated), as vLLM's ``StructuredOutputsParams`` does. Pure logic: construction only
normalizes (a schema given as a dict or bool is stored as its JSON text, a list of choices
as a tuple), :func:`validate_structured_outputs` checks the shape and names the field. Whether
the grammar itself compiles (an unsupported schema keyword, a regex with look-ahead) is the
grammar backend's answer, given when the schedule stage compiles it (see
``docs/architecture.md`` §11, "Structured outputs").
"""

from __future__ import annotations

import dataclasses
import json as _json
from typing import Any

from stages.checks import check_text
from stages.errors import InvalidRequestError
from transports.codec import message

__all__ = [
    "KINDS",
    "MAX_CHOICES",
    "MAX_SPEC_CHARS",
    "StructuredOutputsParams",
    "closed_objects",
    "validate_structured_outputs",
]

#: the constraint kinds, as the fields that set them are named
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: the longest schema, regex or grammar text (and the most characters of all choices): the
#: schedule stage compiles it, and every front end parses a schema once to check it
MAX_SPEC_CHARS = 256 * 1024
#: the most strings ``choice`` may list
MAX_CHOICES = 1024


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """The constraint of one request (vLLM's ``StructuredOutputsParams``); exactly one of
    the first five fields is set.

    ``json``: a JSON schema, as JSON text (a dict or bool given here is stored as its text,
    property order kept). ``json_object``: any JSON object. ``regex``: the whole output
    matches it. ``choice``: the output is one of these strings. ``grammar``: a Lark grammar
    (llguidance's dialect) or a GBNF one (``root ::= ...``). ``disable_any_whitespace``: JSON
    without whitespace between tokens (vLLM's option of the same name; by default any
    whitespace is allowed, as in vLLM). ``disable_additional_properties``: a schema's objects
    that list ``properties`` but say nothing of ``additionalProperties`` allow no other keys
    (vLLM's option of the same name; by default JSON Schema's rule holds, any other key is
    allowed, which lets a small model add keys without end).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        schema: Any = self.json
        if isinstance(schema, (dict, bool)):
            try:
                object.__setattr__(self, "json", _json.dumps(schema, ensure_ascii=False))
            except (TypeError, ValueError):
                pass  # left as it is: validation names the field
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The one constraint set (``"json"``, ``"regex"``, ...); ``""`` when none is."""
        chosen = _chosen(self)
        return chosen[0] if len(chosen) == 1 else ""

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """What identifies the compiled grammar (the compile cache's key): the kind, its
        text (choices joined as JSON) and the two options."""
        kind = self.kind
        if kind == "json_object":
            text = ""
        elif kind == "choice":
            text = _json.dumps(list(self.choice or ()), ensure_ascii=False)
        else:
            text = str(getattr(self, kind, "") or "")
        return (kind, text, self.disable_any_whitespace, self.disable_additional_properties)


#: keywords whose value is a map of subschemas, a subschema, or a list of subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "allOf", "oneOf")


def closed_objects(schema: str) -> str:
    """``schema`` (JSON text) with ``"additionalProperties": false`` added to every object
    schema in it that has ``properties`` or ``patternProperties`` and no
    ``additionalProperties`` of its own, at any depth (what ``disable_additional_properties``
    asks of a backend). vLLM's ``process_for_additional_properties``
    (``vllm/v1/structured_output/backend_guidance.py``) closes the same objects; this walk
    follows the subschema keywords only, so a property *named* ``properties`` is not taken
    for a schema.

    Raises:
        ValueError: ``schema`` is not JSON.
    """

    def close(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        closed = dict(node)
        for keyword in _SCHEMA_MAPS:
            if isinstance(closed.get(keyword), dict):
                closed[keyword] = {name: close(sub) for name, sub in closed[keyword].items()}
        for keyword in _SCHEMA_ONE:
            if isinstance(closed.get(keyword), dict):
                closed[keyword] = close(closed[keyword])
        for keyword in _SCHEMA_LISTS:
            if isinstance(closed.get(keyword), list):
                closed[keyword] = [close(sub) for sub in closed[keyword]]
        if "additionalProperties" not in closed and (
            "properties" in closed or "patternProperties" in closed
        ):
            closed["additionalProperties"] = False
        return closed

    return _json.dumps(close(_json.loads(schema)), ensure_ascii=False)


def _chosen(params: StructuredOutputsParams) -> list[str]:
    """The constraints ``params`` sets, in :data:`KINDS` order (an empty string or list counts
    as set: it is refused as empty, not taken for "unset")."""
    return [
        kind
        for kind in KINDS
        if (
            params.json_object is True
            if kind == "json_object"
            else getattr(params, kind) is not None
        )
    ]


def validate_structured_outputs(
    params: StructuredOutputsParams | None, *, request_id: str | None = None
) -> None:
    """Check the shape of ``params`` (None passes): exactly one constraint, of the right
    type, not empty, within the size limits; a schema must parse as JSON and be an object or
    a boolean.

    Raises:
        InvalidRequestError: naming the field (``structured_outputs`` or
            ``structured_outputs.<field>``).
    """
    if params is None:
        return

    def fail(field: str, problem: str) -> None:
        name = f"structured_outputs.{field}" if field else "structured_outputs"
        raise InvalidRequestError(f"{name} {problem}", field=name, request_id=request_id)

    if not isinstance(params, StructuredOutputsParams):
        fail("", f"must be a StructuredOutputsParams, got {type(params).__name__}")
    for flag in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
        if type(getattr(params, flag)) is not bool:
            fail(flag, "must be a boolean")
    chosen = _chosen(params)
    if len(chosen) != 1:
        got = " and ".join(chosen) if chosen else "none"
        fail("", f"must set exactly one of {', '.join(KINDS)}; got {got}")
    kind = chosen[0]
    if kind == "json_object":
        return
    if kind == "choice":
        choices = params.choice
        if not isinstance(choices, tuple) or not all(isinstance(c, str) for c in choices):
            fail("choice", "must be a list of strings")
        assert choices is not None
        if not choices:
            fail("choice", "must list at least one string")
        if len(choices) > MAX_CHOICES:
            fail("choice", f"may list at most {MAX_CHOICES} strings, got {len(choices)}")
        if sum(len(c) for c in choices) > MAX_SPEC_CHARS:
            fail("choice", f"may hold at most {MAX_SPEC_CHARS} characters in all")
        for index, text in enumerate(choices):  # text every link carries (a UTF-8 form)
            check_text(
                "structured_outputs.choice",
                text,
                request_id=request_id,
                where=f"structured_outputs.choice[{index}]",
            )
        return
    text = getattr(params, kind)
    if not isinstance(text, str):
        what = (
            "a JSON schema (an object or a boolean, or its JSON text)"
            if kind == "json"
            else "a string"
        )
        fail(kind, f"must be {what}, got {type(text).__name__}")
    if not text.strip():
        fail(kind, "must not be empty")
    if len(text) > MAX_SPEC_CHARS:
        fail(kind, f"may be at most {MAX_SPEC_CHARS} characters, got {len(text)}")
    if "\x00" in text:
        fail(kind, "must not contain a NUL character")
    check_text(f"structured_outputs.{kind}", text, request_id=request_id)  # a UTF-8 form
    if kind == "json":
        try:
            schema = _json.loads(text)
        except (ValueError, RecursionError) as exc:
            fail("json", f"is not valid JSON: {exc}")
        if not isinstance(schema, (dict, bool)):
            fail("json", f"must be a JSON object or boolean, got {type(schema).__name__}")
