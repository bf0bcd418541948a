"""The shape every answer shares: the fields a response or stream chunk starts with
(``id``, ``object``, ``created``, ``model``), the logprobs decoder when they were asked for,
and the usage of a request's choices."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from pipeline.server.http.echo import Echo
from pipeline.server.http.logprobs import TokenTexts
from pipeline.server.http.sse import event
from stages.messages import RequestOutput

__all__ = ["Answer", "usage"]


def usage(outputs: Sequence[RequestOutput], per_prompt: int) -> dict[str, Any]:
    """The usage of a request's choices (``per_prompt`` choices of each prompt, in order):
    each prompt's tokens (and its cached ones) counted once, from its first choice; the
    completion tokens of every choice. Counted by the engine (no tokenizing here)."""
    firsts = outputs[::per_prompt]
    prompt = sum(output.num_prompt_tokens for output in firsts)
    completion = sum(len(output.token_ids) for output in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
    }


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """How to shape the answer to one request: its ``head`` fields, the token decoder when
    logprobs were asked for (else None), whether a stream ends with a usage chunk, how
    many choices each prompt has (``n``), whether every chunk carries its choice's usage
    so far (vLLM's ``stream_options.continuous_usage_stats``), and whether the answer
    carries token ids (vLLM's ``return_token_ids``: the prompt's, and each choice's, in a
    stream each chunk's new ones). ``echo``: a completion's choices start with their prompt
    (:mod:`~pipeline.server.http.echo`); ``prompt_logprobs``: the token decoder when vLLM's
    ``prompt_logprobs`` field was asked for (None: not asked)."""

    head: dict[str, Any]
    texts: TokenTexts | None
    include_usage: bool
    per_prompt: int
    continuous_usage: bool = False
    token_ids: bool = False
    echo: Echo | None = None
    prompt_logprobs: TokenTexts | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        kind: str,
        model: str,
        texts: TokenTexts | None,
        include_usage: bool,
        per_prompt: int,
        continuous_usage: bool = False,
        token_ids: bool = False,
        *,
        echo: Echo | None = None,
        prompt_logprobs: TokenTexts | None = None,
    ) -> Answer:
        head = {"id": request_id, "object": kind, "created": int(time.time()), "model": model}
        return cls(
            head, texts, include_usage, per_prompt, continuous_usage, token_ids, echo,
            prompt_logprobs,
        )  # fmt: skip

    def response(
        self, choices: list[dict[str, Any]], outputs: Sequence[RequestOutput]
    ) -> dict[str, Any]:
        """A whole (not streamed) response."""
        return {**self.head, "choices": choices, "usage": self.usage(outputs)}

    def chunk(
        self,
        choice: dict[str, Any],
        output: RequestOutput | None = None,
        *,
        started: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """A stream event carrying one choice's chunk; with continuous usage, the usage of
        the choice's ``output`` so far, as vLLM counts it (its prompt and its tokens;
        ``started`` False: none yet, the chat stream's opening chunk). ``extra``: fields of
        the chunk beside its choices (the chat stream's ``prompt_token_ids``)."""
        extra = {**(extra or {}), **({"usage": None} if self.include_usage else {})}
        if self.continuous_usage and output is not None:
            completion = len(output.token_ids) if started else 0
            prompt = output.num_prompt_tokens
            extra["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        return event({**self.head, "choices": [choice], **extra})

    def usage(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        return usage(outputs, self.per_prompt)

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> str:
        """The stream's last event when usage was asked for: no choices, the usage."""
        return event({**self.head, "choices": [], "usage": self.usage(outputs)})
