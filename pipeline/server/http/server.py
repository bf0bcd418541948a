"""The HTTP front end: uvicorn serving the OpenAI-compatible app over one started engine,
on the caller's event loop, with optional TLS (and mutual TLS).

::

    async with AsyncEngine("smollm2-135m") as engine:
        server = HttpServer(engine, api_keys=ApiKeys.load(["secret"]))
        url = await server.start("127.0.0.1", 8000)   # http://127.0.0.1:8000/v1
        ...
        await server.stop()

NOTE: uvicorn runs as a task of the caller's loop (the loop that runs the engine's frontend
stages), and its own signal handling is off: whoever runs the server decides when it stops
(``actorline serve`` on SIGINT/SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.metrics import EngineMetrics
from pipeline.server.auth import ApiKeys
from pipeline.server.http.app import create_app
from pipeline.server.http.connections import (
    ConnectionGuard,
    guarded_protocol,
    quiet_accept_errors,
)
from pipeline.server.http.defaults import DEFAULT_MAX_REQUEST_BYTES
from pipeline.server.http.logprobs import TokenTexts
from pipeline.server.http.state import HttpService
from pipeline.server.limits import ListenerLimits, connection_cap
from pipeline.server.listen import format_address, listening_socket
from pipeline.server.lora_modules import LoRAModules
from pipeline.server.tls import ServerTLS
from stages.tokenize import load_tokenizer
from transports.tasks import TaskSet

__all__ = ["API_PREFIX", "DEFAULT_HTTP_GRACE_SECONDS", "HttpServer"]

logger = logging.getLogger("actorline.server.http")

#: where the API is, under the server's URL
API_PREFIX = "/v1"
#: how long responses get to end at shutdown (after every request was aborted, they end at
#: once) before they are cancelled
DEFAULT_HTTP_GRACE_SECONDS = 5.0
#: seconds between two looks at whether uvicorn has started
_STARTUP_POLL = 0.01


class _Uvicorn(uvicorn.Server):
    """uvicorn's server without its signal handlers (the caller owns the signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """The OpenAI-compatible API of ``engine`` (started, not owned: close it after
    :meth:`stop`). ``model_name``: the model id clients send (default: the engine's
    ``options.model``). ``metrics``: the engine's metrics to serve at ``/metrics`` (None: the
    server makes and owns its own). ``limits``: the bounds on its connections (timeouts, the
    cap) and on what one request may ask for (:mod:`pipeline.server.limits`).
    ``lora_modules``: the LoRA adapters a request's ``model`` may name (docs/lora.md).
    :attr:`app` is the FastAPI app, to which routes may be added before :meth:`start`.

    Raises (from the constructor): ValueError for a ``max_request_bytes`` that is not a
    positive integer.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        api_keys: ApiKeys | None = None,
        tls: ServerTLS | None = None,
        model_name: str | None = None,
        metrics: EngineMetrics | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        limits: ListenerLimits | None = None,
        lora_modules: LoRAModules | None = None,
    ) -> None:
        self.engine = engine
        self.tls = tls
        self.limits = limits if limits is not None else ListenerLimits()
        self.service = HttpService(
            engine,
            model_name or engine.options.model,
            self.limits.max_logprob_entries,
            self.limits.trust_request_chat_template,
            lora_modules,
            api_keys.tenant_adapters() if api_keys is not None else None,
        )
        self._owns_metrics = metrics is None
        self.metrics = (
            metrics if metrics is not None else EngineMetrics(engine, model_name=model_name)
        )
        if self.metrics.lora is not None:
            self.metrics.lora.serve(self.service.lora_modules.adapters.keys())
        self.app: FastAPI = create_app(
            self.service,
            api_keys=api_keys,
            max_request_bytes=max_request_bytes,
            registry=self.metrics.registry,
        )
        self._server: _Uvicorn | None = None
        #: the connections of the running server (None before :meth:`start`)
        self.connections: ConnectionGuard | None = None
        self._task: asyncio.Task[None] | None = None
        self._tasks = TaskSet("http server")  # uvicorn's serve
        self.url: str | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Load the tokenizer (to spell out logprobs' tokens), listen on ``host:port`` (0: a
        free port) and start serving.

        Returns:
            The API's base URL, ``http(s)://host:port/v1`` with the real port.
        Raises:
            OSError: the address cannot be bound.
            RuntimeError: the server was started before.
        """
        if self._server is not None:
            raise RuntimeError("the server is already started")
        listener = listening_socket(host, port)
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, self.engine.options.model)
            self.service.texts = TokenTexts(tokenizer)
            self.service.tokenizer = tokenizer
            if self._owns_metrics:
                await self.metrics.start()
            self.connections = ConnectionGuard(self.limits, connection_cap(self.limits))
            quiet_accept_errors(asyncio.get_running_loop())
            config = uvicorn.Config(
                self.app,
                http=guarded_protocol(self.connections),
                timeout_keep_alive=self.limits.keep_alive_timeout,  # type: ignore[arg-type]
                lifespan="off",
                log_config=None,
                log_level=logging.WARNING,
                access_log=False,
                server_header=False,
                timeout_graceful_shutdown=int(DEFAULT_HTTP_GRACE_SECONDS),
            )
            config.load()
            if self.tls is not None:
                config.ssl = self.tls.ssl_context()
            server = _Uvicorn(config)
            self._server = server
            self._task = self._tasks.spawn(server.serve(sockets=[listener]), name="http:serve")
            while not server.started:
                if self._task.done():
                    self._task.result()  # its error
                    raise OSError(f"the HTTP server on {format_address(host, port)} stopped")
                await asyncio.sleep(_STARTUP_POLL)
        except BaseException:
            listener.close()
            raise
        scheme = "https" if self.tls is not None else "http"
        bound = listener.getsockname()[1]
        self.url = f"{scheme}://{format_address(host, bound)}{API_PREFIX}"
        return self.url

    async def stop(self, grace: float = DEFAULT_HTTP_GRACE_SECONDS) -> None:
        """Refuse new requests, abort every running one (a stream ends with ``finish_reason:
        "abort"`` and ``[DONE]``, a whole answer with what it had) and stop serving,
        cancelling responses still running after ``grace`` seconds. Idempotent."""
        await self.service.shut_down()
        server, task = self._server, self._task
        if server is not None and task is not None and not task.done():
            server.config.timeout_graceful_shutdown = max(0, math.ceil(grace))
            server.should_exit = True
            with contextlib.suppress(Exception):
                await task
        if self._owns_metrics:
            await self.metrics.aclose()
