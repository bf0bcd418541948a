"""One bad message fails one request (stages/recovery.py and each stage's recovery): a fault
put into one stage for one request (a tokenizer, the admission checks, the scheduler's
intake, a detokenizer, a stop checker that raise, a router whose send to a replica fails)
ends that request with a typed error, aborts it in the engine if it was there, and leaves a
bystander stream and every later request alone (docs/architecture.md, "Failure: one request
or the pipeline"). A failure repeated at will logs its traceback once (§7.2).

The faults are injected: once every request is validated at the boundary no real input
makes these stages raise, which is the point; the stages must still contain what a bug would
raise. The engine is the null model in the memory topology, so every stage is reachable;
the router runs only with data parallelism, so its test has two replicas over zmq.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline import AsyncEngine, RequestFailedError, SamplingParams
from pipeline.engine.loop_thread import LoopThread
from stages import admit, stop_check
from stages.detokenizer import DetokenizerFactory, IncrementalDetokenizer
from stages.errors import InvalidRequestError, RequestError
from stages.messages import EngineRequest, GenerateRequest, StepResult
from stages.recovery import rejection, request_error, request_id_of
from stages.route import RouterStage
from stages.router import ReplicaLoad
from stages.schedule import ScheduleStage
from stages.stop_checker import StopChecker, StopDecision
from stages.tokenize import TokenizeStage
from transports.errors import EncodeError

LONG = SamplingParams(max_tokens=64, ignore_eos=True)


class Injected(RuntimeError):
    """The fault a test puts into a stage."""


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LoopThread, AsyncEngine]]:
    loop = LoopThread()
    engine = AsyncEngine(null_model=True, transport="memory")
    loop.run(engine.start())
    yield loop, engine
    loop.run(engine.close())
    loop.stop()


async def outcome(engine: AsyncEngine, prompt: str, params: SamplingParams) -> Any:
    """The outputs a request streamed and the error it ended with (None: it finished)."""
    outputs = []
    try:
        async for output in engine.generate(prompt, params):
            outputs.append(output)
    except RequestError as error:
        return outputs, error
    return outputs, None


async def with_bystander(engine: AsyncEngine, prompt: str) -> tuple[list[Any], BaseException]:
    """Run the poisoned request while a bystander streams; both are checked here, and a
    request after them must run."""
    bystander = asyncio.ensure_future(outcome(engine, "a bystander", LONG))
    outputs, error = await outcome(engine, prompt, LONG)
    seen, failure = await bystander
    assert failure is None and seen[-1].finish_reason == "length" and len(seen[-1].token_ids) == 64
    later, failure = await outcome(engine, "later", SamplingParams(max_tokens=3))
    assert failure is None and len(later[-1].token_ids) == 3
    assert engine.failure is None
    assert error is not None
    return outputs, error


async def engine_holds_nothing(engine: AsyncEngine) -> None:
    """Wait until the engine runs and queues nothing (a failed request was aborted there)."""
    for _ in range(200):
        async for _ in engine.generate("probe", SamplingParams(max_tokens=1)):
            pass
        stats = engine.stats
        if stats is not None and stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine still holds requests: {engine.stats}")


async def recovered(engine: AsyncEngine, stage: str) -> int:
    """How many failures frontend stage ``stage`` has contained (StageStatistics)."""
    (main,) = [host for host in await engine.running.statistics() if host.host == "main"]
    (statistics,) = [s for s in main.stages if s.name == stage]
    return statistics.recovered


def break_detokenizer(
    monkeypatch: pytest.MonkeyPatch,
    engine: AsyncEngine,
    fault: type[Exception],
    *,
    when: str = "decoding",
) -> None:
    """Make the detokenizer of every request with the prompt "poison" raise ``fault``:
    ``when`` "registering" (creating it), or "decoding" (its fifth push, mid-stream, in a
    batch with every other running request's row)."""
    tokenize = engine.running.stage("tokenize")
    assert isinstance(tokenize, TokenizeStage)
    poison = tuple(tokenize.tokenizer.encode("poison", add_special_tokens=True))
    real = DetokenizerFactory.create

    class Breaks:
        def __init__(self, inner: IncrementalDetokenizer) -> None:
            self.inner = inner
            self.pushes = 0

        def push(self, token_ids: Any) -> str:
            self.pushes += 1
            if self.pushes == 5:
                raise fault("a decoder state broke")
            return self.inner.push(token_ids)

        def flush(self) -> str:
            return self.inner.flush()

    def create(factory: DetokenizerFactory, prompt_token_ids: Any = (), **options: Any) -> Any:
        detokenizer = real(factory, prompt_token_ids, **options)
        if tuple(prompt_token_ids) != poison:
            return detokenizer
        if when == "registering":
            raise fault("cannot build a decoder")
        return Breaks(detokenizer)

    monkeypatch.setattr(DetokenizerFactory, "create", create)


def break_stop_checker(monkeypatch: pytest.MonkeyPatch, fault: type[Exception]) -> SamplingParams:
    """Make every stop checker raise ``fault`` on its third push; the params of a request
    that has one (the bystander has no stop strings, so no checker)."""

    class Breaks(StopChecker):
        def push(self, text: str, num_output_tokens: int) -> StopDecision:
            if num_output_tokens == 3:
                raise fault("a stop checker broke")
            return super().push(text, num_output_tokens)

    monkeypatch.setattr(stop_check, "StopChecker", Breaks)
    return LONG.replace(stop=("never in random text \x00",))


def test_a_tokenizer_that_raises_fails_that_request(
    served: tuple[LoopThread, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    loop, engine = served
    stage = engine.running.stage("tokenize")
    assert isinstance(stage, TokenizeStage)
    real = stage.tokenizer

    class Breaks:
        def encode(self, text: str, **options: Any) -> Any:
            if "poison" in text:
                raise TypeError("TextEncodeInput must be Union[...]")
            return real.encode(text, **options)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    monkeypatch.setattr(stage, "tokenizer", Breaks())
    outputs, error = loop.run(with_bystander(engine, "poison"))
    assert not outputs and type(error) is RequestFailedError
    assert str(error) == (
        "stage 'tokenize' failed on this request: TypeError: TextEncodeInput must be Union[...]"
    )
    assert error.kind == "failed" and error.request_id is not None


def test_admission_that_raises_fails_that_request(
    served: tuple[LoopThread, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    loop, engine = served
    real = admit.validate_request

    def validate_request(request: EngineRequest, info: Any) -> None:
        if request.prompt == "poison":
            raise Injected("a check broke")
        real(request, info)

    monkeypatch.setattr(admit, "validate_request", validate_request)
    outputs, error = loop.run(with_bystander(engine, "poison"))
    assert not outputs and type(error) is RequestFailedError
    assert str(error) == "stage 'admit' failed on this request: Injected: a check broke"


def test_a_scheduler_that_fails_to_take_a_request_drops_it(
    served: tuple[LoopThread, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It fails after queueing the request: the stage drops it again, so it never runs."""
    loop, engine = served
    stage = engine.running.stage("schedule")
    assert isinstance(stage, ScheduleStage) and stage.scheduler is not None
    scheduler = stage.scheduler
    real = scheduler.add_request

    def add_request(request: EngineRequest) -> None:
        real(request)
        if request.prompt == "poison":
            raise Injected("a policy hook raised")

    monkeypatch.setattr(scheduler, "add_request", add_request)
    outputs, error = loop.run(with_bystander(engine, "poison"))
    assert not outputs and type(error) is RequestFailedError
    assert "stage 'schedule' failed on this request" in str(error)
    loop.run(engine_holds_nothing(engine))


@pytest.mark.parametrize("when", ["registering", "decoding"])
def test_a_detokenizer_that_raises_fails_that_request_and_frees_it(
    served: tuple[LoopThread, AsyncEngine], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Registering it (before any output) or decoding its fifth step's tokens (mid-stream,
    in a batch with the bystander's): the request ends with the error after the tokens it
    had, and is aborted in the engine, which frees it."""
    loop, engine = served
    break_detokenizer(monkeypatch, engine, Injected, when=when)
    outputs, error = loop.run(with_bystander(engine, "poison"))
    assert type(error) is RequestFailedError
    assert "stage 'detokenize' failed on this request: Injected" in str(error)
    assert len(outputs[-1].token_ids) == 4 if when == "decoding" else not outputs
    loop.run(engine_holds_nothing(engine))


def test_a_stop_checker_that_raises_fails_that_request_and_frees_it(
    served: tuple[LoopThread, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its third push raises (the bystander has no stop strings, so no checker)."""
    loop, engine = served
    params = break_stop_checker(monkeypatch, Injected)

    async def body() -> Any:
        bystander = asyncio.ensure_future(outcome(engine, "a bystander", LONG))
        result = await outcome(engine, "poison", params)
        seen, failure = await bystander
        assert failure is None and len(seen[-1].token_ids) == 64
        return result

    outputs, error = loop.run(body())
    assert type(error) is RequestFailedError
    assert "stage 'stop_check' failed on this request: Injected" in str(error)
    assert outputs and len(outputs[-1].token_ids) == 2
    loop.run(engine_holds_nothing(engine))


@pytest.mark.parametrize(
    ("stage", "batch"), [("detokenize", "EngineOutputs"), ("stop_check", "TextOutputs")]
)
def test_a_row_failure_repeated_at_will_logs_its_traceback_once(
    served: tuple[LoopThread, AsyncEngine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stage: str,
    batch: str,
) -> None:
    """Three requests fail the same way, each on its row of a batch: each ends with the
    error, the host counts all three as contained, and logs the first with its traceback and
    the others in one line each (docs/architecture.md §7.2), as it logs what a stage's
    recover contains."""
    loop, engine = served

    class Repeated(RuntimeError):
        """A type the stage has not met (the host remembers types for the module's engine)."""

        __qualname__ = "Repeated"

    if stage == "detokenize":
        break_detokenizer(monkeypatch, engine, Repeated)
        params = LONG
    else:
        params = break_stop_checker(monkeypatch, Repeated)

    async def body() -> tuple[int, int]:
        before = await recovered(engine, stage)
        for _ in range(3):
            _, error = await outcome(engine, "poison", params)
            assert type(error) is RequestFailedError
            assert f"stage {stage!r} failed on this request: Repeated" in str(error)
        return before, await recovered(engine, stage)

    with caplog.at_level(logging.ERROR):
        before, after = loop.run(body())
    assert after - before == 3
    records = [r for r in caplog.records if "Repeated" in r.getMessage()]
    assert [r.name for r in records] == ["actorline.host"] * 3, records
    for record in records:
        assert record.levelno == logging.ERROR
        assert f"stage {stage} recovered from Repeated on a {batch} (request '" in (
            record.getMessage()
        )
    assert [record.exc_info is not None for record in records] == [True, False, False]
    loop.run(engine_holds_nothing(engine))


def test_a_router_whose_send_fails_fails_that_request_and_undoes_its_routing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With two replicas the router (on the frontend) sends each request over a zmq link to
    its replica's admit. A value that link cannot carry (a lone surrogate in the tenant, put
    into the request on the router's path, past the boundary checks of §7.1) makes the real
    codec raise EncodeError in the router's send, after it recorded the route: the request
    ends with InvalidRequestError, the router's books are as if it had never come, a
    bystander stream and a later request run, and the engine lives."""

    async def body() -> None:
        async with AsyncEngine(null_model=True, data_parallel_size=2) as engine:
            router = engine.running.stage("router")
            assert isinstance(router, RouterStage)
            real = router.emit

            async def emit(port: str, message: object, *, to: str | None = None) -> None:
                if isinstance(message, EngineRequest) and message.prompt == "poison":
                    message = dataclasses.replace(message, tenant="\ud800")
                await real(port, message, to=to)

            monkeypatch.setattr(router, "emit", emit)
            for _ in range(2):  # and again: nothing of the first failure is left
                outputs, error = await with_bystander(engine, "poison")
                assert not outputs and type(error) is InvalidRequestError
                assert "cannot carry: EngineRequest.tenant:" in str(error)
                assert "surrogates not allowed" in str(error)
                assert error.request_id not in {request_id for request_id, _ in router.recent}
            assert await recovered(engine, "router") == 2
            # the bystanders and the later requests, 2 each: every one finished
            assert sum(router.routed.values()) == 4
            assert router.live_replicas == ("0", "1")
            for name in router.live_replicas:
                assert router.load(name) == ReplicaLoad(name, 0, 0)

    asyncio.run(asyncio.wait_for(body(), 120))


def test_request_errors_for_what_a_stage_raised() -> None:
    assert request_id_of(GenerateRequest("g", SamplingParams(), prompt="x")) == "g"
    assert request_id_of(StepResult(0, (), (), 1, 1)) is None
    invalid = InvalidRequestError("no", field="prompt")
    assert request_error("tokenize", invalid) is invalid
    encode = request_error("tokenize", EncodeError("EngineRequest.tenant: bad"))
    assert type(encode) is InvalidRequestError
    assert "cannot carry: EngineRequest.tenant: bad" in str(encode)
    rejected = rejection("detokenize", "r", KeyError("k"), abort=True)
    assert (rejected.request_id, rejected.kind, rejected.abort) == ("r", "failed", True)
    assert rejected.message == "stage 'detokenize' failed on this request: KeyError: 'k'"
