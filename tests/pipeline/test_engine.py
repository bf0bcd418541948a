"""AsyncEngine end to end on the tiny random Llama: transports agree, cancellation frees KV,
many concurrent streams stay separate, bad input gets typed errors while the engine keeps
serving, and a dead engine fails every pending request."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline import (
    AsyncEngine,
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    SamplingParams,
)

T = TypeVar("T")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away, there lived",
    "1 2 3 4 5",
    "Paris is the capital of",
    "def fibonacci(n):",
    "A",
]


class LoopThread:
    """An event loop in a thread, so one engine can serve several tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(coroutine, timeout), self.loop
        ).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[LoopThread, AsyncEngine]]:
    """One memory-topology engine (small KV cache) shared by the tests of this module."""
    loop = LoopThread()
    engine = AsyncEngine(str(tiny_model_dir), transport="memory", num_blocks=256)
    loop.run(engine.start())
    yield loop, engine
    loop.run(engine.close())
    loop.stop()


async def complete(engine: AsyncEngine, prompt: Any, params: SamplingParams) -> Any:
    last = None
    async for output in engine.generate(prompt, params):
        last = output
    return last


async def wait_all_blocks_free(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats
        if stats is not None and stats.kv_blocks_free == stats.kv_blocks_total:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"KV blocks were not all freed: {engine.stats}")


def reference_greedy(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """HF generate, one request at a time (the ground truth for greedy decoding)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens
            )
        results.append(out[0, ids.shape[1] :].tolist())
    return results


# -- transports --------------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_outputs_identical_across_transports(tiny_model_dir: Path) -> None:
    expected = reference_greedy(tiny_model_dir, PROMPTS, GREEDY.max_tokens)

    async def run(**options: Any) -> list[list[int]]:
        async with AsyncEngine(str(tiny_model_dir), **options) as engine:
            outputs = await asyncio.gather(*(complete(engine, p, GREEDY) for p in PROMPTS))
        return [list(output.token_ids) for output in outputs]

    for options in (
        {"transport": "memory"},
        {"transport": "zmq"},
        {"transport": "grpc"},
        {"transport": "zmq", "compression": "zstd"},
    ):
        assert asyncio.run(run(**options)) == expected, options


@pytest.mark.slow
def test_64_concurrent_streams_over_zmq(tiny_model_dir: Path) -> None:
    prompts = [f"Request number {i}: tell me about {i * 7} apples" for i in range(64)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = reference_greedy(tiny_model_dir, prompts, params.max_tokens)

    async def run() -> list[Any]:
        async with AsyncEngine(str(tiny_model_dir), transport="zmq") as engine:
            streams: dict[int, list[Any]] = {i: [] for i in range(64)}

            async def consume(i: int) -> None:
                async for output in engine.generate(prompts[i], params, request_id=f"req-{i}"):
                    streams[i].append(output)

            await asyncio.gather(*(consume(i) for i in range(64)))
            return [streams[i] for i in range(64)]

    results = asyncio.run(run())
    for i, outputs in enumerate(results):
        final = outputs[-1]
        assert final.request_id == f"req-{i}" and final.finish_reason == "length"
        assert list(final.token_ids) == expected[i]
        assert "".join(o.delta for o in outputs) == final.text
        assert all(o.request_id == f"req-{i}" for o in outputs)


# -- cancellation and abort ----------------------------------------------------------------------


def test_breaking_out_of_a_stream_frees_its_kv(served: tuple[LoopThread, AsyncEngine]) -> None:
    loop, engine = served

    async def body() -> None:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        seen = 0
        async for _output in engine.generate("Count forever: 1 2 3", params):
            seen += 1
            if seen == 3:
                assert engine.stats is not None
                assert engine.stats.kv_blocks_free < engine.stats.kv_blocks_total
                break
        await wait_all_blocks_free(engine)
        assert engine.stats is not None and engine.stats.num_running == 0

    loop.run(body())


def test_cancelling_the_consuming_task_frees_its_kv(
    served: tuple[LoopThread, AsyncEngine],
) -> None:
    loop, engine = served

    async def body() -> None:
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("Never ending story", params):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_all_blocks_free(engine)

    loop.run(body())


def test_abort_ends_the_stream(served: tuple[LoopThread, AsyncEngine]) -> None:
    loop, engine = served

    async def body() -> None:
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        outputs = []
        async for output in engine.generate("Abort me", params, request_id="to-abort"):
            outputs.append(output)
            if len(outputs) == 2:
                await engine.abort("to-abort")
        assert outputs[-1].finish_reason == "abort"
        assert outputs[-1].text.startswith(outputs[1].text)
        await wait_all_blocks_free(engine)

    loop.run(body())


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ("   ", SamplingParams(), "prompt"),
        (42, SamplingParams(), "prompt"),
        (None, SamplingParams(), "prompt"),
        ("fine", SamplingParams(temperature=-1.0), "temperature"),
        ("fine", SamplingParams(top_p=0.0), "top_p"),
        ("fine", SamplingParams(max_tokens=0), "max_tokens"),
        ("fine", SamplingParams(top_k=-5), "top_k"),
        ("fine", SamplingParams(min_p=1.5), "min_p"),
        ("fine", SamplingParams(stop_token_ids=(10**9,)), "stop_token_ids"),
        ([10**9, 1], SamplingParams(), "prompt_token_ids"),
        ([{"role": "user"}], SamplingParams(), "prompt"),
    ],
)
def test_bad_input_gets_a_typed_error_naming_the_field(
    served: tuple[LoopThread, AsyncEngine], prompt: Any, params: SamplingParams, field: str
) -> None:
    loop, engine = served
    with pytest.raises(InvalidRequestError) as error:
        loop.run(complete(engine, prompt, params))
    assert error.value.field == field
    # the engine keeps serving everyone else
    good = loop.run(complete(engine, "still alive", SamplingParams(max_tokens=3, temperature=0)))
    assert good.finish_reason == "length" and len(good.token_ids) == 3


def test_prompt_longer_than_the_model(served: tuple[LoopThread, AsyncEngine]) -> None:
    loop, engine = served
    assert engine.info is not None
    too_long = [5] * engine.info.max_model_len
    with pytest.raises(PromptTooLongError, match="model's length"):
        loop.run(complete(engine, too_long, SamplingParams()))


def test_bad_requests_do_not_disturb_running_ones(served: tuple[LoopThread, AsyncEngine]) -> None:
    loop, engine = served

    async def body() -> None:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        running = asyncio.ensure_future(complete(engine, "A long answer please", params))
        for _ in range(5):
            with pytest.raises(InvalidRequestError):
                await complete(engine, "x", SamplingParams(top_p=2.0))
        final = await running
        assert final.finish_reason == "length" and len(final.token_ids) == 20

    loop.run(body())


def test_unknown_option_is_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"unknown engine option.*max_batch"):
        AsyncEngine("smollm2-135m", max_batch=3)
    with pytest.raises(ValueError, match="transport must be one of"):
        AsyncEngine("smollm2-135m", transport="carrier-pigeon")
    with pytest.raises(ValueError, match="tune_gc must be a boolean"):
        AsyncEngine("smollm2-135m", tune_gc="yes")


# -- engine death ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_killed_engine_fails_pending_requests(tiny_model_dir: Path) -> None:
    async def body() -> None:
        async with AsyncEngine(str(tiny_model_dir), transport="zmq") as engine:
            params = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
            pending = [
                asyncio.ensure_future(complete(engine, f"forever {i}", params)) for i in range(4)
            ]
            await asyncio.sleep(1.0)
            os.kill(engine.running.pids["engine"], signal.SIGKILL)
            started = time.monotonic()
            results = await asyncio.gather(*pending, return_exceptions=True)
            assert time.monotonic() - started < 2.0
            assert all(isinstance(r, EngineDeadError) for r in results), results
            with pytest.raises(EngineDeadError):
                await complete(engine, "after", SamplingParams(max_tokens=2))

    asyncio.run(asyncio.wait_for(body(), 120))
