"""The gRPC server: the Generation service, gRPC health checking and server reflection over
one engine, with optional TLS (and mutual TLS); and :func:`serve`, the body of
``actorline serve``.

Health (``grpc.health.v1.Health``) reports SERVING for ``""`` and ``actorline.v1.Generation``
while the engine runs, and NOT_SERVING once the engine died or the server is shutting down.
Health and reflection need no API key (probes and tools like ``grpcurl`` use them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import signal
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.options import EngineOptions
from pipeline.server import generation_pb2 as pb
from pipeline.server.auth import ApiKeys
from pipeline.server.service import GenerationService, add_to_server

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
    "serve",
]

logger = logging.getLogger("actorline.server")

#: the full name of the Generation service
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Generation"].full_name
#: listen on loopback only unless told otherwise
DEFAULT_HOST = "127.0.0.1"
#: the conventional gRPC port
DEFAULT_PORT = 50051
#: how long in-flight calls get to end at shutdown before they are cancelled
DEFAULT_GRACE_SECONDS = 5.0
_PEM_MARKER = b"-----BEGIN "
_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
#: PKCS#8 ("PRIVATE KEY"), PKCS#1 ("RSA PRIVATE KEY"), SEC 1 ("EC PRIVATE KEY"), ...
_PEM_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )?PRIVATE KEY-----")
#: PKCS#8 "ENCRYPTED PRIVATE KEY", or the legacy OpenSSL header of an encrypted PKCS#1 key
_PEM_ENCRYPTED = re.compile(rb"-----BEGIN ENCRYPTED PRIVATE KEY-----|Proc-Type: 4,ENCRYPTED")
_HEALTH_NAMES = ("", SERVICE_NAME)
# NOTE: without this, gRPC binds with SO_REUSEPORT on Linux and a second server could
# silently share a port that is already taken.
_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerTLS:
    """The server's PEM certificate chain and private key; with ``client_ca``, clients must
    present a certificate signed by it (mutual TLS).

    Raises (from the constructor): ValueError for empty or non-PEM data.
    """

    certificate_chain: bytes = dataclasses.field(repr=False)
    private_key: bytes = dataclasses.field(repr=False)
    client_ca: bytes | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("certificate_chain", "private_key", "client_ca"):
            value = getattr(self, name)
            if value is None and name == "client_ca":
                continue
            if not isinstance(value, bytes) or _PEM_MARKER not in value:
                raise ValueError(f"{name} must be PEM data (bytes with '-----BEGIN ...')")

    @classmethod
    def from_files(
        cls,
        certificate_chain: str | Path,
        private_key: str | Path,
        client_ca: str | Path | None = None,
    ) -> ServerTLS:
        """Read the PEM files and check them as the TLS library will use them: the chain
        holds certificates, the key file an unencrypted private key, the key belongs to the
        chain's first certificate, and ``client_ca`` holds certificates. So a bad pair (say
        the two files swapped) is a clear error here, not a failure to listen later.

        Raises:
            OSError: a file cannot be read. ValueError: a file is not what it should be, or
                the key does not match the certificate (the message names the file).
        """
        chain = _read_pem(certificate_chain, "certificate chain")
        key = _read_pem(private_key, "private key")
        ca = _read_pem(client_ca, "client CA") if client_ca is not None else None
        _check_certificates(certificate_chain, chain, "certificate chain")
        _check_private_key(private_key, key)
        _check_key_pair(certificate_chain, private_key)
        if client_ca is not None and ca is not None:
            _check_certificates(client_ca, ca, "client CA")
        return cls(chain, key, ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def _read_pem(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"TLS {what} {path}: {exc.strerror or exc}") from None


def _check_certificates(path: str | Path, data: bytes, what: str) -> None:
    """``data`` (read from ``path``) holds PEM certificates that the TLS library parses."""
    if _PEM_CERTIFICATE not in data:
        swapped = what == "certificate chain" and _PEM_PRIVATE_KEY.search(data)
        hint = " (it holds a private key: are the certificate and key swapped?)"
        raise ValueError(
            f"TLS {what} {path} holds no PEM certificate ('{_PEM_CERTIFICATE.decode()}')"
            + (hint if swapped else "")
        )
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        raise ValueError(f"TLS {what} {path} is not a valid PEM certificate: {exc}") from None


def _check_private_key(path: str | Path, data: bytes) -> None:
    """``data`` (read from ``path``) holds an unencrypted PEM private key."""
    if _PEM_ENCRYPTED.search(data):
        raise ValueError(f"TLS private key {path} is encrypted; gRPC needs an unencrypted key")
    if not _PEM_PRIVATE_KEY.search(data):
        hint = " (it holds a certificate: are the certificate and key swapped?)"
        raise ValueError(
            f"TLS private key {path} holds no PEM private key ('-----BEGIN ... PRIVATE KEY')"
            + (hint if _PEM_CERTIFICATE in data else "")
        )


def _check_key_pair(certificate_chain: str | Path, private_key: str | Path) -> None:
    """The key parses and belongs to the chain's first certificate (``ssl`` checks both, as
    the TLS library serving the port will)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # NOTE: the password callback keeps an encrypted key the marker check missed from
        # prompting on the terminal; the empty password then fails to decrypt it.
        context.load_cert_chain(str(certificate_chain), str(private_key), password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"TLS private key {private_key} does not match the certificate {certificate_chain}"
            ) from None
        raise ValueError(f"TLS private key {private_key} cannot be loaded: {exc}") from None


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GenerationServer:
    """A grpc.aio server with the Generation service, health and reflection, over a started
    ``engine`` (not owned: close it after :meth:`stop`).

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
    ) -> None:
        self.engine = engine
        self.tls = tls
        self.service = GenerationService(engine, api_keys)
        self.health = health.aio.HealthServicer()
        self._grpc_options = (*_SERVER_OPTIONS, *grpc_options)
        self._server: grpc.aio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
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
        server = grpc.aio.server(options=self._grpc_options)
        add_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
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
        self.engine.running.add_failure_callback(self._on_engine_failure)
        for name in _HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server = server
        self.address = format_address(host, bound)
        if self.engine.failure is not None:  # died while we started
            self._on_engine_failure(self.engine.failure)
        return self.address

    async def stop(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        """Report NOT_SERVING, refuse new calls, abort every running request (their calls end
        with UNAVAILABLE) and stop the server, cancelling calls still running after
        ``grace`` seconds. Idempotent."""
        await self.health.enter_graceful_shutdown()
        await self.service.shut_down()
        if self._server is not None:
            await self._server.stop(grace)
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def wait_for_termination(self) -> None:
        """Wait until the server has stopped."""
        if self._server is not None:
            await self._server.wait_for_termination()

    def _on_engine_failure(self, error: BaseException) -> None:
        logger.error("the engine died; reporting NOT_SERVING: %s", error)
        task = asyncio.get_running_loop().create_task(self._report_not_serving())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report_not_serving(self) -> None:
        for name in _HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def serve(
    options: EngineOptions,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_keys: ApiKeys | None = None,
    tls: ServerTLS | None = None,
    grace: float = DEFAULT_GRACE_SECONDS,
    on_ready: Callable[[str], None] = lambda address: None,
    metrics_host: str = DEFAULT_HOST,
    metrics_port: int | None = None,
    on_metrics_ready: Callable[[str], None] = lambda url: None,
) -> None:
    """Run the engine behind a :class:`GenerationServer` until SIGINT or SIGTERM, then shut
    down cleanly: in-flight calls end with UNAVAILABLE, the server stops, and the engine
    (and its process) stops. ``on_ready(address)`` is called once the server serves.

    With ``metrics_port`` (0: a free one), Prometheus metrics
    (:class:`~pipeline.engine.metrics.EngineMetrics`) are served at
    ``http://metrics_host:port/metrics``; ``on_metrics_ready(url)`` is called after
    ``on_ready``.

    Raises:
        OSError: an address cannot be bound.
        PipelineError: the engine could not start (e.g. the model failed to load).
    """
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop_requested.set)
    engine = AsyncEngine(**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
    metrics: EngineMetrics | None = None
    try:
        starting = asyncio.ensure_future(engine.start())
        stopping = asyncio.ensure_future(stop_requested.wait())
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal arrived while the model loaded
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return
        stopping.cancel()
        starting.result()
        metrics_url = None
        if metrics_port is not None:
            from pipeline.engine.metrics import EngineMetrics

            metrics = await EngineMetrics(engine).start()
            bound = metrics.start_http_server(metrics_host, metrics_port)
            metrics_url = f"http://{format_address(metrics_host, bound)}/metrics"
        server = GenerationServer(engine, api_keys=api_keys, tls=tls)
        address = await server.start(host, port)
        logger.info("serving %s on %s", SERVICE_NAME, address)
        on_ready(address)
        if metrics_url is not None:
            on_metrics_ready(metrics_url)
        try:
            await stop_requested.wait()
        finally:
            logger.info("shutting down")
            await server.stop(grace)
    finally:
        if metrics is not None:
            await metrics.aclose()
        await engine.close()
        for signum in signals:
            loop.remove_signal_handler(signum)
