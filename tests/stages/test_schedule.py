"""The schedule stage's structured outputs, end to end on the null model (no forward pass, so
every token is drawn uniformly among those the grammar allows): constrained outputs match,
grammars compile in the background while free requests run, a grammar that does not compile
fails only its request, aborts during a compile, preemption, and both topologies."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from pipeline import AsyncEngine, InvalidRequestError, SamplingParams, StructuredOutputsParams
from stages.messages import RequestOutput

PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
COLORS = ("red", "green", "blue", "ultraviolet")


async def final(
    engine: AsyncEngine, prompt: str, params: SamplingParams, **kw: Any
) -> RequestOutput:
    last: RequestOutput | None = None
    async for output in engine.generate(prompt, params, **kw):
        last = output
    assert last is not None
    return last


def constrained(kind: str, **extra: Any) -> SamplingParams:
    if kind == "regex":
        so = StructuredOutputsParams(regex=PHONE)
    else:
        so = StructuredOutputsParams(choice=COLORS)
    return SamplingParams(max_tokens=64, structured_outputs=so, **extra)


def check(output: RequestOutput, kind: str) -> None:
    assert output.finish_reason == "stop", output
    if kind == "regex":
        assert re.fullmatch(PHONE, output.text), output.text
    else:
        assert output.text in COLORS, output.text


@pytest.mark.parametrize("transport", ["memory", "zmq"])
def test_constrained_and_free_requests_share_the_engine(
    tiny_model_dir: Path, transport: str
) -> None:
    async def run() -> None:
        async with AsyncEngine(str(tiny_model_dir), null_model=True, transport=transport) as engine:
            kinds = ["regex", "choice"] * 6
            free = SamplingParams(max_tokens=20, ignore_eos=True)
            outputs = await asyncio.gather(
                *(final(engine, f"q{i}", constrained(k, seed=i)) for i, k in enumerate(kinds)),
                *(final(engine, f"free {i}", free) for i in range(4)),
            )
            for output, kind in zip(outputs, kinds):
                check(output, kind)
            assert all(len(o.token_ids) == 20 for o in outputs[len(kinds) :])
            # streaming: the deltas add up to the constrained text
            text = ""
            async for output in engine.generate("stream", constrained("regex")):
                text += output.delta
            assert re.fullmatch(PHONE, text)

    asyncio.run(run())


def test_a_grammar_that_does_not_compile_fails_only_its_request(tiny_model_dir: Path) -> None:
    bad = SamplingParams(
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(json='{"type": "array", "uniqueItems": true}'),
    )
    lookahead = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(?=x)y"))

    async def run() -> None:
        async with AsyncEngine(str(tiny_model_dir), null_model=True, transport="memory") as engine:
            results = await asyncio.gather(
                final(engine, "a", bad),
                final(engine, "b", constrained("choice")),
                final(engine, "c", lookahead),
                final(engine, "d", SamplingParams(max_tokens=5, ignore_eos=True)),
                return_exceptions=True,
            )
            assert isinstance(results[0], InvalidRequestError), results[0]
            assert results[0].field == "structured_outputs.json"
            assert "uniqueItems" in str(results[0])
            assert isinstance(results[2], InvalidRequestError)
            assert results[2].field == "structured_outputs.regex"
            check(results[1], "choice")  # type: ignore[arg-type]
            assert len(results[3].token_ids) == 5  # type: ignore[union-attr]
            # two constraints at once: refused before anything is queued
            with pytest.raises(InvalidRequestError) as caught:
                await final(
                    engine,
                    "e",
                    SamplingParams(
                        structured_outputs=StructuredOutputsParams(regex="a", json="{}")
                    ),
                )
            assert caught.value.field == "structured_outputs"
            # and the same bad grammar again: refused again (failures are not cached as good)
            with pytest.raises(InvalidRequestError, match="uniqueItems"):
                await final(engine, "f", bad)
            check(await final(engine, "g", constrained("regex")), "regex")

    asyncio.run(run())


def test_abort_during_a_compile_and_preemption_keep_outputs_valid(tiny_model_dir: Path) -> None:
    """A request cancelled while its grammar compiles never runs; with a KV cache too small
    for the batch, constrained requests are preempted and resumed and still match."""

    async def run() -> None:
        async with AsyncEngine(
            str(tiny_model_dir), null_model=True, transport="memory", num_blocks=24
        ) as engine:
            fresh = SamplingParams(
                max_tokens=40, structured_outputs=StructuredOutputsParams(regex="[a-c]{30}x")
            )
            task = asyncio.ensure_future(final(engine, "cancelled", fresh))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # distinct prompts (no shared prefix blocks), 12 x ~60 tokens > 24 blocks of 16
            prompts = [" ".join(str(1000 * i + j) for j in range(12)) for i in range(12)]
            outputs = await asyncio.gather(*(final(engine, p, fresh) for p in prompts))
            for output in outputs:
                assert re.fullmatch("[a-c]{30}x", output.text), output.text
            stats = engine.stats
            assert stats is not None and stats.num_preemptions > 0
            assert stats.kv_blocks_free == stats.kv_blocks_total

    asyncio.run(run())
