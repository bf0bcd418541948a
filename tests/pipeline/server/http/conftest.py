"""The shared server of the HTTP tests: ``actorline serve`` serving gRPC and the
OpenAI-compatible API from one engine (the tiny model, served as ``tiny``), with API keys
from a key file (some with tiny rate limits), trusting requests' own chat templates. Tests
that share it leave it as they found it (no request running). Its teardown stops it with
SIGINT: exit status 0, no engine process left, no traceback."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pipeline.server.serving import ServeProcess, child_pids, process_alive

MODEL = "tiny"
API_KEY = "test-key-0123"
#: two keys limited to about one request (a bucket of 1 refilling at 0.001/s) each
LIMITED_KEYS = ("limited-key-a", "limited:key-b")
#: a key limited likewise, for a request of two choices (the second one is refused)
CHOICES_LIMITED_KEY = "limited-key-n"
#: a key limited likewise, whose one request is spent over gRPC (the budget is the key's)
SHARED_BUDGET_KEY = "shared-budget-key"
IGNORE_EOS = {"ignore_eos": True}
#: seconds to wait for the server to notice a disconnect and abort
ABORT_WAIT = 30.0
POLL_SECONDS = 0.1
EXIT_TIMEOUT = 60.0

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]
RUNNING = ("actorline_requests_running", frozenset[tuple[str, str]]())
ABORTED = ("actorline_requests_finished_total", frozenset({("finish_reason", "abort")}))


def poll_until(condition: Callable[[], bool], what: str, timeout: float = ABORT_WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_SECONDS)


def metrics(serve: ServeProcess) -> Metrics:
    """The Prometheus samples at ``/metrics`` of the HTTP port (no key needed)."""
    with urllib.request.urlopen(serve.base_url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def openai_serve_arguments(model: Path, *extra: str, grpc: bool = True) -> list[str]:
    """``actorline serve`` arguments: HTTP (and, with ``grpc``, gRPC) on a free port of
    127.0.0.1, the model served as ``tiny``, then ``extra``."""
    ports = ["--grpc-port", "0", "--http-port", "0"] if grpc else ["--http-port", "0"]
    return ["--model", str(model), "--host", "127.0.0.1", *ports, "--served-model-name", MODEL,
            *extra]  # fmt: skip


@pytest.fixture(scope="package")
def openai_serve(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    directory = tmp_path_factory.mktemp("openai-serve")
    limited = (*LIMITED_KEYS, CHOICES_LIMITED_KEY, SHARED_BUDGET_KEY)
    key_file = directory / "keys.txt"
    key_file.write_text("\n".join([API_KEY, *(f"{key} 0.001 -" for key in limited)]) + "\n")
    serve = ServeProcess(
        openai_serve_arguments(tiny_model_dir, "--num-blocks", "128", "--api-key-file",
                               str(key_file), "--trust-request-chat-template"),
        directory / "stderr.txt",
    )  # fmt: skip
    try:
        yield serve
        children = child_pids(serve.process.pid)
        assert children, "the engine runs in a process of its own"
        serve.process.send_signal(signal.SIGINT)
        assert serve.process.wait(timeout=EXIT_TIMEOUT) == 0, serve.stderr[-3000:]
        assert not [pid for pid in children if process_alive(pid)]
        assert "Traceback" not in serve.stderr, serve.stderr[-3000:]
    finally:
        serve.kill()


@pytest.fixture(scope="package")
def reasoning_serve(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """``actorline serve --reasoning-parser deepseek_r1``, HTTP only, no keys: the chat and
    the Responses API tests of the parser share it (they only send requests)."""
    serve = ServeProcess(
        openai_serve_arguments(tiny_model_dir, "--num-blocks", "64", "--reasoning-parser",
                               "deepseek_r1", grpc=False),
        tmp_path_factory.mktemp("reasoning-serve") / "stderr.txt",
    )  # fmt: skip
    try:
        yield serve
    finally:
        serve.kill()


@pytest.fixture
def client(openai_serve: ServeProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=openai_serve.http_url, api_key=API_KEY, max_retries=0) as made:
        yield made
