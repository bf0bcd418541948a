"""Python client of the ``actorline.v1.Generation`` gRPC service (``actorline serve``).

::

    async with AsyncClient("127.0.0.1:50051", api_key="secret") as client:
        async for output in client.generate("Hello", SamplingParams(max_tokens=32)):
            print(output.delta, end="", flush=True)

    with Client("127.0.0.1:50051", api_key="secret") as client:  # the same, synchronously
        text = "".join(output.delta for output in client.generate("Hello"))

Failed calls raise the typed errors of the engine API, not raw gRPC errors:
:class:`~stages.errors.InvalidRequestError` (with ``field``), ``PromptTooLongError``,
``RateLimitedError``, ``OverloadedError``, :class:`AuthenticationError`,
:class:`~pipeline.engine.errors.EngineDeadError` (the server's engine died),
:class:`ServiceUnavailableError` (unreachable or shutting down), ``TimeoutError``, and
:class:`ServiceError` for anything else. Breaking out of a ``generate`` stream cancels the
call, which aborts the request on the server.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import AsyncGenerator, Coroutine, Generator, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline.engine.loop_thread import LoopThread
from pipeline.engine.prompts import Prompt, checked_request
from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc as pb_grpc
from pipeline.server.auth import AUTHORIZATION_KEY, AuthenticationError
from pipeline.server.convert import finish_reason_name, request_to_proto
from pipeline.server.status import (
    ServiceError,
    ServiceUnavailableError,
    error_from_status,
)
from stages.errors import RequestError
from stages.messages import Logprobs
from stages.params import SamplingParams

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "Client",
    "ModelInfo",
    "ServiceError",
    "ServiceUnavailableError",
    "StreamedOutput",
    "Usage",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request (``cached_tokens``: prompt tokens served from the
    server's prefix cache)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class StreamedOutput:
    """One response of a ``generate`` stream: the new text and token ids since the previous
    one; the last has ``finish_reason`` ("stop", "length", "abort", "error"), the
    ``stop_reason`` (stop string or token id, if one ended it) and ``usage``. ``logprobs``:
    one entry per new token when the request asked for them. ``prompt_token_ids`` and
    ``prompt_logprobs`` (vLLM's shape: None for the first token, then each token's score),
    when the request asked for ``prompt_logprobs``: on the output with the first token only."""

    request_id: str
    delta: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    logprobs: tuple[Logprobs, ...] | None = None
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model: its length and vocabulary, the KV cache capacity (``kv_cache_blocks``
    of ``block_size`` tokens = ``kv_cache_tokens``), and how it runs."""

    model: str
    max_model_len: int
    vocab_size: int
    kv_cache_blocks: int
    block_size: int
    kv_cache_tokens: int
    kv_cache_bytes: int
    dtype: str
    device: str
    scheduler: str
    prefix_caching: bool
    eos_token_ids: tuple[int, ...]
    kv_cache_dtype: str = ""  # empty from a server older than the field
    omp_wait_policy: str = ""  # the same
    #: speculative decoding's draft model, its own KV cache and its host ("" / 0: none)
    draft_model: str = ""
    draft_kv_cache_blocks: int = 0
    draft_kv_cache_bytes: int = 0
    draft_host: str = ""


def _output_from_proto(response: pb.GenerateResponse) -> StreamedOutput:
    which = response.WhichOneof("stop_reason")
    stop_reason: str | int | None = getattr(response, which) if which else None
    usage = None
    if response.HasField("usage"):
        usage = Usage(
            response.usage.prompt_tokens,
            response.usage.completion_tokens,
            response.usage.cached_tokens,
        )
    logprobs = None
    if response.logprobs:
        logprobs = tuple(_logprobs_from_proto(entry) for entry in response.logprobs)
    prompt_logprobs = None
    if response.prompt_token_ids:
        prompt_logprobs = (None, *map(_logprobs_from_proto, response.prompt_logprobs))
    return StreamedOutput(
        response.request_id,
        response.delta,
        tuple(response.token_ids),
        finish_reason_name(response.finish_reason),
        stop_reason,
        usage,
        logprobs,
        tuple(response.prompt_token_ids),
        prompt_logprobs,
    )


def _logprobs_from_proto(entry: pb.TokenLogprob) -> Logprobs:
    return Logprobs(
        entry.token_id,
        entry.logprob,
        entry.rank,
        tuple(entry.top_token_ids),
        tuple(entry.top_logprobs),
    )


def _model_info_from_proto(message: pb.ModelInfo) -> ModelInfo:
    values = {field.name: getattr(message, field.name) for field in dataclasses.fields(ModelInfo)}
    values["eos_token_ids"] = tuple(message.eos_token_ids)
    return ModelInfo(**values)


def _mapped(error: grpc.aio.AioRpcError) -> Exception:
    return error_from_status(error.code(), error.details() or "", error.trailing_metadata())


class AsyncClient:
    """An asyncio client of one Generation server.

    ``target``: ``host:port``. ``api_key``: sent as ``authorization: Bearer KEY``. ``tls``:
    None for plain TCP, True for TLS with the system's root certificates, or PEM root
    certificate bytes to trust (e.g. a self-signed server certificate). ``client_certificate``:
    ``(certificate_chain, private_key)`` PEM for mutual TLS. ``timeout``: seconds per call
    (None: no deadline). ``channel_options``: extra gRPC channel arguments.

    Use it as ``async with`` or call :meth:`close`. The channel is created on first use, in
    the running event loop.
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tls: bool | bytes | None = None,
        client_certificate: tuple[bytes, bytes] | None = None,
        timeout: float | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if not isinstance(target, str) or not target:
            raise ValueError("target must be 'host:port'")
        if client_certificate is not None and not tls:
            raise ValueError("client_certificate needs tls")
        self.target = target
        self.timeout = timeout
        self._tls = tls
        self._client_certificate = client_certificate
        self._channel_options = tuple(channel_options)
        self._metadata: tuple[tuple[str, str], ...] = (
            ((AUTHORIZATION_KEY, f"Bearer {api_key}"),) if api_key else ()
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    def __repr__(self) -> str:  # never shows the API key
        return f"AsyncClient({self.target!r}, tls={bool(self._tls)})"

    # -- calls ----------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat_template: bool = False,
    ) -> AsyncGenerator[StreamedOutput, None]:
        """Stream the outputs of one request (the last one has a ``finish_reason``).

        ``prompt``: a string (``chat_template=True`` wraps it as a user message and applies
        the model's chat template), a list of chat messages, or a list of token ids.
        ``params``: None for the server's (vLLM's) defaults.

        Raises:
            InvalidRequestError: a bad prompt or parameter (checked here first, then by the
                server), naming the field. And any error of the module docstring.
        """
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        try:
            # the validation core of every front end (docs/architecture.md, "Failure: one
            # request or the pipeline"): what the proto or the engine could not carry (a
            # lone surrogate, 2**70) is refused here, by field, before anything is sent
            checked_request(
                "client" if request_id is None else request_id, prompt, params, "", chat_template
            )
            request = request_to_proto(
                prompt, params, request_id=request_id, chat_template=chat_template
            )
        except RequestError as exc:
            exc.request_id = request_id
            raise
        call = self._generation().Generate(request, metadata=self._metadata, timeout=self.timeout)
        try:
            async for response in call:
                yield _output_from_proto(response)
        except grpc.aio.AioRpcError as error:
            mapped = _mapped(error)
            if isinstance(mapped, RequestError) and request_id is not None:
                mapped.request_id = request_id  # the caller's id, as the engine's errors carry
            raise mapped from None
        finally:
            call.cancel()  # a no-op once finished; otherwise the server aborts the request

    async def abort(self, request_id: str) -> bool:
        """Abort a running request of this API key; its stream ends with finish_reason
        "abort". Returns False when no such request is running."""
        response = await self._unary(
            self._generation().Abort(
                pb.AbortRequest(request_id=request_id),
                metadata=self._metadata,
                timeout=self.timeout,
            )
        )
        return bool(response.aborted)

    async def embed(
        self,
        inputs: str | Sequence[int] | Sequence[str | Sequence[int]],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[list[float]]:
        """The embedding of each input (a text, token ids, or a list of either), in order,
        pooled as the server's ``--pooling-type`` says (docs/serving.md, "Embeddings").

        Raises:
            InvalidRequestError: a bad input or field (named), ``dimensions`` the model does
                not allow; RateLimitedError, OverloadedError, ServiceUnavailableError as
                :meth:`generate`.
        """
        batch: Sequence[object] = inputs
        if isinstance(inputs, str) or (inputs and all(type(t) is int for t in inputs)):
            batch = [inputs]
        items = [
            pb.EmbedInput(text=item)
            if isinstance(item, str)
            else pb.EmbedInput(token_ids=pb.TokenIds(ids=list(item)))  # type: ignore[call-overload]
            for item in batch
        ]
        request = pb.EmbedRequest(
            inputs=items,
            dimensions=dimensions,
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        response = await self._unary(
            self._generation().Embed(request, metadata=self._metadata, timeout=self.timeout)
        )
        return [list(embedding.values) for embedding in response.embeddings]

    async def model_info(self) -> ModelInfo:
        """The served model, its KV cache and scheduler."""
        response = await self._unary(
            self._generation().GetModelInfo(
                pb.GetModelInfoRequest(), metadata=self._metadata, timeout=self.timeout
            )
        )
        return _model_info_from_proto(response)

    async def health(self, service: str = "") -> str:
        """The server's health status name for ``service`` (``""``: the whole server):
        "SERVING", "NOT_SERVING" or "SERVICE_UNKNOWN".

        Raises:
            ServiceUnavailableError: the server cannot be reached.
        """
        self._generation()
        assert self._health is not None
        response = await self._unary(
            self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        )
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return name

    # -- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the channel (cancelling calls in progress). Idempotent."""
        channel, self._channel = self._channel, None
        self._stub = self._health = None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals ------------------------------------------------------------------------------

    def _generation(self) -> pb_grpc.GenerationStub:
        if self._stub is None:
            self._channel = self._open_channel()
            self._stub = pb_grpc.GenerationStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._stub

    def _open_channel(self) -> grpc.aio.Channel:
        if not self._tls:
            return grpc.aio.insecure_channel(self.target, options=self._channel_options)
        root = self._tls if isinstance(self._tls, bytes) else None
        key, chain = (None, None)
        if self._client_certificate is not None:
            chain, key = self._client_certificate
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=chain
        )
        return grpc.aio.secure_channel(self.target, credentials, options=self._channel_options)

    @staticmethod
    async def _unary(call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise _mapped(error) from None


class Client:
    """The synchronous client: the same calls as :class:`AsyncClient` (same arguments), run
    on a private event loop thread. ``generate`` returns an iterator; leaving it early
    cancels the call. Use it as ``with`` or call :meth:`close`."""

    def __init__(self, target: str, **options: Any) -> None:
        self._loop = LoopThread()
        self._client = AsyncClient(target, **options)
        self._finalizer = weakref.finalize(self, _close_client, self._client, self._loop)

    def __repr__(self) -> str:
        return f"Client({self._client.target!r})"

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if not self._finalizer.alive:
            coroutine.close()
            raise ServiceUnavailableError("the client is closed")
        return self._loop.run(coroutine)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat_template: bool = False,
    ) -> Generator[StreamedOutput, None, None]:
        """See :meth:`AsyncClient.generate`; closing the generator (or leaving a for loop
        over it) cancels the call."""
        stream = self._client.generate(
            prompt, params, request_id=request_id, chat_template=chat_template
        )
        try:
            while True:
                try:
                    output = self._run(_next(stream))
                except StopAsyncIteration:
                    return
                yield output
        finally:
            if self._finalizer.alive:
                self._loop.run(_close_stream(stream))

    def abort(self, request_id: str) -> bool:
        """See :meth:`AsyncClient.abort`."""
        return self._run(self._client.abort(request_id))

    def embed(
        self,
        inputs: str | Sequence[int] | Sequence[str | Sequence[int]],
        **options: Any,
    ) -> list[list[float]]:
        """See :meth:`AsyncClient.embed`."""
        return self._run(self._client.embed(inputs, **options))

    def model_info(self) -> ModelInfo:
        """See :meth:`AsyncClient.model_info`."""
        return self._run(self._client.model_info())

    def health(self, service: str = "") -> str:
        """See :meth:`AsyncClient.health`."""
        return self._run(self._client.health(service))

    def close(self) -> None:
        """Close the channel and stop the loop thread. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _next(stream: AsyncGenerator[T, None]) -> T:
    return await stream.__anext__()


async def _close_stream(stream: AsyncGenerator[Any, None]) -> None:
    await stream.aclose()


def _close_client(client: AsyncClient, loop: LoopThread) -> None:
    try:
        if loop.loop.is_running():
            loop.run(client.close())
    finally:
        loop.stop()
