"""The default LLM pipeline's wiring: however a request ends, no stage keeps anything of it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import AsyncEngine, InvalidRequestError, SamplingParams
from pipeline.engine.async_engine import EngineObserver
from stages.detokenize import DetokenizeStage
from stages.messages import GenerateRequest, RequestOutput
from stages.stop_check import StopCheckStage

#: seconds a condition may take to hold: a hang guard, not a timing assumption
HANG_GUARD = 30.0


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        stats = engine.stats
        if (
            stats is not None
            and stats.num_running == stats.num_waiting == 0
            and stats.kv_blocks_free == stats.kv_blocks_total
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine did not go idle: {engine.stats}")


async def eventually(condition: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_GUARD
    while not condition():
        assert loop.time() < deadline, f"not reached in {HANG_GUARD}s: {what}"
        await asyncio.sleep(0.01)


class Recorder(EngineObserver):
    """The ids (inside the pipeline) of requests sent, finished and ended (hooks run on the
    engine's loop, the test's too)."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.finished: set[str] = set()
        self.ended: set[str] = set()

    def request_sent(self, request: GenerateRequest) -> None:
        self.sent.append(request.request_id)

    def output_received(self, output: RequestOutput) -> None:
        if output.finished:
            self.finished.add(output.request_id)

    def request_ended(self, request_id: str, error: BaseException | None) -> None:
        self.ended.add(request_id)


def test_every_way_a_request_ends_releases_its_frontend_state(tiny_model_dir: Path) -> None:
    """Length, stop token, stop string (the engine still runs it when stop-check ends it),
    abort mid-stream and rejection: afterwards detokenize and stop_check track nothing."""

    async def body() -> None:
        async with AsyncEngine(str(tiny_model_dir), transport="memory", num_blocks=128) as engine:
            greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            reference = None
            async for output in engine.generate("Once upon a time", greedy):
                reference = output
            assert reference is not None and reference.finish_reason == "length"
            # a stop string cut from the middle of the reference text
            stop = reference.text[len(reference.text) // 2 :][:3]
            assert stop.strip(), reference.text
            stopped = None
            async for output in engine.generate("Once upon a time", greedy.replace(stop=[stop])):
                stopped = output
            assert stopped is not None and stopped.finish_reason == "stop"
            assert stopped.stop_reason == stop
            token = reference.token_ids[3]
            by_token = None
            async for output in engine.generate(
                "Once upon a time", greedy.replace(stop_token_ids=[token], ignore_eos=False)
            ):
                by_token = output
            assert by_token is not None and by_token.finish_reason == "stop"
            async for _ in engine.generate("Once upon a time", greedy.replace(max_tokens=500)):
                break  # aborts the request
            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate("Once upon a time", greedy.replace(top_p=3.0)):
                    pass
            await wait_idle(engine)
            detokenize = engine.running.stage("detokenize")
            stop_check = engine.running.stage("stop_check")
            assert isinstance(detokenize, DetokenizeStage)
            assert isinstance(stop_check, StopCheckStage)
            # the last aborts pass through the frontend stages
            await eventually(lambda: not detokenize._requests, "detokenize forgets every request")
            await eventually(lambda: not stop_check._requests, "stop_check forgets every request")
            assert engine.num_unfinished_requests == 0

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_late_abort_never_hits_a_later_request_with_the_same_id(tiny_model_dir: Path) -> None:
    """Leaving a stream after the engine finished the request still sends an abort (the
    caller never saw the last output); it reaches schedule after the request is gone. A new
    request reusing the id must run, not be taken for the one that abort was meant for."""

    async def body() -> None:
        async with AsyncEngine(str(tiny_model_dir), transport="memory", num_blocks=64) as engine:
            recorder = Recorder()
            engine.add_observer(recorder)
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            async for output in engine.generate("Hello world", params, request_id="x"):
                assert output.request_id == "x"
                # the engine finishes it meanwhile: its final output has arrived, unread
                await eventually(lambda: bool(recorder.finished), "the engine finishes x")
                break
            (first,) = recorder.sent
            assert recorder.finished == {first}
            # the stream's end has queued the late abort; once the pipeline is idle (two calm
            # snapshots in a row), it has passed through every stage, schedule included
            await eventually(lambda: first in recorder.ended, "the stream of x ends")
            assert await engine.running.wait_idle(HANG_GUARD)
            await wait_idle(engine)
            outputs = [o async for o in engine.generate("Hello world", params, request_id="x")]
            assert outputs[-1].finish_reason == "length"
            assert {o.request_id for o in outputs} == {"x"}
            # and abort() by the caller's id still works while one runs
            stream = engine.generate("Hello world", params.replace(max_tokens=500), request_id="x")
            await stream.__anext__()
            assert await engine.abort("x")
            assert not await engine.abort("x")  # no longer running
            assert not await engine.abort("never-sent")
            rest = [o async for o in stream]
            assert rest[-1].finish_reason == "abort" and rest[-1].request_id == "x"
            await wait_idle(engine)

    asyncio.run(asyncio.wait_for(body(), 120))
