"""End-to-end tests of the Generation service over real gRPC channels, called through the
generated stubs as any language's client would: streaming, abort, model info, health,
reflection, API keys, rate limits, invalid parameters, concurrency, cancellation, TLS and
shutdown. The engine runs the tiny model in its own process."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from transformers import AutoTokenizer

from pipeline.engine.prompts import Prompt
from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc as pb_grpc
from pipeline.server.convert import finish_reason_name, sampling_to_proto
from pipeline.server.serve import SERVICE_NAME, GenerationServer, ServerTLS
from pipeline.server.status import ERROR_FIELD_KEY, ERROR_KIND_KEY
from stages.messages import RequestOutput
from stages.params import SamplingParams
from stages.structured.params import StructuredOutputsParams
from tests.pipeline.server.serving import (
    GOOD_KEY,
    OTHER_KEY,
    REQUEST_LIMITED_KEY,
    TOKEN_LIMITED_KEY,
    Certificate,
    ServedEngine,
    bearer,
    read_until_end,
    reflection_generate,
    rpc_error,
    trailer,
)

pytestmark = pytest.mark.slow

GREEDY = pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
#: a request that runs until it is stopped
LONG = pb.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
TEXT = "The quick brown fox"


def plain_channel(served: ServedEngine) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(served.address)


async def last_engine_output(
    served: ServedEngine, prompt: Prompt, params: SamplingParams, **options: Any
) -> RequestOutput:
    last = None
    async for output in served.engine.generate(prompt, params, **options):
        last = output
    assert last is not None and last.finished
    return last


async def generate(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, key: str | None = GOOD_KEY
) -> list[pb.GenerateResponse]:
    metadata = bearer(key) if key else ()
    return [response async for response in stub.Generate(request, metadata=metadata)]


def check_stream(responses: Sequence[pb.GenerateResponse], reference: RequestOutput) -> None:
    """The responses stream exactly the engine's output, with the finish on the last one."""
    assert "".join(r.delta for r in responses) == reference.text
    assert tuple(t for r in responses for t in r.token_ids) == reference.token_ids
    assert len({r.request_id for r in responses}) == 1
    *running, last = responses
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in running)
    assert not any(r.HasField("usage") for r in running)
    assert finish_reason_name(last.finish_reason) == reference.finish_reason
    assert last.usage.prompt_tokens == reference.num_prompt_tokens
    assert last.usage.completion_tokens == len(reference.token_ids)
    assert last.usage.cached_tokens <= last.usage.prompt_tokens


# -- streaming ------------------------------------------------------------------------------

INPUTS: dict[str, tuple[pb.GenerateRequest, Prompt, bool]] = {
    "text": (pb.GenerateRequest(text=TEXT), TEXT, False),
    "text+chat template": (pb.GenerateRequest(text=TEXT, chat_template=True), TEXT, True),
    "messages": (
        pb.GenerateRequest(
            messages=pb.ChatMessages(
                messages=[
                    pb.ChatMessage(role="system", content="Be brief."),
                    pb.ChatMessage(role="user", content="Name a colour."),
                ]
            )
        ),
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        False,
    ),
    "token ids": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[504, 2365, 6354, 13, 9])),
        [504, 2365, 6354, 13, 9],
        False,
    ),
}


@pytest.mark.parametrize("kind", list(INPUTS))
def test_generate_streams_what_the_engine_generates(served: ServedEngine, kind: str) -> None:
    request, prompt, chat_template = INPUTS[kind]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def body() -> None:
        reference = await last_engine_output(served, prompt, params, chat_template=chat_template)
        call_request = pb.GenerateRequest()
        call_request.CopyFrom(request)
        call_request.sampling_params.CopyFrom(GREEDY)
        call_request.request_id = f"stream-{kind}"
        async with plain_channel(served) as channel:
            responses = await generate(pb_grpc.GenerationStub(channel), call_request)
        check_stream(responses, reference)
        assert responses[0].request_id == f"stream-{kind}"
        assert len(responses) > 1  # streamed, not one final message

    served.run(body())


SAMPLING_CASES: dict[str, SamplingParams] = {
    "seeded sampling": SamplingParams(
        max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True
    ),
    "penalties": SamplingParams(
        max_tokens=10,
        temperature=0.0,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        min_p=0.01,
        ignore_eos=True,
    ),
    "stop token": SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(40405,)),
    "stop string": SamplingParams(max_tokens=12, temperature=0.0, stop=(" Tucker",)),
    "min tokens": SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0),
    "structured outputs": SamplingParams(
        max_tokens=12,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(regex="[a-z]{3}-[0-9]{2}"),
    ),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_parameters_reach_the_engine(served: ServedEngine, case: str) -> None:
    """Every sampling parameter sent over gRPC acts exactly as the same SamplingParams given
    to the engine directly (including stop reasons)."""
    params = SAMPLING_CASES[case]

    async def body() -> None:
        reference = await last_engine_output(served, "Hello there", params)
        request = pb.GenerateRequest(text="Hello there", sampling_params=sampling_to_proto(params))
        async with plain_channel(served) as channel:
            responses = await generate(pb_grpc.GenerationStub(channel), request)
        check_stream(responses, reference)
        last = responses[-1]
        stop = last.WhichOneof("stop_reason")
        assert (getattr(last, stop) if stop else None) == reference.stop_reason

    served.run(body())


def test_the_stop_tokens_text_is_not_streamed(served: ServedEngine, tiny_model_dir: Path) -> None:
    """A request the engine stops with a stop token id streams the text before that token
    only (as vLLM); the token itself is among the token ids and names the stop reason."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SAMPLING_CASES["stop token"]
    (stop_token,) = params.stop_token_ids
    assert tokenizer.decode([stop_token])  # the token has text to leave out

    async def body() -> None:
        request = pb.GenerateRequest(text="Hello there", sampling_params=sampling_to_proto(params))
        async with plain_channel(served) as channel:
            responses = await generate(pb_grpc.GenerationStub(channel), request)
        token_ids = [token for response in responses for token in response.token_ids]
        last = responses[-1]
        assert last.finish_reason == pb.FINISH_REASON_STOP and last.stop_token_id == stop_token
        assert token_ids[-1] == stop_token and stop_token not in token_ids[:-1]
        assert "".join(r.delta for r in responses) == tokenizer.decode(token_ids[:-1])

    served.run(body())


def test_unset_parameters_take_the_vllm_defaults(served: ServedEngine) -> None:
    request = pb.GenerateRequest(
        text=TEXT, sampling_params=pb.SamplingParams(temperature=0.0, ignore_eos=True)
    )

    async def body() -> None:
        async with plain_channel(served) as channel:
            responses = await generate(pb_grpc.GenerationStub(channel), request)
        assert responses[-1].usage.completion_tokens == SamplingParams().max_tokens
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH

    served.run(body())


def test_logprobs_come_with_each_new_token(served: ServedEngine) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    request = pb.GenerateRequest(text=TEXT, sampling_params=sampling_to_proto(params))

    async def body() -> None:
        reference = await last_engine_output(served, TEXT, params)
        async with plain_channel(served) as channel:
            responses = await generate(pb_grpc.GenerationStub(channel), request)
        entries = [entry for r in responses for entry in r.logprobs]
        for response in responses:
            assert [e.token_id for e in response.logprobs] == list(response.token_ids)
        assert reference.logprobs is not None and len(entries) == len(reference.logprobs)
        for entry, expected in zip(entries, reference.logprobs):
            assert entry.token_id == expected.token_id and entry.rank == expected.rank
            assert entry.logprob == pytest.approx(expected.logprob, abs=1e-5)
            assert list(entry.top_token_ids) == list(expected.top_token_ids)
            assert len(entry.top_logprobs) == 2

    served.run(body())


def test_prompt_logprobs_come_once_with_the_first_token(served: ServedEngine) -> None:
    """vLLM's prompt_logprobs over gRPC: the prompt's ids and the score of each token after
    the first, once, equal to the engine's own (the Python API's)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    request = pb.GenerateRequest(text=TEXT, sampling_params=sampling_to_proto(params))
    assert request.sampling_params.prompt_logprobs == 1

    async def body() -> None:
        reference = await last_engine_output(served, TEXT, params)
        async with plain_channel(served) as channel:
            responses = await generate(pb_grpc.GenerationStub(channel), request)
        with_prompt = [r for r in responses if r.prompt_token_ids]
        assert len(with_prompt) == 1 and with_prompt[0].token_ids  # with the first token
        (first,) = with_prompt
        assert tuple(first.prompt_token_ids) == reference.prompt_token_ids
        assert reference.prompt_logprobs is not None
        expected = [entry for entry in reference.prompt_logprobs if entry is not None]
        assert len(first.prompt_logprobs) == len(expected) == len(first.prompt_token_ids) - 1
        for entry, wanted in zip(first.prompt_logprobs, expected):
            assert (entry.token_id, entry.rank) == (wanted.token_id, wanted.rank)
            assert entry.logprob == pytest.approx(wanted.logprob, abs=1e-5)
            assert list(entry.top_token_ids) == list(wanted.top_token_ids)
        assert not any(r.prompt_logprobs for r in responses if r is not first)

    served.run(body())


def test_fifty_concurrent_streams_get_their_own_outputs(served: ServedEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [f"Story {i}:" + " once" * (i % 9) for i in range(50)]

    async def body() -> None:
        references = await asyncio.gather(*(last_engine_output(served, p, params) for p in prompts))
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            streams = await asyncio.gather(
                *(
                    generate(
                        stub,
                        pb.GenerateRequest(text=p, sampling_params=GREEDY, request_id=f"c{i}"),
                    )
                    for i, p in enumerate(prompts)
                )
            )
        assert len({ref.text for ref in references}) > 1  # the prompts lead to different texts
        for i, (responses, reference) in enumerate(zip(streams, references)):
            check_stream(responses, reference)
            assert responses[0].request_id == f"c{i}"
        await served.wait_kv_free()

    served.run(body())


# -- abort and cancellation -----------------------------------------------------------------


def test_abort_ends_the_stream_of_the_callers_request(served: ServedEngine) -> None:
    async def body() -> None:
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(text=TEXT, sampling_params=LONG, request_id="abort-me")
            call = stub.Generate(request, metadata=bearer(GOOD_KEY))
            first = await call.read()
            assert first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
            # another key cannot see, let alone abort, this request
            abort = pb.AbortRequest(request_id="abort-me")
            assert not (await stub.Abort(abort, metadata=bearer(OTHER_KEY))).aborted
            assert (await stub.Abort(abort, metadata=bearer(GOOD_KEY))).aborted
            rest = await read_until_end(call)
            assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
            assert rest[-1].usage.completion_tokens < LONG.max_tokens
            assert await call.code() == grpc.StatusCode.OK
            assert not (await stub.Abort(abort, metadata=bearer(GOOD_KEY))).aborted
        await served.wait_kv_free()

    served.run(body())


def test_cancelled_call_aborts_the_request_and_frees_its_kv(served: ServedEngine) -> None:
    async def body() -> None:
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(
                pb.GenerateRequest(text=TEXT, sampling_params=LONG), metadata=bearer(GOOD_KEY)
            )
            for _ in range(3):
                await call.read()
            stats = served.engine.stats
            assert stats is not None and stats.kv_blocks_free < stats.kv_blocks_total
            assert served.server.service.num_running == 1
            call.cancel()
            await served.wait_kv_free()
            assert served.server.service.num_running == 0

    served.run(body())


def test_request_ids_are_unique_per_key(served: ServedEngine) -> None:
    async def body() -> None:
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(text=TEXT, sampling_params=LONG, request_id="same")
            first = stub.Generate(request, metadata=bearer(GOOD_KEY))
            await first.read()
            error = await rpc_error(stub.Generate(request, metadata=bearer(GOOD_KEY)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert trailer(error, ERROR_FIELD_KEY) == "request_id"
            other = stub.Generate(request, metadata=bearer(OTHER_KEY))  # its own namespace
            assert (await other.read()).request_id == "same"
            first.cancel()
            other.cancel()
        await served.wait_kv_free()

    served.run(body())


# -- model info, health, reflection ---------------------------------------------------------


def test_model_info_describes_the_engine(served: ServedEngine) -> None:
    async def body() -> pb.ModelInfo:
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            return await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(GOOD_KEY))

    info = served.run(body())
    engine = served.engine.info
    assert engine is not None
    assert info.model == engine.model
    assert info.max_model_len == engine.max_model_len == 1024
    assert info.vocab_size == engine.vocab_size == 49152
    assert info.kv_cache_blocks == engine.num_blocks
    assert info.block_size == engine.block_size
    assert info.kv_cache_tokens == engine.num_blocks * engine.block_size
    assert info.kv_cache_bytes == engine.kv_cache_bytes > 0
    assert (info.dtype, info.device, info.scheduler) == ("float32", "cpu", "fcfs")
    assert info.kv_cache_dtype == engine.kv_cache_dtype == "float32"
    assert info.prefix_caching and tuple(info.eos_token_ids) == engine.eos_token_ids


def test_health_reports_serving_without_a_key(served: ServedEngine) -> None:
    async def body() -> None:
        async with plain_channel(served) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                assert response.status == health_pb2.HealthCheckResponse.SERVING
            error = await rpc_error(stub.Check(health_pb2.HealthCheckRequest(service="nope")))
            assert error.code() == grpc.StatusCode.NOT_FOUND

    served.run(body())


def test_reflection_lists_and_describes_the_service(served: ServedEngine) -> None:
    async def body() -> list[reflection_pb2.ServerReflectionResponse]:
        async with plain_channel(served) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            requests = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
            ]
            return [response async for response in stub.ServerReflectionInfo(iter(requests))]

    listing, described = served.run(body())
    names = {service.name for service in listing.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(data)
        for data in described.file_descriptor_response.file_descriptor_proto
    ]
    services = {
        f"{file.package}.{service.name}": [method.name for method in service.method]
        for file in files
        for service in file.service
    }
    assert services[SERVICE_NAME] == ["Generate", "Abort", "GetModelInfo", "Embed"]


def test_a_client_built_from_reflection_alone_streams_a_generation(served: ServedEngine) -> None:
    """What grpcurl or a dynamic client in any language does: fetch the service's schema by
    reflection, build the messages from it (no actorline code, no generated stubs), send a
    request written as JSON and read the stream as JSON."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def body() -> tuple[list[dict[str, Any]], RequestOutput]:
        reference = await last_engine_output(served, TEXT, params)
        async with plain_channel(served) as channel:
            responses = await reflection_generate(
                channel,
                {
                    "text": TEXT,
                    "samplingParams": {"maxTokens": 8, "temperature": 0, "ignoreEos": True},
                },
                bearer(GOOD_KEY),
            )
        return responses, reference

    responses, reference = served.run(body())
    assert "".join(r.get("delta", "") for r in responses) == reference.text
    assert [int(t) for r in responses for t in r.get("tokenIds", [])] == list(reference.token_ids)
    assert responses[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert responses[-1]["usage"]["completionTokens"] == 8


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [(), bearer("wrong-key"), (("authorization", f"Basic {GOOD_KEY}"),), bearer("")],
    ids=["no key", "wrong key", "not bearer", "empty key"],
)
def test_calls_without_a_valid_key_are_unauthenticated(
    served: ServedEngine, metadata: tuple[tuple[str, str], ...]
) -> None:
    async def body() -> None:
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            calls = [
                stub.Generate(pb.GenerateRequest(text=TEXT), metadata=metadata),
                stub.Abort(pb.AbortRequest(request_id="x"), metadata=metadata),
                stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata),
            ]
            for call in calls:
                error = await rpc_error(call)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                assert GOOD_KEY not in (error.details() or "")
                assert "wrong-key" not in (error.details() or "")

    served.run(body())


def test_two_authorization_values_are_unauthenticated(served: ServedEngine) -> None:
    """Which of two keys counts would be a guess (a proxy may have checked the other)."""

    async def body() -> None:
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for metadata in (
                (*bearer(GOOD_KEY), *bearer(OTHER_KEY)),
                (*bearer("wrong-key"), *bearer(GOOD_KEY)),
            ):
                call = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
                error = await rpc_error(call)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "send exactly one" in (error.details() or "")

    served.run(body())


@pytest.mark.parametrize(
    "data",
    [b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xc3\x28"],
    ids=["garbage", "truncated", "invalid utf-8"],
)
def test_request_bytes_that_do_not_parse_are_invalid_argument(
    served: ServedEngine, data: bytes
) -> None:
    """Not gRPC's UNKNOWN with Python's exception text: INVALID_ARGUMENT naming the message
    type, and UNAUTHENTICATED first for a caller without a key."""

    async def body() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError, bool]:
        async with plain_channel(served) as channel:
            raw = channel.unary_stream(
                f"/{SERVICE_NAME}/Generate",
                request_serializer=lambda request: request,
                response_deserializer=pb.GenerateResponse.FromString,
            )
            keyed = await rpc_error(raw(data, metadata=bearer(GOOD_KEY)))
            anonymous = await rpc_error(raw(data))
            request = pb.GenerateRequest(text=TEXT, sampling_params=GREEDY)
            served_still = bool(await generate(pb_grpc.GenerationStub(channel), request))
            return keyed, anonymous, served_still

    keyed, anonymous, served_still = served.run(body())
    assert keyed.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid actorline.v1.GenerateRequest" in (keyed.details() or "")
    assert trailer(keyed, ERROR_FIELD_KEY) == "request"
    assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED
    assert served_still


def test_keys_over_their_limits_are_resource_exhausted(served: ServedEngine) -> None:
    async def body() -> None:
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            # 64 tokens/s, a burst of 64 (keys have no longer burst). Without max_tokens a
            # request gets and pays for the whole burst, so of two sent at once one passes and
            # the other is refused unless a whole second passes between their arrivals.
            whole = pb.GenerateRequest(
                text=TEXT, sampling_params=pb.SamplingParams(until_model_len=True)
            )
            calls = [stub.Generate(whole, metadata=bearer(TOKEN_LIMITED_KEY)) for _ in range(2)]
            outcomes = await asyncio.gather(
                *(read_until_end(call) for call in calls), return_exceptions=True
            )
            (error,) = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert trailer(error, ERROR_KIND_KEY) == "rate_limited"
            assert "tokens per second" in (error.details() or "")
            # one that could never fit the burst is a bad request, not a retryable limit
            big = pb.GenerateRequest(text=TEXT, sampling_params=pb.SamplingParams(max_tokens=100))
            error = await rpc_error(stub.Generate(big, metadata=bearer(TOKEN_LIMITED_KEY)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_tokens" in (error.details() or "")
            # the same request under an unlimited key passes
            request = pb.GenerateRequest(text=TEXT, sampling_params=GREEDY)
            assert await generate(stub, request, REQUEST_LIMITED_KEY)  # its one request
            error = await rpc_error(stub.Generate(request, metadata=bearer(REQUEST_LIMITED_KEY)))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "requests per second" in (error.details() or "")
            assert await generate(stub, request, GOOD_KEY)

    served.run(body())


def test_errors_carry_grpcs_richer_error_model(served: ServedEngine) -> None:
    """What a plain gRPC client in any language reads with its status helpers (here Python's
    grpcio-status, on a synchronous channel): the google.rpc.Status in
    grpc-status-details-bin, with ErrorInfo, BadRequest naming the field, and RetryInfo
    saying how long a rate-limited caller should wait."""
    bad = _request(top_p=0.0)
    limited = pb.GenerateRequest(text=TEXT, sampling_params=GREEDY)
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as invalid:
            list(stub.Generate(bad, metadata=bearer(GOOD_KEY)))
        # a key with one request per 1,000 s: of two calls, at least the second is refused
        calls = [stub.Generate(limited, metadata=bearer(REQUEST_LIMITED_KEY)) for _ in range(2)]
        refusals = []
        for call in calls:
            try:
                list(call)
            except grpc.RpcError as error:
                refusals.append(error)
    status = rpc_status.from_call(invalid.value)
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    details = {detail.TypeName(): detail for detail in status.details}
    info, violations = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    assert details["google.rpc.ErrorInfo"].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "INVALID",
        "actorline",
        {"field": "top_p"},
    )
    assert details["google.rpc.BadRequest"].Unpack(violations)
    [violation] = violations.field_violations
    assert violation.field == "top_p" and "top_p" in violation.description
    assert "google.rpc.RetryInfo" not in details

    assert refusals, "the request-limited key let both calls through"
    status = rpc_status.from_call(refusals[-1])
    assert status is not None and status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    details = {detail.TypeName(): detail for detail in status.details}
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert details["google.rpc.ErrorInfo"].Unpack(info) and info.reason == "RATE_LIMITED"
    assert details["google.rpc.RetryInfo"].Unpack(retry)
    assert 0 < retry.retry_delay.ToNanoseconds() / 1e9 <= 1000  # the bucket's own estimate


def _request(**sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=TEXT, sampling_params=pb.SamplingParams(**sampling))


INVALID: dict[str, tuple[pb.GenerateRequest, str, str]] = {
    "max_tokens": (_request(max_tokens=0), "max_tokens", "invalid"),
    "temperature": (_request(temperature=-1.0), "temperature", "invalid"),
    "top_p": (_request(top_p=0.0), "top_p", "invalid"),
    "top_k": (_request(top_k=-2), "top_k", "invalid"),
    "min_p": (_request(min_p=1.5), "min_p", "invalid"),
    "repetition_penalty": (_request(repetition_penalty=0.0), "repetition_penalty", "invalid"),
    "presence_penalty": (_request(presence_penalty=3.0), "presence_penalty", "invalid"),
    "frequency_penalty": (_request(frequency_penalty=-3.0), "frequency_penalty", "invalid"),
    "seed": (_request(seed=-1), "seed", "invalid"),
    "stop": (_request(stop=[""]), "stop", "invalid"),
    "stop_token_ids": (_request(stop_token_ids=[10**6]), "stop_token_ids", "invalid"),
    "min_tokens": (_request(min_tokens=20, max_tokens=10), "min_tokens", "invalid"),
    "logprobs": (_request(logprobs=21), "logprobs", "invalid"),
    "prompt_logprobs": (_request(prompt_logprobs=-2), "prompt_logprobs", "invalid"),
    "token id": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])),
        "prompt_token_ids",
        "invalid",
    ),
    "too long": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 1024)),
        "prompt",
        "prompt_too_long",
    ),
    "empty text": (pb.GenerateRequest(text=""), "prompt", "invalid"),
    "no input": (pb.GenerateRequest(), "input", "invalid"),
    "empty messages": (pb.GenerateRequest(messages=pb.ChatMessages()), "messages", "invalid"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids", "invalid"),
    "empty request id": (pb.GenerateRequest(text=TEXT, request_id=""), "request_id", "invalid"),
    "long request id": (
        pb.GenerateRequest(text=TEXT, request_id="x" * 300),
        "request_id",
        "invalid",
    ),
    "no constraint": (
        pb.GenerateRequest(
            text=TEXT, sampling_params=pb.SamplingParams(structured_outputs=pb.StructuredOutputs())
        ),
        "structured_outputs",
        "invalid",
    ),
    "unsupported schema keyword": (
        pb.GenerateRequest(
            text=TEXT,
            sampling_params=pb.SamplingParams(
                structured_outputs=pb.StructuredOutputs(
                    json='{"type": "array", "uniqueItems": true}'
                )
            ),
        ),
        "structured_outputs.json",
        "invalid",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_parameters_name_the_field(served: ServedEngine, case: str) -> None:
    request, field, kind = INVALID[case]

    async def body() -> grpc.aio.AioRpcError:
        async with plain_channel(served) as channel:
            stub = pb_grpc.GenerationStub(channel)
            return await rpc_error(stub.Generate(request, metadata=bearer(GOOD_KEY)))

    error = served.run(body())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (error.details() or "")
    assert trailer(error, ERROR_FIELD_KEY) == field
    assert trailer(error, ERROR_KIND_KEY) == kind


# -- TLS and shutdown -----------------------------------------------------------------------


def test_tls_and_mutual_tls(
    served: ServedEngine, server_certificate: Certificate, client_certificate: Certificate
) -> None:
    tls = ServerTLS(server_certificate.certificate, server_certificate.key)
    mutual = ServerTLS(
        server_certificate.certificate, server_certificate.key, client_certificate.certificate
    )
    trusted = grpc.ssl_channel_credentials(root_certificates=server_certificate.certificate)
    with_client_cert = grpc.ssl_channel_credentials(
        root_certificates=server_certificate.certificate,
        private_key=client_certificate.key,
        certificate_chain=client_certificate.certificate,
    )
    untrusted = grpc.ssl_channel_credentials(root_certificates=client_certificate.certificate)
    request = pb.GenerateRequest(text=TEXT, sampling_params=GREEDY)

    async def works(address: str, credentials: grpc.ChannelCredentials) -> None:
        async with grpc.aio.secure_channel(address, credentials) as channel:
            responses = await generate(pb_grpc.GenerationStub(channel), request)
            assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING

    async def refused(address: str, credentials: grpc.ChannelCredentials | None) -> None:
        channel = (
            grpc.aio.secure_channel(address, credentials)
            if credentials is not None
            else grpc.aio.insecure_channel(address)
        )
        async with channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(GOOD_KEY))
            error = await rpc_error(call)
            assert error.code() == grpc.StatusCode.UNAVAILABLE

    async def body() -> None:
        server = await served.start_server(tls)
        try:
            assert server.address is not None
            await works(server.address, trusted)
            await refused(server.address, None)  # plaintext to a TLS port
            await refused(server.address, untrusted)  # the server's certificate is not trusted
        finally:
            await server.stop()
        server = await served.start_server(mutual)
        try:
            assert server.address is not None
            await works(server.address, with_client_cert)
            await refused(server.address, trusted)  # no client certificate
        finally:
            await server.stop()

    served.run(body())


def test_stopping_a_server_ends_its_calls_with_unavailable(served: ServedEngine) -> None:
    async def body() -> None:
        server = await served.start_server()
        assert server.address is not None
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(
                pb.GenerateRequest(text=TEXT, sampling_params=LONG), metadata=bearer(GOOD_KEY)
            )
            await call.read()
            await server.stop(grace=5.0)
            error = await rpc_error(read_until_end(call))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in (error.details() or "")
        await served.wait_kv_free()

    served.run(body())


def test_a_port_in_use_is_refused(served: ServedEngine) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()

        async def body() -> None:
            server = GenerationServer(served.engine)
            with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:"):
                await server.start("127.0.0.1", taken.getsockname()[1])

        served.run(body())
