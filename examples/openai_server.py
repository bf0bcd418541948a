"""An OpenAI-compatible HTTP server on actorline's async API (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (with
``"stream": true``: server-sent events, ``data: {...}`` chunks ending with ``data: [DONE]``)
and ``GET /metrics`` (Prometheus, :class:`pipeline.metrics.EngineMetrics`)::

    python examples/openai_server.py --model smollm2-135m --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}], max_tokens=32
    )

Request fields use OpenAI's names (``max_tokens``/``max_completion_tokens``, ``temperature``,
``top_p``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``user``,
``stream_options.include_usage``) plus vLLM's sampling extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``); unknown fields
are ignored, as vLLM does. Only ``n=1`` is supported. ``user`` names the tenant whose rate
limits apply (``--user-limit``). Errors are OpenAI-style JSON ``{"error": {"message", "type",
"param", "code"}}``: 400 for an invalid parameter (``param`` names it), 401 for a bad API key,
404 for an unknown model, 429 when a rate limit is hit, 503 when overloaded or the engine is
down. A client that disconnects aborts its request, freeing its KV cache at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, cast

import anyio
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from pipeline import AsyncEngine, PipelineError
from pipeline.metrics import EngineMetrics
from pipeline.options import EngineOptions
from stages.errors import (
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RateLimitedError,
)
from stages.messages import RequestOutput
from stages.params import SamplingParams, validate_sampling

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "create_app", "main"]

logger = logging.getLogger("actorline.examples.openai")

#: chat roles the model's chat template understands ("developer" is OpenAI's new "system")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: OpenAI's default ``max_tokens`` for /v1/completions
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- request bodies -------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationBody(BaseModel):
    """Fields shared by completions and chat completions (None: not given)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None


class CompletionRequest(_GenerationBody):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_GenerationBody):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: Any = None


#: body fields accepted only at a value that asks for nothing this server lacks
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": lambda value: value not in (None, 1),
    "echo": bool,
    "best_of": lambda value: value not in (None, 1),
    "suffix": bool,
    "logprobs": lambda value: value is not None and value is not False,
    "top_logprobs": lambda value: value is not None,
    "tools": bool,
    "response_format": lambda value: value not in (None, {"type": "text"}),
}
_SAMPLING_FIELDS = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos",
)  # fmt: skip


# -- errors ---------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered as OpenAI-style JSON with HTTP ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.error_type, "param": self.param,
                 "code": self.code}  # fmt: skip
        return JSONResponse({"error": error}, status_code=self.status)

    @classmethod
    def from_engine(cls, error: Exception) -> ApiError:
        """The HTTP answer to an error of the engine API."""
        if isinstance(error, PromptTooLongError):
            return cls(400, str(error), param=error.field, code="context_length_exceeded")
        if isinstance(error, InvalidRequestError):
            return cls(400, str(error), param=error.field, code="invalid_value")
        if isinstance(error, RateLimitedError):
            return cls(429, str(error), error_type="rate_limit_error", code="rate_limit_exceeded")
        if isinstance(error, OverloadedError):
            return cls(503, str(error), error_type="server_error", code="overloaded")
        if isinstance(error, PipelineError):
            return cls(503, f"the engine is not available: {error}", error_type="server_error")
        return cls(500, f"{type(error).__name__}: {error}", error_type="server_error")


def _unsupported(body: BaseModel) -> None:
    for field, asks_too_much in _UNSUPPORTED.items():
        value = getattr(body, field, None)
        if asks_too_much(value):
            what = "only n=1 is supported" if field == "n" else "is not supported"
            raise ApiError(400, f"{field}: {what} (got {value!r})", param=field,
                           code="unsupported_value")  # fmt: skip


def _sampling(body: _GenerationBody, max_tokens: int) -> SamplingParams:
    values: dict[str, Any] = {name: getattr(body, name) for name in _SAMPLING_FIELDS}
    values = {name: value for name, value in values.items() if value is not None}
    if body.stop is not None:
        values["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        values["stop_token_ids"] = tuple(body.stop_token_ids)
    params = SamplingParams(max_tokens=max_tokens, **values)
    try:
        validate_sampling(params)
    except InvalidRequestError as exc:
        raise ApiError.from_engine(exc) from None
    return params


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    messages = []
    for index, message in enumerate(body.messages):
        role = CHAT_ROLES.get(message.role)
        if role is None:
            raise ApiError(400, f"role {message.role!r} is not supported; use one of "
                           f"{', '.join(CHAT_ROLES)}", param=f"messages[{index}].role")  # fmt: skip
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ApiError(400, "only text content parts are supported",
                               param=f"messages[{index}].content")  # fmt: skip
            content = "".join(part.text or "" for part in content)
        messages.append({"role": role, "content": content or ""})
    return messages


# -- generation -----------------------------------------------------------------------------------


def _usage(output: RequestOutput) -> dict[str, Any]:
    completion = len(output.token_ids)
    return {
        "prompt_tokens": output.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": output.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


async def _abort_on_disconnect(request: Request, engine: AsyncEngine, request_id: str) -> None:
    """Wait for the client to go away, then abort its request (frees its KV blocks)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    logger.info("client of %s disconnected; aborting", request_id)
    with contextlib.suppress(Exception):  # the engine may be closing
        await engine.abort(request_id)


@dataclasses.dataclass
class _Generation:
    """One running request: its stream of outputs (first one already received) and the task
    that aborts it when the client disconnects."""

    request_id: str
    stream: AsyncGenerator[RequestOutput, None]
    first: RequestOutput
    watcher: asyncio.Task[None]

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        yield self.first
        async for output in self.stream:
            yield output

    async def close(self) -> None:
        self.watcher.cancel()
        # NOTE: shielded: a cancelled streaming response must still end the engine stream
        # (which aborts the request if it is still running).
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


async def _start(
    request: Request, engine: AsyncEngine, request_id: str, prompt: Any,
    params: SamplingParams, tenant: str,
) -> _Generation:  # fmt: skip
    """Start generating and wait for the first output, so that a refusal (invalid, rate
    limited, ...) is answered with its HTTP status, not in the middle of a stream."""
    # NOTE: generate() is an async generator; aclose() ends it (aborting a running request)
    stream = cast(
        AsyncGenerator[RequestOutput, None],
        engine.generate(prompt, params, request_id=request_id, tenant=tenant),
    )
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, engine, request_id))
    try:
        first = await anext(stream)
    except Exception as exc:
        watcher.cancel()
        await stream.aclose()
        raise ApiError.from_engine(exc) from exc
    return _Generation(request_id, stream, first, watcher)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _collect(generation: _Generation) -> RequestOutput:
    try:
        last = generation.first
        async for output in generation.outputs():
            last = output
        return last
    finally:
        await generation.close()


# -- the application ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Server:
    options: EngineOptions
    model_name: str
    api_keys: frozenset[str]
    registry: CollectorRegistry
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    engine: AsyncEngine | None = None

    def usable_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise ApiError(503, "the engine is not running", error_type="server_error")
        return self.engine


def create_app(
    options: EngineOptions,
    *,
    served_model_name: str | None = None,
    api_keys: Sequence[str] = (),
    on_ready: Callable[[], object] = lambda: None,
) -> FastAPI:
    """The FastAPI application: starts an :class:`AsyncEngine` with ``options`` (and its
    metrics) when the server starts, closes it at shutdown. ``served_model_name``: the model
    id clients use (default ``options.model``). ``api_keys``: accepted bearer tokens (none:
    no authentication). ``on_ready()``: called once the engine is up."""
    server = _Server(options, served_model_name or options.model, frozenset(api_keys),
                     CollectorRegistry())  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        async with (
            AsyncEngine(**engine_options) as engine,
            EngineMetrics(engine, server.registry),
        ):
            server.engine = engine
            on_ready()
            try:
                yield
            finally:
                server.engine = None

    async def authenticate(request: Request) -> None:
        if not server.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(
            secrets.compare_digest(key.encode(), known.encode()) for known in server.api_keys
        ):
            raise ApiError(401, "invalid API key", code="invalid_api_key")

    app = FastAPI(title="actorline OpenAI-compatible server", lifespan=lifespan)
    # NOTE: the API needs the key; /metrics does not (scrapers, like health probes, have none)
    api = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])
    app.state.server = server

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"msg": "invalid request body"}
        if first.get("type") == "json_invalid":
            context = first.get("ctx")
            detail = context.get("error", "") if isinstance(context, dict) else ""
            return ApiError(400, f"the body is not valid JSON: {detail}").response()
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return ApiError(400, message, param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return ApiError(error.status_code, str(error.detail)).response()

    def check_model(model: str) -> None:
        if model != server.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{server.model_name!r}", param="model",
                           code="model_not_found")  # fmt: skip

    @api.get("/models")
    async def list_models() -> dict[str, Any]:
        model = {"id": server.model_name, "object": "model", "created": server.created,
                 "owned_by": "actorline"}  # fmt: skip
        return {"object": "list", "data": [model]}

    @api.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        _unsupported(body)
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = _sampling(body, max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        engine = server.usable_engine()
        generation = await _start(request, engine, request_id, prompt, params, body.user or "")
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": server.model_name}  # fmt: skip
        if not body.stream:
            last = await _collect(generation)
            choice = {"index": 0, "text": last.text, "logprobs": None,
                      "finish_reason": last.finish_reason}  # fmt: skip
            return JSONResponse({**head, "choices": [choice], "usage": _usage(last)})
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            try:
                async for output in generation.outputs():
                    if output.delta or output.finished:
                        choice = {"index": 0, "text": output.delta, "logprobs": None,
                                  "finish_reason": output.finish_reason}  # fmt: skip
                        usage = {"usage": None} if include_usage else {}
                        yield _sse({**head, "choices": [choice], **usage})
                    if output.finished and include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(output)})
                yield SSE_DONE
            finally:
                await generation.close()

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    @api.post("/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        _unsupported(body)
        messages = _chat_messages(body)
        engine = server.usable_engine()
        assert engine.info is not None
        # NOTE: with no limit asked for, the engine stops at the model's length.
        max_tokens = next(
            (limit for limit in (body.max_completion_tokens, body.max_tokens) if limit is not None),
            engine.info.max_model_len,
        )
        params = _sampling(body, max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = await _start(request, engine, request_id, messages, params, body.user or "")
        head = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": server.model_name}  # fmt: skip
        if not body.stream:
            last = await _collect(generation)
            choice = {"index": 0, "message": {"role": "assistant", "content": last.text},
                      "logprobs": None, "finish_reason": last.finish_reason}  # fmt: skip
            return JSONResponse({**head, "choices": [choice], "usage": _usage(last)})
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head["object"] = "chat.completion.chunk"
        usage = {"usage": None} if include_usage else {}

        def chunk(delta: dict[str, str], finish_reason: str | None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
            return _sse({**head, "choices": [choice], **usage})

        async def events() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""}, None)
                async for output in generation.outputs():
                    if output.delta:
                        yield chunk({"content": output.delta}, None)
                    if output.finished:
                        yield chunk({}, output.finish_reason)
                        if include_usage:
                            yield _sse({**head, "choices": [], "usage": _usage(output)})
                yield SSE_DONE
            finally:
                await generation.close()

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    app.include_router(api)
    return app


# -- command line ---------------------------------------------------------------------------------


def _user_limit(text: str) -> tuple[str, tuple[float | None, float | None]]:
    """``USER:REQUESTS_PER_SECOND:TOKENS_PER_SECOND`` with ``-`` for no limit."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0]:
        raise argparse.ArgumentTypeError(f"expected USER:REQUESTS/S:TOKENS/S, got {text!r}")
    try:
        limits = tuple(None if part == "-" else float(part) for part in parts[1:])
    except ValueError:
        raise argparse.ArgumentTypeError(f"limits must be numbers or '-', got {text!r}") from None
    return parts[0], (limits[0], limits[1])


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF directory or .gguf")
    parser.add_argument("--served-model-name", default=None, help="model id (default --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: pick a free port")
    parser.add_argument("--api-key", action="append", default=[], help="accepted key (repeat)")
    parser.add_argument("--transport", default="zmq", choices=("zmq", "grpc", "memory"))
    parser.add_argument("--scheduler", default="fcfs", help="scheduling policy plugin name")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--requests-per-second", type=float, default=None, help="per user")
    parser.add_argument("--tokens-per-second", type=float, default=None, help="per user")
    parser.add_argument("--user-limit", type=_user_limit, action="append", default=[],
                        help="USER:REQUESTS/S:TOKENS/S for one user ('-': none)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM. Prints ``serving OpenAI-compatible API on URL`` once the
    engine is up."""
    args = _arguments(argv)
    try:
        options = EngineOptions.create(
            args.model,
            transport=args.transport,
            scheduler=args.scheduler,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            requests_per_second=args.requests_per_second,
            tokens_per_second=args.tokens_per_second,
            tenant_limits=dict(args.user_limit),
        )
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    listener = socket.create_server((args.host, args.port))
    url = f"http://{args.host}:{listener.getsockname()[1]}/v1"
    app = create_app(
        options,
        served_model_name=args.served_model_name,
        api_keys=args.api_key,
        on_ready=lambda: print(f"serving OpenAI-compatible API on {url}", flush=True),
    )
    # NOTE: once uvicorn has shut down gracefully on SIGINT/SIGTERM, it re-raises the signal
    # to the handler that was installed before it ran; ignoring it there makes a graceful
    # shutdown exit with status 0.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda received, frame: None)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
