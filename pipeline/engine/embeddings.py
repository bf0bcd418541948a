"""Embeddings through the engine's API: an embedding request made from a checked prompt, and
its answer in vLLM's shape (``EmbeddingRequestOutput`` with ``.outputs.embedding``).

An embedding request is a generation request with ``pooling`` set (prefill only, its vector
pooled by the execute stage: docs/architecture.md §12), so it meets the same checks, queues,
rate limits and steps as any other; :meth:`~pipeline.engine.AsyncEngine.embed` and
``LLM.embed`` are the callers.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.engine.prompts import CheckedPrompt
from stages.errors import RequestFailedError
from stages.messages import RequestOutput
from stages.pooling import PoolingParams, validate_pooling

__all__ = ["EmbeddingOutput", "EmbeddingRequestOutput", "as_embedding", "embedding_result"]


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


def as_embedding(checked: CheckedPrompt, pooling: PoolingParams | None) -> CheckedPrompt:
    """``checked`` (a prompt checked with :func:`stages.pooling.embedding_sampling_params`'s
    parameters) made an embedding request asking ``pooling`` (None: the engine's defaults).

    Raises:
        InvalidRequestError: a bad ``pooling`` field (``dimensions``, ``normalize``), or
            sampling parameters that an embedding would ignore.
    """
    pooling = pooling if pooling is not None else PoolingParams()
    validate_pooling(pooling, checked.params)
    request = dataclasses.replace(checked.request, pooling=pooling)
    return CheckedPrompt(request, checked.vocab_size)


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
