"""The ``llguidance`` grammar backend (the built-in one; see :mod:`stages.structured.backend`).

Follows vLLM's ``vllm/v1/structured_output/backend_guidance.py``: the tokenizer is wrapped
once (``llguidance.hf.from_tokenizer``, about a second), each constraint becomes an llguidance
grammar (JSON schemas with flexible whitespace unless ``disable_any_whitespace``, their objects
closed to other keys with ``disable_additional_properties``, regexes,
choices as a Lark alternation, grammars as Lark or GBNF), and compiling it builds an
``LLMatcher`` that stays in the cache as a template: a request's matcher is a deep copy of it
(microseconds). Masks of a batch are filled in parallel by an ``LLExecutor``.

llguidance refuses what it does not implement (``uniqueItems``, ``not``, ``if``/``then``, an
unknown string ``format``, look-around in a regex) with an error, which becomes the request's
typed error; it never silently ignores a keyword. Compiling also computes the template's first
mask on a copy (on the compile thread, whose stack is sized for it): a constraint that fails
there (a regex that matches nothing, a lexer limit hit at once) is refused before the request
runs. A matcher that fails later (llguidance's ``LLMatcher`` enters an error state and
``get_error()`` says why: a lexer or parser limit hit mid-way, ``a{1000000}``, a grammar
whose language is empty) reports it by :meth:`_Matcher.error`, and the schedule stage ends
that request with a typed error instead of letting the all-EOS mask of a failed matcher pass
for a finished answer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import numpy as np

from stages.structured.backend import API_VERSION, GrammarCompileError, GrammarMatcher
from stages.structured.params import StructuredOutputsParams, closed_objects

__all__ = ["LLGuidanceBackend"]

#: threads that fill a batch's masks (llguidance releases the GIL)
_FILL_THREADS = max(1, min(4, os.cpu_count() or 1))
#: where llguidance's error message ends and its dump of the parser's state begins
_STATE_DUMP = "\n<state>"


def _reason(error: str) -> str:
    """llguidance's error without the parser state it appends (the tokens so far, the
    grammar's internals): the first part says what went wrong; its bare stop reason for a
    grammar with nowhere to go is spelled out."""
    reason = error.split(_STATE_DUMP, 1)[0].strip() or "the grammar failed"
    if reason in ("NoExtension", "NoExtensionBias"):
        return f"the grammar allows no token here: it matches nothing ({reason})"
    return reason


class _Matcher:
    """One request's ``LLMatcher``; tokens after the grammar stopped are not fed to it
    (vLLM's ``GuidanceGrammar.accept_tokens``)."""

    __slots__ = ("matcher", "num_accepted")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_accepted = 0  # tokens the LLMatcher consumed (rollback undoes only those)

    def accept_token(self, token_id: int) -> bool:
        if self.matcher.is_stopped():
            return True
        accepted = bool(self.matcher.consume_token(token_id))
        if accepted:
            self.num_accepted += 1
        return accepted

    def rollback(self, num_tokens: int) -> None:
        count = min(num_tokens, self.num_accepted)
        if count > 0:
            self.matcher.rollback(count)
            self.num_accepted -= count

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def error(self) -> str | None:
        """llguidance's reason the matcher failed, or None while it has not."""
        if not self.matcher.is_error():
            return None
        return _reason(str(self.matcher.get_error()))


class _Compiled:
    __slots__ = ("template",)

    def __init__(self, template: Any) -> None:
        self.template = template

    def matcher(self) -> GrammarMatcher:
        return _Matcher(self.template.deep_copy())


class LLGuidanceBackend:
    """Grammars by llguidance (see the module docstring).

    Raises:
        ImportError: llguidance is not installed.
        ValueError: the tokenizer is not a fast (Rust) HF tokenizer.
    """

    api_version: ClassVar[int] = API_VERSION
    name: ClassVar[str] = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        eos = list(eos_token_ids) or None
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=eos
        )
        self._executor = llguidance.LLExecutor(num_threads=_FILL_THREADS)

    def _grammar(self, params: StructuredOutputsParams) -> str:
        matcher = self._llguidance.LLMatcher
        options: Any = {"whitespace_flexible": not params.disable_any_whitespace}
        kind = params.kind
        if kind == "json":
            schema = params.json or ""
            if params.disable_additional_properties:
                schema = closed_objects(schema)
            return str(matcher.grammar_from_json_schema(schema, defaults=options))
        if kind == "json_object":
            return str(matcher.grammar_from_json_schema('{"type": "object"}', defaults=options))
        if kind == "regex":
            return str(matcher.grammar_from_regex(params.regex or ""))
        if kind == "choice":
            return str(
                self._llguidance.grammar_from("choice", json.dumps(list(params.choice or ())))
            )
        if kind == "grammar":
            return str(self._llguidance.grammar_from("grammar", params.grammar or ""))
        raise GrammarCompileError(f"no constraint is set (kind {kind!r})")

    def compile(self, params: StructuredOutputsParams) -> _Compiled:
        """Build the constraint's matcher (the template of every request's).

        Raises:
            GrammarCompileError: llguidance's reason the constraint does not compile.
        """
        try:
            grammar = self._grammar(params)
        except (ValueError, RecursionError) as exc:
            # a schema that is not JSON, a GBNF that does not convert, a schema nested too
            # deeply for disable_additional_properties's walk
            reason = str(exc) if isinstance(exc, ValueError) else f"nested too deeply: {exc}"
            raise GrammarCompileError(reason) from exc
        template = self._llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarCompileError(_reason(template.get_error()))
        # NOTE: the first mask on a copy, here on the compile thread: a grammar that fails
        # at its first step is refused before the request runs.
        probe = template.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarCompileError(_reason(probe.get_error()))
        return _Compiled(template)

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Fill ``bitmask``'s rows in parallel (a stopped or failed matcher allows only the
        end of sequence)."""
        if not matchers:
            return
        import llguidance.numpy

        pairs = [(cast(_Matcher, matcher).matcher, row) for row, matcher in enumerate(matchers)]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
