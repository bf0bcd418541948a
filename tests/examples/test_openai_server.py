"""examples/openai_server.py as a real uvicorn server (a subprocess on a free port running the
tiny model), driven with the official ``openai`` client: models list, completions and chat
completions with and without streaming, several choices (``n``) and several prompts in one
request (seeded choices, usage counting each prompt once, streams interleaving the choices),
logprobs in both endpoints' formats, stop strings and
``stop_reason``, chat generating up to the model's length by default, OpenAI-style errors (400
naming the field, 401, 404, 429), rate limits that follow the API key (not the ``user``
field), a client that disconnects mid-stream aborting its request, the engine dying under
running requests (503 JSON; an error event then ``[DONE]`` in a stream), Prometheus metrics,
and a clean exit on SIGTERM (status 0, no process left)."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.examples.running import RUN_TIMEOUT, example_command, example_env
from tests.pipeline.server.serving import child_pids, process_alive
from tests.processes import child_processes

pytestmark = pytest.mark.slow

MODEL = "tiny"
API_KEY = "test-key-0123"
#: two keys limited to about one request (a bucket of 1 refilling at 0.001/s) each
LIMITED_KEYS = ("limited-key-a", "limited:key-b")
#: a key limited likewise, for a request of two choices (the second one is refused)
CHOICES_LIMITED_KEY = "limited-key-n"
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

    def __init__(self, model: Path, stderr_path: Path, *arguments: str) -> None:
        self._stderr = stderr_path.open("w")
        self.stderr_path = stderr_path
        self.process = subprocess.Popen(
            example_command(
                "openai_server", "--model", str(model), "--served-model-name", MODEL,
                "--port", "0", "--num-blocks", "128", *arguments,
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

    def metric(self, name: str) -> float:
        """The value of the unlabelled sample ``name``."""
        return self.metrics()[name, frozenset()]

    def kill_engine(self) -> None:
        """SIGKILL the engine's process(es) (the pipeline hosts the server spawned)."""
        hosts = [pid for pid, command in child_processes(self.process.pid).items()
                 if "pipeline.runtime.host_main" in command]  # fmt: skip
        assert hosts, "the engine runs in a process of its own"
        for pid in hosts:
            os.kill(pid, signal.SIGKILL)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    limited = (*LIMITED_KEYS, CHOICES_LIMITED_KEY)
    limits = [argument for key in limited for argument in ("--key-limit", f"{key}:0.001:-")]
    keys = [argument for key in (API_KEY, *limited) for argument in ("--api-key", key)]
    stderr_path = tmp_path_factory.mktemp("openai") / "stderr.txt"
    running = Server(tiny_model_dir, stderr_path, *keys, *limits)
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


def stop_reason(choice: object) -> object:
    """vLLM's ``stop_reason`` of a choice (an extra field for the openai client)."""
    assert isinstance(choice, pydantic.BaseModel) and choice.model_extra is not None
    return choice.model_extra["stop_reason"]


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


def test_seeded_choices_differ_and_reproduce(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                   seed=7, extra_body=IGNORE_EOS)  # fmt: skip
    completion = client.completions.create(**request, n=3)  # type: ignore[call-overload]
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    texts = [choice.text for choice in completion.choices]
    assert len(set(texts)) > 1  # choice j samples with seed + j
    again = client.completions.create(**request, n=3)  # type: ignore[call-overload]
    assert [choice.text for choice in again.choices] == texts
    single = client.completions.create(**request)  # type: ignore[call-overload]
    assert single.choices[0].text == texts[0]  # choice 0 samples with the seed itself
    assert completion.usage is not None and single.usage is not None
    assert completion.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert completion.usage.completion_tokens == 24
    assert completion.usage.total_tokens == single.usage.prompt_tokens + 24


def test_several_prompts_in_one_request(client: openai.OpenAI) -> None:
    greedy = dict(model=MODEL, max_tokens=4, temperature=0.0, extra_body=IGNORE_EOS)
    for prompts in (["Hello there", "Once upon a time"],
                    [list(range(1000, 1010)), list(range(2000, 2012))]):  # fmt: skip
        singles = [
            client.completions.create(prompt=prompt, **greedy)  # type: ignore[call-overload]
            for prompt in prompts
        ]
        batched = client.completions.create(prompt=prompts, n=2, **greedy)  # type: ignore[call-overload]
        # choice prompt_index * n + j; greedy choices of one prompt are identical
        assert [choice.index for choice in batched.choices] == [0, 1, 2, 3]
        expected = [single.choices[0].text for single in singles for _ in range(2)]
        assert [choice.text for choice in batched.choices] == expected
        assert all(choice.finish_reason == "length" for choice in batched.choices)
        assert batched.usage is not None
        assert batched.usage.prompt_tokens == sum(
            single.usage.prompt_tokens for single in singles if single.usage
        )
        assert batched.usage.completion_tokens == 16


def test_chat_streams_several_choices(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Say something"}],
                   max_tokens=6, temperature=0.0, n=2, logprobs=True,
                   extra_body=IGNORE_EOS)  # fmt: skip
    full = client.chat.completions.create(**request)  # type: ignore[call-overload]
    assert [choice.index for choice in full.choices] == [0, 1]
    assert full.usage is not None and full.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(  # type: ignore[call-overload]
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    usage = [chunk for chunk in chunks if not chunk.choices]
    assert usage == [chunks[-1]]  # one usage chunk, after every choice ended
    assert usage[0].usage is not None and usage[0].usage.completion_tokens == 12
    assert usage[0].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(len(chunk.choices) == 1 for chunk in chunks[:-1])
    for choice in full.choices:
        own = [chunk.choices[0] for chunk in chunks[:-1] if chunk.choices[0].index == choice.index]
        assert own[0].delta.role == "assistant"
        assert [part.delta.role for part in own].count("assistant") == 1
        assert "".join(part.delta.content or "" for part in own) == choice.message.content
        assert [part.finish_reason for part in own if part.finish_reason] == ["length"]
        assert own[-1].finish_reason == "length"
        # each choice's logprobs: its own tokens, each once
        tokens = [entry.token for part in own if part.logprobs
                  for entry in part.logprobs.content or ()]  # fmt: skip
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert tokens == [entry.token for entry in choice.logprobs.content]
        assert len(tokens) == 6


def test_a_refused_choice_refuses_the_request(server: Server) -> None:
    """The key's budget admits one request: of two choices, one is refused, so the request
    is answered 429 and the choice already admitted is aborted."""
    running = ("actorline_requests_running", frozenset[tuple[str, str]]())
    aborted = ("actorline_requests_finished_total", frozenset({("finish_reason", "abort")}))
    rejected = ("actorline_requests_rejected_total", frozenset({("kind", "rate_limited")}))
    before = server.metrics()
    with (
        openai.OpenAI(base_url=server.url, api_key=CHOICES_LIMITED_KEY, max_retries=0) as limited,
        pytest.raises(openai.RateLimitError) as refused,
    ):
        limited.completions.create(
            model=MODEL, prompt="Go on forever", n=2, max_tokens=900, extra_body=IGNORE_EOS
        )
    assert refused.value.status_code == 429
    assert int(refused.value.response.headers["retry-after"]) >= 1
    poll_until(lambda: server.metrics()[aborted] > before[aborted], "the admitted choice's abort")
    poll_until(lambda: server.metrics()[running] == 0, "no request to run")
    assert server.metrics()[rejected] == before[rejected] + 1


def test_errors_are_openai_style(client: openai.OpenAI, server: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as no_choice:
        client.chat.completions.create(model=MODEL, messages=messages, n=0)  # type: ignore[arg-type]
    assert no_choice.value.status_code == 400
    assert no_choice.value.param == "n" and no_choice.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as too_many_choices:
        client.completions.create(model=MODEL, prompt="Hi", n=17)
    assert too_many_choices.value.param == "n" and too_many_choices.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as too_many_in_all:  # 5 prompts x 16 > 64
        client.completions.create(model=MODEL, prompt=["Hi"] * 5, n=16)
    assert too_many_in_all.value.param == "n"
    with pytest.raises(openai.BadRequestError) as no_prompt:
        client.completions.create(model=MODEL, prompt=[])
    assert no_prompt.value.param == "prompt"
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
    with pytest.raises(openai.BadRequestError) as top_alone:
        client.chat.completions.create(model=MODEL, messages=messages, top_logprobs=2)  # type: ignore[arg-type]
    assert top_alone.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model=MODEL, prompt="Hi", logprobs=21)
    assert too_many.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as options_alone:  # as vLLM: stream=True only
        client.completions.create(model=MODEL, prompt="Hi", stream_options={"include_usage": True})
    assert options_alone.value.param == "stream_options"


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_aborts_the_request(client: openai.OpenAI, server: Server, n: int) -> None:
    aborted = ("actorline_requests_finished_total", frozenset({("finish_reason", "abort")}))
    before = server.metrics()[aborted]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Go on forever"}],
        max_tokens=900, temperature=0.0, n=n, stream=True, extra_body=IGNORE_EOS,
    )  # fmt: skip
    for index, _ in enumerate(stream):
        if index == 2 + n:
            break
    stream.close()
    poll_until(lambda: server.metrics()[aborted] >= before + n, "every choice's abort")
    running = ("actorline_requests_running", frozenset[tuple[str, str]]())
    poll_until(lambda: server.metrics()[running] == 0, "no request to run")


def test_rate_limits_follow_the_api_key(server: Server) -> None:
    first, second = (
        openai.OpenAI(base_url=server.url, api_key=key, max_retries=0) for key in LIMITED_KEYS
    )
    request = dict(model=MODEL, prompt="Hi", max_tokens=1)
    with first, second:
        first.completions.create(**request, user="alice")  # type: ignore[call-overload]
        with pytest.raises(openai.RateLimitError) as limited:
            # another user under the same key: the same budget
            first.completions.create(**request, user="bob")  # type: ignore[call-overload]
        second.completions.create(**request, user="bob")  # type: ignore[call-overload]
    assert limited.value.status_code == 429
    assert int(limited.value.response.headers["retry-after"]) >= 1  # the client's backoff
    body = json.dumps(limited.value.body)
    assert "limit" in body
    # the tenant is named by the key's hash, never by the key itself
    assert "key-" + hashlib.sha256(LIMITED_KEYS[0].encode()).hexdigest()[:12] in body
    assert LIMITED_KEYS[0] not in body
    assert LIMITED_KEYS[0] not in server.stderr_path.read_text()


def check_token_logprobs(logprob: float, top: list[float], rank_one: bool) -> None:
    assert logprob <= 0.0 and all(value <= 0.0 for value in top)
    assert top == sorted(top, reverse=True)
    if rank_one:  # greedy: the sampled token is the most likely one
        assert top[0] == pytest.approx(logprob)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Say something"}],
                   max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3,
                   extra_body=IGNORE_EOS)  # fmt: skip
    completion = client.chat.completions.create(**request)  # type: ignore[call-overload]
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 8
    assert "".join(entry.token for entry in entries) == choice.message.content
    for entry in entries:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        check_token_logprobs(entry.logprob, [top.logprob for top in entry.top_logprobs], True)

    chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content or ()]  # fmt: skip
    assert [entry.token for entry in streamed] == [entry.token for entry in entries]
    assert [entry.logprob for entry in streamed] == pytest.approx(
        [entry.logprob for entry in entries]
    )
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == choice.message.content


def test_completion_logprobs(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.0,
                   logprobs=2, extra_body=IGNORE_EOS)  # fmt: skip
    completion = client.completions.create(**request)  # type: ignore[call-overload]
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == 8
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(8)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and token in top
        check_token_logprobs(logprob, list(top.values()), True)

    chunks = list(client.completions.create(**request, stream=True))  # type: ignore[call-overload]
    streamed = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices[0].logprobs]
    assert len(streamed) > 1
    assert [token for part in streamed for token in part.tokens or ()] == logprobs.tokens
    assert [offset for part in streamed for offset in part.text_offset or ()] == (
        logprobs.text_offset
    )


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0.0,
                   extra_body=IGNORE_EOS)  # fmt: skip
    full = client.completions.create(**request)  # type: ignore[call-overload]
    assert stop_reason(full.choices[0]) is None
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    cut = client.completions.create(**request, stop=[stop])  # type: ignore[call-overload]
    choice = cut.choices[0]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"
    assert stop_reason(choice) == stop

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=12,
            temperature=0.0,
            stop=stop,
            stream=True,
            extra_body=IGNORE_EOS,
        )
    )
    last = chunks[-1].choices[0]
    assert last.finish_reason in ("stop", "length")
    assert stop_reason(last) == (stop if last.finish_reason == "stop" else None)
    assert stop not in "".join(c.choices[0].delta.content or "" for c in chunks)


#: a token the tiny model generates greedily within 12 tokens after "Hello there" (" Tucker")
STOP_TOKEN = 40405


def test_a_stop_tokens_text_is_not_in_the_answer(client: openai.OpenAI) -> None:
    """A request the engine stops with a stop token id answers the text before that token
    (as vLLM); the token's text is left out, streamed or not."""
    request = dict(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0.0,
                   extra_body=IGNORE_EOS)  # fmt: skip
    full = client.completions.create(**request).choices[0].text  # type: ignore[call-overload]
    assert " Tucker" in full
    stopped = dict(request, extra_body={**IGNORE_EOS, "stop_token_ids": [STOP_TOKEN]})
    choice = client.completions.create(**stopped).choices[0]  # type: ignore[call-overload]
    assert choice.finish_reason == "stop" and stop_reason(choice) == STOP_TOKEN
    assert choice.text == full[: full.index(" Tucker")]
    chunks = list(client.completions.create(**stopped, stream=True))  # type: ignore[call-overload]
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_without_a_limit_runs_to_the_model_length(client: openai.OpenAI) -> None:
    model = client.models.list().data[0]
    assert model.model_extra is not None
    max_model_len = model.model_extra["max_model_len"]
    # a long prompt (about one token per word) leaves a few dozen tokens to generate
    words = "hello " * (max_model_len - 80)
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": words}], temperature=0.0,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    choice = completion.choices[0]
    assert completion.usage is not None
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens > 1
    assert completion.usage.total_tokens == max_model_len


@pytest.fixture
def doomed_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    """A server of its own (no API keys) whose engine the test kills."""
    running = Server(tiny_model_dir, tmp_path / "stderr.txt")
    try:
        yield running
    finally:
        running.kill()


def test_engine_death_is_answered_openai_style(doomed_server: Server) -> None:
    long = dict(model=MODEL, max_tokens=900, temperature=0.0, extra_body=IGNORE_EOS)
    chat = dict(long, messages=[{"role": "user", "content": "Go on forever"}])
    failures: queue.Queue[BaseException | None] = queue.Queue()
    with openai.OpenAI(base_url=doomed_server.url, api_key="none", max_retries=0) as client:

        def complete() -> None:
            try:
                client.completions.create(prompt="Go on forever", **long)  # type: ignore[call-overload]
            except openai.APIError as exc:
                failures.put(exc)
            else:
                failures.put(None)

        threading.Thread(target=complete, daemon=True).start()
        stream = iter(client.chat.completions.create(**chat, stream=True))  # type: ignore[call-overload]
        next(stream)
        raw_request = urllib.request.Request(
            f"{doomed_server.url}/chat/completions",
            data=json.dumps({**chat, "stream": True, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(raw_request, timeout=RUN_TIMEOUT) as raw:
            assert raw.status == 200
            events = (line.decode().rstrip("\n") for line in raw if line.strip())
            next(events)
            poll_until(lambda: doomed_server.metric("actorline_requests_running") == 3,
                       "three running requests")  # fmt: skip
            doomed_server.kill_engine()
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


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_signal_aborts_streams_in_flight_and_exits_cleanly(
    tiny_model_dir: Path, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    """SIGINT or SIGTERM while a long stream runs: the stream ends at once with
    ``finish_reason: "abort"`` (each of its choices: two under SIGTERM) and ``[DONE]``, the
    server exits with status 0 without a traceback, and no engine process is left."""
    stderr_path = tmp_path / "stderr.txt"
    running = Server(tiny_model_dir, stderr_path)
    n = 1 if stop_signal == signal.SIGINT else 2
    try:
        children = child_pids(running.process.pid)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on forever"}],
                "max_tokens": 900, "temperature": 0.0, "n": n, "stream": True,
                **IGNORE_EOS}  # fmt: skip
        request = urllib.request.Request(
            running.url + "/chat/completions",
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
                if len(events) == 2 + n:  # the stream runs: stop the server
                    running.process.send_signal(stop_signal)
        assert running.process.wait(timeout=60) == 0, stderr_path.read_text()[-3000:]
        assert events[-1] == "[DONE]"
        choices = [json.loads(event)["choices"][0] for event in events[:-1]]
        for index in range(n):
            own = [choice for choice in choices if choice["index"] == index]
            finish_reasons = [choice["finish_reason"] for choice in own]
            assert finish_reasons[-1] == "abort" and not any(finish_reasons[:-1])
            completion_tokens = sum(bool(choice["delta"].get("content")) for choice in own)
            assert completion_tokens < 900  # ended by the abort, not by max_tokens
        assert {choice["index"] for choice in choices} == set(range(n))
        stderr = stderr_path.read_text()
        assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr[-3000:]
        assert not [pid for pid in children if process_alive(pid)]
    finally:
        running.kill()
