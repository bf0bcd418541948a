"""Property-based fuzz of the HTTP front end, in its own encoding: JSON bodies of
/v1/completions and /v1/chat/completions with any value in any field (integers of any size
such as 2**70, NaN and Infinity, "\\ud800" escapes, control characters, wrong types, empty
and huge lists, structured outputs by ``response_format`` and by ``structured_outputs``), and
bodies that are not JSON at all. Against the null-model engine (zmq topology) behind a real
HttpServer, with a bystander client: each request is answered (200) or refused by field
(400, 404 for an unknown model, 413 over the body cap), never 500, and within
:data:`PATIENCE`: the engine's length is short (:data:`MAX_MODEL_LEN`), so every valid
request ends quickly and a request left without an answer is a hang, which fails the test;
the bystander gets every answer whole; the engine lives (docs/architecture.md, "Failure: one
request or the pipeline")."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline import AsyncEngine
from pipeline.engine.loop_thread import LoopThread
from pipeline.server.http.server import HttpServer
from tests.hostile import FLOATS, INTS, TEXT

MODEL = "m"
#: the engine's length: it bounds every valid request (a chat without max_tokens, a
#: max_tokens of 2**31 and three choices of it generate up to this many tokens each)
MAX_MODEL_LEN = 256
#: seconds within which every request must be answered (status and body, or a stream's
#: first events): a valid one generates at most MAX_MODEL_LEN tokens per choice, which the
#: null model does in well under a second, so this is only a loaded machine's margin
PATIENCE = 30.0
#: server-sent events read from a stream before the client hangs up
EVENTS_READ = 3
ANSWERED = {200, 400, 404, 413}

JSON_SCALAR = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON = st.recursive(
    JSON_SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)
SMALL = st.one_of(st.integers(1, 6), INTS, JSON)
NUMBER = st.one_of(st.floats(0.0, 1.0), FLOATS, JSON)
PROMPT = st.one_of(
    st.text(min_size=1, max_size=20),
    TEXT,
    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3),
    st.lists(st.integers(0, 49_151), min_size=1, max_size=6),
    st.lists(INTS, max_size=4),
    st.lists(st.lists(st.integers(0, 49_151), min_size=1, max_size=3), min_size=1, max_size=2),
    st.integers(20_000, 40_000).map(lambda n: [1] * n),
    JSON,
)
#: a JSON schema: plausible (each one satisfiable), with hostile values, or any JSON
SCHEMA = st.one_of(
    st.sampled_from(
        [
            {"type": "object"},
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            {"type": "string", "enum": ["yes", "no"]},
            {"type": "integer", "minimum": 0, "maximum": 9},
        ]
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "array"])},
        optional={
            "maxLength": INTS,
            "minimum": st.one_of(INTS, FLOATS),
            "maxItems": INTS,
            "pattern": TEXT,
            "enum": st.lists(JSON_SCALAR, max_size=3),
        },
    ),
    st.dictionaries(TEXT, JSON, max_size=3),
    JSON,
)
#: OpenAI's ``response_format``: each type, with hostile values, and any JSON
RESPONSE_FORMAT = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"name": st.one_of(st.just("answer"), TEXT), "schema": SCHEMA},
                optional={"strict": st.one_of(st.booleans(), JSON), "description": TEXT},
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.one_of(TEXT, JSON)}, optional={"json_schema": JSON}),
    JSON,
)
#: vLLM's ``structured_outputs``: each kind alone (plausible or hostile), several at once,
#: unknown keys, and any JSON
STRUCTURED_OUTPUTS = st.one_of(
    st.fixed_dictionaries(
        {"regex": st.one_of(st.sampled_from(["[a-z]+", "(yes|no)", "[0-9]{1,3}"]), TEXT, JSON)}
    ),
    st.fixed_dictionaries(
        {
            "choice": st.one_of(
                st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),
                st.lists(st.one_of(TEXT, JSON), max_size=3),
                JSON,
            )
        }
    ),
    st.fixed_dictionaries({"json": st.one_of(SCHEMA, SCHEMA.map(json.dumps), TEXT)}),
    st.fixed_dictionaries({"json_object": st.one_of(st.booleans(), JSON)}),
    st.fixed_dictionaries(
        {"grammar": st.one_of(st.just('root ::= "yes" | "no"'), st.just("start: /[a-z]+/"), TEXT)}
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "json": SCHEMA,
            "regex": TEXT,
            "choice": st.lists(TEXT, max_size=2),
            "grammar": TEXT,
            "json_object": JSON,
            "disable_any_whitespace": JSON,
            "disable_additional_properties": JSON,
        },
    ),
    st.dictionaries(TEXT, JSON, max_size=2),
    JSON,
)
SAMPLING = {
    "max_tokens": SMALL,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "n": st.one_of(st.integers(1, 3), JSON),
    "stream": st.one_of(st.booleans(), JSON),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), JSON),
    "seed": st.one_of(st.integers(0, 2**63 - 1), INTS, JSON),
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "top_k": SMALL,
    "min_p": NUMBER,
    "repetition_penalty": NUMBER,
    "min_tokens": SMALL,
    "ignore_eos": st.one_of(st.booleans(), JSON),
    "stop_token_ids": st.one_of(st.lists(INTS, max_size=4), JSON),
    "user": st.one_of(TEXT, JSON),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "response_format": RESPONSE_FORMAT,
    "structured_outputs": STRUCTURED_OUTPUTS,
}
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}
    ),
    st.fixed_dictionaries(
        {
            "role": st.one_of(TEXT, JSON),
            "content": st.one_of(TEXT, st.lists(JSON, max_size=2), JSON),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2
            ),
        }
    ),
    JSON,
)


def _some(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Up to four of ``fields``, each with a value of its strategy."""
    names = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({n: fields[n] for n in chosen}))


COMPLETION = st.tuples(
    st.just("/completions"),
    st.fixed_dictionaries({"model": st.one_of(st.just(MODEL), TEXT), "prompt": PROMPT}),
    _some({**SAMPLING, "logprobs": SMALL, "echo": JSON, "best_of": JSON}),
)
CHAT = st.tuples(
    st.just("/chat/completions"),
    st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON)}
    ),
    _some(
        {
            **SAMPLING,
            "max_completion_tokens": SMALL,
            "logprobs": st.one_of(st.booleans(), JSON),
            "top_logprobs": SMALL,
            "tools": JSON,
        }
    ),
)
#: bodies that are not the API's JSON: anything, JSON with a huge number, nesting, duplicates
RAW = st.one_of(
    st.binary(max_size=60),
    st.text(max_size=60).map(str.encode),
    st.integers(1, 5_000).map(
        lambda n: b'{"model":"m","prompt":"hi","max_tokens":' + b"9" * n + b"}"
    ),
    st.integers(1, 200_000).map(lambda n: b"[" * n),
    st.just(b'{"model":"m","prompt":"hi","prompt":[1],"max_tokens":2}'),
    st.just(b'{"model":"m","prompt":"hi","max_tokens":2,"temperature":1e999}'),
    st.just(b'{"model":"m","prompt":"\\udfff\\ud800","max_tokens":2}'),
    st.integers(1_100_000, 1_300_000).map(lambda n: b'{"model":"m","prompt":"' + b"a" * n + b'"}'),
)


class Bystander:
    """Asks for one ordinary completion after another until stopped; each must be whole."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answered = 0
        self.problems: list[str] = []
        self.stopping = False

    async def run(self) -> None:
        body = {"model": MODEL, "prompt": "the bystander", "max_tokens": 24, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            while not self.stopping:
                response = await client.post("/completions", json=body)
                answer = response.json()
                if response.status_code != 200 or answer["usage"]["completion_tokens"] != 24:
                    self.problems.append(f"{response.status_code}: {answer!r:.300}")
                    return
                self.answered += 1


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LoopThread, HttpServer, Bystander, dict[str, Any]]]:
    loop = LoopThread()
    engine = AsyncEngine(null_model=True, transport="zmq", max_model_len=MAX_MODEL_LEN)
    server = HttpServer(engine, model_name=MODEL)
    state: dict[str, Any] = {}

    async def begin() -> Bystander:
        await engine.start()
        url = await server.start("127.0.0.1", 0)
        bystander = Bystander(url)
        state["task"] = asyncio.get_running_loop().create_task(bystander.run())
        state["client"] = httpx.AsyncClient(base_url=url, timeout=PATIENCE)
        return bystander

    bystander = loop.run(begin())
    yield loop, server, bystander, state

    async def end() -> None:
        await state["client"].aclose()
        await server.stop()
        await engine.close()

    loop.run(end())
    loop.stop()


async def post(client: httpx.AsyncClient, path: str, content: bytes) -> int:
    """POST ``content``; its status. A stream is read for a few events, then hung up on
    (which aborts it); any other answer is read whole.

    Raises:
        AssertionError: no answer within :data:`PATIENCE` (a hang: no valid request runs
            that long), or a refusal that is not an OpenAI-style error naming the problem.
    """
    headers = {"content-type": "application/json"}
    try:
        async with asyncio.timeout(PATIENCE):
            async with client.stream("POST", path, content=content, headers=headers) as response:
                if response.status_code == 200 and "text/event-stream" in response.headers.get(
                    "content-type", ""
                ):
                    read = 0
                    async for line in response.aiter_lines():
                        read += bool(line)
                        if read == EVENTS_READ:
                            break
                else:
                    body = json.loads(await response.aread())
                    if response.status_code != 200:
                        error = body["error"]
                        assert set(error) == {"message", "type", "param", "code"}, body
                        assert error["message"], body
                return response.status_code
    except (TimeoutError, httpx.TimeoutException):
        raise AssertionError(
            f"no answer within {PATIENCE} s to POST {path} {content[:300]!r}"
        ) from None


def check(served: Any, path: str, content: bytes) -> None:
    loop, server, bystander, state = served
    status = loop.run(post(state["client"], path, content))
    assert status in ANSWERED, status
    assert server.engine.failure is None
    assert not bystander.problems, bystander.problems


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=st.one_of(COMPLETION, CHAT))
def test_any_json_body_is_answered_or_refused_by_field(
    served: Any, request: tuple[str, dict[str, Any], dict[str, Any]]
) -> None:
    path, required, optional = request
    body = json.dumps({**required, **optional}).encode()  # NaN, Infinity, \ud800 escapes
    check(served, path, body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(["/completions", "/chat/completions"]),
    constraint=st.one_of(
        st.fixed_dictionaries({"response_format": RESPONSE_FORMAT}),
        st.fixed_dictionaries({"structured_outputs": STRUCTURED_OUTPUTS}),
        st.fixed_dictionaries(
            {"response_format": RESPONSE_FORMAT, "structured_outputs": STRUCTURED_OUTPUTS}
        ),
    ),
    stream=st.booleans(),
)
# a refusal that names a key without a UTF-8 form (it was a 500: the answer could not be
# encoded)
@example(path="/chat/completions", constraint={"structured_outputs": {"\ud800": 1}}, stream=False)
def test_any_structured_output_is_answered_or_refused_by_field(
    served: Any, path: str, constraint: dict[str, Any], stream: bool
) -> None:
    """Every request carries a constraint (the fuzz above draws one now and then)."""
    prompt: dict[str, Any] = (
        {"prompt": "answer"}
        if path == "/completions"
        else {"messages": [{"role": "user", "content": "answer"}]}
    )
    body = {"model": MODEL, **prompt, "max_tokens": 8, "stream": stream, **constraint}
    check(served, path, json.dumps(body).encode())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(["/completions", "/chat/completions"]), content=RAW)
def test_any_bytes_are_refused_or_answered(served: Any, path: str, content: bytes) -> None:
    check(served, path, content)


#: the vectors of the hostile review (issue 16) in JSON, each with the ``param`` of its 400
#: (HTTP has no priority, request id or tenant field: the id is the server's, the tenant the
#: API key's)
VECTORS: list[tuple[str, str, dict[str, Any], str]] = [
    ("max_tokens 2**64", "/completions", {"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
    (
        "max_tokens -2**63-1",
        "/completions",
        {"prompt": "hi", "max_tokens": -(2**63) - 1},
        "max_tokens",
    ),
    ("top_k 2**70", "/completions", {"prompt": "hi", "top_k": 2**70}, "top_k"),
    (
        "stop_token_ids 2**64",
        "/completions",
        {"prompt": "hi", "stop_token_ids": [2**64]},
        "stop_token_ids",
    ),
    ("prompt id 2**64", "/completions", {"prompt": [1, 2**64]}, "prompt"),
    ("prompt id -2**63-1", "/completions", {"prompt": [-(2**63) - 1]}, "prompt"),
    ("prompt surrogate", "/completions", {"prompt": "a\ud800"}, "prompt"),
    (
        "chat content surrogate",
        "/chat/completions",
        {"messages": [{"role": "user", "content": "\udfff"}]},
        "messages",
    ),
    (
        "chat role surrogate",
        "/chat/completions",
        {"messages": [{"role": "\ud800", "content": "x"}]},
        "messages[0].role",
    ),
    ("stop surrogate", "/completions", {"prompt": "hi", "stop": ["ok", "\ud800"]}, "stop"),
    ("bool max_tokens", "/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("str temperature", "/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("NaN top_p", "/completions", {"prompt": "hi", "top_p": math.nan}, "top_p"),
    (
        "Infinity temperature",
        "/completions",
        {"prompt": "hi", "temperature": math.inf},
        "temperature",
    ),
    ("prompt id past the vocabulary", "/completions", {"prompt": [1, 49_152]}, "prompt"),
    (
        "stop token id past the vocabulary",
        "/completions",
        {"prompt": "hi", "stop_token_ids": [10**6]},
        "stop_token_ids",
    ),
]


@pytest.mark.parametrize(
    ("path", "fields", "param"), [pytest.param(*vector[1:], id=vector[0]) for vector in VECTORS]
)
def test_each_vector_of_the_review_is_400_naming_its_param(
    served: Any, path: str, fields: dict[str, Any], param: str
) -> None:
    loop, server, bystander, state = served

    async def answer() -> httpx.Response:
        body = json.dumps({"model": MODEL, **fields}).encode()  # NaN, Infinity, \ud800 escapes
        headers = {"content-type": "application/json"}
        return await state["client"].post(path, content=body, headers=headers)

    response = loop.run(answer())
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (400, param, "invalid_value")
    assert server.engine.failure is None
    assert not bystander.problems, bystander.problems


def test_after_the_fuzz_the_bystander_was_answered_and_nothing_runs(served: Any) -> None:
    loop, server, bystander, state = served

    async def settle() -> None:
        bystander.stopping = True
        await state["task"]
        for _ in range(100):
            if server.service.num_running == 0:
                return
            await asyncio.sleep(0.05)

    loop.run(settle())
    assert not bystander.problems and bystander.answered >= 1
    assert server.engine.failure is None and server.service.num_running == 0
