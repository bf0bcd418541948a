"""Test helpers: a real engine and Generation server running in a background event loop, and
self-signed TLS certificates made with ``openssl``.

NOTE: tests run their client coroutines on the server's own loop (:meth:`ServedEngine.run`),
so one event loop drives the engine, the server and the test's gRPC channels.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.loop_thread import LoopThread
from pipeline.server.auth import ApiKey, ApiKeys
from pipeline.server.client import Client, StreamedOutput
from pipeline.server.serve import SERVICE_NAME, GenerationServer, ServerTLS
from stages.params import SamplingParams
from tests.processes import child_processes, process_alive

__all__ = [
    "GOOD_KEY",
    "HTTP_READY_LINE",
    "OTHER_KEY",
    "READY_LINE",
    "REQUEST_LIMITED_KEY",
    "RUN_TIMEOUT",
    "SERVE_START_TIMEOUT",
    "TEST_KEYS",
    "TOKEN_LIMITED_KEY",
    "Certificate",
    "ServeProcess",
    "ServedEngine",
    "actorline_command",
    "bearer",
    "child_pids",
    "engine_host_pids",
    "make_certificate",
    "process_alive",
    "read_until_end",
    "reflection_generate",
    "rpc_error",
    "serve_arguments",
    "trailer",
]

T = TypeVar("T")

#: API keys of the shared test server: two unlimited keys, one whose token bucket (64 tokens)
#: is smaller than any request asking for 100 tokens, one allowing a single request
GOOD_KEY = "good-key-0123"
OTHER_KEY = "other-key-4567"
TOKEN_LIMITED_KEY = "token-limited-key"
REQUEST_LIMITED_KEY = "request-limited-key"
TEST_KEYS: dict[str, tuple[float | None, float | None] | None] = {
    GOOD_KEY: None,
    OTHER_KEY: None,
    TOKEN_LIMITED_KEY: (None, 64.0),
    REQUEST_LIMITED_KEY: (1e-3, None),
}

#: seconds a test coroutine may run on the server loop before the test fails
RUN_TIMEOUT = 120.0

REPOSITORY = Path(__file__).resolve().parents[3]
#: what ``actorline serve`` prints once it serves gRPC
READY_LINE = re.compile(r"^serving actorline\.v1\.Generation on (127\.0\.0\.1:\d+)$")
#: what it prints once it serves HTTP (after the gRPC line, when both are served)
HTTP_READY_LINE = re.compile(r"^serving OpenAI-compatible API on (https?://127\.0\.0\.1:\d+/v1)$")
#: seconds for an ``actorline serve`` subprocess to load the model and print its address
SERVE_START_TIMEOUT = 300.0


class ServedEngine:
    """An :class:`AsyncEngine` on ``model`` and a :class:`GenerationServer` over it on
    127.0.0.1 (a free port), in a loop thread. ``keys``: API key → limits (None: the
    defaults) or no keys (authentication off)."""

    def __init__(
        self,
        model: Path,
        *,
        keys: dict[str, tuple[float | None, float | None] | None] | None = None,
        **engine_options: Any,
    ) -> None:
        entries = [ApiKey.create(key, limits) for key, limits in (keys or {}).items()]
        self.api_keys = ApiKeys(entries)
        self._loop_thread = LoopThread()
        self.engine = AsyncEngine(
            str(model), tenant_limits=self.api_keys.tenant_limits(), **engine_options
        )
        self.server = GenerationServer(self.engine, api_keys=self.api_keys)
        try:
            self.address = self.run(self._start())
        except BaseException:
            self.close()
            raise

    async def _start(self) -> str:
        await self.engine.start()
        return await self.server.start("127.0.0.1", 0)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = RUN_TIMEOUT) -> T:
        """Run ``coroutine`` on the server's loop and return its result."""
        future = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(coroutine, timeout), self._loop_thread.loop
        )
        return future.result()

    async def start_server(self, tls: ServerTLS | None = None) -> GenerationServer:
        """Another server over the same engine (e.g. with TLS); the caller stops it."""
        server = GenerationServer(self.engine, api_keys=self.api_keys, tls=tls)
        await server.start("127.0.0.1", 0)
        return server

    async def wait_kv_free(self, timeout: float = 30.0) -> None:
        """Wait until no request runs and every KV block is free (polls the engine stats).

        Raises:
            TimeoutError: not reached within ``timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            stats = self.engine.stats
            if (
                stats is not None
                and stats.num_running == 0
                and stats.num_waiting == 0
                and stats.kv_blocks_free == stats.kv_blocks_total
            ):
                return
            if loop.time() > deadline:
                raise TimeoutError(f"KV blocks still in use after {timeout}s: {stats}")
            await asyncio.sleep(0.05)

    def close(self) -> None:
        async def stop() -> None:
            await self.server.stop(grace=1.0)
            await self.engine.close()

        try:
            if self._loop_thread.loop.is_running():
                self.run(stop())
        finally:
            self._loop_thread.stop()


@dataclasses.dataclass
class BackgroundStream:
    """A gRPC ``Generate`` stream read on a thread of its own: what it received, the error that
    ended it (if any), and ``started``, set at the first output or at the end."""

    outputs: list[StreamedOutput]
    errors: list[BaseException]
    started: threading.Event
    thread: threading.Thread


def stream_in_background(
    address: str, prompt: str, params: SamplingParams, **client_options: Any
) -> BackgroundStream:
    """Start reading ``prompt``'s stream from the server at ``address`` (``client_options``
    go to :class:`~pipeline.server.client.Client`)."""
    outputs: list[StreamedOutput] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def read() -> None:
        with Client(address, **client_options) as client:
            try:
                for output in client.generate(prompt, params):
                    outputs.append(output)
                    started.set()
            except BaseException as error:
                errors.append(error)
        started.set()

    thread = threading.Thread(target=read)
    thread.start()
    return BackgroundStream(outputs, errors, started, thread)


@dataclasses.dataclass(frozen=True)
class Certificate:
    """A self-signed certificate (it is its own CA) and its key, as files and PEM bytes."""

    certificate_path: Path
    key_path: Path

    @property
    def certificate(self) -> bytes:
        return self.certificate_path.read_bytes()

    @property
    def key(self) -> bytes:
        return self.key_path.read_bytes()


def make_certificate(directory: Path, name: str) -> Certificate:
    """A self-signed P-256 certificate for ``localhost`` / 127.0.0.1, valid one day."""
    certificate = Certificate(directory / f"{name}.crt", directory / f"{name}.key")
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec",
            "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(certificate.key_path), "-out", str(certificate.certificate_path),
            "-days", "1", "-subj", f"/CN={name}",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-addext", "basicConstraints=critical,CA:TRUE",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return certificate


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``key``."""
    return (("authorization", f"Bearer {key}"),)


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    """The error a call (or a coroutine reading one) ends with; fails the test on success."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    return caught.value


def trailer(error: grpc.aio.AioRpcError, key: str) -> str | None:
    """The value of trailer ``key`` of a failed call."""
    return dict(error.trailing_metadata() or ()).get(key)


async def reflection_generate(
    channel: grpc.aio.Channel, request: dict[str, Any], metadata: Any = ()
) -> list[dict[str, Any]]:
    """What grpcurl or a dynamic client in any language does: fetch the Generation service's
    schema by reflection, build the messages from it (no actorline code, no generated stubs),
    send ``request`` written as JSON to Generate and read the stream as JSON.

    Raises:
        grpc.aio.AioRpcError: the call failed.
    """
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    query = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)
    [answer] = [reply async for reply in stub.ServerReflectionInfo(iter([query]))]
    pool = descriptor_pool.DescriptorPool()
    for data in answer.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(data))
    method = pool.FindServiceByName(SERVICE_NAME).FindMethodByName("Generate")
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_stream(
        f"/{SERVICE_NAME}/Generate",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    message = json_format.ParseDict(request, request_class())
    return [
        json_format.MessageToDict(response) async for response in call(message, metadata=metadata)
    ]


async def read_until_end(call: Any) -> list[Any]:
    """Every remaining response of a streaming call (raises its error, if it fails)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def child_pids(parent: int) -> set[int]:
    """Live (non-zombie) processes whose parent is ``parent``."""
    return set(child_processes(parent))


def engine_host_pids(parent: int) -> set[int]:
    """Live spawned pipeline hosts (the engine process) whose parent is ``parent``."""
    return {
        pid
        for pid, command in child_processes(parent).items()
        if "pipeline.runtime.host_main" in command
    }


def serve_arguments(model: Path, *extra: str) -> list[str]:
    """``actorline serve`` arguments: ``model`` with 64 KV blocks on 127.0.0.1 (a free port),
    then ``extra``."""
    return [
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--num-blocks",
        "64",
        *extra,
    ]


def actorline_command() -> list[str]:
    """The installed ``actorline`` script, or the same entry point through the interpreter."""
    script = Path(sys.executable).with_name("actorline")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from pipeline.cli import main; sys.exit(main())"]


class ServeProcess:
    """``actorline serve ARGUMENTS`` in a subprocess (stderr to ``stderr_path``), once it
    printed its ready lines: :attr:`address` (gRPC ``host:port``; None when only
    ``--http-port`` is given) and :attr:`http_url` (the HTTP API's base URL, with
    ``--http-port``; else None). :meth:`kill` it when done. ``preexec_fn`` runs in the child
    before it executes (e.g. to lower its resource limits); ``env``: its environment (default:
    this process's), with this checkout first on its path.

    Raises (from the constructor): AssertionError when a ready line does not come (the
    process is killed, the message shows its stderr).
    """

    def __init__(
        self,
        arguments: list[str],
        stderr_path: Path,
        preexec_fn: Callable[[], None] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = {**(os.environ if env is None else env), "PYTHONPATH": str(REPOSITORY)}
        self._stderr = stderr_path.open("w")
        self.process = subprocess.Popen(
            [*actorline_command(), "serve", *arguments],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=REPOSITORY,
            preexec_fn=preexec_fn,
        )
        self.stderr_path = stderr_path
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        serves_http = "--http-port" in arguments
        serves_grpc = not serves_http or any(
            flag in arguments for flag in ("--port", "--grpc-port")
        )
        self.address = self._wait_ready(READY_LINE) if serves_grpc else None
        self.http_url = self._wait_ready(HTTP_READY_LINE) if serves_http else None

    @property
    def stderr(self) -> str:
        """What the process wrote to stderr so far."""
        return self.stderr_path.read_text()

    @property
    def base_url(self) -> str:
        """The HTTP server's URL (``/health``, ``/metrics`` are under it)."""
        assert self.http_url is not None
        return self.http_url.removesuffix("/v1")

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _wait_ready(self, ready: re.Pattern[str]) -> str:
        try:
            line = self.lines.get(timeout=SERVE_START_TIMEOUT)
        except queue.Empty:
            line = None
        match = ready.match(line or "")
        if match is None:
            self.kill()
            raise AssertionError(f"no ready line (got {line!r}); stderr:\n{self.stderr[-3000:]}")
        return match.group(1)

    def kill(self) -> None:
        """SIGKILL the process if it still runs, and wait for it. Idempotent."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._stderr.close()
