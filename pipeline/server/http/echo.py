"""The prompt in an answer: ``/v1/completions``' ``echo`` (the answer's text, and its
logprobs, start with the prompt's) and vLLM's ``prompt_logprobs`` field, shaped as vLLM's
``vllm/entrypoints/openai/completion/serving.py`` shapes them.

With ``echo``, a choice's text is its prompt followed by what was generated; with
``logprobs`` its logprobs cover the prompt's tokens first (the first one has no score: its
``token_logprobs`` and ``top_logprobs`` entries are null, as OpenAI and vLLM send them), then
the generated ones. ``max_tokens`` 0 with ``echo`` answers the prompt only (the engine runs one
token, which is left out, as vLLM does; the usage counts no completion token). A stream sends
the prompt's text and scores in each choice's first chunk.

The prompt's text is the prompt as sent when it was text; a prompt of token ids (or one that
``truncate_prompt_tokens`` shortened) is decoded from the tokens the engine ran, on a worker
thread, so a long prompt never holds the event loop.

``prompt_logprobs`` (vLLM's): per prompt token, null for the first, then ``{token id:
{"logprob", "rank", "decoded_token"}}`` for the prompt's token followed by the top
alternatives (ranks 1, 2, ...); a completion choice carries it, a chat answer at its top level
(vLLM's places).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from pipeline.engine.prompts import Prompt
from pipeline.server.http.logprobs import MIN_LOGPROB, TokenTexts
from pipeline.server.http.whole import LazyArray
from stages.messages import Logprobs, RequestOutput

__all__ = ["Echo", "echo_only_output", "lazy_prompt_logprobs", "prompt_entries"]


@dataclasses.dataclass(slots=True)
class Echo:
    """What a ``/v1/completions`` body's ``echo`` asks of its choices: ``prompts[i]`` is
    choice ``i``'s prompt as sent; ``decode`` turns token ids into text (off the event loop);
    ``decode_all``: decode even text prompts (``truncate_prompt_tokens`` may have shortened
    them); ``only``: ``max_tokens`` 0, the prompt alone. :meth:`prepare` finds every choice's
    prompt text for a whole answer, :meth:`text` one choice's for a stream."""

    prompts: Sequence[Prompt]
    decode: Callable[[Sequence[int]], Awaitable[str]]
    decode_all: bool = False
    only: bool = False
    texts: dict[int, str] = dataclasses.field(default_factory=dict)

    async def text(self, index: int, output: RequestOutput) -> str:
        """Choice ``index``'s prompt text (``output``: one of its outputs)."""
        text = self.texts.get(index)
        if text is None:
            prompt = self.prompts[index]
            if isinstance(prompt, str) and not self.decode_all:
                text = prompt
            else:
                text = await self.decode(output.prompt_token_ids or ())
            self.texts[index] = text
        return text

    async def prepare(self, outputs: Sequence[RequestOutput]) -> None:
        """Find every choice's prompt text (``outputs[i]``: choice ``i``'s last output)."""
        for index, output in enumerate(outputs):
            await self.text(index, output)


def echo_only_output(output: RequestOutput) -> RequestOutput:
    """``output`` of an echo with ``max_tokens`` 0 without the one token the engine ran for
    it: no text, tokens or logprobs; ``"length"`` once it finished (the limit was 0)."""
    finish = None if output.finish_reason is None else "length"
    if output.finish_reason in ("abort", "error"):
        finish = output.finish_reason
    return dataclasses.replace(
        output,
        text="",
        delta="",
        token_ids=(),
        logprobs=() if output.logprobs is not None else None,
        finish_reason=finish,
        stop_reason=None,
    )


def prompt_entries(output: RequestOutput) -> tuple[int, Sequence[Logprobs]] | None:
    """The first prompt token (it has no score) and the scores of the others, for an echo's
    logprobs; None when the output carries no prompt scores (ended before its first
    token)."""
    scores = output.prompt_logprobs
    if scores is None or not output.prompt_token_ids:
        return None
    return output.prompt_token_ids[0], [entry for entry in scores[1:] if entry is not None]


def _entry(entry: Logprobs, texts: TokenTexts) -> dict[str, dict[str, Any]]:
    """vLLM's dict of one scored prompt token: the token first, then its top alternatives."""
    shaped = {
        str(entry.token_id): {
            "logprob": max(entry.logprob, MIN_LOGPROB),
            "rank": entry.rank,
            "decoded_token": texts(entry.token_id),
        }
    }
    for rank, (token_id, logprob) in enumerate(
        zip(entry.top_token_ids, entry.top_logprobs), start=1
    ):
        shaped.setdefault(
            str(token_id),
            {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": texts(token_id)},
        )
    return shaped


def _entries(
    scores: Sequence[Logprobs | None], texts: TokenTexts
) -> Iterator[dict[str, dict[str, Any]] | None]:
    for entry in scores:
        yield None if entry is None else _entry(entry, texts)


def lazy_prompt_logprobs(output: RequestOutput, texts: TokenTexts) -> LazyArray | None:
    """vLLM's ``prompt_logprobs`` of ``output`` (made as it is written); None when it has
    none."""
    if output.prompt_logprobs is None:
        return None
    return LazyArray(_entries(output.prompt_logprobs, texts))
