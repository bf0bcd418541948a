"""The Python client (async and sync) against a real Generation server: streamed outputs
equal the engine's, abort, model info, health, cancellation, TLS, and every failure mapped
to its typed Python error."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.engine.prompts import Prompt
from pipeline.server.client import (
    AsyncClient,
    AuthenticationError,
    Client,
    ModelInfo,
    ServiceUnavailableError,
    StreamedOutput,
    Usage,
)
from pipeline.server.serve import ServerTLS
from stages.errors import InvalidRequestError, PromptTooLongError, RateLimitedError
from stages.messages import ChatMessage, RequestOutput
from stages.params import SamplingParams
from tests.pipeline.server.serving import ServedEngine, make_certificate

pytestmark = pytest.mark.slow

KEY = "client-test-key"
LIMITED_KEY = "client-limited-key"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[ServedEngine]:
    """The tiny model, every stage in this process (the client does not care where)."""
    engine = ServedEngine(
        tiny_model_dir,
        keys={KEY: None, LIMITED_KEY: (None, 64.0)},
        transport="memory",
        num_blocks=128,
    )
    yield engine
    engine.close()


async def engine_output(served: ServedEngine, prompt: Prompt, **options: object) -> RequestOutput:
    last = None
    async for output in served.engine.generate(prompt, GREEDY, **options):  # type: ignore[arg-type]
        last = output
    assert last is not None
    return last


def check_outputs(outputs: list[StreamedOutput], reference: RequestOutput) -> None:
    assert "".join(output.delta for output in outputs) == reference.text
    assert tuple(t for output in outputs for t in output.token_ids) == reference.token_ids
    assert all(not output.finished for output in outputs[:-1])
    last = outputs[-1]
    assert last.finish_reason == reference.finish_reason == "length"
    assert isinstance(last.usage, Usage)
    assert last.usage.prompt_tokens == reference.num_prompt_tokens
    assert last.usage.completion_tokens == len(reference.token_ids)


PROMPTS: dict[str, tuple[Prompt, bool]] = {
    "text": ("Once upon a time", False),
    "chat template": ("Once upon a time", True),
    "dict messages": ([{"role": "user", "content": "Say hi."}], False),
    "ChatMessage": ([ChatMessage("system", "Be nice."), ChatMessage("user", "Hi")], False),
    "token ids": ([504, 2365, 6354], False),
}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_async_client_streams_the_engine_output(served: ServedEngine, kind: str) -> None:
    prompt, chat_template = PROMPTS[kind]

    async def body() -> None:
        reference = await engine_output(served, prompt, chat_template=chat_template)
        async with AsyncClient(served.address, api_key=KEY) as client:
            outputs = [
                output
                async for output in client.generate(
                    prompt, GREEDY, request_id=f"id-{kind}", chat_template=chat_template
                )
            ]
        check_outputs(outputs, reference)
        assert {output.request_id for output in outputs} == {f"id-{kind}"}

    served.run(body())


def test_sync_client_is_the_same_client(served: ServedEngine) -> None:
    reference = served.run(engine_output(served, "Once upon a time"))
    with Client(served.address, api_key=KEY) as client:
        check_outputs(list(client.generate("Once upon a time", GREEDY)), reference)
        assert client.health() == "SERVING"
        info = client.model_info()
        assert isinstance(info, ModelInfo)
        assert (info.vocab_size, info.max_model_len, info.kv_cache_blocks) == (49152, 1024, 128)
        assert info.kv_cache_tokens == 128 * info.block_size
        assert info.scheduler == "fcfs" and info.eos_token_ids == (2,)
        assert info.kv_cache_dtype == "float32"
        assert client.abort("not-running") is False
    with pytest.raises(ServiceUnavailableError, match="closed"):
        client.health()
    assert KEY not in repr(client) and KEY not in repr(client._client)


def test_logprobs_are_returned_per_token(served: ServedEngine) -> None:
    params = GREEDY.replace(logprobs=3)
    with Client(served.address, api_key=KEY) as client:
        outputs = list(client.generate("Hello", params))
    for output in outputs:
        assert output.logprobs is not None
        assert [entry.token_id for entry in output.logprobs] == list(output.token_ids)
        assert all(len(entry.top_token_ids) == 3 and entry.rank >= 1 for entry in output.logprobs)


def test_prompt_logprobs_come_with_the_first_token(served: ServedEngine) -> None:
    params = GREEDY.replace(max_tokens=3, prompt_logprobs=2)
    with Client(served.address, api_key=KEY) as client:
        outputs = list(client.generate("Hello there, friend", params))
    first, *rest = outputs
    assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
    assert len(first.prompt_logprobs) == len(first.prompt_token_ids) > 2
    scored = first.prompt_logprobs[1:]
    assert [entry.token_id for entry in scored if entry] == list(first.prompt_token_ids[1:])
    assert all(entry and len(entry.top_token_ids) == 2 for entry in scored)
    assert all(output.prompt_logprobs is None for output in rest)


def test_abort_ends_the_stream_with_abort(served: ServedEngine) -> None:
    async def body() -> None:
        async with AsyncClient(served.address, api_key=KEY) as client:
            stream = client.generate("Hello", LONG, request_id="to-abort")
            first = await stream.__anext__()
            assert not first.finished
            assert await client.abort("to-abort")
            rest = [output async for output in stream]
            assert rest[-1].finish_reason == "abort"
            assert await client.abort("to-abort") is False
        await served.wait_kv_free()

    served.run(body())


def test_leaving_a_sync_stream_early_aborts_the_request(served: ServedEngine) -> None:
    with Client(served.address, api_key=KEY) as client:
        stream = client.generate("Hello", LONG)
        for _, output in zip(range(3), stream):
            assert not output.finished
        stream.close()  # what leaving a for loop early does, once the iterator is dropped
        served.run(served.wait_kv_free())


@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_in_a_sync_stream_aborts_the_request(served: ServedEngine) -> None:
    """SIGINT while the caller waits for the next output: KeyboardInterrupt reaches the
    caller (not an error about the generator) and the server aborts the request."""
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    with Client(served.address, api_key=KEY) as client:
        stream = client.generate("Hello", LONG)
        assert not next(stream).finished
        timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for _ in stream:
                pass
        timer.join()
        stream.close()
        served.run(served.wait_kv_free())
        assert client.health() == "SERVING"  # the client is still usable


def test_cancelling_an_async_stream_aborts_the_request(served: ServedEngine) -> None:
    async def body() -> None:
        async with AsyncClient(served.address, api_key=KEY) as client:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in client.generate("Hello", LONG):
                    started.set()

            task = asyncio.ensure_future(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await served.wait_kv_free()

    served.run(body())


# -- errors ---------------------------------------------------------------------------------


def test_missing_or_wrong_keys_raise_authentication_error(served: ServedEngine) -> None:
    for key in (None, "wrong"):
        with Client(served.address, api_key=key) as client:
            with pytest.raises(AuthenticationError):
                client.model_info()
            with pytest.raises(AuthenticationError):
                list(client.generate("Hello", GREEDY))
            with pytest.raises(AuthenticationError):
                client.abort("x")
            assert client.health() == "SERVING"  # health needs no key


@pytest.mark.parametrize(
    ("prompt", "params", "error", "field"),
    [
        ("Hi", SamplingParams(max_tokens=0), InvalidRequestError, "max_tokens"),  # checked here
        ("Hi", SamplingParams(top_p=2.0), InvalidRequestError, "top_p"),
        ([1, -5], None, InvalidRequestError, "prompt_token_ids"),
        (b"bytes", None, InvalidRequestError, "prompt"),
        ([1, 10**6], None, InvalidRequestError, "prompt_token_ids"),  # checked by the server
        ("Hi", SamplingParams(stop_token_ids=(10**6,)), InvalidRequestError, "stop_token_ids"),
        ([1] * 1024, None, PromptTooLongError, "prompt"),
        ("", None, InvalidRequestError, "prompt"),
        # what the wire cannot carry (issue 16's vectors): refused naming the field
        ("Hi", SamplingParams(max_tokens=2**64), InvalidRequestError, "max_tokens"),
        ("Hi", SamplingParams(top_k=-(2**70)), InvalidRequestError, "top_k"),
        ([1, 2**70], None, InvalidRequestError, "prompt_token_ids"),
        ("Hi \ud800", None, InvalidRequestError, "prompt"),
        ("Hi", SamplingParams(stop=("\ud800",)), InvalidRequestError, "stop"),
        ("Hi", SamplingParams(max_tokens=True), InvalidRequestError, "max_tokens"),
        ("Hi", SamplingParams(temperature=float("nan")), InvalidRequestError, "temperature"),
    ],
)
def test_invalid_requests_raise_invalid_request_error_with_the_field(
    served: ServedEngine,
    prompt: Prompt,
    params: SamplingParams | None,
    error: type[Exception],
    field: str,
) -> None:
    with Client(served.address, api_key=KEY) as client, pytest.raises(error) as caught:
        list(client.generate(prompt, params))
    assert isinstance(caught.value, InvalidRequestError) and caught.value.field == field


def test_errors_carry_the_callers_request_id(served: ServedEngine) -> None:
    """Checked here or by the server, an error names the request by the caller's id."""
    cases = (
        ("Hi", SamplingParams(top_p=2.0)),  # checked here
        ("Hi", SamplingParams(stop_token_ids=(10**6,))),  # checked by the server
        ([1] * 1024, None),  # refused by the engine: too long
    )
    with Client(served.address, api_key=KEY) as client:
        for prompt, params in cases:
            with pytest.raises(InvalidRequestError) as caught:
                list(client.generate(prompt, params, request_id="mine"))
            assert caught.value.request_id == "mine"


def test_over_the_limit_raises_rate_limited_error(served: ServedEngine) -> None:
    with Client(served.address, api_key=LIMITED_KEY) as client:
        with pytest.raises(InvalidRequestError, match="more than tenant") as caught:
            list(client.generate("Hello", SamplingParams(max_tokens=100)))  # never fits
        assert caught.value.field == "max_tokens"
    # 64 tokens/s, a burst of 64 (the server's limits have no longer burst), still full: the
    # refusal checked before took nothing. Each request below costs the whole burst (3 prompt
    # tokens + 61), so whichever reaches the engine second is refused unless a whole second
    # passes between the two. Sent at once, not one after the other's first output, so how
    # fast the engine generates does not matter.
    whole_burst = SamplingParams(max_tokens=61, ignore_eos=True)

    async def body() -> list[list[StreamedOutput] | BaseException]:
        async with AsyncClient(served.address, api_key=LIMITED_KEY) as client:

            async def stream(request_id: str) -> list[StreamedOutput]:
                outputs = client.generate([504, 2365, 6354], whole_burst, request_id=request_id)
                return [output async for output in outputs]

            return await asyncio.gather(stream("a"), stream("b"), return_exceptions=True)

    results = served.run(body())
    refused = [result for result in results if isinstance(result, BaseException)]
    finished = [result for result in results if not isinstance(result, BaseException)]
    assert len(refused) == 1, results
    assert isinstance(refused[0], RateLimitedError), refused[0]
    assert "tokens per second" in str(refused[0])
    # when to retry comes through gRPC's RetryInfo: at most the one second a full burst takes
    assert refused[0].retry_after is not None and 0 < refused[0].retry_after <= 1.0
    assert len(finished) == 1 and finished[0][-1].finish_reason == "length"  # one fits


def test_unreachable_server_raises_service_unavailable() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    with Client(address, timeout=30) as client:
        with pytest.raises(ServiceUnavailableError):
            client.health()
        with pytest.raises(ServiceUnavailableError):
            list(client.generate("Hello"))


def test_client_over_tls(served: ServedEngine, tmp_path: Path) -> None:
    certificate = make_certificate(tmp_path, "server")
    server = served.run(served.start_server(ServerTLS(certificate.certificate, certificate.key)))
    try:
        assert server.address is not None
        with Client(server.address, api_key=KEY, tls=certificate.certificate) as client:
            assert client.health() == "SERVING"
            assert list(client.generate("Hello", GREEDY))[-1].finish_reason == "length"
        with (
            Client(server.address, api_key=KEY) as plaintext,
            pytest.raises(ServiceUnavailableError),
        ):
            plaintext.model_info()
    finally:
        served.run(server.stop())


def test_client_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="target"):
        AsyncClient("")
    with pytest.raises(ValueError, match="tls"):
        AsyncClient("127.0.0.1:1", client_certificate=(b"cert", b"key"))


def test_abort_of_a_request_that_has_just_finished_is_false(served: ServedEngine) -> None:
    """Abort is True only when it reached a request the engine had not finished. Here the
    engine has finished the request while its last outputs still wait for the client (it
    reads nothing, so flow control holds the server's writes): the call still runs on the
    server, yet Abort answers False and the stream ends as it would have, with "length"."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=20)
    # no BDP probing and a small window: the server cannot write more until the client reads
    options = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))

    async def body() -> None:
        async with AsyncClient(served.address, api_key=KEY, channel_options=options) as client:
            stream = client.generate("Hello", params, request_id="just-finished")
            first = await stream.__anext__()
            assert not first.finished
            deadline = asyncio.get_running_loop().time() + 60
            while served.engine.num_unfinished_requests:
                assert asyncio.get_running_loop().time() < deadline, "the request never finished"
                await asyncio.sleep(0.01)
            assert served.server.service.num_running == 1  # its call is still writing
            assert await client.abort("just-finished") is False
            rest = [output async for output in stream]
            assert rest[-1].finish_reason == "length"
            assert sum(len(output.token_ids) for output in (first, *rest)) == 32
        await served.wait_kv_free()

    served.run(body())
