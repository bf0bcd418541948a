"""Incremental detokenization: token ids in, complete UTF-8 text out, one state per request.

Three decoding methods, chosen once per tokenizer by :class:`DetokenizerFactory`:

- ``"byte_level"`` (tokenizers whose decoder is exactly ``ByteLevel``: GPT-2, Llama 3, Qwen,
  SmolLM): every token maps to a fixed byte string, so decoding is a table lookup fed to
  Python's C UTF-8 decoder, whose non-final mode leaves an incomplete character's bytes
  for the next token. It reproduces ``tokenizers.Tokenizer.decode`` exactly (added tokens that are
  kept split the byte stream, skipped special tokens do not; invalid bytes become U+FFFD)
  and costs a fraction of a DecodeStream step. Not in vLLM; tested against the Rust decode.
- ``"decode_stream"`` (other Rust-backed tokenizers; vLLM V1 ``vllm/v1/engine/detokenizer.py``
  ``FastIncrementalDetokenizer``): a ``tokenizers.decoders.DecodeStream`` per request, primed
  with a short prompt suffix so the first token is spaced as in a full decode (decoders such
  as Llama 2's ``Strip`` drop the leading space of the very first token). ``step`` returns
  None while a multi-byte or byte-fallback character is incomplete.
- ``"window"`` (any tokenizer with ``decode``; vLLM ``detokenizer_utils.py``
  ``detokenize_incrementally``, from TGI): decode a short window with and without the pending
  tokens; emit the growth unless it ends with U+FFFD.

The state is per request and depends only on the tokens pushed, never on the engine, so it
survives preemption unchanged: a preempted request is recomputed, and only its new tokens
are pushed afterwards.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any, Final

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

__all__ = [
    "DETOKENIZE_METHODS",
    "DetokenizerClosedError",
    "DetokenizerFactory",
    "IncrementalDetokenizer",
    "InvalidTokenIdError",
]

DETOKENIZE_METHODS: Final = ("auto", "byte_level", "decode_stream", "window")

REPLACEMENT_CHAR: Final = "\ufffd"

# The C UTF-8 decoder behind bytes.decode, with control over the final incomplete character.
_utf8_decode: Final = codecs.utf_8_decode

# tokenizers raises a plain ``Exception`` with this message when a decoder's text for a longer
# sequence does not start with its text for the shorter one (non-monotonic decoders). vLLM
# matches the same text (vllm/v1/engine/detokenizer.py, INVALID_PREFIX_ERR_MSG).
INVALID_PREFIX_MESSAGE: Final = "Invalid prefix encountered"

# The prompt suffix priming a stream: the shortest suffix of at least this many tokens that
# decodes without U+FFFD, searched up to the maximum (the bounds of vLLM's fast detokenizer).
PRIME_MIN_TOKENS: Final = 4
PRIME_MAX_TOKENS: Final = 24

# Tokens of context decoded before the pending ones on the window path and in flush()
# (vLLM detokenizer_utils.py INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
CONTEXT_TOKENS: Final = 5


class InvalidTokenIdError(ValueError):
    """A pushed token id is not a non-negative integer."""


class DetokenizerClosedError(RuntimeError):
    """``push`` was called on an :class:`IncrementalDetokenizer` after ``flush``."""


def _gpt2_char_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` (tokenizers ``pre_tokenizers/byte_level.rs``):
    printable Latin-1 bytes stand for themselves, the others for code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            mapping[chr(256 + shifted)] = byte
            shifted += 1
    return mapping


def _byte_level_tables(backend: Tokenizer) -> tuple[list[bytes | None], dict[int, str]]:
    """Per token id: the bytes a ByteLevel decoder produces for it, or None for added tokens
    (whose text, returned in the dict, the Rust decoder emits verbatim)."""
    char_to_byte = _gpt2_char_to_byte()
    added = {
        token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()
    }
    vocab = backend.get_vocab(with_added_tokens=False)
    size = max([*vocab.values(), *added, -1]) + 1
    table: list[bytes | None] = [b""] * size
    for token, token_id in vocab.items():
        try:
            table[token_id] = bytes([char_to_byte[char] for char in token])
        except KeyError:
            # A character outside the byte alphabet: the decoder keeps the token's own UTF-8.
            table[token_id] = token.encode()
    for token_id in added:
        table[token_id] = None
    return table, added


def _backend_of(tokenizer: Any) -> Tokenizer | None:
    """The Rust ``tokenizers.Tokenizer`` behind ``tokenizer``, or None when it has none."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class DetokenizerFactory:
    """Builds :class:`IncrementalDetokenizer` objects for one tokenizer.

    Resolves once what every request shares (the Rust backend, the decoding method, the
    byte-level tables and special-token set), so a detokenizer per request is cheap.

    Args:
        tokenizer: a transformers tokenizer (``TokenizersBackend`` / ``PreTrainedTokenizerFast``),
            a ``tokenizers.Tokenizer``, or any object with ``decode(ids, skip_special_tokens=,
            clean_up_tokenization_spaces=)`` (window method only).
        method: one of :data:`DETOKENIZE_METHODS`; "auto" picks "byte_level" for a ByteLevel
            decoder, else "decode_stream" when there is a Rust backend, else "window".

    Raises:
        ValueError: unknown ``method``, or one the tokenizer cannot use.
        TypeError: ``tokenizer`` has neither a Rust backend nor a ``decode`` method.
    """

    __slots__ = ("_decode", "added_tokens", "backend", "byte_table", "method", "special_ids")

    def __init__(self, tokenizer: Any, *, method: str = "auto") -> None:
        if method not in DETOKENIZE_METHODS:
            raise ValueError(f"method must be one of {DETOKENIZE_METHODS}, got {method!r}")
        backend = _backend_of(tokenizer)
        if method == "auto":
            if backend is None:
                method = "window"
            elif isinstance(backend.decoder, ByteLevel):
                method = "byte_level"
            else:
                method = "decode_stream"
        if method != "window" and backend is None:
            raise ValueError(f"method {method!r} needs a tokenizer backed by tokenizers (Rust)")
        if method == "byte_level" and not isinstance(getattr(backend, "decoder", None), ByteLevel):
            raise ValueError("method 'byte_level' needs a tokenizer whose decoder is ByteLevel")
        self.method: str = method
        self.backend: Tokenizer | None = backend
        self.byte_table: list[bytes | None] = []
        self.added_tokens: dict[int, str] = {}
        self.special_ids: frozenset[int] = frozenset()
        if backend is not None:
            self.special_ids = frozenset(
                token_id
                for token_id, token in backend.get_added_tokens_decoder().items()
                if token.special
            )
            if method == "byte_level":
                self.byte_table, self.added_tokens = _byte_level_tables(backend)
            rust = backend

            def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
                return rust.decode(list(ids), skip_special_tokens=skip_special_tokens)

        elif callable(getattr(tokenizer, "decode", None)):

            def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
                text = tokenizer.decode(
                    list(ids),
                    skip_special_tokens=skip_special_tokens,
                    clean_up_tokenization_spaces=False,
                )
                return str(text)

        else:
            raise TypeError(
                "tokenizer must be a transformers tokenizer, a tokenizers.Tokenizer or have "
                f"a decode method, got {type(tokenizer).__name__}"
            )
        self._decode: Callable[[Sequence[int], bool], str] = decode

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """One-shot decode of ``token_ids`` (no cleanup of tokenization spaces)."""
        return self._decode(token_ids, skip_special_tokens)

    def create(
        self, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A new detokenizer for one request whose prompt is ``prompt_token_ids``."""
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text, incrementally.

    ``push(ids)`` returns the text those tokens complete (maybe ""): never part of a
    multi-byte character, spaced as in a full decode of prompt + output. ``flush()`` at finish
    returns what is still held back.

    NOTE: each token's text is emitted once and in order: ``text`` (every push, then the
    flush) equals the full decode of the output after the prompt (for "byte_level": exactly
    ``decode(token_ids)``). One exception: a decoder that rewrites earlier text (tokenizers'
    "Invalid prefix" error) restarts the stream, and text already emitted cannot change.

    Args:
        tokenizer: a :class:`DetokenizerFactory` (cheapest, for many requests), or anything a
            factory accepts.
        prompt_token_ids: the request's prompt, used only as decoding context.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
    """

    __slots__ = (
        "_added_tokens",
        "_backend",
        "_byte_table",
        "_closed",
        "_decode",
        "_ids",
        "_num_prime",
        "_parts",
        "_pending_bytes",
        "_pending_start",
        "_push_tokens",
        "_skip_ids",
        "_skip_special_tokens",
        "_stream",
        "_text",
        "_window_prefix_text",
        "_window_start",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        factory = tokenizer if isinstance(tokenizer, DetokenizerFactory) else None
        if factory is None:
            factory = DetokenizerFactory(tokenizer)
        self._decode = factory.decode
        self._backend = factory.backend
        self._byte_table = factory.byte_table
        self._added_tokens = factory.added_tokens
        self._skip_special_tokens = skip_special_tokens
        self._skip_ids = factory.special_ids if skip_special_tokens else frozenset()
        self._parts: list[str] = []
        self._text: str | None = ""
        self._closed = False
        self._pending_bytes = b""
        # NOTE: a ByteLevel decoder neither adds nor strips anything at the start, so
        # decode(output) already equals the output part of decode(prompt + output): no priming.
        prime = [] if factory.method == "byte_level" else self._choose_prime(prompt_token_ids)
        # NOTE: _ids holds the priming prompt suffix, then every generated token; indexes
        # below point into it. Tokens [_pending_start:] have not produced text yet.
        self._ids: list[int] = prime
        self._num_prime = len(prime)
        self._pending_start = self._num_prime
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        # Window method: decode(_ids[_window_start:_pending_start]) is _window_prefix_text.
        self._window_start = max(0, self._num_prime - CONTEXT_TOKENS)
        self._window_prefix_text = ""
        # NOTE: the method's plain function, not a bound method: a bound method of self held
        # by self is a reference cycle, which would leave every request's detokenizer to the
        # cycle collector instead of freeing it when the request ends.
        self._push_tokens: Callable[[IncrementalDetokenizer, Sequence[int]], str]
        if factory.method == "byte_level":
            self._push_tokens = IncrementalDetokenizer._push_byte_level
        elif factory.method == "decode_stream":
            self._push_tokens = IncrementalDetokenizer._push_decode_stream
        else:
            self._push_tokens = IncrementalDetokenizer._push_window
            self._window_prefix_text = self._decode(
                prime[self._window_start :], skip_special_tokens=skip_special_tokens
            )

    def _choose_prime(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt suffix that primes decoding (vLLM's suffix search, fast detokenizer).

        A short suffix is enough for spacing and keeps priming cheap for long prompts. A
        suffix starting mid-character is skipped while a clean one exists; a prompt that
        itself ends mid-character primes nothing (the character's completion would otherwise
        be emitted together with the prompt's bytes).
        """
        if not prompt_token_ids:
            return []
        prompt = list(prompt_token_ids[-PRIME_MAX_TOKENS:])
        skip = self._skip_special_tokens
        longest = len(prompt)
        for length in range(min(PRIME_MIN_TOKENS, longest), longest + 1):
            suffix = prompt[-length:]
            if REPLACEMENT_CHAR not in self._decode(suffix, skip_special_tokens=skip):
                return suffix
        suffix = prompt[-longest:]
        if self._decode(suffix, skip_special_tokens=skip).endswith(REPLACEMENT_CHAR):
            return []
        return suffix

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every generated token pushed so far (prompt excluded)."""
        return tuple(self._ids[self._num_prime :])

    @property
    def num_tokens(self) -> int:
        """How many generated tokens were pushed."""
        return len(self._ids) - self._num_prime

    @property
    def text(self) -> str:
        """The text emitted so far (every push, and the flush once finished)."""
        if self._text is None:
            self._text = "".join(self._parts)
            self._parts = [self._text]
        return self._text

    @property
    def finished(self) -> bool:
        """True once :meth:`flush` ran."""
        return self._closed

    def push(self, token_ids: Sequence[int]) -> str:
        """Append newly generated tokens; return the text they complete (possibly "").

        Ids beyond the tokenizer's vocabulary (a model's padded embedding rows) decode to
        nothing, as in ``tokenizer.decode``.

        Raises:
            InvalidTokenIdError: a token id is not a non-negative int.
            DetokenizerClosedError: after :meth:`flush`.
        """
        if self._closed:
            raise DetokenizerClosedError("push() after flush(): the request already finished")
        new_text = self._push_tokens(self, token_ids)
        if new_text:
            self._parts.append(new_text)
            self._text = None
        return new_text

    def flush(self) -> str:
        """Finish the request: return the text of tokens still held, then refuse pushes.

        Choice: held tokens are rendered as a one-shot decode renders them, so an incomplete
        character at the end (``max_tokens`` hit mid-emoji, say) comes out as U+FFFD and
        ``text`` equals the full decode; skipped special tokens give "". A second call
        returns "".
        """
        if self._closed:
            return ""
        self._closed = True
        tail = _utf8_decode(self._pending_bytes, "replace", True)[0]
        self._pending_bytes = b""
        if self._pending_start < len(self._ids):
            ids = self._ids
            start = max(0, self._pending_start - CONTEXT_TOKENS)
            skip = self._skip_special_tokens
            prefix = self._decode(ids[start : self._pending_start], skip_special_tokens=skip)
            full = self._decode(ids[start:], skip_special_tokens=skip)
            tail = full[len(prefix) :] if full.startswith(prefix) else full
            self._pending_start = len(ids)
        if tail:
            self._parts.append(tail)
            self._text = None
        return tail

    def _push_byte_level(self, token_ids: Sequence[int]) -> str:
        """Byte-level method: table lookup, then UTF-8 decoding that keeps an incomplete
        character's bytes in ``_pending_bytes`` until it completes."""
        ids = self._ids
        table = self._byte_table
        vocab_size = len(table)
        pending = self._pending_bytes
        new_text = ""
        for token_id in token_ids:
            if type(token_id) is not int or token_id < 0:
                raise InvalidTokenIdError(f"token id {token_id!r} is not a non-negative integer")
            ids.append(token_id)
            if token_id >= vocab_size:
                continue
            token_bytes = table[token_id]
            if token_bytes is None:
                if token_id in self._skip_ids:
                    continue
                # A kept added token: the Rust decoder ends the byte run before it (an
                # incomplete character there becomes U+FFFD) and writes its text verbatim.
                if pending:
                    new_text += _utf8_decode(pending, "replace", True)[0]
                    pending = b""
                new_text += self._added_tokens[token_id]
                continue
            data = pending + token_bytes
            # Invalid bytes become U+FFFD at once; an incomplete final character is left
            # unconsumed (final=False) and waits for its next byte.
            piece, consumed = _utf8_decode(data, "replace", False)
            pending = data[consumed:] if consumed < len(data) else b""
            new_text += piece
        self._pending_bytes = pending
        self._pending_start = len(ids)
        return new_text

    def _push_window(self, token_ids: Sequence[int]) -> str:
        """Window method (TGI, vLLM ``detokenize_incrementally``): per token, decode the
        window with the pending tokens; emit its growth unless it ends mid-character."""
        ids = self._ids
        skip = self._skip_special_tokens
        new_text = ""
        for token_id in token_ids:
            if type(token_id) is not int or token_id < 0:
                raise InvalidTokenIdError(f"token id {token_id!r} is not a non-negative integer")
            ids.append(token_id)
            window_text = self._decode(ids[self._window_start :], skip_special_tokens=skip)
            prefix_text = self._window_prefix_text
            if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
                continue
            new_text += window_text[len(prefix_text) :]
            # Slide: the window now starts where the emitted text was read up to before.
            self._window_start = self._pending_start
            self._pending_start = len(ids)
            self._window_prefix_text = self._decode(
                ids[self._window_start :], skip_special_tokens=skip
            )
        return new_text

    def _push_decode_stream(self, token_ids: Sequence[int]) -> str:
        """DecodeStream method: one Rust step per token (None while a character is
        incomplete)."""
        ids = self._ids
        backend = self._backend
        assert backend is not None, "the decode_stream method always has a Rust backend"
        new_text = ""
        for token_id in token_ids:
            if type(token_id) is not int or token_id < 0:
                raise InvalidTokenIdError(f"token id {token_id!r} is not a non-negative integer")
            ids.append(token_id)
            try:
                piece = self._stream.step(backend, token_id)
            except Exception as error:
                if not str(error).startswith(INVALID_PREFIX_MESSAGE):
                    raise
                piece = self._restart_stream()
            if piece is not None:
                self._pending_start = len(ids)
                new_text += piece
        return new_text

    def _restart_stream(self) -> str | None:
        """Recover from tokenizers' "Invalid prefix" error (vLLM issue 17448).

        vLLM rebuilds the stream without the prompt and steps only the new token, dropping
        the text of tokens still pending. Stepping every pending token as one list on the
        fresh stream keeps that text and cannot fail again: a fresh stream has no prefix to
        contradict.
        """
        assert self._backend is not None, "the decode_stream method always has a Rust backend"
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return self._stream.step(self._backend, self._ids[self._pending_start :])
