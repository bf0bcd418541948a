"""Embeddings through the engine's API (:meth:`~pipeline.engine.AsyncEngine.embed`,
``LLM.embed``): an embedding request made from a prompt, and its answer in vLLM's shape
(``EmbeddingRequestOutput`` with ``.outputs.embedding``).

An embedding request is a generation request with ``pooling`` set (prefill only, its vector
pooled by the execute stage: docs/architecture.md §12), so it meets the same checks, queues,
rate limits and steps as any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

import numpy as np

from pipeline.engine.prompts import CheckedPrompt, Prompt
from stages.errors import InvalidRequestError, RequestFailedError
from stages.messages import EngineInfo, RequestOutput
from stages.params import SamplingParams
from stages.pooling import (
    PoolingParams,
    check_dimensions,
    embedding_sampling_params,
    validate_pooling,
)

__all__ = [
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "check_embedding",
    "embed",
    "embedding_result",
]


class _Engine(Protocol):
    """What embedding needs of :class:`~pipeline.engine.AsyncEngine`."""

    @property
    def info(self) -> EngineInfo | None: ...

    def check(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str = "",
    ) -> CheckedPrompt: ...

    def generate(
        self, prompt: Prompt | CheckedPrompt, *, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """One prompt's embedding: ``data``, ``float32 [dimensions]``; ``embedding``, the same
    as a list of floats (vLLM's ``EmbeddingOutput.embedding``)."""

    data: np.ndarray

    @property
    def embedding(self) -> list[float]:
        values: list[float] = self.data.tolist()
        return values

    @property
    def hidden_size(self) -> int:
        return int(self.data.shape[0])


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    """The answer to one embedding request (vLLM's ``EmbeddingRequestOutput``):
    ``outputs.embedding`` is the vector; ``num_prompt_tokens`` the tokens it pooled."""

    request_id: str
    outputs: EmbeddingOutput
    num_prompt_tokens: int
    finished: bool = True


def check_embedding(
    engine: _Engine,
    prompt: Prompt,
    pooling_params: PoolingParams | None = None,
    *,
    request_id: str | None = None,
    tenant: str = "",
    truncate_prompt_tokens: int | None = None,
    priority: int = 0,
) -> CheckedPrompt:
    """``prompt`` checked as an embedding request: the prompt by the validation core (as
    ``engine.check``), ``pooling_params`` (None: the engine's defaults) by
    :func:`stages.pooling.validate_pooling` and, once the engine is loaded, its
    ``dimensions`` against the model (admit checks them again: a request sent while the
    engine starts is checked there).

    Raises:
        InvalidRequestError: a bad prompt or pooling parameter (the field is named),
            ``dimensions`` the model does not allow, or an engine that computes no embeddings.
    """
    params = embedding_sampling_params(truncate_prompt_tokens, priority)
    checked = engine.check(prompt, params, request_id=request_id, tenant=tenant)
    pooling = pooling_params if pooling_params is not None else PoolingParams()
    validate_pooling(pooling, checked.params, request_id=request_id)
    info = engine.info
    if info is not None:
        check_dimensions(
            pooling,
            model=info.model,
            embedding_size=info.embedding_size,
            matryoshka_dimensions=info.matryoshka_dimensions,
            request_id=request_id,
        )
    return CheckedPrompt(dataclasses.replace(checked.request, pooling=pooling), checked.vocab_size)


async def embed(
    engine: _Engine,
    prompt: Prompt | CheckedPrompt,
    pooling_params: PoolingParams | None = None,
    *,
    request_id: str | None = None,
    tenant: str = "",
    truncate_prompt_tokens: int | None = None,
) -> EmbeddingRequestOutput:
    """The embedding of one prompt: the engine's pooling (``pooling_type``,
    ``pooling_normalize``) over the final hidden states of the prompt's tokens, prefill only.
    ``prompt``: as ``generate`` takes it, or from :func:`check_embedding` (which carries its
    pooling parameters, tenant and truncation: give none of them here).

    Raises: as ``generate``; InvalidRequestError also for ``dimensions`` the model does not
    allow, an engine that computes no embeddings, or a checked prompt that is no embedding.
    """
    if not isinstance(prompt, CheckedPrompt):
        prompt = check_embedding(
            engine, prompt, pooling_params, request_id=request_id, tenant=tenant,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )  # fmt: skip
    elif prompt.request.pooling is None or pooling_params is not None:
        raise InvalidRequestError(
            "embed() takes a prompt checked by check_embedding(), which carries its pooling "
            "parameters (give them there)",
            field="pooling_params",
            request_id=request_id,
        )
    last = None
    async for output in engine.generate(prompt, request_id=request_id):
        last = output
    return embedding_result(last.request_id if last is not None else request_id or "", last)


def embedding_result(request_id: str, output: RequestOutput | None) -> EmbeddingRequestOutput:
    """The answer made of an embedding request's final ``output``.

    Raises:
        RequestFailedError: the request ended without a vector (it was aborted).
    """
    if output is None or output.embedding is None:
        reason = None if output is None else output.finish_reason
        raise RequestFailedError(
            f"the embedding request ended without a vector (finish_reason {reason!r})",
            request_id=request_id,
        )
    return EmbeddingRequestOutput(
        request_id, EmbeddingOutput(output.embedding), output.num_prompt_tokens
    )
