"""Issue 34 over the Python API: no grammar can hurt the engine. Each vector of the issue
(a chain of 3,000 or 12,000 Lark or GBNF rules, GBNF allowed a quarter of the bound;
``$ref`` / ``allOf`` / property-``$ref`` chains 3,000 deep; ``a{1000000}``; a grammar whose
language is empty; a regex that matches nothing) runs against a real engine in its own
process (zmq: a native crash there would be the engine's death, ``EngineDeadError``) while a
bystander stream runs; each gets its answer or a typed ``InvalidRequestError`` naming the
field and the bound or llguidance's reason (never a fake "stop"), the bystander finishes
with bounded gaps, the engine lives, and no traceback reaches the log. Then a hypothesis
fuzz of grammars, regexes and schemas (deep, wide, recursive, empty) does the same with
bystander streams running throughout. The test at the bounds themselves is
``tests/stages/structured/test_limits.py``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import AsyncEngine, InvalidRequestError, SamplingParams, StructuredOutputsParams
from pipeline.engine.loop_thread import LoopThread
from stages.errors import RequestError
from tests.stages.structured.grammar_chains import chain_schema, gbnf_chain, lark_chain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: the bystander's tokens, and the longest gap allowed between two of them (a loaded 2-core
#: machine; on a quiet one gaps are tens of milliseconds)
BYSTANDER_TOKENS = 12
MAX_GAP_S = 60.0
#: seconds anything may take before the test fails
PATIENCE_S = 300.0


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[LoopThread, AsyncEngine]]:
    """One engine in its own process, shared by the module."""
    loop = LoopThread()
    engine = AsyncEngine(str(tiny_model_dir), transport="zmq", num_blocks=256)
    loop.run(asyncio.wait_for(engine.start(), PATIENCE_S))
    yield loop, engine
    loop.run(asyncio.wait_for(engine.close(), PATIENCE_S))
    loop.stop()


async def bystander(engine: AsyncEngine, started: asyncio.Event | None = None) -> float:
    """A free stream of :data:`BYSTANDER_TOKENS` tokens; its worst gap between outputs.

    Raises:
        AssertionError: it did not end at its length with every token.
    """
    params = SamplingParams(max_tokens=BYSTANDER_TOKENS, ignore_eos=True)
    worst, last, final = 0.0, time.monotonic(), None
    async for output in engine.generate("Once upon a time", params):
        now = time.monotonic()
        worst, last, final = max(worst, now - last), now, output
        if started is not None:
            started.set()
    assert final is not None and final.finish_reason == "length"
    assert len(final.token_ids) == BYSTANDER_TOKENS
    return worst


async def hostile(engine: AsyncEngine, params: StructuredOutputsParams) -> tuple[Any, float, float]:
    """``params``'s request (6 tokens) sent while a bystander streams: its last output or
    the error it raised, its seconds, and the bystander's worst gap."""
    started = asyncio.Event()
    watch = asyncio.create_task(bystander(engine, started))
    await asyncio.wait_for(started.wait(), PATIENCE_S)
    began = time.monotonic()
    outcome: Any = None

    async def run() -> None:
        nonlocal outcome
        async for output in engine.generate(
            "Write:", SamplingParams(max_tokens=6, structured_outputs=params)
        ):
            outcome = output

    try:
        await asyncio.wait_for(run(), PATIENCE_S)
    except RequestError as exc:
        outcome = exc
    took = time.monotonic() - began
    return outcome, took, await asyncio.wait_for(watch, PATIENCE_S)


async def all_blocks_free(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        stats = engine.stats
        idle = stats is not None and stats.num_running == stats.num_waiting == 0
        if idle and stats is not None and stats.kv_blocks_free == stats.kv_blocks_total:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine kept requests or KV blocks: {engine.stats}")


ANSWERED = {
    "lark chain 3000": (StructuredOutputsParams(grammar=lark_chain(3000)), "a"),
    "gbnf chain 1000": (StructuredOutputsParams(grammar=gbnf_chain(1000)), "a"),
    "$ref chain 3000": (StructuredOutputsParams(json=chain_schema(3000, "ref")), None),
    "property $ref chain 1300": (
        StructuredOutputsParams(json=chain_schema(1300, "property")),
        None,
    ),
}
REFUSED = {
    "lark chain 12000": (
        StructuredOutputsParams(grammar=lark_chain(12000)),
        "structured_outputs.grammar",
        "has 12000 rules; at most 4000 are allowed (the engine's grammar_max_rules)",
    ),
    "gbnf chain 3000": (
        StructuredOutputsParams(grammar=gbnf_chain(3000)),
        "structured_outputs.grammar",
        "has 3000 GBNF rules; at most 1000",
    ),
    "gbnf chain 12000": (
        StructuredOutputsParams(grammar=gbnf_chain(12000)),
        "structured_outputs.grammar",
        "has 12000 GBNF rules; at most 1000",
    ),
    "allOf chain 3000": (
        StructuredOutputsParams(json=chain_schema(3000, "allOf")),
        "structured_outputs.json",
        "has 6001 objects (subschemas and their maps); at most 4000",
    ),
    "property $ref chain 3000": (
        StructuredOutputsParams(json=chain_schema(3000, "property")),
        "structured_outputs.json",
        "has 9000 objects",
    ),
    "a{1000000}": (
        StructuredOutputsParams(regex="a{1000000}"),
        "structured_outputs.regex",
        "lexer error: too many expressions constructed",
    ),
    "empty language": (
        StructuredOutputsParams(grammar='start: "a" start'),
        "structured_outputs.grammar",
        "parser error: Too many items",
    ),
    "impossible regex": (
        StructuredOutputsParams(regex=r"[^\s\S]"),
        "structured_outputs.regex",
        "does not compile (llguidance): the grammar allows no token here: it matches nothing",
    ),
}


def test_the_issues_vectors_get_an_answer_or_a_typed_error_and_the_engine_lives(
    served: tuple[LoopThread, AsyncEngine], capfd: pytest.CaptureFixture[str]
) -> None:
    loop, engine = served
    gaps: dict[str, float] = {}
    for name, (params, text) in ANSWERED.items():
        outcome, _, gaps[name] = loop.run(hostile(engine, params))
        assert not isinstance(outcome, BaseException), (name, outcome)
        assert outcome.finish_reason in ("length", "stop"), (name, outcome)
        if text is not None:  # a prefix of the chain's "aaa..."
            assert outcome.text and outcome.text == text * len(outcome.text), name
        elif outcome.finish_reason == "stop":  # a complete document of the schema
            json.loads(outcome.text)
    for name, (params, field, words) in REFUSED.items():
        outcome, took, gaps[name] = loop.run(hostile(engine, params))
        assert isinstance(outcome, InvalidRequestError), (name, outcome)
        assert outcome.field == field, name
        assert words in str(outcome), (name, str(outcome))
        assert "<state>" not in str(outcome), name
        assert took < PATIENCE_S, name
    assert max(gaps.values()) < MAX_GAP_S, gaps
    assert engine.failure is None
    loop.run(all_blocks_free(engine))  # the failed requests were aborted in the engine
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Segmentation" not in err, err[-4000:]


# -- the fuzz ----------------------------------------------------------------------------------

_depth = st.integers(1, 5000)


def _lark(shape: str, n: int) -> str:
    if shape == "chain":
        return lark_chain(max(2, n))
    if shape == "wide":
        return "start: " + " | ".join(f'"w{i}"' for i in range(n))
    if shape == "nested":
        return "start: " + '("a" ' * n + '"b"' + ")" * n
    if shape == "recursive":
        return 'start: "(" start ")" | "x"'
    if shape == "left recursive":
        return 'start: start "a" | "a"'
    if shape == "empty":
        return 'start: "a" start'
    return "start: start"  # no sentence at all


def _regex(shape: str, n: int) -> str:
    if shape == "repeat":
        return f"a{{{n * 200}}}"
    if shape == "nested":
        return "(" * min(n, 400) + "a" + ")" * min(n, 400)
    if shape == "wide":
        return "|".join(f"w{i}" for i in range(n))
    if shape == "repeat of repeat":
        return f"(ab{{{n}}}){{{n}}}"
    return r"[^\s\S]"


def _schema(shape: str, n: int) -> str:
    if shape in ("ref", "allOf", "property"):
        return chain_schema(max(2, min(n, 3000)), shape)
    if shape == "literal":
        return '{"items": ' * min(n, 500) + '{"type": "integer"}' + "}" * min(n, 500)
    if shape == "wide":
        props = {f"p{i}": {"type": "integer"} for i in range(min(n, 3000))}
        return json.dumps({"type": "object", "properties": props, "required": ["p0"]})
    if shape == "cycle":
        return '{"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}}'
    return '{"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {}]}}}'


constraints = st.one_of(
    st.builds(
        lambda shape, n: StructuredOutputsParams(grammar=_lark(shape, n)),
        st.sampled_from(
            ["chain", "wide", "nested", "recursive", "left recursive", "empty", "nothing"]
        ),
        _depth,
    ),
    st.builds(
        lambda shape, n: StructuredOutputsParams(regex=_regex(shape, n)),
        st.sampled_from(["repeat", "nested", "wide", "repeat of repeat", "impossible"]),
        _depth,
    ),
    st.builds(
        lambda shape, n: StructuredOutputsParams(json=_schema(shape, n)),
        st.sampled_from(["ref", "allOf", "property", "literal", "wide", "cycle", "recursive"]),
        _depth,
    ),
)


def test_fuzzed_grammars_leave_the_engine_and_a_bystander_alone(
    served: tuple[LoopThread, AsyncEngine], capfd: pytest.CaptureFixture[str]
) -> None:
    loop, engine = served
    stop = asyncio.Event()
    gaps: list[float] = []

    async def bystanders() -> int:
        finished = 0
        while not stop.is_set():
            gaps.append(await bystander(engine))
            finished += 1
        return finished

    watch = loop.run(_start(bystanders()))

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(params=constraints)
    def one(params: StructuredOutputsParams) -> None:
        async def run() -> None:
            try:
                async for output in engine.generate(
                    "Go:", SamplingParams(max_tokens=4, structured_outputs=params)
                ):
                    # a failed grammar never passes for a finished answer
                    assert output.finish_reason in (None, "length", "stop"), output
            except InvalidRequestError as exc:
                assert exc.field is not None and exc.field.startswith("structured_outputs")

        loop.run(asyncio.wait_for(run(), PATIENCE_S))
        assert engine.failure is None

    one()
    loop.loop.call_soon_threadsafe(stop.set)
    finished = loop.run(asyncio.wait_for(_wait(watch), PATIENCE_S))
    assert finished >= 1 and max(gaps) < MAX_GAP_S, gaps
    assert engine.failure is None
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Segmentation" not in err, err[-4000:]


async def _start(coroutine: Any) -> asyncio.Task[Any]:
    return asyncio.create_task(coroutine)


async def _wait(task: asyncio.Task[Any]) -> Any:
    return await task
