"""The ``actorline.v1.Generation`` servicer over a started
:class:`~pipeline.engine.async_engine.AsyncEngine`.

Each call is authenticated by its API key (:mod:`pipeline.server.auth`), which selects the
engine tenant, so the admit stage enforces the key's rate limits. Request ids are namespaced
by tenant: two keys may use the same id, and a key can only abort its own requests. Errors
end the call with the status of :mod:`pipeline.server.status`.

NOTE: a client that cancels its Generate call cancels the handler task; closing the engine's
output iterator (``aclosing``) then aborts the request in the engine, which frees its KV.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, NoReturn, cast

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from pipeline.engine.async_engine import AsyncEngine
from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc as pb_grpc
from pipeline.server.auth import (
    AUTHORIZATION_KEY,
    ApiKeys,
    AuthenticationError,
    PermissionDeniedError,
)
from pipeline.server.convert import (
    embed_inputs_from_proto,
    model_info_to_proto,
    prompt_from_proto,
    rendering_from_proto,
    response_from_output,
    sampling_from_proto,
    tools_from_proto,
)
from pipeline.server.limits import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    check_logprob_entries,
    check_request_template,
)
from pipeline.server.lora_modules import LoRAModules
from pipeline.server.status import ServiceUnavailableError, status_for
from stages.errors import InvalidRequestError, RequestError
from stages.lora import LoRARequest
from stages.messages import RequestOutput
from stages.pooling import PoolingParams
from transports.tasks import TaskSet

__all__ = ["MAX_REQUEST_ID_LENGTH", "GenerationService"]

logger = logging.getLogger("actorline.server")

#: longest client request id accepted (characters)
MAX_REQUEST_ID_LENGTH = 256
_ENGINE_ID_SEPARATOR = "/"


class GenerationService(pb_grpc.GenerationServicer):
    """Serves Generate, Abort, Embed and GetModelInfo from ``engine`` (started, not owned: the
    caller closes it). ``api_keys``: the accepted keys (none: authentication is off);
    ``max_logprob_entries``: the logprobs one call may ask for (INVALID_ARGUMENT over it,
    :func:`~pipeline.server.limits.check_logprob_entries`); ``trust_request_chat_template``:
    whether a call may bring its own chat template
    (:func:`~pipeline.server.limits.check_request_template`); ``lora_modules``: the LoRA
    adapters a call's ``lora_name`` may name (docs/lora.md)."""

    def __init__(
        self,
        engine: AsyncEngine,
        api_keys: ApiKeys | None = None,
        *,
        max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
        trust_request_chat_template: bool = False,
        lora_modules: LoRAModules | None = None,
    ) -> None:
        self._engine = engine
        self._lora_modules = lora_modules if lora_modules is not None else LoRAModules()
        self._max_logprob_entries = max_logprob_entries
        self._trust_request_chat_template = trust_request_chat_template
        self._api_keys = api_keys if api_keys is not None else ApiKeys()
        self._tenant_adapters = self._api_keys.tenant_adapters()
        self._running: set[str] = set()
        self._shutting_down = False

    @property
    def num_running(self) -> int:
        """Generate calls in progress."""
        return len(self._running)

    # -- RPCs -----------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream the request's outputs: one response per engine output, the last with the
        finish reason and usage. Ends with an error status for a refused request."""
        tenant = await self._authenticate(context)
        client_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        try:
            self._check_serving()
            engine_id = self._engine_request_id(tenant, client_id)
            prompt = prompt_from_proto(request)
            params = sampling_from_proto(request.sampling_params)
            tools = tools_from_proto(request)
            rendering = rendering_from_proto(request)
            check_request_template(rendering, self._trust_request_chat_template)
            info = self._engine.info
            if info is not None:
                check_logprob_entries(
                    1,
                    params.max_tokens,
                    params.logprobs,
                    info.max_model_len,
                    self._max_logprob_entries,
                    params.prompt_logprobs,
                )
            lora = self._lora_of(request.lora_name, tenant)
            if request.lora_name and lora is None:
                raise InvalidRequestError(
                    f"the LoRA adapter {request.lora_name!r:.80} does not exist; this server "
                    f"serves {sorted(self._lora_modules.adapters) or 'none'}",
                    field="lora_name",
                )
            if engine_id in self._running:
                raise InvalidRequestError(
                    f"request id {client_id!r} is already running", field="request_id"
                )
        except Exception as error:
            await _end_call(context, error)
        self._running.add(engine_id)
        try:
            sent = sent_reasoning = 0
            prompt_sent = False
            # NOTE: generate is an async generator (annotated as an iterator)
            outputs = cast(
                AsyncGenerator[RequestOutput, None],
                self._engine.generate(
                    prompt,
                    params,
                    request_id=engine_id,
                    tenant=tenant,
                    chat_template=request.chat_template,
                    tools=tools,
                    rendering=rendering,
                    lora_request=lora,
                ),
            )
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if output.finish_reason == "abort" and self._shutting_down:
                        raise ServiceUnavailableError(
                            "the server is shutting down; the request was aborted"
                        )
                    with_prompt = not prompt_sent and output.prompt_logprobs is not None
                    await context.write(
                        response_from_output(
                            output, client_id, sent, sent_reasoning, with_prompt=with_prompt
                        )
                    )
                    prompt_sent = prompt_sent or with_prompt
                    sent = len(output.token_ids)
                    sent_reasoning = len(output.reasoning)
        except Exception as error:
            await _end_call(context, error)
        finally:
            self._running.discard(engine_id)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Abort a running request of the caller's key (its stream ends with ABORT).

        ``aborted`` is True only when the abort reached a request the engine had not finished:
        a request that has just finished (its last output is on its way to the client, so its
        call is still running here) is left alone and answers False."""
        tenant = await self._authenticate(context)
        try:
            self._check_serving()
            engine_id = self._engine_request_id(tenant, request.request_id)
            if engine_id not in self._running:
                return pb.AbortResponse(aborted=False)
            aborted = await self._engine.abort(engine_id)
        except Exception as error:
            await _end_call(context, error)
        return pb.AbortResponse(aborted=aborted)

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        """Every input's embedding (docs/serving.md, "Embeddings"): all checked before any
        runs, then run together; one refused or failed input fails the call (and aborts the
        others)."""
        tenant = await self._authenticate(context)
        engine = self._engine
        call_id = uuid.uuid4().hex
        try:
            self._check_serving()
            self._check_unbound(tenant)
            prompts = embed_inputs_from_proto(request)
            pooling = PoolingParams(
                dimensions=request.dimensions if request.HasField("dimensions") else None,
                normalize=request.normalize if request.HasField("normalize") else None,
            )
            truncate = (
                request.truncate_prompt_tokens
                if request.HasField("truncate_prompt_tokens")
                else None
            )
            checked = []
            for index, prompt in enumerate(prompts):
                try:
                    checked.append(
                        engine.check_embedding(
                            prompt, pooling, tenant=tenant, truncate_prompt_tokens=truncate
                        )
                    )
                except InvalidRequestError as error:
                    if error.field in ("prompt", "prompt_token_ids"):
                        error.field = f"inputs[{index}]"
                    raise
            engine_ids = [
                self._engine_request_id(tenant, f"embed-{call_id}-{index}")
                for index in range(len(checked))
            ]
            self._running.update(engine_ids)
            try:
                # NOTE: leaving the block on an error cancels the other inputs and waits
                async with TaskSet("embed") as tasks:
                    running = [
                        tasks.spawn(engine.embed(prompt, request_id=engine_id))
                        for prompt, engine_id in zip(checked, engine_ids, strict=True)
                    ]
                    results = [await task for task in running]
            finally:
                self._running.difference_update(engine_ids)
        except Exception as error:
            await _end_call(context, error)
        return pb.EmbedResponse(
            embeddings=[
                pb.Embedding(
                    values=result.outputs.data.tolist(), prompt_tokens=result.num_prompt_tokens
                )
                for result in results
            ],
            prompt_tokens=sum(item.num_prompt_tokens for item in results),
        )

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        """The engine's model, KV cache and scheduler."""
        await self._authenticate(context)
        try:
            self._check_serving()
            info = self._engine.info
            if info is None:
                raise ServiceUnavailableError("the engine is not started")
        except Exception as error:
            await _end_call(context, error)
        return model_info_to_proto(info, self._engine.options.scheduler)

    # -- shutdown -------------------------------------------------------------------------------

    async def shut_down(self) -> None:
        """Refuse new calls and abort every running request: their calls end with UNAVAILABLE
        (after the output they already received)."""
        self._shutting_down = True
        for engine_id in list(self._running):
            with contextlib.suppress(Exception):  # the engine may be gone already
                await self._engine.abort(engine_id)

    # -- internals ------------------------------------------------------------------------------

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> str:
        values = [
            value.decode() if isinstance(value, bytes) else value
            for key, value in context.invocation_metadata() or ()
            if key == AUTHORIZATION_KEY
        ]
        try:
            if len(values) > 1:
                # NOTE: which one counts would be the server's guess; a proxy in front may
                # have checked another one than this server would bill.
                raise AuthenticationError(
                    f"{len(values)} '{AUTHORIZATION_KEY}' metadata values; send exactly one"
                )
            return self._api_keys.authenticate(values[0] if values else None)
        except RequestError as error:
            await _end_call(context, error)

    async def refuse_malformed(
        self, request: MalformedRequest, context: grpc.aio.ServicerContext
    ) -> NoReturn:
        """End a call whose request bytes did not parse: UNAUTHENTICATED without a valid key
        (as any call), else INVALID_ARGUMENT naming the message type."""
        await self._authenticate(context)
        await _end_call(
            context,
            InvalidRequestError(
                f"the request is not a valid {request.type_name}: {request.reason}",
                field="request",
            ),
        )

    def _check_serving(self) -> None:
        if self._shutting_down:
            raise ServiceUnavailableError("the server is shutting down")
        if self._engine.failure is not None:
            # NOTE: one error object for every call while the engine is dead or restarting:
            # raised afresh, so its traceback does not grow by each call's frames
            raise self._engine.failure.with_traceback(None)

    def _lora_of(self, name: str, tenant: str) -> LoRARequest | None:
        """The adapter a Generate call runs with: the one its key is bound to (docs/lora.md,
        "An API key bound to an adapter"; ``lora_name`` then empty or that adapter), else
        the one ``name`` names (None: the base model, or no such adapter).

        Raises:
            PermissionDeniedError: a bound key naming another adapter.
            InvalidRequestError: a bound key's adapter is not served now.
        """
        bound = self._tenant_adapters.get(tenant) if tenant else None
        if bound is None:
            return self._lora_modules.get(name) if name else None
        lora = self._lora_modules.bound(bound, name, (), "lora_name")
        if lora is None:
            raise InvalidRequestError(
                f"the LoRA adapter {bound!r:.80} this API key is bound to is not served now",
                field="lora_name",
            )
        return lora

    def _check_unbound(self, tenant: str) -> None:
        """Refuse a key bound to an adapter on a call that serves none (Embed).

        Raises:
            PermissionDeniedError: naming the adapter.
        """
        bound = self._tenant_adapters.get(tenant) if tenant else None
        if bound is not None:
            raise PermissionDeniedError(
                f"this API key is bound to the LoRA adapter {bound!r:.80}, which serves "
                "Generate only",
                field="lora_name",
            )

    @staticmethod
    def _engine_request_id(tenant: str, request_id: str) -> str:
        if not request_id:
            raise InvalidRequestError("request_id must not be empty", field="request_id")
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidRequestError(
                f"request_id must be at most {MAX_REQUEST_ID_LENGTH} characters, "
                f"got {len(request_id)}",
                field="request_id",
            )
        return f"{tenant}{_ENGINE_ID_SEPARATOR}{request_id}" if tenant else request_id


async def _end_call(context: grpc.aio.ServicerContext, error: BaseException) -> NoReturn:
    """End the call with the status for ``error`` (``context.abort`` raises)."""
    status = status_for(error)
    if status.code == grpc.StatusCode.INTERNAL:
        logger.error("call failed: %s", error, exc_info=error)
    await context.abort(status.code, status.details, status.trailing_metadata())
    raise AssertionError("context.abort returned")  # pragma: no cover


# -- registration -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class MalformedRequest:
    """Request bytes that did not parse as ``type_name`` (``reason`` from protobuf)."""

    type_name: str
    reason: str


def _lenient(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: bytes that do not parse become a
    :class:`MalformedRequest`. (gRPC's own handling of a deserializer error is status
    UNKNOWN with Python's exception text, and an ERROR traceback in the log per call, which
    any client, authenticated or not, could repeat at will.)"""

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            return MalformedRequest(message_type.DESCRIPTOR.full_name, str(error))

    return parse


def _or_refuse(service: GenerationService, method: Any) -> Any:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await service.refuse_malformed(request, context)
        return await method(request, context)

    return handle


def add_to_server(service: GenerationService, server: grpc.aio.Server) -> None:
    """Register ``service`` on ``server`` as the generated ``add_GenerationServicer_to_server``
    does, but with request bytes that do not parse answered INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _or_refuse(service, service.Generate),
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            _or_refuse(service, service.Abort),
            request_deserializer=_lenient(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "Embed": grpc.unary_unary_rpc_method_handler(
            _or_refuse(service, service.Embed),
            request_deserializer=_lenient(pb.EmbedRequest),
            response_serializer=pb.EmbedResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            _or_refuse(service, service.GetModelInfo),
            request_deserializer=_lenient(pb.GetModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
