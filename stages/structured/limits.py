"""The bounds a structured-outputs constraint must keep before it reaches the grammar compiler.

A grammar compiler recurses: llguidance compiles a Lark rule by compiling the rules it
names, depth first (``parser/src/lark/compiler.rs``, ``do_rule`` → ``do_expansions`` →
``do_atom`` → ``do_rule``), and a JSON schema by following its subschemas and ``$ref``
chains. A chain of 3,000 rules, or a ``$ref`` chain 3,000 deep, overflows an 8 MiB thread
stack, and a stack overflow in native code kills the whole process (SIGSEGV), with every
other request in it. Two bounds keep every constraint compilable on a stack of known size
(``docs/structured-outputs.md``, "Bounds"):

- ``max_rules``: the rules (and terminals) a Lark or GBNF grammar defines, or the objects
  (subschemas, and the maps that hold them) of a JSON schema. Each rule or subschema is
  entered at most once on any chain of the compiler's recursion, so this bounds its depth;
  the compile thread's stack is sized from it (:func:`compile_stack_bytes`), and
  ``tests/stages/structured/test_limits.py`` compiles chains at the bound.
  A GBNF grammar may have a quarter of that: llguidance translates it to Lark in Python, in
  time that grows with the square of its rules (``llguidance/gbnf_to_lark.py``'s
  ``resolve``: 1,000 rules about 1 s, 2,000 about 4 s on a quiet core), holding the GIL.
- ``max_chars``: the text's length (at most :data:`~stages.structured.params.MAX_SPEC_CHARS`,
  which every front end checks already).

Nesting inside one rule or one regex is bounded by llguidance itself ("lark grammar too
deeply nested", regex nesting), and a JSON document's nesting by its JSON parser. Pure
logic.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from stages.errors import InvalidRequestError
from stages.structured.params import MAX_SPEC_CHARS, StructuredOutputsParams

__all__ = [
    "DEFAULT_MAX_RULES",
    "GBNF_SHARE",
    "MAX_RULES_LIMIT",
    "GrammarLimits",
    "check_grammar_limits",
    "compile_stack_bytes",
    "count_rules",
]

#: the default bound on a grammar's rules or a schema's objects
DEFAULT_MAX_RULES = 4000
#: the largest ``max_rules`` that may be configured (its stack: about 700 MiB of address
#: space, touched only as deep as a grammar really recurses)
MAX_RULES_LIMIT = 20000
#: a GBNF grammar may have 1/GBNF_SHARE of ``max_rules`` (its translation is quadratic)
GBNF_SHARE = 4
#: stack per rule: llguidance spends about 3 KiB per Lark rule of a chain and about 5 KiB per
#: object of a property-``$ref`` chain (measured, llguidance 1.9); 32 KiB leaves five times that
_STACK_PER_RULE = 32 * 1024
#: stack for everything else on the compile thread (Python frames, the JSON parser, llguidance
#: at the root)
_STACK_BASE = 16 * 1024 * 1024

# a Lark definition: `name:`, `?name:`, `!name:`, `name{params}:`, `NAME.2:`; a GBNF one
# `name ::=` (one definition a line in both)
_LARK_DEFINITION = re.compile(
    r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*[ \t]*(?:\{[^}\n]*\})?[ \t]*(?:\.-?[0-9]+)?[ \t]*:(?!:)",
    re.MULTILINE,
)
_GBNF_DEFINITION = re.compile(r"^[ \t]*[A-Za-z0-9_.-]+[ \t]*::=", re.MULTILINE)
# llguidance's Lark may embed a JSON schema or another grammar: `%json { ... }`, `%lark { ... }`
_NESTED = re.compile(r"%(?:json|lark)\b")


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarLimits:
    """``max_rules``: the most rules (and terminals) of a Lark or GBNF grammar, or objects of a
    JSON schema. ``max_chars``: the longest schema, regex or grammar text.

    Raises:
        ValueError: ``max_rules`` outside [1, :data:`MAX_RULES_LIMIT`], ``max_chars`` outside
            [1, :data:`~stages.structured.params.MAX_SPEC_CHARS`].
    """

    max_rules: int = DEFAULT_MAX_RULES
    max_chars: int = MAX_SPEC_CHARS

    def __post_init__(self) -> None:
        if type(self.max_rules) is not int or not 1 <= self.max_rules <= MAX_RULES_LIMIT:
            raise ValueError(
                f"max_rules must be an integer in [1, {MAX_RULES_LIMIT}], got {self.max_rules!r}"
            )
        if type(self.max_chars) is not int or not 1 <= self.max_chars <= MAX_SPEC_CHARS:
            raise ValueError(
                f"max_chars must be an integer in [1, {MAX_SPEC_CHARS}], got {self.max_chars!r}"
            )


def compile_stack_bytes(limits: GrammarLimits) -> int:
    """The stack the compile thread needs for the deepest grammar ``limits`` admit."""
    return _STACK_BASE + limits.max_rules * _STACK_PER_RULE


def _count_objects(node: Any) -> int:
    """The JSON objects in ``node`` (iteratively: a deep document must not exhaust Python's
    stack here)."""
    count = 0
    pending = [node]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            count += 1
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return count


def count_rules(params: StructuredOutputsParams) -> int:
    """What :attr:`GrammarLimits.max_rules` counts in ``params``: a grammar's definitions (and,
    where it embeds ``%json`` or ``%lark``, every ``{``, conservatively), a JSON schema's
    objects; 0 for the other kinds.

    Raises:
        ValueError: the schema is not JSON (or too deeply nested to parse).
    """
    kind = params.kind
    if kind == "grammar":
        text = params.grammar or ""
        count = len(_GBNF_DEFINITION.findall(text)) + len(_LARK_DEFINITION.findall(text))
        if _NESTED.search(text):
            count += text.count("{")
        return count
    if kind == "json":
        try:
            return _count_objects(json.loads(params.json or ""))
        except RecursionError as exc:
            raise ValueError(f"is nested too deeply to parse: {exc}") from exc
    return 0


def check_grammar_limits(
    params: StructuredOutputsParams, limits: GrammarLimits, *, request_id: str | None = None
) -> None:
    """Check ``params`` (shape-checked already) against ``limits``.

    Raises:
        InvalidRequestError: over a bound, naming the field (``structured_outputs.<kind>``),
            what it holds, the bound and the engine option that sets it.
    """
    kind = params.kind
    field = f"structured_outputs.{kind}"
    text = params.key[1]
    if len(text) > limits.max_chars:
        raise InvalidRequestError(
            f"{field} may be at most {limits.max_chars} characters (the engine's "
            f"grammar_max_chars), got {len(text)}",
            field=field,
            request_id=request_id,
        )
    try:
        rules = count_rules(params)
    except ValueError as exc:
        raise InvalidRequestError(f"{field} {exc}", field=field, request_id=request_id) from exc
    if kind == "grammar" and _GBNF_DEFINITION.search(params.grammar or ""):
        most = max(1, limits.max_rules // GBNF_SHARE)
        if rules > most:
            raise InvalidRequestError(
                f"{field} has {rules} GBNF rules; at most {most} are allowed (a quarter of the "
                f"engine's grammar_max_rules: GBNF is translated to Lark in time that grows "
                f"with the square of its rules)",
                field=field,
                request_id=request_id,
            )
    if rules > limits.max_rules:
        what = "objects (subschemas and their maps)" if kind == "json" else "rules"
        raise InvalidRequestError(
            f"{field} has {rules} {what}; at most {limits.max_rules} are allowed (the engine's "
            f"grammar_max_rules), so that compiling it stays within the compile thread's stack",
            field=field,
            request_id=request_id,
        )
