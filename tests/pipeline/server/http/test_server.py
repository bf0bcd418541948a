"""The HTTP front end's life under ``actorline serve``: serving HTTP alone (``--http-port``
only), the engine dying under running requests (503 OpenAI-style; an error event then
``[DONE]`` in a stream; ``/health`` 503), and a stop signal while an HTTP stream and a gRPC
stream run (the HTTP stream ends with ``finish_reason: "abort"`` per choice and ``[DONE]``,
the gRPC call with UNAVAILABLE; exit status 0, no traceback, no engine process left). TLS of
the HTTP port: tests/pipeline/server/test_serve_cli.py."""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pipeline.server.client import ServiceUnavailableError
from stages.params import SamplingParams
from tests.pipeline.server.http.conftest import (
    ABORT_WAIT,
    EXIT_TIMEOUT,
    IGNORE_EOS,
    MODEL,
    metrics,
    openai_serve_arguments,
    poll_until,
)
from tests.pipeline.server.serving import (
    RUN_TIMEOUT,
    ServeProcess,
    child_pids,
    engine_host_pids,
    process_alive,
    stream_in_background,
)

pytestmark = pytest.mark.slow

LONG = dict(model=MODEL, max_tokens=900, temperature=0.0, extra_body=IGNORE_EOS)


@pytest.fixture
def http_only(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServeProcess]:
    """``actorline serve --http-port 0`` alone (no keys): HTTP only, a server the test may
    break (and that stays broken: no restart)."""
    serve = ServeProcess(
        openai_serve_arguments(
            tiny_model_dir, "--num-blocks", "128", "--no-restart-engine", grpc=False
        ),
        tmp_path / "stderr.txt",
    )
    try:
        yield serve
    finally:
        serve.kill()


def test_engine_death_is_answered_openai_style(http_only: ServeProcess) -> None:
    assert http_only.address is None  # only the HTTP ready line was printed
    chat = dict(LONG, messages=[{"role": "user", "content": "Go on forever"}])
    failures: queue.Queue[BaseException | None] = queue.Queue()
    with openai.OpenAI(base_url=http_only.http_url, api_key="none", max_retries=0) as client:

        def complete() -> None:
            try:
                client.completions.create(prompt="Go on forever", **LONG)  # type: ignore[call-overload]
            except openai.APIError as exc:
                failures.put(exc)
            else:
                failures.put(None)

        threading.Thread(target=complete, daemon=True).start()
        stream = iter(client.chat.completions.create(**chat, stream=True))  # type: ignore[call-overload]
        next(stream)
        assert http_only.http_url is not None
        raw_request = urllib.request.Request(
            f"{http_only.http_url}/chat/completions",
            # NOTE: ``extra_body`` is the openai client's argument, not a body field
            data=json.dumps(
                {
                    **{k: v for k, v in chat.items() if k != "extra_body"},
                    "stream": True,
                    "ignore_eos": True,
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(raw_request, timeout=RUN_TIMEOUT) as raw:
            assert raw.status == 200
            events = (line.decode().rstrip("\n") for line in raw if line.strip())
            next(events)
            poll_until(
                lambda: metrics(http_only)["actorline_requests_running", frozenset()] == 3,
                "three running requests",
            )
            (engine,) = engine_host_pids(http_only.process.pid)
            os.kill(engine, signal.SIGKILL)
            tail = list(events)[-2:]
        with pytest.raises(openai.APIError) as streamed:
            for _ in stream:
                pass
        collected = failures.get(timeout=ABORT_WAIT)
        with pytest.raises(openai.InternalServerError) as later:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)

    assert tail[-1] == "data: [DONE]"
    error = json.loads(tail[0].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "engine" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(streamed.value.body, dict) and streamed.value.body["type"] == "server_error"
    assert isinstance(collected, openai.InternalServerError) and collected.status_code == 503
    assert isinstance(collected.body, dict) and collected.body["type"] == "server_error"
    assert later.value.status_code == 503
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(http_only.base_url + "/health", timeout=60)
    assert health.value.code == 503
    assert "killed by signal 9" in json.loads(health.value.read())["error"]["message"]
    # the command still stops cleanly
    http_only.process.send_signal(signal.SIGTERM)
    assert http_only.process.wait(EXIT_TIMEOUT) == 0, http_only.stderr[-3000:]


def test_a_stop_signal_aborts_the_streams_of_both_front_ends_and_exits_cleanly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    serve = ServeProcess(
        openai_serve_arguments(tiny_model_dir, "--num-blocks", "128"), tmp_path / "stderr.txt"
    )
    n = 2
    try:
        children = child_pids(serve.process.pid)
        assert serve.address is not None and serve.http_url is not None
        params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        grpc = stream_in_background(serve.address, "Hello", params, timeout=60)
        assert grpc.started.wait(60)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on forever"}],
                "max_tokens": 900, "temperature": 0.0, "n": n, "stream": True,
                **IGNORE_EOS}  # fmt: skip
        request = urllib.request.Request(
            serve.http_url + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        events: list[str] = []
        # NOTE: the timeout bounds each read: a hang guard, not a timing assertion
        with urllib.request.urlopen(request, timeout=60) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line:
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 2 + n:  # both streams run: stop the server
                    serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(timeout=EXIT_TIMEOUT) == 0, serve.stderr[-3000:]
        grpc.thread.join(EXIT_TIMEOUT)

        assert events[-1] == "[DONE]"
        choices = [json.loads(event)["choices"][0] for event in events[:-1]]
        for index in range(n):
            own = [choice for choice in choices if choice["index"] == index]
            finish_reasons = [choice["finish_reason"] for choice in own]
            assert finish_reasons[-1] == "abort" and not any(finish_reasons[:-1])
            completion_tokens = sum(bool(choice["delta"].get("content")) for choice in own)
            assert completion_tokens < 900  # ended by the abort, not by max_tokens
        assert grpc.outputs and not any(output.finished for output in grpc.outputs)
        assert len(grpc.errors) == 1 and isinstance(grpc.errors[0], ServiceUnavailableError)
        assert "shutting down" in str(grpc.errors[0])
        stderr = serve.stderr
        assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr[-3000:]
        assert not [pid for pid in children if process_alive(pid)]
    finally:
        serve.kill()
