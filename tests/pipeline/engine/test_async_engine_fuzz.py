"""Property-based fuzz of the Python API (AsyncEngine.generate): arbitrary values in every
SamplingParams field and every prompt form, against the null-model engine in the zmq
topology (engine process and frontend linked by real sockets) while a bystander stream runs.
Each request runs or is refused with a typed error; the bystander finishes every request it
sends; the engine lives (docs/architecture.md, "Failure: one request or the pipeline"). Once
with one engine, once with two replicas behind the router stage (docs/architecture.md §8),
which is one more stage on the request's path and one more zmq link."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import AsyncEngine, InvalidRequestError, RequestError, SamplingParams
from pipeline.engine.loop_thread import LoopThread
from stages.route import RouterStage
from stages.router import ReplicaLoad
from tests.hostile import JUNK, PROMPTS, SAMPLING, TEXT, sampling_params

#: outputs read from a request that runs before it is aborted (keeps every example short)
OUTPUTS_READ = 3
BYSTANDER = SamplingParams(max_tokens=24, ignore_eos=True)


class Bystander:
    """Sends one ordinary request after another until stopped; each must finish whole."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.finished = 0
        self.problems: list[str] = []
        self.task: asyncio.Task[None] | None = None
        self._stopping = False

    async def run(self) -> None:
        while not self._stopping:
            last = None
            try:
                async for output in self.engine.generate("The bystander's own prompt", BYSTANDER):
                    last = output
            except Exception as error:
                self.problems.append(f"{type(error).__name__}: {error}")
                return
            if last is None or last.finish_reason != "length" or len(last.token_ids) != 24:
                self.problems.append(f"a bystander request ended as {last!r:.200}")
                return
            self.finished += 1

    async def stop(self) -> None:
        self._stopping = True
        assert self.task is not None
        await self.task


@pytest.fixture(scope="module", params=[1, 2], ids=["one-engine", "two-replicas"])
def fuzzed(request: pytest.FixtureRequest) -> Iterator[tuple[LoopThread, AsyncEngine, Bystander]]:
    loop = LoopThread()
    engine = AsyncEngine(null_model=True, transport="zmq", data_parallel_size=request.param)
    loop.run(engine.start())
    if request.param > 1:
        assert set(engine.running.pids) == {"engine", "engine_1"}
    bystander = Bystander(engine)

    async def begin() -> None:
        bystander.task = asyncio.get_running_loop().create_task(bystander.run())

    loop.run(begin())
    yield loop, engine, bystander
    loop.run(engine.close())
    loop.stop()


async def attempt(engine: AsyncEngine, prompt: Any, params: Any, keywords: dict[str, Any]) -> str:
    """Send one request: "ran" if it streamed (aborted after a few outputs), else the kind of
    the typed error it was refused with. Anything else raised fails the test."""
    read = 0
    try:
        async for _ in engine.generate(prompt, params, **keywords):
            read += 1
            if read == OUTPUTS_READ:
                break
    except RequestError as error:
        assert str(error)
        return error.kind
    return "ran"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=PROMPTS,
    fields=SAMPLING,
    keywords=st.fixed_dictionaries(
        {},
        optional={
            "request_id": st.one_of(TEXT, JUNK),
            "tenant": st.one_of(TEXT, JUNK),
            "chat_template": st.one_of(st.booleans(), JUNK),
        },
    ),
)
def test_any_request_runs_or_is_refused_and_the_engine_lives(
    fuzzed: tuple[LoopThread, AsyncEngine, Bystander],
    prompt: Any,
    fields: dict[str, Any],
    keywords: dict[str, Any],
) -> None:
    loop, engine, bystander = fuzzed
    outcome = loop.run(
        asyncio.wait_for(attempt(engine, prompt, sampling_params(fields), keywords), 60)
    )
    assert outcome in ("ran", "invalid", "prompt_too_long"), outcome
    assert engine.failure is None
    assert not bystander.problems, bystander.problems


#: the vectors of the hostile review (issue 16), each with the field its refusal names:
#: integers msgpack cannot carry (>= 2**64, < -2**63), lone surrogates, a bool for an int, a
#: str for a float, NaN and infinities, token ids outside the vocabulary
VECTORS: list[tuple[str, Any, dict[str, Any], dict[str, Any], str]] = [
    ("max_tokens 2**64", "hi", {"max_tokens": 2**64}, {}, "max_tokens"),
    ("max_tokens -2**63-1", "hi", {"max_tokens": -(2**63) - 1}, {}, "max_tokens"),
    ("priority 2**64", "hi", {"priority": 2**64}, {}, "priority"),
    ("priority -2**63-1", "hi", {"priority": -(2**63) - 1}, {}, "priority"),
    ("top_k 2**64", "hi", {"top_k": 2**64}, {}, "top_k"),
    ("top_k -2**70", "hi", {"top_k": -(2**70)}, {}, "top_k"),
    ("stop_token_ids 2**64", "hi", {"stop_token_ids": [2**64]}, {}, "stop_token_ids"),
    ("prompt id 2**64", [1, 2**64], {}, {}, "prompt_token_ids"),
    ("prompt id -2**63-1", [-(2**63) - 1], {}, {}, "prompt_token_ids"),
    ("prompt surrogate", "a\ud800", {}, {}, "prompt"),
    ("chat content surrogate", [{"role": "user", "content": "\udfff"}], {}, {}, "messages"),
    ("chat role surrogate", [{"role": "\ud800", "content": "x"}], {}, {}, "messages"),
    ("stop surrogate", "hi", {"stop": ["ok", "\ud800"]}, {}, "stop"),
    ("request_id surrogate", "hi", {}, {"request_id": "\ud800"}, "request_id"),
    ("tenant surrogate", "hi", {}, {"tenant": "\ud800"}, "tenant"),
    ("bool max_tokens", "hi", {"max_tokens": True}, {}, "max_tokens"),
    ("str temperature", "hi", {"temperature": "0.5"}, {}, "temperature"),
    ("nan top_p", "hi", {"top_p": math.nan}, {}, "top_p"),
    ("inf temperature", "hi", {"temperature": math.inf}, {}, "temperature"),
    ("prompt id past the vocabulary", [1, 49_152], {}, {}, "prompt_token_ids"),
    ("stop token id past the vocabulary", "hi", {"stop_token_ids": [10**6]}, {}, "stop_token_ids"),
]


@pytest.mark.parametrize(
    ("prompt", "fields", "keywords", "field"),
    [pytest.param(*vector[1:], id=vector[0]) for vector in VECTORS],
)
def test_each_vector_of_the_review_is_refused_naming_its_field(
    fuzzed: tuple[LoopThread, AsyncEngine, Bystander],
    prompt: Any,
    fields: dict[str, Any],
    keywords: dict[str, Any],
    field: str,
) -> None:
    loop, engine, bystander = fuzzed

    async def refused() -> InvalidRequestError:
        with pytest.raises(InvalidRequestError) as caught:
            async for _ in engine.generate(prompt, sampling_params(fields), **keywords):
                pass
        return caught.value

    error = loop.run(asyncio.wait_for(refused(), 60))
    assert error.field == field, error
    assert engine.failure is None
    assert not bystander.problems, bystander.problems


def test_after_the_fuzz_the_bystander_finished_and_nothing_is_left(
    fuzzed: tuple[LoopThread, AsyncEngine, Bystander],
) -> None:
    loop, engine, bystander = fuzzed
    loop.run(bystander.stop())
    assert not bystander.problems and bystander.finished >= 1
    assert engine.failure is None

    async def settled() -> None:
        # an ordinary request still runs, and afterwards the engine holds no request
        last = None
        async for output in engine.generate("after the storm", SamplingParams(max_tokens=4)):
            last = output
        assert last is not None and last.finish_reason is not None
        while engine.stats is None or engine.stats.num_running or engine.stats.num_waiting:
            async for _ in engine.generate("one more", SamplingParams(max_tokens=1)):
                pass
            await asyncio.sleep(0.05)
        assert engine.num_unfinished_requests == 0

    loop.run(asyncio.wait_for(settled(), 60))
    if "router" in engine.running.pipeline.stages:
        # both replicas served, and the router's books hold no request any more
        router = engine.running.stage("router")
        assert isinstance(router, RouterStage)
        assert router.live_replicas == ("0", "1") and set(router.routed) == {"0", "1"}
        for name in router.live_replicas:
            assert router.load(name) == ReplicaLoad(name, 0, 0)
