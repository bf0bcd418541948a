"""The FastAPI application of the OpenAI-compatible API over an
:class:`~pipeline.server.http.service.HttpService`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``"stream": true``: server-sent events), ``GET /health`` (200 while the engine serves, 503
once it died or the server is shutting down) and ``GET /metrics`` (Prometheus text, when a
registry is given). ``/v1/`` needs the API key when the server has keys
(:mod:`~pipeline.server.http.gate`); ``/openapi.json`` describes the API (the interactive
docs pages are off: they load scripts from a CDN).

An app is an ordinary FastAPI app: add routes to it (the browser chat example serves its
page from one).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pipeline.server.auth import ApiKeys
from pipeline.server.http import chat, completions
from pipeline.server.http.answers import Answer
from pipeline.server.http.defaults import DEFAULT_MAX_REQUEST_BYTES
from pipeline.server.http.errors import add_error_handlers
from pipeline.server.http.gate import Gate, tenant_of
from pipeline.server.http.protocol import ChatCompletionRequest, CompletionRequest
from pipeline.server.http.requests import plan_chat, plan_completion
from pipeline.server.http.service import HttpService
from pipeline.server.http.sse import EventStream

__all__ = ["create_app"]

OWNED_BY = "actorline"


def create_app(
    service: HttpService,
    *,
    api_keys: ApiKeys | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The application serving ``service``. ``api_keys``: the accepted keys (none:
    authentication is off); ``max_request_bytes``: the body cap; ``registry``: served at
    ``/metrics`` (None: no ``/metrics``).

    Raises:
        ValueError: a cap that is not a positive integer.
    """
    app = FastAPI(
        title="actorline OpenAI-compatible API",
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(
        Gate,
        api_keys=api_keys if api_keys is not None else ApiKeys(),
        max_request_bytes=max_request_bytes,
    )
    add_error_handlers(app)
    app.state.service = service

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        problem = service.problem()
        if problem is not None:
            return problem.response()
        return JSONResponse({"status": "ok"})

    if registry is not None:

        @app.get("/metrics", include_in_schema=False)
        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        problem = service.problem()
        if problem is not None:
            raise problem
        info = service.engine.info
        assert info is not None
        card = {
            "id": service.model_name,
            "object": "model",
            "created": service.created,
            "owned_by": OWNED_BY,
            "max_model_len": info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        service.check_model(body.model)
        plan = plan_completion(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        answer = Answer.create(
            request_id,
            completions.OBJECT,
            service.model_name,
            service.token_texts(plan.logprobs),
            plan.include_usage,
            plan.per_prompt,
        )
        started = await service.start(
            request_id, plan.choices, tenant_of(request.scope), request.receive
        )
        if not body.stream:
            outputs = await service.collect(started)
            return JSONResponse(completions.completion_response(answer, outputs))
        return EventStream(started, completions.completion_events(answer, started))

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        service.check_model(body.model)
        plan = plan_chat(body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        answer = Answer.create(
            request_id,
            chat.CHUNK_OBJECT if body.stream else chat.OBJECT,
            service.model_name,
            service.token_texts(plan.logprobs),
            plan.include_usage,
            plan.per_prompt,
        )
        started = await service.start(
            request_id, plan.choices, tenant_of(request.scope), request.receive
        )
        if not body.stream:
            outputs = await service.collect(started)
            return JSONResponse(chat.chat_response(answer, outputs))
        return EventStream(started, chat.chat_events(answer, started))

    return app
