"""Embedding requests: what a request asks of the pooler, and the checks of it (pure logic;
docs/architecture.md §12).

An embedding request is an ordinary :class:`~stages.messages.EngineRequest` whose ``pooling``
is set: it is prefill only. The scheduler plans its prompt like any other (sharing steps with
generation), execute reduces the final-norm hidden states of its prompt's tokens to one vector
(:mod:`stages.execute.pooling`, as vLLM's pooling runner does for causal models such as
Qwen3-Embedding) instead of sampling a token, and the request finishes in that step with the
vector in its output. How the engine pools (``last``, ``mean`` or ``cls``) is the engine's
option ``pooling_type`` (vLLM's ``PoolerConfig.pooling_type``); whether the vector is
L2-normalized is ``pooling_normalize``, which a request may override (vLLM's request field
``normalize``). ``dimensions`` keeps the vector's first N values (then normalizes again), only
for a model whose ``config.json`` says it was trained for it (Matryoshka representation:
``is_matryoshka``, or ``matryoshka_dimensions``, the sizes it allows), as vLLM allows it.
"""

from __future__ import annotations

import dataclasses

from stages.checks import check_bool, check_int, describe
from stages.errors import InvalidRequestError
from stages.params import SamplingParams
from transports.codec import message

__all__ = [
    "POOLING_TYPES",
    "PoolingParams",
    "check_dimensions",
    "embedding_sampling_params",
    "validate_pooling",
]

#: how the engine reduces a prompt's hidden states to one vector (vLLM's pooling types of the
#: same names): the last token's (causal embedding models: Qwen3-Embedding, e5-mistral), the
#: mean over the tokens, or the first token's (CLS)
POOLING_TYPES = ("last", "mean", "cls")


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class PoolingParams:
    """What one embedding request asks of the pooler (vLLM's ``PoolingParams``).

    ``dimensions``: keep the first N values of the vector (a Matryoshka model only; None: the
    model's hidden size). ``normalize``: L2-normalize the vector (None: the engine's
    ``pooling_normalize``).
    """

    dimensions: int | None = None
    normalize: bool | None = None


def embedding_sampling_params(
    truncate_prompt_tokens: int | None = None, priority: int = 0
) -> SamplingParams:
    """The sampling parameters an embedding request carries: nothing is sampled, so one
    (never generated) token of room and greedy; only vLLM's ``truncate_prompt_tokens`` and the
    scheduling ``priority`` apply."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        truncate_prompt_tokens=truncate_prompt_tokens,
        priority=priority,
    )


def validate_pooling(
    pooling: object, params: SamplingParams, *, request_id: str | None = None
) -> None:
    """Check an embedding request's ``pooling`` and that its sampling parameters ask for
    nothing but what :func:`embedding_sampling_params` gives (an embedding samples nothing:
    a sampling field set would be silently ignored).

    Raises:
        InvalidRequestError: naming the field that is wrong.
    """
    if not isinstance(pooling, PoolingParams):
        raise InvalidRequestError(
            f"pooling must be a PoolingParams, got {describe(pooling)}",
            field="pooling",
            request_id=request_id,
        )
    if pooling.dimensions is not None:
        check_int("dimensions", pooling.dimensions, minimum=1, request_id=request_id)
    if pooling.normalize is not None:
        check_bool("normalize", pooling.normalize, request_id=request_id)
    expected = embedding_sampling_params(params.truncate_prompt_tokens, params.priority)
    if params != expected:
        changed = next(
            field.name
            for field in dataclasses.fields(SamplingParams)
            if getattr(params, field.name) != getattr(expected, field.name)
        )
        raise InvalidRequestError(
            f"{changed}: an embedding request samples nothing; only truncate_prompt_tokens "
            "and priority apply to it",
            field=changed,
            request_id=request_id,
        )


def check_dimensions(
    pooling: PoolingParams,
    *,
    model: str,
    embedding_size: int,
    matryoshka_dimensions: tuple[int, ...] | None,
    request_id: str | None = None,
) -> None:
    """Check ``pooling.dimensions`` against the model: ``embedding_size`` its hidden size (0:
    the engine computes no embeddings, the null model), ``matryoshka_dimensions`` the sizes its
    config allows (None: not a Matryoshka model; empty: any size up to the hidden size).

    Raises:
        InvalidRequestError: the engine computes no embeddings (field ``input``), or
            ``dimensions`` the model does not allow (field ``dimensions``).
    """
    if embedding_size < 1:
        raise InvalidRequestError(
            f"model {model!r} computes no embeddings in this engine (the null model has no "
            "hidden states; pipeline-parallel shards pass back logits only)",
            field="input",
            request_id=request_id,
        )
    dimensions = pooling.dimensions
    if dimensions is None:
        return
    if matryoshka_dimensions is None:
        raise InvalidRequestError(
            f"dimensions: model {model!r} does not support Matryoshka representation "
            "(its config.json has no is_matryoshka or matryoshka_dimensions); shortening its "
            "embeddings would make them poor (leave dimensions out)",
            field="dimensions",
            request_id=request_id,
        )
    if dimensions > embedding_size:
        raise InvalidRequestError(
            f"dimensions ({dimensions}) must be at most the model's embedding size "
            f"({embedding_size})",
            field="dimensions",
            request_id=request_id,
        )
    if matryoshka_dimensions and dimensions not in matryoshka_dimensions:
        allowed = ", ".join(map(str, matryoshka_dimensions))
        raise InvalidRequestError(
            f"dimensions ({dimensions}) must be one of the model's Matryoshka sizes: {allowed}",
            field="dimensions",
            request_id=request_id,
        )
