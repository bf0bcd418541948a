"""``POST /v1/embeddings``: OpenAI's embeddings endpoint (and vLLM's, for a causal model:
``vllm/entrypoints/openai/serving_embedding.py``).

Each input is one embedding request of the engine (:meth:`~pipeline.engine.AsyncEngine.embed`'s
kind: prefill only, its vector pooled by the execute stage, docs/architecture.md §12), checked
all before any starts and started together, as a completion's choices are; they share steps
with every other request. The answer::

    {"id": "embd-...", "object": "list", "created": ..., "model": ...,
     "data": [{"object": "embedding", "index": i, "embedding": [...] or "<base64>"}, ...],
     "usage": {"prompt_tokens": n, "total_tokens": n}}

``encoding_format`` ``"base64"`` sends each vector as the base64 of its little-endian float32
bytes (what the ``openai`` client asks for by default, and decodes with numpy).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import Request
from starlette.responses import Response

from pipeline.engine.prompts import CheckedPrompt, Prompt
from pipeline.server.http.errors import ApiError
from pipeline.server.http.gate import tenant_of
from pipeline.server.http.requests import check_extras
from pipeline.server.http.schema import EMBEDDINGS_ACCEPTED_AT, EmbeddingRequest
from pipeline.server.http.state import HttpService
from pipeline.server.http.whole import JsonAnswer, LazyArray
from pipeline.server.limits import MAX_EMBEDDING_INPUTS
from stages.errors import RequestError
from stages.messages import RequestOutput
from stages.pooling import PoolingParams

__all__ = ["ENCODING_FORMATS", "create_embeddings", "embedding_inputs"]

#: OpenAI's encodings of a vector
ENCODING_FORMATS = ("float", "base64")
#: the error params naming the prompt, as this endpoint names it
_INPUT_PARAMS = ("prompt", "prompt_token_ids", "messages")


def embedding_inputs(body: EmbeddingRequest) -> list[Prompt]:
    """The prompts of ``body.input``: a text, texts, token ids, or lists of token ids.

    Raises:
        ApiError: 400 (param ``input``) for an empty input or list, or more than
            :data:`MAX_EMBEDDING_INPUTS` inputs.
    """
    value = body.input
    prompts: list[Prompt]
    if isinstance(value, str):
        prompts = [value]
    elif value and all(type(item) is int for item in value):
        prompts = [[item for item in value if type(item) is int]]
    else:
        prompts = list(value)  # type: ignore[arg-type]
    if not prompts:
        raise ApiError(400, "input: must not be empty", param="input", code="invalid_value")
    if len(prompts) > MAX_EMBEDDING_INPUTS:
        raise ApiError(
            400,
            f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(prompts)}",
            param="input",
            code="invalid_value",
        )
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            where = "input" if isinstance(value, str) else f"input[{index}]"
            raise ApiError(400, f"{where}: must not be empty", param=where, code="invalid_value")
    return prompts


def _input_error(error: RequestError, index: int, many: bool) -> ApiError:
    """``error`` of input ``index`` as the 400 naming ``input`` (or ``input[i]``) where it
    named the engine's prompt field."""
    answer = ApiError.from_error(error)
    if error.field in _INPUT_PARAMS:
        answer.param = f"input[{index}]" if many else "input"
    return answer


def _check(
    service: HttpService, request_id: str, body: EmbeddingRequest, tenant: str
) -> list[CheckedPrompt]:
    """Every input through the engine's checks (the validation core, and ``dimensions``
    against the model), before any starts.

    Raises:
        ApiError: 400 naming the field; 503 while nothing can be served.
    """
    if body.encoding_format not in ENCODING_FORMATS:
        raise ApiError(
            400,
            f"encoding_format: must be one of {', '.join(ENCODING_FORMATS)}, got "
            f"{body.encoding_format!r:.40}",
            param="encoding_format",
            code="invalid_value",
        )
    problem = service.problem()
    if problem is not None:
        raise problem
    prompts = embedding_inputs(body)
    pooling = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    many = not isinstance(body.input, str) and not all(type(i) is int for i in body.input)
    checked = []
    for index, prompt in enumerate(prompts):
        try:
            checked.append(
                service.engine.check_embedding(
                    prompt,
                    pooling,
                    request_id=request_id,
                    tenant=tenant,
                    truncate_prompt_tokens=body.truncate_prompt_tokens,
                )
            )
        except RequestError as exc:
            raise _input_error(exc, index, many) from None
    return checked


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        little = vector.astype("<f4", copy=False)
        return base64.b64encode(little.tobytes()).decode("ascii")
    values: list[float] = vector.tolist()
    return values


def embeddings_response(
    request_id: str, model: str, outputs: Sequence[RequestOutput], encoding_format: str
) -> dict[str, Any]:
    """The answer made of every input's final output (each carries its ``embedding``)."""
    prompt_tokens = sum(output.num_prompt_tokens for output in outputs)

    def items() -> Any:
        for index, output in enumerate(outputs):
            assert output.embedding is not None
            yield {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(output.embedding, encoding_format),
            }

    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": LazyArray(items()),
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


async def create_embeddings(
    service: HttpService, body: EmbeddingRequest, request: Request
) -> Response:
    """Answer ``POST /v1/embeddings``.

    Raises:
        ApiError: 400 naming the field (an unknown field, an empty input, ``dimensions`` the
            model does not allow, a prompt too long, ...); 404 for another model; 429 / 503
            as the engine refuses.
    """
    service.check_model(body.model, adapters=False, tenant=tenant_of(request.scope))
    check_extras(body.model_extra, EMBEDDINGS_ACCEPTED_AT)
    request_id = f"embd-{uuid.uuid4().hex}"
    tenant = tenant_of(request.scope)
    checked = _check(service, request_id, body, tenant)
    try:
        started = await service.start(request_id, checked, tenant, request.receive)
    except ApiError as exc:
        if exc.param in _INPUT_PARAMS:  # admit's: a prompt too long once tokenized
            exc.param = "input"
        raise
    outputs = await service.collect(started)
    for output in outputs:
        if output.embedding is None:  # ended without a vector: the engine aborted it
            raise ApiError.from_error(
                RuntimeError(f"an input ended without an embedding ({output.finish_reason})")
            )
    return JsonAnswer(
        embeddings_response(request_id, service.model_name, outputs, body.encoding_format)
    )
