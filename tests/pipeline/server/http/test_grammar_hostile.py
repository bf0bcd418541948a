"""Issue 34 over HTTP and gRPC, against the real ``actorline serve`` of
:mod:`tests.pipeline.server.http.conftest` (one engine behind both front ends): a grammar
over the bounds (a chain of 12,000 Lark rules, an ``allOf`` chain 3,000 deep) is a 400 naming
``param`` over HTTP and INVALID_ARGUMENT naming the field over gRPC, ``a{1000000}`` (llguidance's
lexer limit) and an empty-language grammar end with a typed error instead of a fake
``"stop"``, a 3,000-rule chain is answered, all while a bystander stream runs to its end; the
server's log holds no traceback (its teardown checks that too) and it goes on serving."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import openai
import pytest

from pipeline.server.client import Client
from stages.errors import InvalidRequestError
from stages.params import SamplingParams
from stages.structured.params import StructuredOutputsParams
from tests.pipeline.server.http.conftest import API_KEY, MODEL
from tests.pipeline.server.serving import (
    ServeProcess,
    bearer,
    reflection_generate,
    rpc_error,
    trailer,
)
from tests.stages.structured.grammar_chains import chain_schema, lark_chain

pytestmark = pytest.mark.slow

#: seconds: the longest gap allowed between two bystander tokens (a loaded 2-core machine)
MAX_GAP_S = 60.0
BYSTANDER_TOKENS = 32


class Bystander:
    """A free HTTP stream in a thread; its worst gap between chunks and how it ended."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.worst = 0.0
        self.finish: str | None = None
        self.tokens = 0
        self.started = threading.Event()
        self._client = client
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.started.wait(120), "the bystander never streamed"

    def _run(self) -> None:
        last = time.monotonic()
        stream = self._client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=BYSTANDER_TOKENS, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            now = time.monotonic()
            self.worst, last = max(self.worst, now - last), now
            self.started.set()
            for choice in chunk.choices:
                self.tokens += 1 if choice.text else 0
                self.finish = choice.finish_reason or self.finish
        self.started.set()

    def finished(self) -> None:
        self._thread.join(300)
        assert not self._thread.is_alive(), "the bystander never finished"
        assert self.finish == "length", self.finish
        assert self.worst < MAX_GAP_S, self.worst


def http_constraint(client: openai.OpenAI, constraint: dict[str, Any], stream: bool) -> Any:
    """A completion under ``constraint`` (vLLM's ``structured_outputs`` extra); streamed
    chunks are read to the end."""
    answer = client.completions.create(
        model=MODEL, prompt="Go:", max_tokens=6, stream=stream,
        extra_body={"structured_outputs": constraint},
    )  # fmt: skip
    return list(answer) if stream else answer


@pytest.fixture
def client(openai_serve: ServeProcess) -> Any:
    with openai.OpenAI(base_url=openai_serve.http_url, api_key=API_KEY, max_retries=0) as made:
        yield made


def test_over_the_bounds_is_a_400_naming_the_param_and_a_bystander_runs_on(
    client: openai.OpenAI,
) -> None:
    for constraint, param, words in (
        ({"grammar": lark_chain(12000)}, "structured_outputs.grammar", "has 12000 rules"),
        ({"json": chain_schema(3000, "allOf")}, "structured_outputs.json", "has 6001 objects"),
    ):
        bystander = Bystander(client)
        began = time.monotonic()
        with pytest.raises(openai.BadRequestError) as caught:
            http_constraint(client, constraint, stream=False)
        took = time.monotonic() - began
        error = caught.value.body
        assert isinstance(error, dict), error
        assert error["param"] == param and words in error["message"], error
        assert "grammar_max_rules" in error["message"]
        assert took < 120, took
        bystander.finished()


def test_a_failed_matcher_is_an_error_not_a_stop_over_http(client: openai.OpenAI) -> None:
    for constraint, words in (
        ({"regex": "a{1000000}"}, "lexer error: too many expressions"),
        ({"grammar": 'start: "a" start'}, "Too many items"),
    ):
        bystander = Bystander(client)
        with pytest.raises(openai.BadRequestError) as caught:
            http_constraint(client, constraint, stream=False)
        error = caught.value.body
        assert isinstance(error, dict), error
        assert error["param"].startswith("structured_outputs."), error
        assert words in error["message"] and "<state>" not in error["message"], error
        bystander.finished()
    # streamed, the answer never ends with "stop": the stream carries an error instead
    with pytest.raises(openai.APIError) as streamed:
        chunks = http_constraint(client, {"regex": "a{1000000}"}, stream=True)
        assert all(c.choices[0].finish_reason != "stop" for c in chunks if c.choices)
    assert "lexer error" in str(streamed.value)
    # a 3,000-rule chain is answered, and the server goes on serving
    answer = http_constraint(client, {"grammar": lark_chain(3000)}, stream=False)
    text = answer.choices[0].text
    assert text and text == "a" * len(text)


def test_the_vectors_over_grpc(openai_serve: ServeProcess) -> None:
    assert openai_serve.address is not None
    with Client(openai_serve.address, api_key=API_KEY) as grpc_client:
        for params, field, words in (
            (
                StructuredOutputsParams(grammar=lark_chain(12000)),
                "structured_outputs.grammar",
                "has 12000 rules",
            ),
            (
                StructuredOutputsParams(regex="a{1000000}"),
                "structured_outputs.regex",
                "lexer error",
            ),
        ):
            with pytest.raises(InvalidRequestError) as caught:
                list(
                    grpc_client.generate(
                        "Go:", SamplingParams(max_tokens=6, structured_outputs=params)
                    )
                )
            assert caught.value.field == field and words in str(caught.value), caught.value
        outputs = list(
            grpc_client.generate(
                "Go:",
                SamplingParams(
                    max_tokens=6,
                    structured_outputs=StructuredOutputsParams(grammar=lark_chain(3000)),
                ),
            )
        )
        assert outputs[-1].finish_reason in ("length", "stop")
        assert "".join(o.delta for o in outputs) == "a" * sum(len(o.delta) for o in outputs)

    async def raw() -> grpc.aio.AioRpcError:
        """What any gRPC client sees (no actorline code): the status and the field trailer."""
        assert openai_serve.address is not None
        async with grpc.aio.insecure_channel(openai_serve.address) as channel:
            request = {
                "text": "Go:",
                "samplingParams": {
                    "maxTokens": 6,
                    "structuredOutputs": {"grammar": lark_chain(12000)},
                },
            }
            return await rpc_error(reflection_generate(channel, request, bearer(API_KEY)))

    error = asyncio.run(raw())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert trailer(error, "actorline-error-field") == "structured_outputs.grammar"
    assert "grammar_max_rules" in (error.details() or "")
