"""Each request is checked once, at the façade (docs/architecture.md §7.1): over the Python
API, the HTTP server and the gRPC server of one engine, a hostile value is refused with the
same typed error naming the same field, and every request (good or bad, each choice of an
HTTP request) goes through the validation core exactly once. The engine is the null model on
the memory transport, so every stage runs in this process and would show a second check."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio
import httpx2 as httpx
import pytest

import pipeline.engine.prompts as prompts
from pipeline import AsyncEngine
from pipeline.engine.loop_thread import LoopThread
from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc as pb_grpc
from pipeline.server.http.server import HttpServer
from pipeline.server.serve import GenerationServer
from pipeline.server.status import ERROR_FIELD_KEY
from stages.errors import InvalidRequestError
from stages.messages import GenerateRequest
from stages.params import SamplingParams
from tests.pipeline.server.serving import rpc_error, trailer

MODEL = "m"
#: seconds any one call may take (generous: a shared machine)
PATIENCE = 60.0

#: hostile sampling values each front end can carry in its own encoding, and the field named
HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    "temperature": ({"temperature": -0.5}, "temperature"),
    "top_p": ({"top_p": 1.5}, "top_p"),
    "presence_penalty": ({"presence_penalty": 3.0}, "presence_penalty"),
    "top_k": ({"top_k": -2}, "top_k"),
    "seed": ({"seed": -1}, "seed"),
    "min_tokens over max_tokens": ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    "stop token id": ({"stop_token_ids": [-1]}, "stop_token_ids"),
}


class Served:
    """One null-model engine behind an HTTP and a gRPC server, in a loop thread; ``checks``
    counts the validation core's calls."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.engine = AsyncEngine(null_model=True, transport="memory", max_model_len=256)
        self.http = HttpServer(self.engine, model_name=MODEL)
        self.grpc = GenerationServer(self.engine)
        self.checks = 0

        async def start() -> tuple[str, str]:
            await self.engine.start()
            return await self.http.start("127.0.0.1", 0), await self.grpc.start("127.0.0.1", 0)

        self.url, self.address = self.loop.run(start())

    def run(self, coroutine: Any) -> Any:
        return self.loop.run(asyncio.wait_for(coroutine, PATIENCE))

    def close(self) -> None:
        async def stop() -> None:
            await self.grpc.stop(grace=1.0)
            await self.http.stop()
            await self.engine.close()

        try:
            self.loop.run(stop())
        finally:
            self.loop.stop()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    served = Served()
    try:
        yield served
    finally:
        served.close()


@pytest.fixture
def counted(served: Served, monkeypatch: pytest.MonkeyPatch) -> Served:
    """``served`` with the validation core's calls counted (the real core runs)."""
    real = prompts.validate_generate_request

    def counting(request: GenerateRequest, *, vocab_size: int | None = None) -> None:
        served.checks += 1
        real(request, vocab_size=vocab_size)

    monkeypatch.setattr(prompts, "validate_generate_request", counting)
    served.checks = 0
    return served


async def python_api(served: Served, values: dict[str, Any]) -> InvalidRequestError:
    params = SamplingParams(**values)
    with pytest.raises(InvalidRequestError) as caught:
        async for _ in served.engine.generate("hi", params):
            pass
    return caught.value


async def http_post(served: Served, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=served.url, timeout=PATIENCE) as client:
        return await client.post("/completions", json={"model": MODEL, **body})


async def grpc_generate(served: Served, values: dict[str, Any]) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(**values))
        return await rpc_error(stub.Generate(request))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_value_is_refused_alike_by_every_front_end_after_one_check(
    counted: Served, case: str
) -> None:
    values, field = HOSTILE[case]
    error = counted.run(python_api(counted, values))
    assert type(error) is InvalidRequestError and error.field == field
    assert counted.checks == 1

    response = counted.run(http_post(counted, {"prompt": "hi", **values}))
    assert response.status_code == 400
    answer = response.json()["error"]
    assert (answer["param"], answer["code"], answer["message"]) == (
        field,
        "invalid_value",
        str(error),
    )
    assert counted.checks == 2

    failed = counted.run(grpc_generate(counted, values))
    assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailer(failed, ERROR_FIELD_KEY) == field and str(error) in (failed.details() or "")
    assert counted.checks == 3


def test_a_good_request_is_checked_once_per_engine_request(counted: Served) -> None:
    async def python() -> list[int]:
        outputs = [o async for o in counted.engine.generate("hi", SamplingParams(max_tokens=3))]
        return list(outputs[-1].token_ids)

    assert len(counted.run(python())) == 3
    assert counted.checks == 1

    # two choices: two engine requests, each checked once (before either starts)
    response = counted.run(http_post(counted, {"prompt": "hi", "max_tokens": 3, "n": 2}))
    assert response.status_code == 200 and len(response.json()["choices"]) == 2
    assert counted.checks == 3

    async def over_grpc() -> int:
        async with grpc.aio.insecure_channel(counted.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_tokens=3))
            return sum([len(r.token_ids) async for r in stub.Generate(request)])

    assert counted.run(over_grpc()) == 3
    assert counted.checks == 4


def test_a_checked_prompt_carries_its_parameters(served: Served) -> None:
    """A front end that checked a prompt (:meth:`AsyncEngine.check`) passes it to generate
    as it is; giving parameters again is refused rather than silently ignored."""
    checked = served.engine.check("hi", SamplingParams(max_tokens=2), tenant="t")

    async def run(**options: Any) -> list[int]:
        outputs = [o async for o in served.engine.generate(checked, **options)]
        return list(outputs[-1].token_ids)

    assert len(served.run(run())) == 2
    assert len(served.run(run(tenant="t"))) == 2
    for options in ({"sampling_params": SamplingParams()}, {"tenant": "u"}):
        with pytest.raises(InvalidRequestError) as caught:
            served.run(run(**options))
        assert caught.value.field == "sampling_params"
