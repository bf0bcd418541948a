"""The OpenAI-compatible API of ``actorline serve --http-port`` (a real process serving the
tiny model; :mod:`tests.pipeline.server.http.conftest`), driven with the official ``openai``
client: models list, completions and chat completions with and without streaming, several
choices (``n``) and several prompts in one request (seeded choices, usage counting each prompt
once, streams interleaving the choices), logprobs in both endpoints' formats, stop strings and
``stop_reason``, chat generating up to the model's length by default, OpenAI-style errors (400
naming the field, 401, 404, 429), rate limits that follow the API key (not the ``user``
field) and are shared with the gRPC front end, a client that disconnects mid-stream aborting
its request, both front ends serving at once (the gRPC one to a reflection-only client, as
grpcurl), and ``/health`` and ``/metrics`` without a key."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import threading
import urllib.error
import urllib.parse
import urllib.request

import grpc
import grpc.aio
import openai
import pydantic
import pytest

from tests.pipeline.server.http.conftest import (
    API_KEY,
    CHOICES_LIMITED_KEY,
    IGNORE_EOS,
    LIMITED_KEYS,
    MODEL,
    RUNNING,
    SHARED_BUDGET_KEY,
    metrics,
    poll_until,
)
from tests.pipeline.server.serving import ServeProcess, bearer, reflection_generate, rpc_error

pytestmark = pytest.mark.slow


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


def test_structured_outputs_over_http(client: openai.OpenAI) -> None:
    """vLLM's ``structured_outputs`` extra constrains the tiny random model (only the mask
    keeps it in the grammar), streamed and not; ``response_format`` a JSON object; a schema
    keyword the engine does not implement is a 400 naming the field."""
    import re

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick."}], max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["north", "south"]}},
    )  # fmt: skip
    assert chat.choices[0].message.content in ("north", "south")
    assert chat.choices[0].finish_reason == "stop"
    texts = ["", ""]
    stream = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=12, stream=True, n=2, seed=5,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
    )  # fmt: skip
    for chunk in stream:
        for streamed in chunk.choices:
            texts[streamed.index] += streamed.text
    assert all(re.fullmatch("[A-Z]{2}-[0-9]{3}", text) for text in texts), texts
    compact = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON!"}], max_tokens=40,
        extra_body={"structured_outputs": {"json": {"type": "object", "properties": {
            "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
            "disable_any_whitespace": True}},
    )  # fmt: skip
    assert json.loads(compact.choices[0].message.content or "")["ok"] in (True, False)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "array", "uniqueItems": True}}},
        )  # fmt: skip
    assert caught.value.body["param"] == "structured_outputs.json"  # type: ignore[index]
    assert "uniqueItems" in caught.value.body["message"]  # type: ignore[index]


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


def test_a_refused_choice_refuses_the_request(openai_serve: ServeProcess) -> None:
    """The key's budget admits one request: of two choices, one is refused, so the request
    is answered 429 and the choice already admitted is aborted."""
    running = ("actorline_requests_running", frozenset[tuple[str, str]]())
    aborted = ("actorline_requests_finished_total", frozenset({("finish_reason", "abort")}))
    rejected = ("actorline_requests_rejected_total", frozenset({("kind", "rate_limited")}))
    before = metrics(openai_serve)
    with (
        openai.OpenAI(
            base_url=openai_serve.http_url, api_key=CHOICES_LIMITED_KEY, max_retries=0
        ) as limited,
        pytest.raises(openai.RateLimitError) as refused,
    ):
        limited.completions.create(
            model=MODEL, prompt="Go on forever", n=2, max_tokens=900, extra_body=IGNORE_EOS
        )
    assert refused.value.status_code == 429
    assert int(refused.value.response.headers["retry-after"]) >= 1
    poll_until(
        lambda: metrics(openai_serve)[aborted] > before[aborted], "the admitted choice's abort"
    )
    poll_until(lambda: metrics(openai_serve)[running] == 0, "no request to run")
    assert metrics(openai_serve)[rejected] == before[rejected] + 1


def test_errors_are_openai_style(client: openai.OpenAI, openai_serve: ServeProcess) -> None:
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
        openai.OpenAI(base_url=openai_serve.http_url, api_key="wrong", max_retries=0) as stranger,
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
def test_disconnect_aborts_the_request(
    client: openai.OpenAI, openai_serve: ServeProcess, n: int
) -> None:
    aborted = ("actorline_requests_finished_total", frozenset({("finish_reason", "abort")}))
    before = metrics(openai_serve)[aborted]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Go on forever"}],
        max_tokens=900, temperature=0.0, n=n, stream=True, extra_body=IGNORE_EOS,
    )  # fmt: skip
    for index, _ in enumerate(stream):
        if index == 2 + n:
            break
    stream.close()
    poll_until(lambda: metrics(openai_serve)[aborted] >= before + n, "every choice's abort")
    running = ("actorline_requests_running", frozenset[tuple[str, str]]())
    poll_until(lambda: metrics(openai_serve)[running] == 0, "no request to run")


def test_rate_limits_follow_the_api_key(openai_serve: ServeProcess) -> None:
    first, second = (
        openai.OpenAI(base_url=openai_serve.http_url, api_key=key, max_retries=0)
        for key in LIMITED_KEYS
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
    assert LIMITED_KEYS[0] not in openai_serve.stderr


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
    # NOTE: enough tokens that the stream has several chunks even when the engine runs ahead of
    # the reader (a lagging reader gets the outputs that piled up merged into one chunk)
    tokens = 16
    request = dict(model=MODEL, prompt="Once upon a time", max_tokens=tokens, temperature=0.0,
                   logprobs=2, extra_body=IGNORE_EOS)  # fmt: skip
    completion = client.completions.create(**request)  # type: ignore[call-overload]
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == tokens
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(tokens)]
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


# -- one engine, two front ends -------------------------------------------------------------


def test_both_front_ends_serve_at_once(client: openai.OpenAI, openai_serve: ServeProcess) -> None:
    """An OpenAI stream and a gRPC call from a reflection-only client (as grpcurl) run at the
    same time on the one engine; greedy, they generate the same tokens for the same prompt."""
    prompt = list(range(1000, 1010))
    streamed: list[str] = []
    started = threading.Event()

    def stream() -> None:
        for chunk in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0, stream=True,
            extra_body=IGNORE_EOS,
        ):  # fmt: skip
            streamed.append(chunk.choices[0].text)
            started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)

    async def grpc_call() -> list[dict[str, object]]:
        assert openai_serve.address is not None
        async with grpc.aio.insecure_channel(openai_serve.address) as channel:
            return await reflection_generate(
                channel,
                {"tokenIds": {"ids": prompt}, "samplingParams": {"maxTokens": 24,
                 "temperature": 0, "ignoreEos": True}},
                bearer(API_KEY),
            )  # fmt: skip

    responses = asyncio.run(grpc_call())
    reader.join(60)
    assert responses[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert "".join(str(r.get("delta", "")) for r in responses) == "".join(streamed)
    assert len(streamed) > 1


def test_a_wrong_key_is_401_over_http_and_unauthenticated_over_grpc(
    openai_serve: ServeProcess,
) -> None:
    with (
        openai.OpenAI(
            base_url=openai_serve.http_url, api_key="wrong-key", max_retries=0
        ) as stranger,
        pytest.raises(openai.AuthenticationError) as refused,
    ):
        stranger.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert isinstance(refused.value.body, dict)
    assert set(refused.value.body) == {"message", "type", "param", "code"}
    assert "wrong-key" not in json.dumps(refused.value.body)
    with pytest.raises(urllib.error.HTTPError) as keyless:
        urllib.request.urlopen(openai_serve.http_url + "/models", timeout=60)
    assert keyless.value.code == 401
    assert json.loads(keyless.value.read())["error"]["code"] == "invalid_api_key"
    # two keys in one request: which one counts would be a guess
    url = urllib.parse.urlsplit(openai_serve.base_url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    try:
        connection.putrequest("GET", "/v1/models")
        connection.putheader("Authorization", f"Bearer {API_KEY}")
        connection.putheader("Authorization", "Bearer another-key")
        connection.endheaders()
        doubled = connection.getresponse()
        assert doubled.status == 401
        assert "2 Authorization headers" in json.loads(doubled.read())["error"]["message"]
    finally:
        connection.close()

    async def grpc_calls() -> list[grpc.aio.AioRpcError]:
        assert openai_serve.address is not None
        async with grpc.aio.insecure_channel(openai_serve.address) as channel:
            request = {"text": "Hi", "samplingParams": {"maxTokens": 1}}
            return [
                await rpc_error(reflection_generate(channel, request, metadata))
                for metadata in (bearer("wrong-key"), ())
            ]

    for error in asyncio.run(grpc_calls()):
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_keys_rate_limit_is_shared_by_both_front_ends(openai_serve: ServeProcess) -> None:
    """The key's budget of one request, spent over gRPC, is spent for HTTP too."""

    async def grpc_call() -> list[dict[str, object]]:
        assert openai_serve.address is not None
        async with grpc.aio.insecure_channel(openai_serve.address) as channel:
            request = {"text": "Hi", "samplingParams": {"maxTokens": 1}}
            return await reflection_generate(channel, request, bearer(SHARED_BUDGET_KEY))

    assert asyncio.run(grpc_call())[-1]["finishReason"]
    with (
        openai.OpenAI(
            base_url=openai_serve.http_url, api_key=SHARED_BUDGET_KEY, max_retries=0
        ) as limited,
        pytest.raises(openai.RateLimitError),
    ):
        limited.completions.create(model=MODEL, prompt="Hi", max_tokens=1)


def test_health_and_metrics_need_no_key(openai_serve: ServeProcess) -> None:
    with urllib.request.urlopen(openai_serve.base_url + "/health", timeout=60) as response:
        assert response.status == 200
        assert json.loads(response.read()) == {"status": "ok"}
    samples = metrics(openai_serve)
    assert samples[RUNNING] == 0
    with pytest.raises(urllib.error.HTTPError) as unknown:
        urllib.request.urlopen(openai_serve.base_url + "/v1/nothing-here", timeout=60)
    assert unknown.value.code == 401  # the key is checked before the route
    request = urllib.request.Request(
        openai_serve.base_url + "/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=60)
    assert missing.value.code == 404
    assert set(json.loads(missing.value.read())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', "not UTF-8"),
        (b'{"model": "tiny", "prompt": ' + b"[" * 10**5 + b"]" * 10**5 + b"}", "too deeply"),
        (b'{"model": "tiny", "prompt": ', "Expecting value"),
    ],
    ids=["undecodable", "deep", "truncated"],
)
def test_undecodable_and_too_deep_json_is_invalid_json(
    openai_serve: ServeProcess, body: bytes, said: str
) -> None:
    """Every body that does not parse is 400 ``invalid_json`` (no traceback reaches the log:
    the fixture's teardown checks), and the server goes on answering."""
    request = urllib.request.Request(
        openai_serve.http_url + "/completions",
        data=body,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("the body is not valid JSON") and said in error["message"]
    with urllib.request.urlopen(openai_serve.base_url + "/health", timeout=60) as response:
        assert response.status == 200
