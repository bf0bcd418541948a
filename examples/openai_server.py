"""An OpenAI-compatible HTTP server on actorline's async API (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (with
``"stream": true``: server-sent events, ``data: {...}`` chunks ending with ``data: [DONE]``)
and ``GET /metrics`` (Prometheus, :class:`pipeline.engine.metrics.EngineMetrics`)::

    python examples/openai_server.py --model smollm2-135m --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}], max_tokens=32
    )

Request fields use OpenAI's names (``max_tokens``/``max_completion_tokens``, ``temperature``,
``top_p``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logprobs`` (and
``top_logprobs`` for chat), ``stream_options.include_usage``) plus vLLM's sampling extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``); unknown fields are ignored, as vLLM does. ``n`` (1 to 16) asks for that
many choices, each its own engine request, all started at once; with a ``seed``, choice j
samples with ``seed + j`` (seeded choices differ, and reproduce); greedy choices are identical.
``prompt`` of /v1/completions may be a list of prompts (strings or token-id lists): choice
``prompt_index * n + j`` (at most 64 choices per request); usage counts each prompt once. A
stream interleaves its choices' chunks, each carrying one choice and its ``index``; chat
streams start with one ``{"role": "assistant"}`` chunk per choice. ``best_of`` above 1 is refused. A
chat request without a token limit generates until the model's length; /v1/completions
defaults to 16 tokens. Choices carry vLLM's ``stop_reason`` (the stop string or token id that
ended them, else null); streamed chunks carry the logprobs of their own tokens. The model card
of ``/v1/models`` has vLLM's ``max_model_len``.

Rate limits (``--requests-per-second``/``--tokens-per-second`` per tenant, ``--key-limit`` for
one key) apply to the authenticated API key: each ``--api-key`` is its own tenant, named
``key-`` and 12 hex digits of the key's SHA-256 (the key itself is never logged or shown).
Without keys, all requests share one tenant. The client-chosen ``user`` field is accepted and
ignored, so it cannot pick or multiply budgets.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for an
invalid parameter (``param`` names it), 401 for a bad API key, 404 for an unknown model, 429
when a rate limit is hit, 503 when overloaded or the engine is down, 500 for anything else. An
error after a stream began is sent as one ``data: {"error": {...}}`` event before
``data: [DONE]``. A refusal of any choice (e.g. 429) answers the request, aborting the choices
already started. A client that disconnects aborts its request (every choice), freeing its KV
cache at once.
SIGINT or SIGTERM aborts every running request (a stream ends with ``finish_reason: "abort"``
and ``[DONE]``), refuses new ones (503) and exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import secrets
import signal
import socket
import sys
import time
import types
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Annotated, Any, cast

import anyio
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from pipeline import AsyncEngine, PipelineError
from pipeline.engine.metrics import EngineMetrics
from pipeline.engine.options import EngineOptions
from stages.errors import (
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RateLimitedError,
)
from stages.messages import Logprobs, RequestOutput
from stages.params import MAX_LOGPROBS, SamplingParams, validate_sampling
from stages.tokenize import load_tokenizer

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "create_app",
    "key_identity",
    "main",
]

logger = logging.getLogger("actorline.examples.openai")

#: chat roles the model's chat template understands ("developer" is OpenAI's new "system")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: OpenAI's default ``max_tokens`` for /v1/completions
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: the most choices (``n``) per prompt
MAX_N = 16
#: the most choices of one request (its prompts times ``n``), each its own engine request
MAX_CHOICES = 64
#: seeds are in [0, SEED_RANGE) (:func:`stages.params.validate_sampling`); choice j's seed is
#: the request's + j, modulo this
SEED_RANGE = 2**63
#: the floor of a logprob in answers (JSON has no -Infinity; vLLM uses the same)
MIN_LOGPROB = -9999.0
SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: seconds uvicorn waits at shutdown for responses still running (after every request was
#: aborted, they end at once) before it cancels them
GRACEFUL_SHUTDOWN_SECONDS = 5


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
    #: accepted and ignored: rate limits follow the API key, not a client-chosen name
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

    #: one prompt or several (OpenAI's four forms: text, texts, token ids, token-id lists)
    prompt: str | list[str] | list[int] | list[list[int]]
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
    "echo": bool,
    "best_of": lambda value: value not in (None, 1),
    "suffix": bool,
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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        error = {"message": self.message, "type": self.error_type, "param": self.param,
                 "code": self.code}  # fmt: skip
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_engine(cls, error: Exception) -> ApiError:
        """The HTTP answer to an error of the engine API (an ApiError is its own answer)."""
        if isinstance(error, ApiError):
            return error
        if isinstance(error, PromptTooLongError):
            return cls(400, str(error), param=error.field, code="context_length_exceeded")
        if isinstance(error, InvalidRequestError):
            return cls(400, str(error), param=error.field, code="invalid_value")
        if isinstance(error, RateLimitedError):
            # NOTE: the openai client waits Retry-After seconds before it retries a 429.
            seconds = max(1, math.ceil(error.retry_after or 1))
            return cls(429, str(error), error_type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(seconds)})  # fmt: skip
        if isinstance(error, OverloadedError):
            return cls(503, str(error), error_type="server_error", code="overloaded")
        if isinstance(error, PipelineError):
            return cls(503, f"the engine is not available: {error}", error_type="server_error",
                       code="engine_unavailable")  # fmt: skip
        return cls(500, f"{type(error).__name__}: {error}", error_type="server_error")


def _unsupported(body: BaseModel) -> None:
    if getattr(body, "stream_options", None) is not None and not getattr(body, "stream", False):
        raise ApiError(400, "stream_options: only allowed when stream is true",
                       param="stream_options", code="invalid_value")  # fmt: skip
    for field, asks_too_much in _UNSUPPORTED.items():
        value = getattr(body, field, None)
        if asks_too_much(value):
            raise ApiError(400, f"{field}: is not supported (got {value!r})", param=field,
                           code="unsupported_value")  # fmt: skip


def _sampling(
    body: _GenerationBody, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The request's sampling parameters, validated. ``max_tokens`` None: up to the model's
    length; ``logprobs``: how many top alternatives to return per token (None: no logprobs)."""
    values: dict[str, Any] = {name: getattr(body, name) for name in _SAMPLING_FIELDS}
    values = {name: value for name, value in values.items() if value is not None}
    if body.stop is not None:
        values["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        values["stop_token_ids"] = tuple(body.stop_token_ids)
    params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)
    try:
        validate_sampling(params)
    except InvalidRequestError as exc:
        raise ApiError.from_engine(exc) from None
    return params


def _choices_per_prompt(body: _GenerationBody) -> int:
    """``n``: how many choices to generate for each prompt (default 1, at most MAX_N)."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n",
                       code="invalid_value")  # fmt: skip
    return n


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a /v1/completions request (a list of token ids is one prompt)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [cast(list[int], prompt)]
    return list(cast(list[str] | list[list[int]], prompt))


def _choice_prompts(
    prompts: Sequence[Any], params: SamplingParams, n: int
) -> list[tuple[Any, SamplingParams]]:
    """Each choice's prompt and sampling parameters, in OpenAI's order (choice
    ``prompt_index * n + j``): with a seed, choice j of a prompt samples with seed + j, so
    that seeded choices differ and reproduce; without one each samples on its own.

    Raises:
        ApiError: 400, more than MAX_CHOICES choices.
    """
    if len(prompts) * n > MAX_CHOICES:
        param = "prompt" if len(prompts) > MAX_CHOICES else "n"
        raise ApiError(400, f"{len(prompts)} prompt(s) times n={n} is {len(prompts) * n} "
                       f"choices; at most {MAX_CHOICES} per request", param=param,
                       code="invalid_value")  # fmt: skip
    seed = params.seed
    each = [params if seed is None else params.replace(seed=(seed + j) % SEED_RANGE)
            for j in range(n)]  # fmt: skip
    return [(prompt, choice) for prompt in prompts for choice in each]


def _chat_logprobs_asked(body: ChatCompletionRequest) -> int | None:
    """``SamplingParams.logprobs`` of a chat request: ``top_logprobs`` (default 0) when
    ``logprobs`` is true, else None."""
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                       param="top_logprobs", code="invalid_value")  # fmt: skip
    if not body.logprobs:
        if top:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs",
                           code="invalid_value")  # fmt: skip
        return None
    return top or 0


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


# -- logprobs -------------------------------------------------------------------------------------


class _TokenTexts:
    """The text of each token id, decoded alone (special tokens kept, as vLLM shows them in
    logprobs) and once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(self._tokenizer.decode([token_id]))
        return text


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _chat_token(texts: _TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}


def _chat_logprobs(entries: Sequence[Logprobs], texts: _TokenTexts) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
    one entry per token, ``top_logprobs`` a list of ``{token, logprob, bytes}``."""
    content = [
        {
            **_chat_token(texts, entry.token_id, entry.logprob),
            "top_logprobs": [
                _chat_token(texts, token_id, logprob)
                for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs)
            ],
        }
        for entry in entries
    ]
    return {"content": content}


def _completion_logprobs(
    entries: Sequence[Logprobs], texts: _TokenTexts, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy completions ``logprobs`` (``tokens``, ``token_logprobs``,
    ``top_logprobs`` as token → logprob dicts, ``text_offset``) with offsets counted from
    ``offset``, and the offset after the last token."""
    tokens = [texts(entry.token_id) for entry in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    payload = {
        "tokens": tokens,
        "token_logprobs": [_logprob(entry.logprob) for entry in entries],
        "top_logprobs": [
            {
                texts(token_id): _logprob(logprob)
                for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs)
            }
            for entry in entries
        ],
        "text_offset": offsets,
    }
    return payload, offset


# -- generation -----------------------------------------------------------------------------------


def _usage(outputs: Sequence[RequestOutput], per_prompt: int) -> dict[str, Any]:
    """The usage of a request's choices (``per_prompt`` choices of each prompt, in order): each
    prompt's tokens (and its cached ones) counted once, from its first choice; the completion
    tokens of every choice."""
    firsts = outputs[::per_prompt]
    prompt = sum(output.num_prompt_tokens for output in firsts)
    completion = sum(len(output.token_ids) for output in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
    }


async def _abort_on_disconnect(
    request: Request, engine: AsyncEngine, request_id: str, engine_ids: Sequence[str]
) -> None:
    """Wait for the client to go away, then abort every engine request answering it (frees
    their KV blocks)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    logger.info("client of %s disconnected; aborting", request_id)
    for engine_id in engine_ids:
        with contextlib.suppress(Exception):  # finished meanwhile, or the engine is closing
            await engine.abort(engine_id)


async def _next_output(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    return await anext(stream)


@dataclasses.dataclass
class _Choices:
    """The engine requests answering one HTTP request, one per choice (a choice's index is its
    position): their output streams, the task that aborts them all when the client
    disconnects, and the set of running requests their ids are in until they end."""

    request_id: str
    engine_ids: list[str]
    streams: list[AsyncGenerator[RequestOutput, None]]
    watcher: asyncio.Task[None]
    running: set[str]
    #: the latest output of each choice (set by :meth:`start`, kept by :meth:`outputs`)
    latest: list[RequestOutput] = dataclasses.field(default_factory=list)
    #: the tasks reading the streams (:meth:`start`'s, then :meth:`outputs`')
    _readers: list[asyncio.Task[Any]] = dataclasses.field(default_factory=list)

    async def start(self) -> None:
        """Wait for every choice's first output.

        Raises:
            Exception: the engine's error for a choice (by index, the first of those refused
                when one is), as soon as one is refused.
        """
        readers = [asyncio.create_task(_next_output(stream)) for stream in self.streams]
        self._readers = readers
        await asyncio.wait(readers, return_when=asyncio.FIRST_EXCEPTION)
        for reader in readers:
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise cast(Exception, reader.exception())
        self.latest = [reader.result() for reader in readers]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs (its first one included) as they arrive, with its index.

        Raises:
            Exception: the first error of any choice (the engine died, ...).
        """
        arrived: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()
        self._readers = [
            asyncio.create_task(self._read(index, arrived)) for index in range(len(self.streams))
        ]
        ended = 0
        while ended < len(self.streams):
            index, item = await arrived.get()
            if item is None:
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                self.latest[index] = item
                yield index, item

    async def _read(
        self, index: int, arrived: asyncio.Queue[tuple[int, RequestOutput | Exception | None]]
    ) -> None:
        arrived.put_nowait((index, self.latest[index]))
        try:
            async for output in self.streams[index]:
                arrived.put_nowait((index, output))
        except Exception as exc:
            arrived.put_nowait((index, exc))
        else:
            arrived.put_nowait((index, None))

    async def close(self) -> None:
        """End every choice, aborting those still running. Shielded: a cancelled response
        must still end the engine streams. Idempotent."""
        self.running.difference_update(self.engine_ids)
        self.watcher.cancel()
        with anyio.CancelScope(shield=True):
            # NOTE: a stream can be closed only once no task runs it: cancel its reader first
            # (which ends it, aborting a running request), then close what was never read.
            for reader in self._readers:
                reader.cancel()
            if self._readers:
                await asyncio.wait(self._readers)
            for reader in self._readers:
                if not reader.cancelled():
                    reader.exception()  # retrieved: a second refusal needs no warning
            for stream in self.streams:
                await stream.aclose()


async def _start(
    request: Request, server: _Server, request_id: str,
    choices: Sequence[tuple[Any, SamplingParams]], tenant: str,
) -> _Choices:  # fmt: skip
    """Start one engine request per choice (a prompt and its sampling parameters), all at
    once, and wait for the first output of each, so that a refusal (invalid, rate limited,
    ...) is answered with its HTTP status, not in the middle of a stream; when one is refused,
    those already started are aborted."""
    engine = server.usable_engine()
    engine_ids = [f"{request_id}-{index}" for index in range(len(choices))]
    # NOTE: generate() is an async generator; aclose() ends it (aborting a running request)
    streams = [
        cast(
            AsyncGenerator[RequestOutput, None],
            engine.generate(prompt, params, request_id=engine_id, tenant=tenant),
        )
        for engine_id, (prompt, params) in zip(engine_ids, choices)
    ]
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, engine, request_id, engine_ids))
    server.running.update(engine_ids)
    started = _Choices(request_id, engine_ids, streams, watcher, server.running)
    try:
        await started.start()
    except BaseException as exc:
        await started.close()
        if isinstance(exc, Exception):
            raise ApiError.from_engine(exc) from exc
        raise
    return started


async def _collect(choices: _Choices) -> list[RequestOutput]:
    """The last output of every choice.

    Raises:
        ApiError: the engine failed on the way (it died, was closed, ...).
    """
    try:
        async for _ in choices.outputs():
            pass
        return choices.latest
    except Exception as exc:
        raise ApiError.from_engine(exc) from exc
    finally:
        await choices.close()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _event_stream(
    choices: _Choices, events: AsyncGenerator[str, None]
) -> AsyncGenerator[str, None]:
    """``events`` then ``data: [DONE]``; an error after the stream began is sent as one
    ``data: {"error": ...}`` event before ``[DONE]`` (as vLLM does). Ends every choice."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except Exception as exc:
        error = ApiError.from_engine(exc)
        logger.warning("request %s failed mid-stream: %s", choices.request_id, error.message)
        yield _sse(error.body())
    finally:
        await choices.close()
    yield SSE_DONE


class _EventStreamResponse(StreamingResponse):
    """The server-sent events of ``choices`` (see :func:`_event_stream`), which ends every
    choice however the response ends: a client gone before the stream began, or while an
    event was being sent, leaves the stream's generator unfinished."""

    def __init__(self, choices: _Choices, events: AsyncGenerator[str, None]) -> None:
        self._choices = choices
        self._events = _event_stream(choices, events)
        super().__init__(self._events, media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
            await self._choices.close()


@dataclasses.dataclass
class _Reply:
    """How to shape the answer to one request: the fields every response or chunk starts
    with, the token decoder when logprobs were asked for (else None), whether a stream ends
    with a usage chunk, and how many choices each prompt has (``n``)."""

    head: dict[str, Any]
    texts: _TokenTexts | None
    include_usage: bool
    per_prompt: int

    def chunk(self, choice: dict[str, Any]) -> str:
        usage = {"usage": None} if self.include_usage else {}
        return _sse({**self.head, "choices": [choice], **usage})

    def usage(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        return _usage(outputs, self.per_prompt)

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> str:
        return _sse({**self.head, "choices": [], "usage": self.usage(outputs)})


@dataclasses.dataclass
class _LogprobsCursor:
    """How much of a request's logprobs a stream has sent: ``sent`` entries, covering
    ``offset`` characters of token text."""

    sent: int = 0
    offset: int = 0

    def take(self, output: RequestOutput) -> Sequence[Logprobs]:
        """The entries of ``output`` not sent yet (they count as sent from now on)."""
        entries = (output.logprobs or ())[self.sent :]
        self.sent += len(entries)
        return entries


def _completion_choice(
    reply: _Reply, index: int, output: RequestOutput, text: str, entries: Sequence[Logprobs],
    offset: int,
) -> tuple[dict[str, Any], int]:  # fmt: skip
    """The /v1/completions choice ``index`` of ``text`` with the logprobs of ``entries`` (text
    offsets from ``offset``), and the offset after them."""
    logprobs = None
    if reply.texts is not None and entries:
        logprobs, offset = _completion_logprobs(entries, reply.texts, offset)
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}  # fmt: skip
    return choice, offset


def _completion_response(reply: _Reply, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    choices = [
        _completion_choice(reply, index, output, output.text, output.logprobs or (), 0)[0]
        for index, output in enumerate(outputs)
    ]
    return {**reply.head, "choices": choices, "usage": reply.usage(outputs)}


async def _completion_events(reply: _Reply, choices: _Choices) -> AsyncGenerator[str, None]:
    cursors = [_LogprobsCursor() for _ in choices.streams]
    async for index, output in choices.outputs():
        if output.delta or output.finished:
            cursor = cursors[index]
            choice, cursor.offset = _completion_choice(
                reply, index, output, output.delta, cursor.take(output), cursor.offset
            )
            yield reply.chunk(choice)
    if reply.include_usage:
        yield reply.usage_chunk(choices.latest)


def _chat_choice_logprobs(reply: _Reply, entries: Sequence[Logprobs]) -> dict[str, Any] | None:
    return _chat_logprobs(entries, reply.texts) if reply.texts is not None and entries else None


def _chat_response(reply: _Reply, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    choices = [
        {"index": index, "message": {"role": "assistant", "content": output.text},
         "logprobs": _chat_choice_logprobs(reply, output.logprobs or ()),
         "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}
        for index, output in enumerate(outputs)
    ]  # fmt: skip
    return {**reply.head, "choices": choices, "usage": reply.usage(outputs)}


def _chat_chunk(
    reply: _Reply, index: int, delta: dict[str, str], entries: Sequence[Logprobs],
    output: RequestOutput | None = None,
) -> str:  # fmt: skip
    """A chat stream chunk of choice ``index``: ``delta`` with the logprobs of ``entries``;
    ``output``: the finished output whose reasons it carries (None: not its last chunk)."""
    choice = {"index": index, "delta": delta, "logprobs": _chat_choice_logprobs(reply, entries),
              "finish_reason": output.finish_reason if output else None,
              "stop_reason": output.stop_reason if output else None}  # fmt: skip
    return reply.chunk(choice)


async def _chat_events(reply: _Reply, choices: _Choices) -> AsyncGenerator[str, None]:
    cursors = [_LogprobsCursor() for _ in choices.streams]
    for index in range(len(cursors)):
        yield _chat_chunk(reply, index, {"role": "assistant", "content": ""}, ())
    async for index, output in choices.outputs():
        if output.delta:
            yield _chat_chunk(reply, index, {"content": output.delta}, cursors[index].take(output))
        if output.finished:
            yield _chat_chunk(reply, index, {}, cursors[index].take(output), output)
    if reply.include_usage:
        yield reply.usage_chunk(choices.latest)


# -- the application ------------------------------------------------------------------------------


def key_identity(key: str) -> str:
    """The tenant name of an API key: ``key-`` and the first 12 hex digits of its SHA-256 (the
    name shows up in rate-limit errors and logs; the key never does)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclasses.dataclass
class _Server:
    options: EngineOptions
    model_name: str
    #: accepted API key → its tenant (empty: no authentication, one shared tenant "")
    tenants: Mapping[str, str]
    registry: CollectorRegistry
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    engine: AsyncEngine | None = None
    texts: _TokenTexts | None = None
    #: ids of the requests being answered
    running: set[str] = dataclasses.field(default_factory=set)
    shutting_down: bool = False
    _aborting: asyncio.Task[None] | None = None

    def usable_engine(self) -> AsyncEngine:
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", error_type="server_error")
        if self.engine is None:
            raise ApiError(503, "the engine is not running", error_type="server_error")
        return self.engine

    def shut_down(self) -> None:
        """Refuse new requests and abort every running one (on the event loop's thread):
        their streams end with ``finish_reason: "abort"``, so the graceful shutdown has
        nothing left to wait for. Idempotent."""
        self.shutting_down = True
        if self._aborting is None:
            self._aborting = asyncio.ensure_future(self._abort_running())

    async def _abort_running(self) -> None:
        engine = self.engine
        if engine is None:
            return
        for request_id in list(self.running):
            with contextlib.suppress(Exception):  # finished meanwhile, or the engine is gone
                await engine.abort(request_id)

    def token_texts(self, logprobs: int | None) -> _TokenTexts | None:
        """The token decoder for a request that asked for ``logprobs`` (None: none asked)."""
        if logprobs is None:
            return None
        if self.texts is None:
            raise ApiError(503, "the tokenizer is not loaded", error_type="server_error")
        return self.texts


async def _tenant(request: Request) -> str:
    """Check the request's API key; its tenant: the key's identity, or "" when the server has
    no keys. The body's ``user`` plays no part.

    Raises:
        ApiError: 401, no or an unknown key.
    """
    server: _Server = request.app.state.server
    if not server.tenants:
        return ""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    tenant = None
    # NOTE: every key is compared (constant time each), so timing does not tell which matched
    for key, identity in server.tenants.items():
        if secrets.compare_digest(given.encode(), key.encode()):
            tenant = identity
    if scheme.lower() != "bearer" or tenant is None:
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    return tenant


#: the authenticated tenant of a request (a dependency: 401 without a valid key)
Tenant = Annotated[str, Depends(_tenant)]


def create_app(
    options: EngineOptions,
    *,
    served_model_name: str | None = None,
    api_keys: Sequence[str] = (),
    on_ready: Callable[[], object] = lambda: None,
) -> FastAPI:
    """The FastAPI application: starts an :class:`AsyncEngine` with ``options`` (and its
    metrics) and loads the model's tokenizer (to spell out logprobs' tokens) when the server
    starts, closes the engine at shutdown. ``served_model_name``: the model id clients use
    (default ``options.model``). ``api_keys``: accepted bearer tokens, each its own tenant
    named by :func:`key_identity` (none: no authentication, one tenant ""; give
    ``options.tenant_limits`` under those names). ``on_ready()``: called once the engine is
    up."""
    tenants = {key: key_identity(key) for key in api_keys}
    server = _Server(options, served_model_name or options.model, tenants, CollectorRegistry())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        server.texts = _TokenTexts(await asyncio.to_thread(load_tokenizer, options.model))
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

    app = FastAPI(title="actorline OpenAI-compatible server", lifespan=lifespan)
    # NOTE: the API needs the key; /metrics does not (scrapers, like health probes, have none)
    api = APIRouter(prefix="/v1", dependencies=[Depends(_tenant)])
    app.state.server = server
    _add_error_handlers(app)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    def check_model(model: str) -> None:
        if model != server.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{server.model_name!r}", param="model",
                           code="model_not_found")  # fmt: skip

    def reply(
        request_id: str, kind: str, body: _GenerationBody, logprobs: int | None, n: int
    ) -> _Reply:
        head = {"id": request_id, "object": kind, "created": int(time.time()),
                "model": server.model_name}  # fmt: skip
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _Reply(head, server.token_texts(logprobs), include_usage, n)

    @api.get("/models")
    async def list_models() -> dict[str, Any]:
        engine = server.usable_engine()
        assert engine.info is not None
        model = {"id": server.model_name, "object": "model", "created": server.created,
                 "owned_by": "actorline", "max_model_len": engine.info.max_model_len}  # fmt: skip
        return {"object": "list", "data": [model]}

    @api.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request, tenant: Tenant) -> Response:
        check_model(body.model)
        _unsupported(body)
        n = _choices_per_prompt(body)
        prompts = _prompts(body.prompt)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = _sampling(body, max_tokens, body.logprobs)
        each = _choice_prompts(prompts, params, n)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        answer = reply(request_id, "text_completion", body, params.logprobs, n)
        choices = await _start(request, server, request_id, each, tenant)
        if not body.stream:
            return JSONResponse(_completion_response(answer, await _collect(choices)))
        return _EventStreamResponse(choices, _completion_events(answer, choices))

    @api.post("/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, tenant: Tenant
    ) -> Response:
        check_model(body.model)
        _unsupported(body)
        n = _choices_per_prompt(body)
        messages = _chat_messages(body)
        # NOTE: with no limit asked for, None: the engine stops at the model's length (vLLM)
        max_tokens = next(
            (limit for limit in (body.max_completion_tokens, body.max_tokens) if limit is not None),
            None,
        )
        params = _sampling(body, max_tokens, _chat_logprobs_asked(body))
        each = _choice_prompts([messages], params, n)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        answer = reply(request_id, kind, body, params.logprobs, n)
        choices = await _start(request, server, request_id, each, tenant)
        if not body.stream:
            return JSONResponse(_chat_response(answer, await _collect(choices)))
        return _EventStreamResponse(choices, _chat_events(answer, choices))

    app.include_router(api)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error OpenAI-style: API errors, invalid bodies, HTTP errors of the
    framework (unknown route, ...), and anything unexpected (500; uvicorn logs its
    traceback)."""

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

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return ApiError.from_engine(error).response()


# -- command line ---------------------------------------------------------------------------------


def _key_limit(text: str) -> tuple[str, tuple[float | None, float | None]]:
    """``KEY:REQUESTS_PER_SECOND:TOKENS_PER_SECOND`` with ``-`` for no limit (the key may
    contain ``:``). Error messages never repeat the key."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise argparse.ArgumentTypeError("expected KEY:REQUESTS/S:TOKENS/S")
    try:
        limits = tuple(None if part == "-" else float(part) for part in parts[1:])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"limits must be numbers or '-', got {':'.join(parts[1:])!r}"
        ) from None
    return parts[0], (limits[0], limits[1])


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF directory or .gguf")
    parser.add_argument("--served-model-name", default=None, help="model id (default --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: pick a free port")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="accepted key, its own rate-limit tenant (repeat)")  # fmt: skip
    parser.add_argument("--transport", default="zmq", choices=("zmq", "grpc", "memory"))
    parser.add_argument("--scheduler", default="fcfs", help="scheduling policy plugin name")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--requests-per-second", type=float, default=None,
                        help="per API key (all requests together without keys)")  # fmt: skip
    parser.add_argument("--tokens-per-second", type=float, default=None,
                        help="per API key (all requests together without keys)")  # fmt: skip
    parser.add_argument("--key-limit", type=_key_limit, action="append", default=[],
                        metavar="KEY:RPS:TPS",
                        help="requests/s and tokens/s of one --api-key ('-': none)")  # fmt: skip
    parser.add_argument("--rate-limit-burst", type=float, default=1.0, metavar="SECONDS",
                        help="seconds of its rate a key may spend at once (1)")  # fmt: skip
    return parser.parse_args(argv)


def _tenant_limits(
    api_keys: Sequence[str], key_limits: Sequence[tuple[str, tuple[float | None, float | None]]]
) -> dict[str, tuple[float | None, float | None]]:
    """``--key-limit`` values as the engine's ``tenant_limits`` (keyed by tenant name).

    Raises:
        ValueError: a limit names a key that is not an ``--api-key``.
    """
    unknown = [key for key, _ in key_limits if key not in api_keys]
    if unknown:
        names = ", ".join(key_identity(key) for key in unknown)
        raise ValueError(f"--key-limit for a key not given with --api-key ({names})")
    return {key_identity(key): limits for key, limits in key_limits}


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which on SIGINT/SIGTERM also calls ``on_exit`` on the event loop
    (to abort the running requests): uvicorn's graceful shutdown waits for every response to
    end, and a stream generating thousands of tokens would otherwise keep it waiting."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # NOTE: a signal handler installed with signal.signal runs between two bytecodes of
        # the main thread, possibly inside the loop's own code: hand the work to the loop.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_exit)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM, which abort the running requests (their streams end with
    ``finish_reason: "abort"``) and stop the server. Prints ``serving OpenAI-compatible API on
    URL`` once the engine is up."""
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
            tenant_limits=_tenant_limits(args.api_key, args.key_limit),
            rate_limit_burst=args.rate_limit_burst,
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
    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS
    )
    server = _Uvicorn(config, on_exit=app.state.server.shut_down)
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
