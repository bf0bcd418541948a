"""``actorline serve`` as a real subprocess (ready line, calls, SIGINT or SIGTERM, exit 0, no
engine process left), a server whose engine process is SIGKILLed, in process and under
``actorline serve`` (calls end with UNAVAILABLE, health turns NOT_SERVING, the command still
exits 0), and the serve command's argument errors. TLS and rate limits through the command:
test_serve_cli.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline.cli import main
from pipeline.engine.errors import EngineDeadError
from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc as pb_grpc
from pipeline.server.client import (
    AuthenticationError,
    Client,
    ServiceUnavailableError,
)
from pipeline.server.status import ERROR_KIND_KEY
from stages.params import SamplingParams
from tests.pipeline.server.serving import (
    Certificate,
    ServedEngine,
    ServeProcess,
    actorline_command,
    child_pids,
    engine_host_pids,
    process_alive,
    read_until_end,
    rpc_error,
    serve_arguments,
    stream_in_background,
    trailer,
)

#: seconds for in-flight calls to end once the engine process is killed (the brief's bound)
ENGINE_DEATH_DEADLINE = 5.0
EXIT_TIMEOUT = 60.0
LONG = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
#: a Generate request that runs until it is stopped
LONG_REQUEST = pb.GenerateRequest(
    text="Hello", sampling_params=pb.SamplingParams(max_tokens=900, ignore_eos=True)
)


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text("# key  requests/s  tokens/s\nfile-key 100 -\n\nother-file-key\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_actorline_serve_serves_until_a_stop_signal(
    tiny_model_dir: Path, tmp_path: Path, key_file: Path, stop_signal: signal.Signals
) -> None:
    serve = ServeProcess(
        [
            "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", "0",
            "--num-blocks", "64", "--api-key", "cli-key", "--api-key-file", str(key_file),
        ],
        tmp_path / "stderr.txt",
    )  # fmt: skip
    try:
        engine_processes = child_pids(serve.process.pid)
        assert engine_processes  # the spawned engine host
        with Client(serve.address, api_key="cli-key") as client:
            assert client.health() == "SERVING"
            assert client.model_info().kv_cache_blocks == 64
            outputs = list(client.generate("Hello", SamplingParams(max_tokens=5, temperature=0)))
            assert outputs[-1].finish_reason == "length" and outputs[-1].usage is not None
            assert outputs[-1].usage.completion_tokens == 5
        for key in ("file-key", "other-file-key"):
            with Client(serve.address, api_key=key) as client:
                assert client.model_info().vocab_size == 49152
        with Client(serve.address) as client, pytest.raises(AuthenticationError):
            client.model_info()

        # a stream in flight when the signal arrives ends with UNAVAILABLE, after its outputs
        stream = stream_in_background(serve.address, "Hello", LONG, api_key="cli-key")
        assert stream.started.wait(60)
        serve.process.send_signal(stop_signal)
        assert serve.process.wait(EXIT_TIMEOUT) == 0, serve.stderr[-3000:]
        stream.thread.join(EXIT_TIMEOUT)
        assert stream.outputs and not any(output.finished for output in stream.outputs)
        assert len(stream.errors) == 1, stream.errors
        assert isinstance(stream.errors[0], ServiceUnavailableError), stream.errors
        assert "shutting down" in str(stream.errors[0])
        assert not any(process_alive(pid) for pid in engine_processes)
        assert serve.lines.get(timeout=5) is None  # the ready line was the only output
    finally:
        serve.kill()


async def kill_engine_during(
    calls: list[Any], health: health_pb2_grpc.HealthStub, engine_pid: int
) -> float:
    """SIGKILL the engine process while ``calls`` stream: each ends with UNAVAILABLE
    (engine_dead, naming the signal) and health turns NOT_SERVING within the deadline.
    Returns the seconds from the kill until every call had ended."""
    os.kill(engine_pid, signal.SIGKILL)
    killed = time.monotonic()
    errors = await asyncio.wait_for(
        asyncio.gather(*(rpc_error(read_until_end(call)) for call in calls)),
        ENGINE_DEATH_DEADLINE,
    )
    ended = time.monotonic() - killed
    for error in errors:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert trailer(error, ERROR_KIND_KEY) == "engine_dead"
        assert "killed by signal 9" in (error.details() or "")
    status = None
    while time.monotonic() - killed < ENGINE_DEATH_DEADLINE:
        status = (await health.Check(health_pb2.HealthCheckRequest())).status
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        await asyncio.sleep(0.05)
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    return ended


@pytest.mark.slow
def test_engine_death_ends_calls_with_unavailable_and_health_not_serving(
    tiny_model_dir: Path,
) -> None:
    served = ServedEngine(tiny_model_dir, num_blocks=64)
    request = LONG_REQUEST

    async def body() -> None:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            calls = [stub.Generate(request) for _ in range(3)]
            for call in calls:
                await call.read()
            engine_pid = served.engine.running.pids["engine"]
            assert engine_pid is not None
            ended = await kill_engine_during(calls, health, engine_pid)
            assert ended < ENGINE_DEATH_DEADLINE
            error = await rpc_error(stub.Generate(request))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            error = await rpc_error(stub.GetModelInfo(pb.GetModelInfoRequest()))
            assert error.code() == grpc.StatusCode.UNAVAILABLE

    try:
        served.run(body())
        with Client(served.address) as client:
            assert client.health() == "NOT_SERVING"
            with pytest.raises(EngineDeadError, match="killed by signal 9"):
                list(client.generate("Hello"))
    finally:
        served.close()


@pytest.mark.slow
def test_killing_the_engine_under_actorline_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL the engine host process of ``actorline serve --no-restart-engine`` (restarts:
    test_serve_heals.py) while streams run: they end with
    UNAVAILABLE (engine_dead) within the deadline, health turns NOT_SERVING, and the command
    still stops cleanly (exit 0) on SIGTERM. Its log says what happened in lines, without a
    traceback (docs/architecture.md §7.3: the death is the pipeline's one ERROR line, what
    fails because of it while the command shuts down is not logged again)."""
    serve = ServeProcess(
        serve_arguments(tiny_model_dir, "--no-restart-engine"), tmp_path / "stderr.txt"
    )

    async def body() -> float:
        async with grpc.aio.insecure_channel(serve.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            calls = [stub.Generate(LONG_REQUEST) for _ in range(2)]
            for call in calls:
                await call.read()
            (engine_pid,) = engine_host_pids(serve.process.pid)
            ended = await kill_engine_during(calls, health, engine_pid)
            error = await rpc_error(stub.Generate(LONG_REQUEST))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            return ended

    try:
        children = child_pids(serve.process.pid)
        ended = asyncio.run(body())
        assert ended < ENGINE_DEATH_DEADLINE
        with Client(serve.address) as client:
            assert client.health() == "NOT_SERVING"
            with pytest.raises(EngineDeadError, match="killed by signal 9"):
                list(client.generate("Hello"))
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(EXIT_TIMEOUT) == 0, serve.stderr[-3000:]
        assert not any(process_alive(pid) for pid in children)
        assert serve.lines.get(timeout=5) is None  # the ready line was the only output
        stderr = serve.stderr
        assert "Traceback" not in stderr and "PeerLostError" not in stderr, stderr[-5000:]
        assert "killed by signal 9" in stderr, stderr[-5000:]
    finally:
        serve.kill()


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if a command tries to start an engine."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command started an engine despite bad arguments")

    monkeypatch.setattr("pipeline.engine.async_engine.AsyncEngine.start", refuse)
    yield


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs"),
        (["--tls-cert", "missing.pem", "--tls-key", "missing.key"], "missing.pem"),
        (["--api-key-file", "missing-keys.txt"], "missing-keys.txt"),
        (["--api-key", "has space"], "printable ASCII"),
        (["--api-key", ""], "an API key must be a non-empty string"),
        (["--port", "99999"], "--port must be in [0, 65535], got 99999"),
        (["--port", "-1"], "--port must be in [0, 65535], got -1"),
        (["--metrics-port", "70000"], "--metrics-port must be in [0, 65535], got 70000"),
        (["--http-port", "65536"], "--http-port must be in [0, 65535], got 65536"),
        (["--grpc-port", "1"], "--port is the old name of --grpc-port; give one of them"),
        (["--port", "50052", "--http-port", "50052"], "--port and --http-port must differ"),
        (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1, got 0"),
        (["--max-connections", "0"], "--max-connections must be an integer >= 1, got 0"),
        (["--header-timeout", "0"], "--header-timeout must be a finite number of seconds > 0"),
        (["--body-timeout", "inf"], "--body-timeout must be a finite number of seconds > 0"),
        (["--max-streams", "-1"], "--max-streams must be an integer >= 1, got -1"),
        (["--max-logprob-entries", "0"], "--max-logprob-entries must be an integer >= 1"),
        (["--device", "gpu"], "device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got 'gpu'"),
        (["--num-blocks", "0"], "num_blocks must be a positive integer"),
        (["--requests-per-second", "0"], "--requests-per-second must be > 0"),
        (["--grace", "-1"], "--grace must be >= 0"),
        (["--model", "/nonexistent/model"], "nonexistent"),
        (["--restart-limit", "0"], "restart_limit must be an integer >= 1, got 0"),
        (["--restart-window", "0"], "restart_window must be a number of seconds > 0"),
        (["--restart-backoff", "-1"], "restart_backoff must be a number of seconds >= 0"),
        (["--heartbeat-timeout", "0"], "heartbeat_timeout must be a number of seconds > 0"),
    ],
)
def test_serve_rejects_bad_arguments_before_starting(
    tiny_model_dir: Path,
    no_engine: None,
    capsys: pytest.CaptureFixture[str],
    arguments: list[str],
    message: str,
) -> None:
    status = main(["serve", "--model", str(tiny_model_dir), "--port", "0", *arguments])
    assert status == 2
    error = capsys.readouterr().err
    assert error.startswith("actorline: error:") and message in error
    assert "has space" not in error  # keys never appear in messages


def test_serve_refuses_ports_it_cannot_have_before_loading_the_model(
    tiny_model_dir: Path, no_engine: None, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for arguments, message in (
            (["--host", "127.0.0.1", "--port", port], f"--port: cannot listen on 127.0.0.1:{port}"),
            (["--port", "0", "--metrics-host", "127.0.0.1", "--metrics-port", port],
             "--metrics-port: cannot listen"),
            (["--host", "127.0.0.1", "--http-port", port],
             f"--http-port: cannot listen on 127.0.0.1:{port}"),
            (["--host", "127.0.0.1", "--grpc-port", port],
             f"--grpc-port: cannot listen on 127.0.0.1:{port}"),
            (["--host", "999.1.1.1", "--port", "0"], "--port: cannot resolve host '999.1.1.1'"),
        ):  # fmt: skip
            status = main(["serve", "--model", str(tiny_model_dir), *arguments])
            error = capsys.readouterr().err
            assert status == 2 and error.startswith("actorline: error:") and message in error


def test_serve_refuses_a_key_file_without_keys(
    tiny_model_dir: Path, tmp_path: Path, no_engine: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key file holding only comments and blank lines would turn authentication off: it is
    an error naming the file, before anything starts."""
    empty = tmp_path / "keys.txt"
    empty.write_text("# the keys are mounted here\n\n   \n")
    status = main(
        ["serve", "--model", str(tiny_model_dir), "--port", "0", "--api-key-file", str(empty)]
    )
    assert status == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("actorline: error: API keys: ") and str(empty) in line
    assert "no API key in the file" in line


@pytest.mark.parametrize("case", ["swapped", "mismatched", "key as client CA"])
def test_serve_checks_the_tls_files_before_starting(
    tiny_model_dir: Path,
    no_engine: None,
    capsys: pytest.CaptureFixture[str],
    server_certificate: Certificate,
    client_certificate: Certificate,
    case: str,
) -> None:
    certificate, key = server_certificate.certificate_path, server_certificate.key_path
    arguments, named, problem = {
        "swapped": (
            ["--tls-cert", str(key), "--tls-key", str(certificate)],
            key,
            "holds no PEM certificate",
        ),
        "mismatched": (
            ["--tls-cert", str(certificate), "--tls-key", str(client_certificate.key_path)],
            client_certificate.key_path,
            "does not match the certificate",
        ),
        "key as client CA": (
            ["--tls-cert", str(certificate), "--tls-key", str(key), "--tls-client-ca", str(key)],
            key,
            "client CA",
        ),
    }[case]
    status = main(["serve", "--model", str(tiny_model_dir), "--port", "0", *arguments])
    assert status == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("actorline: error: TLS ") and str(named) in line and problem in line


def test_swapped_tls_files_are_one_line_from_the_command(
    tiny_model_dir: Path, server_certificate: Certificate
) -> None:
    """Through the real command: one line on stderr (no gRPC log lines), exit status 2."""
    result = subprocess.run(
        [*actorline_command(), "serve", "--model", str(tiny_model_dir), "--port", "0",
         "--tls-cert", str(server_certificate.key_path),
         "--tls-key", str(server_certificate.certificate_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert "are the certificate and key swapped?" in line
    assert str(server_certificate.key_path) in line
