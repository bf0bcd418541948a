"""The gRPC server: the Generation service, gRPC health checking and server reflection over
one engine, with optional TLS (and mutual TLS); and :func:`serve`, the body of
``actorline serve``.

Health (``grpc.health.v1.Health``) reports SERVING for ``""`` and ``actorline.v1.Generation``
while the engine runs, and NOT_SERVING once the engine died or the server is shutting down;
with ``restart_engine`` SERVING again once a fresh engine serves (docs/architecture.md §4.7).
With data parallelism the engine runs while one of its replicas lives: a replica that dies is
logged (its requests fail alone) and the health stays SERVING.
Health and reflection need no API key (probes and tools like ``grpcurl`` use them).
Reflection is served as ``grpc.reflection.v1.ServerReflection`` (what grpcurl and current
clients ask first) and ``grpc.reflection.v1alpha.ServerReflection`` (older ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.errors import EngineCrashLoopError
from pipeline.engine.options import EngineOptions
from pipeline.runtime.replicas import ReplicaLost
from pipeline.server import generation_pb2 as pb
from pipeline.server.auth import ApiKeys
from pipeline.server.grpc_service import GenerationService, add_to_server
from pipeline.server.limits import ListenerLimits, connection_cap
from pipeline.server.listen import DEFAULT_HOST, format_address
from pipeline.server.lora_modules import LoRAModules
from pipeline.server.tls import ServerTLS
from transports.tasks import TaskSet

if TYPE_CHECKING:
    from pipeline.engine.metrics import EngineMetrics

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "SERVICE_NAME",
    "GenerationServer",
    "ServerTLS",
    "format_address",
    "grpc_limit_options",
    "serve",
]

logger = logging.getLogger("actorline.server")

#: the full name of the Generation service
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Generation"].full_name
#: the conventional gRPC port
DEFAULT_PORT = 50051
#: how long in-flight calls get to end at shutdown before they are cancelled
DEFAULT_GRACE_SECONDS = 5.0
_HEALTH_NAMES = ("", SERVICE_NAME)
# NOTE: without this, gRPC binds with SO_REUSEPORT on Linux and a second server could
# silently share a port that is already taken.
_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


#: gRPC reflection's stable name; its messages are v1alpha's, field for field
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection of ``service_names`` as v1alpha (grpcio-reflection's servicer) and as
    v1. NOTE: grpcio-reflection ships v1alpha only; v1's ``reflection.proto`` declares the same
    messages with the same field numbers under another package, so v1 is the same servicer
    behind v1's method path, its messages read and written as v1alpha's."""
    servicer = reflection.aio.ReflectionServicer(service_names)
    reflection.enable_server_reflection(service_names, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),)
    )


class GenerationServer:
    """A grpc.aio server with the Generation service, health and reflection, over a started
    ``engine`` (not owned: close it after :meth:`stop`). ``limits``: the bounds on its
    connections and calls (:func:`grpc_limit_options`) and on the logprobs one call may ask
    for. ``lora_modules``: the LoRA adapters a call's ``lora_name`` may name (docs/lora.md).

    ::

        async with AsyncEngine("smollm2-135m") as engine:
            server = GenerationServer(engine, api_keys=ApiKeys.load(["secret"]))
            address = await server.start("127.0.0.1", 0)
            ...
            await server.stop()
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        api_keys: ApiKeys | None = None,
        tls: ServerTLS | None = None,
        grpc_options: Sequence[tuple[str, Any]] = (),
        limits: ListenerLimits | None = None,
        lora_modules: LoRAModules | None = None,
    ) -> None:
        self.engine = engine
        self.tls = tls
        self.limits = limits if limits is not None else ListenerLimits()
        self.service = GenerationService(
            engine,
            api_keys,
            max_logprob_entries=self.limits.max_logprob_entries,
            trust_request_chat_template=self.limits.trust_request_chat_template,
            lora_modules=lora_modules,
        )
        self.health = health.aio.HealthServicer()
        self._grpc_options = (
            *_SERVER_OPTIONS,
            *grpc_limit_options(self.limits),
            *grpc_options,
        )
        self._server: grpc.aio.Server | None = None
        self._tasks = TaskSet("grpc server")  # health reports
        self.address: str | None = None

    async def start(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
        """Listen on ``host:port`` (port 0 picks a free one) and start serving.

        Returns:
            The address served, ``host:port`` with the real port.
        Raises:
            OSError: the address cannot be bound.
            EngineDeadError, PipelineClosedError: the engine is not running.
        """
        if self._server is not None:
            raise RuntimeError("the server is already started")
        server = grpc.aio.server(
            options=self._grpc_options, maximum_concurrent_rpcs=self.limits.max_streams
        )
        add_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        _enable_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        requested = format_address(host, port)
        try:
            if self.tls is not None:
                bound = server.add_secure_port(requested, self.tls.credentials())
            else:
                bound = server.add_insecure_port(requested)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {requested}: {exc}") from None
        if not bound:
            raise OSError(f"cannot listen on {requested}")
        for name in _HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server = server
        self.address = format_address(host, bound)
        # NOTE: after SERVING is set: called at once if the engine died while we started
        self.engine.add_failure_callback(self._on_engine_failure)
        self.engine.add_restart_callback(self._on_engine_restart)
        self.engine.add_replica_callback(self._on_replica_lost)
        return self.address

    async def stop(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        """Report NOT_SERVING, refuse new calls, abort every running request (their calls end
        with UNAVAILABLE) and stop the server, cancelling calls still running after
        ``grace`` seconds. Idempotent."""
        await self.health.enter_graceful_shutdown()
        await self.service.shut_down()
        if self._server is not None:
            await self._server.stop(grace)
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task

    async def wait_for_termination(self) -> None:
        """Wait until the server has stopped."""
        if self._server is not None:
            await self._server.wait_for_termination()

    def _on_replica_lost(self, lost: ReplicaLost) -> None:
        live = sum(status.alive for status in self.engine.replicas)
        logger.error(
            "engine replica %s died (%s); %d of %d replicas serve on, health stays SERVING",
            lost.replica,
            lost.message,
            live,
            len(self.engine.replicas),
        )

    def _on_engine_failure(self, error: BaseException) -> None:
        if self.engine.restarting:
            logger.warning("the engine died; reporting NOT_SERVING while it restarts")
        else:
            logger.error("the engine died; reporting NOT_SERVING: %s", error)
        self._report(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _on_engine_restart(self) -> None:
        logger.info("the engine was restarted; reporting SERVING")
        self._report(health_pb2.HealthCheckResponse.SERVING)

    def _report(self, status: Any) -> None:
        self._tasks.spawn(self._set_health(status), name="grpc:health")

    async def _set_health(self, status: Any) -> None:
        if self._server is None:
            return
        for name in _HEALTH_NAMES:
            await self.health.set(name, status)


def grpc_limit_options(limits: ListenerLimits) -> tuple[tuple[str, int], ...]:
    """The gRPC core channel arguments that bound the server's connections
    (``include/grpc/impl/channel_arg_names.h``): at most the cap of connections (more are
    closed on arrival), the handshake up to the client's HTTP/2 settings within
    ``header_timeout``, a connection with no call closed after ``grpc_idle_timeout`` (GOAWAY),
    and ``max_streams_per_connection`` calls at once on one connection. (The calls of the
    whole server are bounded by ``maximum_concurrent_rpcs``: more are RESOURCE_EXHAUSTED.)"""
    return (
        ("grpc.max_allowed_incoming_connections", connection_cap(limits)),
        ("grpc.server_handshake_timeout_ms", round(limits.header_timeout * 1000)),
        ("grpc.max_connection_idle_ms", round(limits.grpc_idle_timeout * 1000)),
        ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
    )


async def serve(
    options: EngineOptions,
    *,
    host: str = DEFAULT_HOST,
    port: int | None = DEFAULT_PORT,
    http_port: int | None = None,
    api_keys: ApiKeys | None = None,
    tls: ServerTLS | None = None,
    grace: float = DEFAULT_GRACE_SECONDS,
    on_ready: Callable[[str], None] = lambda address: None,
    on_http_ready: Callable[[str], None] = lambda url: None,
    metrics_host: str = DEFAULT_HOST,
    metrics_port: int | None = None,
    on_metrics_ready: Callable[[str], None] = lambda url: None,
    served_model_name: str | None = None,
    max_request_bytes: int | None = None,
    limits: ListenerLimits | None = None,
    lora_modules: LoRAModules | None = None,
) -> None:
    """Run one engine behind the gRPC :class:`GenerationServer` (on ``port``; None: no gRPC)
    and/or the OpenAI-compatible :class:`~pipeline.server.http.server.HttpServer` (on
    ``http_port``; None: no HTTP) until SIGINT or SIGTERM, then shut down cleanly: in-flight
    gRPC calls end with UNAVAILABLE, HTTP streams with ``finish_reason: "abort"``, the servers
    stop, and the engine (and its process) stops. Both front ends share the engine, the API
    keys (and so the per-key limits), the TLS files and one
    :class:`~pipeline.engine.metrics.EngineMetrics`, served at ``/metrics`` of the HTTP port
    and, with ``metrics_port`` (0: a free one), at ``http://metrics_host:port/metrics``.

    Once serving, ``on_ready(address)`` is called for gRPC, then ``on_http_ready(url)`` for
    HTTP (the API's base URL), then ``on_metrics_ready(url)``. ``served_model_name``: the
    model id of the HTTP API (default ``options.model``); ``max_request_bytes``: its body
    cap (None: the default); ``limits``: both front ends' connection bounds and logprobs cap
    (None: the defaults of :class:`~pipeline.server.limits.ListenerLimits`);
    ``lora_modules``: the LoRA adapters HTTP requests may name as their ``model``
    (docs/lora.md; they need ``options.enable_lora``).

    With ``options.restart_engine`` a dead or frozen engine is replaced by a fresh one
    (health NOT_SERVING / 503 meanwhile); once it is in a crash loop the servers stop and this
    raises :class:`~pipeline.engine.errors.EngineCrashLoopError`.

    Raises:
        ValueError: neither front end asked for.
        OSError: an address cannot be bound.
        PipelineError: the engine could not start (e.g. the model failed to load).
        EngineCrashLoopError: the engine died ``restart_limit`` times within
            ``restart_window`` seconds.
    """
    if port is None and http_port is None:
        raise ValueError("serve needs a gRPC port, an HTTP port or both")
    if lora_modules and not options.enable_lora:
        raise ValueError("--lora-modules serves LoRA adapters: give --enable-lora too")
    # NOTE: one LoRAModules for both front ends: an adapter loaded at run time over HTTP is
    # served over gRPC too
    lora_modules = lora_modules if lora_modules is not None else LoRAModules()
    if api_keys is not None:
        lora_modules.check_bindings(
            api_keys.tenant_adapters().values(),
            options.enable_lora,
            options.enable_lora_runtime_updates,
        )
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop_requested.set)
    engine = AsyncEngine(**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
    metrics: EngineMetrics | None = None
    stops: list[Callable[[], Awaitable[None]]] = []
    gave_up: list[BaseException] = []

    def on_engine_failure(error: BaseException) -> None:
        if isinstance(error, EngineCrashLoopError):
            gave_up.append(error)
            stop_requested.set()

    try:
        async with TaskSet("serve:start") as startup:
            starting = startup.spawn(engine.start(), name="serve:engine-start")
            stopping = startup.spawn(stop_requested.wait(), name="serve:stop-wait")
            await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # a signal arrived while the model loaded
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
                return
            stopping.cancel()
            starting.result()
        engine.add_failure_callback(on_engine_failure)
        metrics_url = None
        if metrics_port is not None or http_port is not None:
            from pipeline.engine.metrics import EngineMetrics

            metrics = await EngineMetrics(engine, model_name=served_model_name).start()
            if metrics.lora is not None:
                metrics.lora.serve(lora_modules.adapters.keys())
        if metrics is not None and metrics_port is not None:
            bound = metrics.start_http_server(metrics_host, metrics_port)
            metrics_url = f"http://{format_address(metrics_host, bound)}/metrics"
        if port is not None:
            server = GenerationServer(
                engine, api_keys=api_keys, tls=tls, limits=limits, lora_modules=lora_modules
            )
            stops.append(lambda: server.stop(grace))
            address = await server.start(host, port)
            logger.info("serving %s on %s", SERVICE_NAME, address)
            on_ready(address)
        if http_port is not None:
            from pipeline.server.http.server import HttpServer

            extra = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes}
            http = HttpServer(
                engine,
                api_keys=api_keys,
                tls=tls,
                model_name=served_model_name,
                metrics=metrics,
                limits=limits,
                lora_modules=lora_modules,
                **extra,
            )
            stops.append(lambda: http.stop(grace))
            url = await http.start(host, http_port)
            logger.info("serving the OpenAI-compatible API on %s", url)
            on_http_ready(url)
        if metrics_url is not None:
            on_metrics_ready(metrics_url)
        await stop_requested.wait()
    finally:
        await engine.stop_restarting()  # a restart under way would only be closed again
        if stops:
            logger.info("shutting down")
            await asyncio.gather(*(stop() for stop in stops))
        if metrics is not None:
            await metrics.aclose()
        await engine.close()
        for signum in signals:
            loop.remove_signal_handler(signum)
    if gave_up:
        raise gave_up[0].with_traceback(None)
