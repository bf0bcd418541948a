"""Logprobs in OpenAI's two formats: chat's ``{"content": [{token, logprob, bytes,
top_logprobs}]}`` and the legacy completions' ``{tokens, token_logprobs, top_logprobs,
text_offset}`` (vLLM's ``vllm/entrypoints/openai/serving_chat.py`` and
``serving_completion.py`` fill the same fields). A whole answer's logprobs
(:func:`lazy_chat_logprobs`, :func:`lazy_completion_logprobs`) are made only as they are
written (:mod:`~pipeline.server.http.whole`), so a large answer does not hold the event loop.

A token's text is the token decoded alone, special tokens kept (as vLLM shows them). A
logprob below :data:`MIN_LOGPROB` (``-inf`` included: JSON has none) is sent as that floor,
as vLLM does.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from pipeline.server.http.whole import LazyArray
from stages.messages import Logprobs, RequestOutput

__all__ = [
    "MIN_LOGPROB",
    "LogprobsCursor",
    "TokenTexts",
    "chat_logprobs",
    "completion_logprobs",
    "lazy_chat_logprobs",
    "lazy_completion_logprobs",
]

MIN_LOGPROB = -9999.0


class TokenTexts:
    """The text of each token id, decoded once per id with ``tokenizer`` (a HF tokenizer).

    NOTE: decoding one id is a dictionary lookup in the tokenizer, and each id is decoded at
    most once: cheap enough for the event loop (no text is tokenized here).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(self._tokenizer.decode([token_id]))
        return text


def _floor(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _chat_token(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode())}


def _chat_entries(entries: Sequence[Logprobs], texts: TokenTexts) -> Iterator[dict[str, Any]]:
    for entry in entries:
        yield {
            **_chat_token(texts, entry.token_id, entry.logprob),
            "top_logprobs": [
                _chat_token(texts, token_id, logprob)
                for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs)
            ],
        }


def chat_logprobs(entries: Sequence[Logprobs], texts: TokenTexts) -> dict[str, Any]:
    """Chat's ``logprobs``: one entry per token, its ``top_logprobs`` a list of ``{token,
    logprob, bytes}``."""
    return {"content": list(_chat_entries(entries, texts))}


def lazy_chat_logprobs(entries: Sequence[Logprobs], texts: TokenTexts) -> dict[str, Any]:
    """:func:`chat_logprobs`, its entries made as they are written."""
    return {"content": LazyArray(_chat_entries(entries, texts))}


def _top(entry: Logprobs, texts: TokenTexts) -> dict[str, float]:
    return {
        texts(token_id): _floor(logprob)
        for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs)
    }


def lazy_completion_logprobs(
    entries: Sequence[Logprobs], texts: TokenTexts, unscored_first: int | None = None
) -> dict[str, Any]:
    """:func:`completion_logprobs` of a whole choice (offsets from 0), its arrays made as
    they are written."""
    ids = [] if unscored_first is None else [unscored_first]
    lead: list[None] = [] if unscored_first is None else [None]
    count = len(ids) + len(entries)
    return {
        "tokens": LazyArray(
            texts(token_id)
            for token_id in itertools.chain(ids, (entry.token_id for entry in entries))
        ),
        "token_logprobs": LazyArray(
            itertools.chain(lead, (_floor(entry.logprob) for entry in entries))
        ),
        "top_logprobs": LazyArray(itertools.chain(lead, (_top(entry, texts) for entry in entries))),
        "text_offset": LazyArray(
            itertools.islice(
                itertools.accumulate(
                    (
                        len(texts(token_id))
                        for token_id in itertools.chain(ids, (e.token_id for e in entries))
                    ),
                    initial=0,
                ),
                count,
            )
        ),
    }


def completion_logprobs(
    entries: Sequence[Logprobs],
    texts: TokenTexts,
    offset: int = 0,
    unscored_first: int | None = None,
) -> tuple[dict[str, Any], int]:
    """The completions ``logprobs`` of ``entries`` (``top_logprobs`` as token → logprob
    dicts), text offsets counted from ``offset``; and the offset after the last token.
    ``unscored_first``: a token before them that has no score (a prompt's first, echoed):
    its ``token_logprobs`` and ``top_logprobs`` entries are null, as OpenAI and vLLM send
    them."""
    lead = [] if unscored_first is None else [unscored_first]
    tokens = [texts(token_id) for token_id in lead] + [texts(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    nulls: list[None] = [None] * len(lead)
    payload = {
        "tokens": tokens,
        "token_logprobs": [*nulls, *(_floor(entry.logprob) for entry in entries)],
        "top_logprobs": [*nulls, *(_top(entry, texts) for entry in entries)],
        "text_offset": offsets,
    }
    return payload, offset


@dataclasses.dataclass
class LogprobsCursor:
    """How much of one choice's logprobs a stream has sent: ``sent`` entries, covering
    ``offset`` characters of token text."""

    sent: int = 0
    offset: int = 0

    def take(self, output: RequestOutput) -> Sequence[Logprobs]:
        """The entries of ``output`` not sent yet (they count as sent from now on)."""
        entries = (output.logprobs or ())[self.sent :]
        self.sent += len(entries)
        return entries
