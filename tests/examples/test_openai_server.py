"""examples/openai_server.py as a real uvicorn server (a subprocess on a free port running the
tiny model), driven with the official ``openai`` client: models list, completions and chat
completions with and without streaming, OpenAI-style errors (400 naming the field, 401, 404,
429), a client that disconnects mid-stream aborting its request, Prometheus metrics, and a
clean exit on SIGTERM (status 0, no process left)."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.examples.running import RUN_TIMEOUT, example_command, example_env
from tests.pipeline.server.serving import child_pids, process_alive

pytestmark = pytest.mark.slow

MODEL = "tiny"
API_KEY = "test-key-0123"
LIMITED_USER = "limited-user"
READY_PREFIX = "serving OpenAI-compatible API on "
IGNORE_EOS = {"ignore_eos": True}
#: seconds to wait for the server to notice a disconnect and abort
ABORT_WAIT = 30.0
POLL_SECONDS = 0.1


def poll_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + ABORT_WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_SECONDS)


class Server:
    """The example server in a subprocess; ``url`` is its /v1 base URL once ready."""

    def __init__(self, model: Path, stderr_path: Path) -> None:
        self._stderr = stderr_path.open("w")
        self.stderr_path = stderr_path
        self.process = subprocess.Popen(
            example_command(
                "openai_server", "--model", str(model), "--served-model-name", MODEL,
                "--port", "0", "--api-key", API_KEY, "--num-blocks", "128",
                "--user-limit", f"{LIMITED_USER}:0.001:-",
            ),
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=example_env(),
        )  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        try:
            line = lines.get(timeout=RUN_TIMEOUT)
        except queue.Empty:
            line = None
        if line is None or not line.startswith(READY_PREFIX):
            self.kill()
            raise AssertionError(f"no ready line ({line!r}): {stderr_path.read_text()[-3000:]}")
        self.url = line.removeprefix(READY_PREFIX)

    def _read(self, lines: queue.Queue[str | None]) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        with urllib.request.urlopen(self.url.removesuffix("/v1") + "/metrics") as response:
            text = response.read().decode()
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tiny_model_dir, tmp_path_factory.mktemp("openai") / "stderr.txt")
    try:
        yield running
        children = child_pids(running.process.pid)
        assert children, "the engine runs in a process of its own"
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=60) == 0, running.stderr_path.read_text()[-3000:]
        assert not [pid for pid in children if process_alive(pid)]
    finally:
        running.kill()


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0) as created:
        yield created


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_completion_streamed_and_not(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, prompt="Hello", max_tokens=6, temperature=0.0,
                   extra_body=IGNORE_EOS)  # fmt: skip
    completion = client.completions.create(**request)  # type: ignore[call-overload]
    choice = completion.choices[0]
    assert completion.object == "text_completion"
    assert choice.text and choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 6
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 6

    chunks = list(
        client.completions.create(**request, stream=True)  # type: ignore[call-overload]
    )
    texts = [chunk.choices[0].text for chunk in chunks]
    assert len([text for text in texts if text]) > 1
    assert "".join(texts) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])


def test_completion_of_token_ids(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt=list(range(1000, 1020)), max_tokens=3, extra_body=IGNORE_EOS
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 20
    assert completion.usage.completion_tokens == 3


def test_chat_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi!"}],
        max_tokens=5, temperature=0.0, extra_body=IGNORE_EOS,
    )  # fmt: skip
    choice = completion.choices[0]
    assert completion.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens > 5  # the chat template's tokens


def test_chat_completion_streams_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten"}],
        max_completion_tokens=8, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
    )  # fmt: skip
    chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices and
              c.choices[0].delta.content]  # fmt: skip
    assert len(pieces) > 1
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_errors_are_openai_style(client: openai.OpenAI, server: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as bad_n:
        client.chat.completions.create(model=MODEL, messages=messages, n=2)  # type: ignore[arg-type]
    assert bad_n.value.status_code == 400
    assert bad_n.value.param == "n" and "n=1" in bad_n.value.message
    with pytest.raises(openai.BadRequestError) as bad_temperature:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1.0)
    assert bad_temperature.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad_type:
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"top_p": "high"})
    assert bad_type.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt=list(range(1000, 2100)), max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-5", prompt="Hi")
    assert unknown.value.param == "model" and unknown.value.code == "model_not_found"
    with (
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        stranger.models.list()
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, user=LIMITED_USER)
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, user=LIMITED_USER)
    assert limited.value.status_code == 429
    assert isinstance(limited.value.body, dict) and "limit" in json.dumps(limited.value.body)


def test_disconnect_aborts_the_request(client: openai.OpenAI, server: Server) -> None:
    aborted = ("actorline_requests_finished_total", frozenset({("finish_reason", "abort")}))
    before = server.metrics()[aborted]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Go on forever"}],
        max_tokens=900, temperature=0.0, stream=True, extra_body=IGNORE_EOS,
    )  # fmt: skip
    for index, _ in enumerate(stream):
        if index == 2:
            break
    stream.close()
    poll_until(lambda: server.metrics()[aborted] > before, "the disconnected request's abort")
    running = ("actorline_requests_running", frozenset[tuple[str, str]]())
    poll_until(lambda: server.metrics()[running] == 0, "no request to run")
