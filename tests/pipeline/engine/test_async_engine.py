"""AsyncEngine end to end on the tiny random Llama: transports agree, cancellation frees KV,
many concurrent streams stay separate, bad input gets typed errors while the engine keeps
serving, and a dead engine fails every pending request."""

from __future__ import annotations

import asyncio
import collections
import functools
import gc
import logging
import os
import signal
import threading
import time
import traceback
import types
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline import (
    AsyncEngine,
    EngineDeadError,
    EngineOptions,
    InvalidRequestError,
    PipelineClosedError,
    PromptTooLongError,
    RateLimitedError,
    SamplingParams,
    Stage,
    llm_pipeline,
)
from stages.models import resolve_model

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


@functools.cache
def _hf_model(model_dir: Path) -> tuple[Any, Any]:
    """The HF tokenizer and model, loaded once per module run (read-only below)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tokenizer, model


@functools.cache
def _hf_greedy(model_dir: Path, prompt: str, max_tokens: int) -> tuple[int, ...]:
    tokenizer, model = _hf_model(model_dir)
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens
        )
    return tuple(out[0, ids.shape[1] :].tolist())


@pytest.fixture(scope="module", autouse=True)
def _forget_hf_model() -> Iterator[None]:
    """The HF model and answers cached above live as long as this module's tests."""
    yield
    _hf_greedy.cache_clear()
    _hf_model.cache_clear()


def reference_greedy(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """HF generate, one request at a time (the ground truth for greedy decoding); each
    (prompt, max_tokens) is generated once per module run and reused by the tests that
    share it (the scheduler configurations run the same prompts)."""
    return [list(_hf_greedy(model_dir, prompt, max_tokens)) for prompt in prompts]


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


def test_abort_delivers_text_held_back_for_a_stop_string(
    served: tuple[LoopThread, AsyncEngine], tiny_model_dir: Path
) -> None:
    """While the text so far could still become a stop string, stop-check holds it back; an
    abort then ends the stream with that text delivered (docs/architecture.md §2.8: flush held-back
    text on every finish), so the final text is everything the request generated."""
    loop, engine = served
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = loop.run(complete(engine, "Hold this back", GREEDY.replace(max_tokens=40)))

    def text_of(count: int) -> str:
        return str(tokenizer.decode(list(reference.token_ids[:count]), skip_special_tokens=True))

    held_tokens = 30
    while text_of(held_tokens).endswith("\ufffd") or not text_of(held_tokens):
        held_tokens -= 1
    # every text up to held_tokens tokens is a proper prefix of this stop string, which
    # itself never matches: all of it is held back while streaming
    stop = text_of(held_tokens) + "\x00"
    params = GREEDY.replace(max_tokens=500, stop=(stop,))

    async def body() -> None:
        outputs = []
        async for output in engine.generate("Hold this back", params, request_id="held"):
            outputs.append(output)
            if len(outputs) == 1:
                assert output.text == "" and output.token_ids  # held back
                assert await engine.abort("held")
        final = outputs[-1]
        assert final.finish_reason == "abort" and final.stop_reason is None
        assert final.request_id == "held"
        assert final.text and final.text == text_of(len(final.token_ids))
        assert "".join(output.delta for output in outputs) == final.text
        await wait_all_blocks_free(engine)

    loop.run(body())


def test_errors_carry_the_callers_request_id(served: tuple[LoopThread, AsyncEngine]) -> None:
    """An error raised by generate names the request by the caller's id, never by the id the
    request has inside the pipeline ("<id>#<n>")."""
    loop, engine = served
    for prompt, params in (
        ("", SamplingParams()),
        ([{"role": "user"}], SamplingParams()),
        ("fine", SamplingParams(top_p=0.0)),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            loop.run(complete_as(engine, prompt, params, "my-request"))
        assert caught.value.request_id == "my-request"
    with pytest.raises(PromptTooLongError) as too_long:
        assert engine.info is not None
        loop.run(complete_as(engine, [5] * engine.info.max_model_len, GREEDY, "long-one"))
    assert too_long.value.request_id == "long-one"

    async def twice() -> None:
        params = GREEDY.replace(max_tokens=500)
        first = engine.generate("one", params, request_id="same")
        await anext(first)
        with pytest.raises(InvalidRequestError, match="already running") as caught:
            await complete_as(engine, "two", params, "same")
        assert caught.value.request_id == "same"
        await first.aclose()  # type: ignore[attr-defined]

    loop.run(twice())


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
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
        ({"prompt": 5}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1], "extra": 1}, SamplingParams(), "prompt"),
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


def test_request_ids_must_be_non_empty_strings(served: tuple[LoopThread, AsyncEngine]) -> None:
    loop, engine = served
    for bad in ("", 123):

        async def body(request_id: Any = bad) -> None:
            params = SamplingParams(max_tokens=1)
            async for _ in engine.generate("hi", params, request_id=request_id):
                pass

        with pytest.raises(InvalidRequestError, match="request_id must be a non-empty string"):
            loop.run(body())


@pytest.mark.usefixtures("no_child_left")
def test_an_engine_starts_once_and_a_failed_start_leaves_nothing_running(
    tiny_model_dir: Path,
) -> None:
    from pipeline import GraphError, Pipeline
    from tests.pipeline.runtime.test_supervision import Forward

    without_info = Pipeline("mine").add("f", Forward).entry("requests", "f").exit("outputs", "f")
    with pytest.raises(GraphError, match="lacks entry 'aborts', exit 'engine_info'"):
        AsyncEngine(pipeline=without_info)

    async def body() -> None:
        engine = AsyncEngine(str(tiny_model_dir), transport="memory")
        async with engine:
            with pytest.raises(RuntimeError, match="started already"):
                await engine.start()
        with pytest.raises(PipelineClosedError, match="create a new AsyncEngine"):
            await engine.start()
        # A start that fails (here: it times out) stops what it started; no child is left
        # (the no_child_left fixture checks) and the engine is closed.
        engine = AsyncEngine(str(tiny_model_dir), start_timeout=0.01)
        with pytest.raises(TimeoutError, match="did not start within"):
            await engine.start()
        with pytest.raises(PipelineClosedError):
            await engine.start()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_unknown_option_is_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"unknown engine option.*max_batch"):
        AsyncEngine("smollm2-135m", max_batch=3)
    with pytest.raises(ValueError, match="transport must be one of"):
        AsyncEngine("smollm2-135m", transport="carrier-pigeon")
    with pytest.raises(ValueError, match="tune_gc must be a boolean"):
        AsyncEngine("smollm2-135m", tune_gc="yes")
    with pytest.raises(ValueError, match=r"num_blocks .* or kv_cache_memory .* not both"):
        AsyncEngine("smollm2-135m", num_blocks=64, kv_cache_memory=2**20)
    with pytest.raises(ValueError, match="log_level must be one of"):
        AsyncEngine("smollm2-135m", log_level="LOUD")
    AsyncEngine("smollm2-135m", log_level="debug")  # any case
    for burst in (0, -1.0, float("inf"), float("nan"), "2", True):
        with pytest.raises(ValueError, match="rate_limit_burst must be a number of seconds"):
            AsyncEngine("smollm2-135m", rate_limit_burst=burst)


def test_the_rate_limit_burst_bounds_a_tenants_burst_and_largest_request(
    tiny_model_dir: Path,
) -> None:
    """10 tokens/s: with the default 1 s burst a 3 + 37 token request can never fit; with a
    4 s burst (40 tokens) it runs, and a second one at once is over the limit."""
    params = SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True)
    prompt = [1, 2, 3]

    async def body() -> None:
        limits = {"model": str(tiny_model_dir), "transport": "memory", "tokens_per_second": 10}
        async with AsyncEngine(**limits) as engine:
            with pytest.raises(InvalidRequestError, match="more than tenant") as refused:
                await complete(engine, prompt, params)
            assert refused.value.field == "max_tokens"
        async with AsyncEngine(**limits, rate_limit_burst=4.0) as engine:
            both = await asyncio.gather(
                complete(engine, prompt, params),
                complete(engine, prompt, params),
                return_exceptions=True,
            )
            refusals = [r for r in both if isinstance(r, BaseException)]
            assert len(refusals) == 1 and isinstance(refusals[0], RateLimitedError), both
            assert "tokens per second" in str(refusals[0])
            [ran] = [r for r in both if not isinstance(r, BaseException)]
            assert len(ran.token_ids) == 37

    asyncio.run(asyncio.wait_for(body(), 120))


# -- memory ----------------------------------------------------------------------------------------


def test_no_request_leaves_a_reference_cycle() -> None:
    """Requests that finish, are aborted by their caller (with and without stop strings) or
    are refused by admit: afterwards the cycle collector finds nothing of any of them. (With
    the frontend's raised GC threshold, per-request cycles were freed only after tens of
    thousands of requests: a 20,000-request soak grew the frontend by 100 MB.) Every stage
    runs in this process here (memory topology), so all of their objects are counted."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def one(engine: AsyncEngine, index: int) -> None:
        kind = index % 4
        try:
            if kind == 0:
                async for _ in engine.generate(f"request {index}", params):
                    pass
            elif kind == 1:
                async for _ in engine.generate(f"request {index}", params):
                    break
            elif kind == 2:
                async for _ in engine.generate(f"request {index}", params.replace(stop=["zz"])):
                    break
            else:
                async for _ in engine.generate([5] * 9000, params):
                    pass
        except PromptTooLongError:
            assert kind == 3

    async def body() -> list[Any]:
        async with AsyncEngine(null_model=True, transport="memory") as engine:
            await asyncio.gather(*(one(engine, index) for index in range(40)))  # warm up
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)  # what any collection finds is kept, not freed
            try:
                await asyncio.gather(*(one(engine, index) for index in range(200)))
                for index in range(40):
                    await one(engine, index)
                await asyncio.sleep(0.1)  # the aborts reach the engine
                gc.collect()
            finally:
                gc.set_debug(0)
            found, gc.garbage[:] = list(gc.garbage), []
            return found

    found = asyncio.run(asyncio.wait_for(body(), 120))
    ours = collections.Counter(
        type(o).__qualname__
        for o in found
        if type(o).__module__.split(".")[0] in ("pipeline", "stages", "transports")
        or isinstance(o, types.TracebackType)
    )
    assert not ours, f"reference cycles of requests: {ours.most_common(10)}"


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


def _engine_failure_log(records: list[logging.LogRecord]) -> list[str]:
    """The ERROR lines of the frontend's log; none may carry a traceback."""
    assert not [r.getMessage() for r in records if r.exc_info is not None]
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_a_killed_engine_is_one_error_line(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Over grpc the frontend first sees the link from the killed engine break: that is the
    symptom, not news; the log says once what happened, without a traceback."""

    async def body() -> None:
        with caplog.at_level(logging.INFO, logger="actorline"):
            async with AsyncEngine(null_model=True, transport=transport) as engine:
                params = SamplingParams(max_tokens=None, ignore_eos=True)
                pending = [
                    asyncio.ensure_future(complete(engine, f"forever {i}", params))
                    for i in range(8)
                ]
                await asyncio.sleep(0.5)
                os.kill(engine.running.pids["engine"], signal.SIGKILL)
                errors = await asyncio.gather(*pending, return_exceptions=True)
                for error in errors:
                    assert isinstance(error, EngineDeadError)
                    assert "died (killed by signal 9)" in str(error)
                    # one error for all, but its traceback is this request's alone
                    assert len(traceback.extract_tb(error.__traceback__)) < 8
        # the line names the requests of the step the engine ran (its crash note)
        (line,) = _engine_failure_log(caplog.records)
        assert line.startswith(
            "pipeline 'llm' failed: host 'engine' died (killed by signal 9): "
            "its latest step had request(s) "
        ), line
        # (those of its last step: some or all of the 8 in flight)
        assert 1 <= len(line.split("request(s) ")[1].split(", ")) <= 8, line

    asyncio.run(asyncio.wait_for(body(), 120))


@pytest.mark.slow
def test_a_frozen_engine_is_unresponsive_not_dead(caplog: pytest.LogCaptureFixture) -> None:
    """SIGSTOP: the process lives, so the error says how long it did not answer (the
    heartbeat timeout, 10 s) instead of "died (unknown exit)"; it keeps its type."""

    async def body() -> None:
        with caplog.at_level(logging.INFO, logger="actorline"):
            async with AsyncEngine(null_model=True) as engine:
                params = SamplingParams(max_tokens=None, ignore_eos=True)
                pending = asyncio.ensure_future(complete(engine, "forever", params))
                await asyncio.sleep(0.5)
                pid = engine.running.pids["engine"]
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                try:
                    with pytest.raises(EngineDeadError) as caught:
                        await asyncio.wait_for(pending, 40)
                finally:
                    os.kill(pid, signal.SIGCONT)  # (the teardown resumes it too)
        error = caught.value
        assert str(error) == (
            "host 'engine' has been unresponsive for 10 s: the engine was shut down"
        )
        assert error.unresponsive and error.unresponsive_for == 10.0
        (line,) = _engine_failure_log(caplog.records)
        assert line.startswith(
            "pipeline 'llm' failed: host 'engine' has been unresponsive for 10 s"
        )
        assert "; its latest step had request(s) " in line, line

    asyncio.run(asyncio.wait_for(body(), 120))


# -- the real scheduler against HF, per configuration ----------------------------------------------

SHORT_GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
_ANGRY = (
    "In the beginning the universe was created. This has made a lot of people very angry and "
    "been widely regarded as a bad move."
)
#: 9 prompts from 1 to 83 tokens (the longest needs six 16-token chunks)
VARIED_PROMPTS = [
    "A",
    "1 2 3 4 5",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time in a land far away, there lived a king who had three daughters and a "
    "very old dog named Rex",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint(fibonacci(10))",
    _ANGRY,
    f"{_ANGRY} {_ANGRY}",
    "Paris is the capital of",
    "Counting: " + " ".join(str(i) for i in range(30)),
]
#: 9 prompts sharing a 52-token prefix (3 full 16-token blocks), with suffixes of varied length
SHARED_PREFIX_PROMPTS = [
    f"{_ANGRY} {_ANGRY}{suffix}"
    for suffix in (
        " So",
        " Then",
        " Later that day, the",
        " Nobody knows why",
        " 1 2 3 4 5 6 7 8 9 10 11 12",
        " The quick brown fox jumps over the lazy dog again and again",
        " Paris",
        " def f(x): return x * 2",
        " Once upon a time",
    )
]


class StepRecorder:
    """Records every SchedulerStep the real scheduler of a memory-topology engine plans (it
    wraps ``Scheduler.schedule`` on the instance; planning itself is unchanged)."""

    def __init__(self, engine: AsyncEngine) -> None:
        from stages.messages import SchedulerStep
        from stages.schedule import ScheduleStage

        stage = engine.running.stage("schedule")
        assert isinstance(stage, ScheduleStage) and stage.scheduler is not None
        scheduler = stage.scheduler
        plan = scheduler.schedule
        self.steps: list[SchedulerStep] = []

        def recording() -> SchedulerStep | None:
            step = plan()
            if step is not None:
                self.steps.append(step)
            return step

        scheduler.schedule = recording  # type: ignore[method-assign]

    def chunks_of(self, request_id: str) -> list[Any]:
        # NOTE: inside the pipeline a caller's request id is "<id>#<n>"
        return [
            c for step in self.steps for c in step.chunks
            if c.request_id.partition("#")[0] == request_id
        ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "options"),
    [
        pytest.param(case, options, id=case)
        for case, options in (
            ("default", {}),
            ("chunked-budget", {"max_num_batched_tokens": 16}),
            ("chunked-long-prefill", {"long_prefill_chunk": 16}),
            ("prefix-cache", {"enable_prefix_caching": True}),
            ("preemption", {"num_blocks": 8, "block_size": 16}),
        )
    ],
)
def test_real_scheduler_greedy_matches_hf_generate(
    tiny_model_dir: Path, case: str, options: dict[str, Any]
) -> None:
    """Concurrent greedy requests through the full memory pipeline (real tokenize, admit,
    scheduler, execute, detokenize, stop-check) give exactly the tokens of unbatched HF
    ``generate``; the engine's own stats prove the configuration did what it is for."""
    prompts = SHARED_PREFIX_PROMPTS if case == "prefix-cache" else VARIED_PROMPTS
    max_tokens = SHORT_GREEDY.max_tokens
    expected = reference_greedy(tiny_model_dir, prompts, max_tokens)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = [len(tokenizer.encode(prompt)) for prompt in prompts]

    async def run() -> tuple[list[Any], Any, StepRecorder]:
        async with AsyncEngine(str(tiny_model_dir), transport="memory", **options) as engine:
            recorder = StepRecorder(engine)
            outputs = []
            rest = list(enumerate(prompts))
            if case == "prefix-cache":
                # the first request fills the cache; the others then run together and hit it
                outputs.append(await complete_as(engine, prompts[0], SHORT_GREEDY, "r0"))
                rest = rest[1:]
            outputs += await asyncio.gather(
                *(complete_as(engine, p, SHORT_GREEDY, f"r{i}") for i, p in rest)
            )
            stats = engine.stats
            await wait_all_blocks_free(engine)  # nothing leaked (also after preemption)
        return outputs, stats, recorder

    outputs, stats, recorder = asyncio.run(asyncio.wait_for(run(), 240))
    for prompt, output, want in zip(prompts, outputs, expected, strict=True):
        assert output.finish_reason == "length", (case, prompt)
        assert list(output.token_ids) == want, (case, prompt)
    assert stats is not None
    longest = max(range(len(prompts)), key=lambda i: lengths[i])
    prefill = [c for c in recorder.chunks_of(f"r{longest}") if c.start < lengths[longest]]
    if case.startswith("chunked"):
        assert lengths[longest] > 4 * 16
        assert all(c.num_tokens <= 16 for step in recorder.steps for c in step.chunks)
        assert len(prefill) >= -(-lengths[longest] // 16), prefill
        assert stats.num_steps >= len(prefill) + max_tokens - 1
    elif case != "preemption":
        assert len(prefill) == 1, prefill  # not chunked: the whole prompt in one step
    if case == "prefix-cache":
        assert stats.prefix_cache_hits > 0, stats
        assert all(o.num_cached_tokens >= 2 * 16 for o in outputs[1:]), [
            o.num_cached_tokens for o in outputs
        ]
    if case == "preemption":
        assert stats.kv_blocks_total == 8
        assert stats.num_preemptions > 0, stats
    else:
        assert stats.num_preemptions == 0, stats


async def complete_as(
    engine: AsyncEngine, prompt: Any, params: SamplingParams, request_id: str
) -> Any:
    last = None
    async for output in engine.generate(prompt, params, request_id=request_id):
        last = output
    return last


# -- timing metrics --------------------------------------------------------------------------------


def test_outputs_carry_timing_metrics(served: tuple[LoopThread, AsyncEngine]) -> None:
    """Time to first token is set from the first streamed output on; total time only on the
    final one, and 0 < ttft <= total there."""
    loop, engine = served

    async def body() -> list[Any]:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        return [output async for output in engine.generate("Time me please", params)]

    before = time.time()
    outputs = loop.run(body())
    after = time.time()
    assert len(outputs) >= 2
    final = outputs[-1]
    assert final.finish_reason == "length" and len(final.token_ids) == 10
    ttfts = []
    for output in outputs:
        metrics = output.metrics
        assert metrics is not None, output
        assert before <= metrics.arrival_time <= after
        assert metrics.time_to_first_token is not None, output  # every output has tokens
        assert metrics.time_to_first_token > 0
        ttfts.append(metrics.time_to_first_token)
        if output is not final:
            assert metrics.total_time is None, output
    assert len(set(ttfts)) == 1, ttfts  # fixed at the first token
    assert final.metrics is not None
    ttft, total = final.metrics.time_to_first_token, final.metrics.total_time
    assert ttft is not None and total is not None
    assert 0 < ttft <= total <= after - before


def test_bad_models_fail_to_start_with_typed_errors(tmp_path: Path) -> None:
    """The caller gets ModelNotFoundError / ModelFormatError itself (not a failure of a
    stage in the engine process), and nothing is left running."""
    from stages.models import ModelFormatError, ModelNotFoundError

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 4096)
    cases: list[tuple[str, type[Exception], str]] = [
        ("smollm9-1t", ModelNotFoundError, "unknown model 'smollm9-1t'"),
        (str(tmp_path / "missing.gguf"), ModelNotFoundError, "does not exist"),
        (str(corrupt), ModelFormatError, "GGUF"),
    ]

    async def body() -> None:
        for model, error, message in cases:
            engine = AsyncEngine(model)
            with pytest.raises(error, match=message):
                await engine.start()
            with pytest.raises(PipelineClosedError):
                engine.running  # noqa: B018 - nothing was started

    asyncio.run(asyncio.wait_for(body(), 120))


@pytest.mark.slow
@pytest.mark.model
def test_stop_and_eos_tokens_leave_no_text_with_the_real_model() -> None:
    """With the real model: a stop token id ("\\n") and EOS ("<|im_end|>", shown with
    skip_special_tokens=False) end the request without their text in the output, as in vLLM
    V1; the token ids keep them. include_stop_str_in_output puts the text back."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m").path)
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)

    async def body() -> None:
        async with AsyncEngine("smollm2-135m", transport="memory") as engine:
            stopped = await complete(
                engine, "The capital of France is", greedy.replace(stop_token_ids=(newline,))
            )
            assert stopped.finish_reason == "stop" and stopped.stop_reason == newline
            assert stopped.token_ids[-1] == newline and "Paris" in stopped.text
            assert stopped.text == tokenizer.decode(list(stopped.token_ids[:-1]))
            assert not stopped.text.endswith("\n")
            kept = await complete(
                engine,
                "The capital of France is",
                greedy.replace(stop_token_ids=(newline,), include_stop_str_in_output=True),
            )
            assert kept.text == stopped.text + "\n"

            chat = [{"role": "user", "content": "Say hi"}]
            shown = SamplingParams(max_tokens=40, temperature=0.0, skip_special_tokens=False)
            ended = await complete(engine, chat, shown)
            assert ended.finish_reason == "stop", ended  # the model ended its turn: EOS
            assert ended.token_ids[-1] in tokenizer.convert_tokens_to_ids(["<|im_end|>"])
            assert ended.text and "<|im_end|>" not in ended.text
            with_eos = await complete(engine, chat, shown.replace(include_stop_str_in_output=True))
            assert with_eos.text == ended.text + "<|im_end|>"

    asyncio.run(asyncio.wait_for(body(), 240))


def test_a_built_pipeline_runs_with_the_options_it_was_built_from(tiny_model_dir: Path) -> None:
    """AsyncEngine(pipeline=llm_pipeline(options)) checks the model and starts the hosts with
    ``options`` (not the defaults, whose model and transport may differ); options given
    explicitly still win."""
    options = EngineOptions(model=str(tiny_model_dir), transport="memory", num_blocks=16)
    pipeline = llm_pipeline(options).insert("noop", Passthrough, after="detokenize")

    async def body() -> None:
        async with AsyncEngine(pipeline=pipeline) as engine:
            assert engine.options == options
            assert engine.running.pids == {}  # memory: one process, as built
            assert engine.info is not None and engine.info.num_blocks == 16
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            outputs = [output async for output in engine.generate("Hi", params)]
            assert len(outputs[-1].token_ids) == 4

    asyncio.run(asyncio.wait_for(body(), 120))
    other = EngineOptions(model=str(tiny_model_dir), transport="zmq")
    assert AsyncEngine(pipeline=pipeline, options=other).options == other


class Passthrough(Stage):
    async def handle(self, message: Any, port: str) -> None:
        await self.emit("out", message)
