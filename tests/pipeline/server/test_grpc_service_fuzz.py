"""Property-based fuzz of the gRPC front end, in its own encoding: GenerateRequests with any
value each proto field can hold (int64 edges, NaN and infinities, control characters, huge
repeated fields, every input form), and request bytes a client can send that no well-behaved
one would (invalid UTF-8 in a string, flipped bytes). Against the null-model engine behind a
real server, with a bystander stream: each call streams or ends with INVALID_ARGUMENT, the
bystander finishes every request, the server and the engine live (docs/architecture.md,
"Failure: one request or the pipeline")."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.server import generation_pb2 as pb
from pipeline.server.serve import SERVICE_NAME
from tests.pipeline.server.serving import ServedEngine

#: responses read from a call that streams before it is cancelled
RESPONSES_READ = 3
#: what a hostile call may end with: it ran (and was cancelled), or it was refused by field
ACCEPTED = {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT}

INT64 = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([2**31, 2**32, 2**63 - 1, -(2**63), -1]),
    st.integers(-(2**63), 2**63 - 1),
)
DOUBLES = st.one_of(
    st.floats(-3.0, 3.0), st.sampled_from([math.nan, math.inf, -math.inf, 5e-324]), st.floats()
)
#: text a proto string can hold: any character but a lone surrogate (see the byte cases)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
UINT32 = st.one_of(st.integers(0, 49_151), st.integers(0, 2**32 - 1))

SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.one_of(st.integers(1, 6), INT64),
        "temperature": DOUBLES,
        "top_p": DOUBLES,
        "top_k": INT64,
        "min_p": DOUBLES,
        "repetition_penalty": DOUBLES,
        "presence_penalty": DOUBLES,
        "frequency_penalty": DOUBLES,
        "seed": INT64,
        "stop": st.lists(TEXT, max_size=3),
        "stop_token_ids": st.one_of(st.lists(INT64, max_size=4), st.just([1] * 5000)),
        "ignore_eos": st.booleans(),
        "min_tokens": st.one_of(st.integers(0, 4), INT64),
        "logprobs": st.one_of(st.integers(0, 20), INT64),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "priority": INT64,
        "until_model_len": st.booleans(),
    },
)
INPUT = st.one_of(
    st.fixed_dictionaries({"text": TEXT}),
    st.fixed_dictionaries({"token_ids": st.lists(UINT32, max_size=6).map(lambda i: {"ids": i})}),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries({}, optional={"role": TEXT, "content": TEXT}), max_size=3
            ).map(lambda messages: {"messages": messages})
        }
    ),
    st.just({}),
)


def build(input_fields: dict[str, Any], sampling: dict[str, Any], extra: dict[str, Any]) -> bytes:
    request = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling), **extra)
    for name, value in input_fields.items():
        if name == "text":
            request.text = value
        elif name == "token_ids":
            request.token_ids.ids.extend(value["ids"])
        else:
            request.messages.SetInParent()
            for message in value["messages"]:
                request.messages.messages.add(**message)
    return request.SerializeToString()


def _with_bad_utf8(prefix: bytes, suffix: bytes) -> bytes:
    """A GenerateRequest whose text holds a UTF-16 surrogate as its CESU-8 bytes, which are
    not UTF-8 (what a client in another language can send)."""
    text = prefix + "\ud800".encode("utf-8", "surrogatepass") + suffix
    return b"\x0a" + bytes([len(text)]) + text


def _flipped(data: bytes, index: int, byte: int) -> bytes:
    index %= len(data)
    return data[:index] + bytes([byte]) + data[index + 1 :]


_VALID = pb.GenerateRequest(
    text="hello", sampling_params=pb.SamplingParams(max_tokens=3, stop=["x"]), request_id="r"
).SerializeToString()
BYTES = st.one_of(
    st.binary(max_size=40),
    st.builds(_with_bad_utf8, st.binary(max_size=8), st.binary(max_size=8)),
    st.builds(_flipped, st.just(_VALID), st.integers(0, 1000), st.integers(0, 255)),
)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServedEngine, dict[str, Any]]]:
    engine = ServedEngine("smollm2-135m", null_model=True)  # type: ignore[arg-type]
    state: dict[str, Any] = {"finished": 0, "problems": [], "stopping": False}

    async def bystander() -> None:
        async with grpc.aio.insecure_channel(engine.address) as channel:
            generate = channel.unary_stream(
                f"/{SERVICE_NAME}/Generate",
                request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=pb.GenerateResponse.FromString,
            )
            request = pb.GenerateRequest(
                text="the bystander",
                sampling_params=pb.SamplingParams(max_tokens=24, ignore_eos=True),
            )
            while not state["stopping"]:
                tokens = 0
                finish = None
                try:
                    async for response in generate(request):
                        tokens += len(response.token_ids)
                        finish = response.finish_reason
                except grpc.aio.AioRpcError as error:
                    state["problems"].append(f"{error.code()}: {error.details()}")
                    return
                if (tokens, finish) != (24, pb.FINISH_REASON_LENGTH):
                    state["problems"].append(f"a bystander request ended with {tokens}, {finish}")
                    return
                state["finished"] += 1

    async def begin() -> None:
        state["task"] = asyncio.get_running_loop().create_task(bystander())

    engine.run(begin())
    yield engine, state
    engine.close()


async def call(address: str, data: bytes) -> grpc.StatusCode:
    """Send request bytes; the status the call ended with (CANCELLED: it streamed and was
    cancelled after a few responses)."""
    async with grpc.aio.insecure_channel(address) as channel:
        generate = channel.unary_stream(
            f"/{SERVICE_NAME}/Generate",
            request_serializer=lambda request: request,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        stream = generate(data)
        read = 0
        try:
            async for _ in stream:
                read += 1
                if read == RESPONSES_READ:
                    stream.cancel()
                    return grpc.StatusCode.CANCELLED
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK


def check(served: tuple[ServedEngine, dict[str, Any]], data: bytes) -> None:
    engine, state = served
    status = engine.run(call(engine.address, data))
    assert status in ACCEPTED, status
    assert engine.engine.failure is None
    assert not state["problems"], state["problems"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    input_fields=INPUT,
    sampling=SAMPLING,
    extra=st.fixed_dictionaries({}, optional={"request_id": TEXT, "chat_template": st.booleans()}),
)
def test_any_request_the_proto_can_carry_runs_or_is_invalid_argument(
    served: tuple[ServedEngine, dict[str, Any]],
    input_fields: dict[str, Any],
    sampling: dict[str, Any],
    extra: dict[str, Any],
) -> None:
    check(served, build(input_fields, sampling, extra))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=BYTES)
def test_any_bytes_are_invalid_argument_or_a_request(
    served: tuple[ServedEngine, dict[str, Any]], data: bytes
) -> None:
    check(served, data)


def test_after_the_fuzz_the_bystander_finished(
    served: tuple[ServedEngine, dict[str, Any]],
) -> None:
    engine, state = served

    async def stop() -> None:
        state["stopping"] = True
        await state["task"]

    engine.run(stop())
    assert not state["problems"] and state["finished"] >= 1
    assert engine.engine.failure is None
