"""Grammar backends: the engine that turns a structured-outputs constraint into a matcher.

A backend is a plugin of the ``actorline.grammars`` entry-point group (protocol version 1,
checked by :mod:`plugins`); the built-in ``llguidance`` (:mod:`stages.structured.llguidance`) was
chosen over xgrammar by measurement (``docs/performance.md``, "Grammar engines"). The schedule
stage's :class:`~stages.structured.manager.GrammarManager` is its only user:

- :meth:`GrammarBackend.compile` turns a :class:`~stages.structured.params.StructuredOutputsParams`
  into a :class:`CompiledGrammar` (on a worker thread; the result is cached by the
  constraint's key), or raises :class:`GrammarCompileError` with the engine's reason;
- :meth:`CompiledGrammar.matcher` starts one request's :class:`GrammarMatcher`, which accepts
  each sampled token (and can roll back);
- :meth:`GrammarBackend.fill_bitmask` writes the tokens each matcher allows next into a token
  bitmask for the whole batch, which the sampler applies (:mod:`stages.execute.grammar_mask`).

The bitmask layout is the one xgrammar and llguidance share: ``int32`` words, row ``i`` for
the ``i``-th matcher, token ``t`` allowed when bit ``t % 32`` of word ``t // 32`` is set.
Pure logic: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from plugins import GRAMMARS, load
from stages.structured.params import StructuredOutputsParams

__all__ = [
    "API_VERSION",
    "BITMASK_DTYPE",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCompileError",
    "GrammarMatcher",
    "bitmask_width",
    "load_grammar_backend",
]

API_VERSION = 1
BITMASK_DTYPE = np.int32


def bitmask_width(vocab_size: int) -> int:
    """The ``int32`` words one bitmask row needs for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class GrammarCompileError(ValueError):
    """The backend cannot compile a constraint (invalid, or it uses a feature the backend
    does not implement); the message is the backend's reason."""


@runtime_checkable
class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``. Returns False when the grammar does not allow it (the
        matcher then allows only end-of-sequence). Tokens after the grammar is complete are
        ignored (True)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and has accepted the end of sequence (or can
        accept nothing more): only end-of-sequence is allowed next."""
        ...

    # A matcher may also have ``error() -> str | None``: why it failed (a limit of the
    # engine hit mid-way, a token refused), None while it is sound. The schedule stage
    # checks it after each token and each mask and ends a failed request with a typed
    # error; without it, only a refused token is noticed. It is not part of the protocol's
    # required methods, so backends written before it still load.


@runtime_checkable
class CompiledGrammar(Protocol):
    """A compiled constraint, shared by every request that uses it (it is cached)."""

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        ...


class GrammarBackend(Protocol):
    """A grammar engine for one tokenizer.

    Constructed once per engine as ``Backend(tokenizer, vocab_size, eos_token_ids)``: the
    model's HF tokenizer, the model's vocabulary size (it may exceed the tokenizer's) and the
    ids that end a sequence (allowed when the grammar is complete). Its ``vocab_size``
    attribute is the width its bitmasks cover, at least the model's vocabulary.
    :meth:`compile` is called on a worker thread, possibly while :meth:`fill_bitmask` runs
    on the event loop for other requests.
    """

    api_version: ClassVar[int]
    name: ClassVar[str]
    vocab_size: int

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None: ...

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile the (shape-checked) constraint.

        Raises:
            GrammarCompileError: the constraint does not compile (the backend's reason).
        """
        ...

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Write into row ``i`` of ``bitmask`` (``[len(matchers), bitmask_width(vocab_size)]``,
        :data:`BITMASK_DTYPE`, C-contiguous) the tokens ``matchers[i]`` allows next."""
        ...


def load_grammar_backend(name: str) -> type[GrammarBackend]:
    """The backend class registered as ``name`` in the ``actorline.grammars`` group.

    Raises:
        plugins.PluginError: no such backend, it fails to import, or lacks the protocol.
    """
    backend: type[GrammarBackend] = load(GRAMMARS, name)
    return backend
