"""The FastAPI application of the OpenAI-compatible API over an
:class:`~pipeline.server.http.state.HttpService`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``"stream": true``: server-sent events), OpenAI's ``POST /v1/responses``
(:mod:`~pipeline.server.http.responses`, stateless), ``POST /v1/embeddings``
(:mod:`~pipeline.server.http.embeddings`), vLLM's ``POST /tokenize``,
``POST /detokenize`` and
``GET /version`` (:mod:`~pipeline.server.http.tokens`), with ``enable_lora_runtime_updates``
vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(:mod:`~pipeline.server.http.lora_updates`), ``GET /health`` (200 while the engine
serves, with data parallelism each replica's state beside it; 503 once it died or the server
is shutting down) and ``GET /metrics`` (Prometheus text, when a registry is given). ``/v1/``
(and vLLM's token endpoints) need the API key when the server has keys
(:mod:`~pipeline.server.http.gate`); ``/openapi.json`` describes the API (the interactive
docs pages are off: they load scripts from a CDN).

An app is an ordinary FastAPI app: add routes to it (the browser chat example serves its
page from one).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pipeline.server.auth import ApiKeys
from pipeline.server.http import chat, completions, embeddings, responses, tokens
from pipeline.server.http.answers import Answer
from pipeline.server.http.defaults import DEFAULT_MAX_REQUEST_BYTES
from pipeline.server.http.errors import ApiError, add_error_handlers
from pipeline.server.http.gate import Gate, tenant_of
from pipeline.server.http.lora_updates import add_lora_update_routes
from pipeline.server.http.requests import plan_chat, plan_completion
from pipeline.server.http.response_output import ResponseShape, response_events, whole_response
from pipeline.server.http.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from pipeline.server.http.sse import EventStream
from pipeline.server.http.state import HttpService
from pipeline.server.http.whole import JsonAnswer
from stages.lora import LoRARequest

__all__ = ["create_app"]

OWNED_BY = "actorline"


def _permission(created: int) -> dict[str, Any]:
    """vLLM's ``ModelPermission`` of a served model: sampling and logprobs allowed, nothing
    else."""
    return {
        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_OID, str(created)).hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


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
        body: dict[str, Any] = {"status": "ok"}
        replicas = service.engine.replicas
        if replicas:  # data parallelism: 200 while one replica lives, each one's state
            body["replicas"] = [
                {"replica": status.replica, "alive": status.alive}
                | ({} if status.error is None else {"error": str(status.error)})
                for status in replicas
            ]
        return JSONResponse(body)

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
            # vLLM's fields: the model the name serves (its path or alias), no parent (an
            # adapter's would be its base), the permission object its clients read
            "root": service.engine.options.model,
            "parent": None,
            "max_model_len": info.max_model_len,
            "permission": [_permission(service.created)],
        }
        # NOTE: vLLM's adapter cards: root the adapter's path, parent the base's name
        # (vllm/entrypoints/openai/serving_models.py, show_available_models)
        cards = [card] + [
            {**card, "id": name, "root": lora.lora_path, "parent": service.model_name}
            for name, lora in service.lora_modules.adapters.items()
        ]
        return {"object": "list", "data": cards}

    if service.engine.options.enable_lora_runtime_updates:
        add_lora_update_routes(app, service)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await tokens.tokenize(service, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await tokens.detokenize(service, body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return tokens.version()

    async def answer(
        request: Request,
        plan: Any,
        request_id: str,
        object_name: str,
        stream: bool,
        respond: Callable[[Answer, Any], dict[str, Any]],
        events: Callable[[Answer, Any], Any],
        lora: LoRARequest | None,
    ) -> Response:
        """Start ``plan``'s choices and answer them whole (``respond``) or streamed
        (``events``), with the LoRA adapter ``lora`` (named by ``model``; its name is the
        answer's model): the part both endpoints share."""
        tenant = tenant_of(request.scope)
        checked = service.check(
            request_id, plan.choices, tenant, plan.tools, plan.rendering, lora=lora
        )
        answer = Answer.create(
            request_id,
            object_name,
            lora.lora_name if lora is not None else service.model_name,
            service.token_texts(plan.logprobs),
            plan.include_usage,
            plan.per_prompt,
            plan.continuous_usage,
            plan.token_ids,
            echo=service.echo(plan),
            prompt_logprobs=service.token_texts(plan.prompt_logprobs),
        )
        started = await service.start(request_id, checked, tenant, request.receive, plan.per_prompt)
        headers = {}
        if plan.deprecated:
            # RFC 7234's 299 "miscellaneous persistent warning"
            fields = ", ".join(plan.deprecated)
            headers["Warning"] = f'299 - "{fields}: deprecated; use structured_outputs"'
        if not stream:
            outputs = await service.collect(started)
            if answer.echo is not None:
                await answer.echo.prepare(outputs)
            return JsonAnswer(respond(answer, outputs), headers=headers)
        return EventStream(started, events(answer, started), headers)

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        lora = service.check_model(body.model, tenant=tenant_of(request.scope))
        return await answer(
            request,
            plan_completion(body),
            f"cmpl-{uuid.uuid4().hex}",
            completions.OBJECT,
            body.stream,
            completions.completion_response,
            completions.completion_events,
            lora,
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        lora = service.check_model(body.model, tenant=tenant_of(request.scope))
        return await answer(
            request,
            plan_chat(body),
            f"chatcmpl-{uuid.uuid4().hex}",
            chat.CHUNK_OBJECT if body.stream else chat.OBJECT,
            body.stream,
            chat.chat_response,
            chat.chat_events,
            lora,
        )

    @app.post("/v1/embeddings", response_model=None)
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await embeddings.create_embeddings(service, body, request)

    @app.post("/v1/responses", response_model=None)
    async def create_response(request: Request, raw: Annotated[Any, Body()]) -> Response:
        body = responses.parse_responses_body(raw)
        service.check_model(body.model, adapters=False, tenant=tenant_of(request.scope))
        plan = responses.plan_responses(body)
        request_id = f"resp_{uuid.uuid4().hex}"
        tenant = tenant_of(request.scope)
        try:
            checked = service.check(request_id, plan.choices, tenant, plan.tools)
        except ApiError as exc:
            raise responses.renamed(exc) from None
        shape = ResponseShape(request_id, service.model_name, responses.echoed(body))
        started = await service.start(request_id, checked, tenant, request.receive)
        if not body.stream:
            (output,) = await service.collect(started)
            return JsonAnswer(whole_response(shape, output))
        return EventStream(started, response_events(shape, started))

    return app
