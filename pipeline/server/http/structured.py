"""Structured outputs over the OpenAI-compatible API: ``response_format`` and vLLM's
``structured_outputs`` extra → :class:`~stages.structured.params.StructuredOutputsParams`.

As vLLM's server reads them (``vllm/entrypoints/openai/protocol.py``):

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
  "strict": ...}}`` (JSON valid under ``schema``; ``name``, ``description`` and ``strict``
  are accepted and change nothing: the schema always binds);
- ``structured_outputs``: an object with exactly one of ``json`` (a schema, object or JSON
  text), ``json_object``, ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or
  GBNF), and optionally ``disable_any_whitespace`` and ``disable_additional_properties``.

- vLLM's legacy fields ``guided_json``, ``guided_regex``, ``guided_choice`` and
  ``guided_grammar``: aliases of ``structured_outputs``' ``json``, ``regex``, ``choice`` and
  ``grammar`` (deprecated in vLLM, which logs a warning: ``vllm/entrypoints/openai/protocol.py``;
  the server logs one and answers with a ``Warning`` header).

Two of these ways on one request (or two legacy fields), an unknown key, or a value of the
wrong shape is a 400 naming the field (``response_format`` or ``structured_outputs``, and the
key); what the grammar engine refuses (an unsupported schema keyword, a regex with
look-ahead) is the engine's 400, naming
``structured_outputs.<kind>``. See ``docs/structured-outputs.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.server.http.errors import ApiError
from stages.structured.params import StructuredOutputsParams

__all__ = ["GUIDED_ALIASES", "structured_outputs_from"]

#: the keys of vLLM's ``structured_outputs`` object that are served
_KEYS = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace",
         "disable_additional_properties")  # fmt: skip
#: vLLM's legacy request fields → the key of ``structured_outputs`` each one stands for
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}  # fmt: skip
#: keys of a ``json_schema`` response format beside ``schema`` that change nothing here
_SCHEMA_NOTES = ("name", "description", "strict")


def _refuse(param: str, problem: str) -> ApiError:
    return ApiError(400, f"{param}: {problem}", param=param, code="invalid_value")


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, Mapping):
        raise _refuse("response_format", f"must be an object, got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise _refuse(
            "response_format.type",
            f"must be 'text', 'json_object' or 'json_schema', got {kind!r:.60}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise _refuse("response_format.json_schema", "must be an object with a 'schema'")
    unknown = sorted(set(spec) - {"schema", *_SCHEMA_NOTES})
    if unknown:
        raise _refuse("response_format.json_schema", f"unknown key(s) {', '.join(unknown)}")
    schema = spec.get("schema")
    if not isinstance(schema, (Mapping, bool)):
        raise _refuse(
            "response_format.json_schema.schema",
            f"must be a JSON schema (an object), got {type(schema).__name__}",
        )
    return StructuredOutputsParams(json=dict(schema) if isinstance(schema, Mapping) else schema)  # type: ignore[arg-type]


def _from_extra(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, Mapping):
        raise _refuse("structured_outputs", f"must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise _refuse(
            "structured_outputs",
            f"unknown or unsupported key(s) {', '.join(map(str, unknown))}; served: "
            f"{', '.join(_KEYS)}",
        )
    values = {key: value[key] for key in _KEYS if value.get(key) is not None}
    if isinstance(values.get("json"), Mapping):
        values["json"] = dict(values["json"])
    if isinstance(values.get("choice"), list):
        values["choice"] = tuple(values["choice"])
    if values.get("json_object") is False:
        del values["json_object"]
    return StructuredOutputsParams(**values)


def _from_guided(guided: Mapping[str, Any]) -> StructuredOutputsParams | None:
    given = {name: value for name, value in guided.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        names = sorted(given)
        raise _refuse(names[1], f"give one of {', '.join(GUIDED_ALIASES)}, got {', '.join(names)}")
    ((name, value),) = given.items()
    try:
        return _from_extra({GUIDED_ALIASES[name]: value})
    except ApiError as error:
        raise _refuse(name, error.message.split(": ", 1)[-1]) from None


def structured_outputs_from(
    response_format: Any, structured_outputs: Any, guided: Mapping[str, Any] | None = None
) -> StructuredOutputsParams | None:
    """The constraint a body asks for with ``response_format``, ``structured_outputs`` or
    one of vLLM's legacy ``guided_*`` fields (``guided``: their values by field name, None
    for not given); None: none. Its shape is checked later, with the other sampling
    parameters.

    Raises:
        ApiError: 400 naming the field: two of these given, an unknown key, a malformed value.
    """
    from_format = None if response_format is None else _from_response_format(response_format)
    from_extra = None if structured_outputs is None else _from_extra(structured_outputs)
    if from_format is not None and from_extra is not None:
        raise _refuse("structured_outputs", "give response_format or structured_outputs, not both")
    from_guided = _from_guided(guided or {})
    if from_guided is not None:
        if response_format is not None or structured_outputs is not None:
            name = next(name for name in GUIDED_ALIASES if (guided or {}).get(name) is not None)
            other = "response_format" if response_format is not None else "structured_outputs"
            raise _refuse(name, f"give {name} (deprecated) or {other}, not both")
        return from_guided
    return from_format if from_format is not None else from_extra
