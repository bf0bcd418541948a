"""Hostile grammar shapes of issue 34, shared by the grammar tests: chains of rules and of
``$ref`` links that make a grammar compiler recurse once per link."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["chain_schema", "gbnf_chain", "lark_chain", "schema_objects_per_link"]


def lark_chain(rules: int) -> str:
    """A Lark grammar of ``rules`` rules, each naming the next: ``"a"`` ``rules`` times."""
    lines = ["start: r1", *(f'r{i}: "a" r{i + 1}' for i in range(1, rules - 1))]
    return "\n".join([*lines, f'r{rules - 1}: "a"'])


def gbnf_chain(rules: int) -> str:
    """The same chain in GBNF."""
    lines = ["root ::= r1", *(f'r{i} ::= "a" r{i + 1}' for i in range(1, rules - 1))]
    return "\n".join([*lines, f'r{rules - 1} ::= "a"'])


#: JSON objects each link of :func:`chain_schema` adds (the link, its ``$ref`` objects, maps)
schema_objects_per_link = {"ref": 1, "allOf": 2, "property": 3}


def chain_schema(depth: int, link: str) -> str:
    """A JSON schema whose ``$ref`` chain is ``depth`` definitions deep, each linking to the
    next by ``"$ref"`` itself, by ``"allOf": [{"$ref"}]`` or by a property whose schema is the
    ``$ref``; the last is an integer."""

    def node(i: int) -> dict[str, Any]:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        if link == "ref":
            return ref
        if link == "allOf":
            return {"allOf": [ref]}
        if link == "property":
            return {"type": "object", "properties": {"x": ref}}
        raise ValueError(link)

    defs = {f"d{i}": node(i) for i in range(depth - 1)}
    defs[f"d{depth - 1}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})
