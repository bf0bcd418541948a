"""Issue 34's grammar vectors against a real engine (zmq, its own process), each with a bystander
stream: what the hostile request gets, how long, the bystander's worst gap between tokens,
and whether the engine lives.

Usage, from the repository root: python -m benchmarks.grammar_vectors [MODEL]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from pipeline import AsyncEngine, SamplingParams, StructuredOutputsParams


def lark_chain(n: int) -> str:
    rules = [f'r{i}: "a" r{i + 1}' for i in range(n - 1)]
    return "\n".join(["start: r0", *rules, f'r{n - 1}: "a"'])


def gbnf_chain(n: int) -> str:
    return "\n".join(
        ["root ::= r0", *(f'r{i} ::= "a" r{i + 1}' for i in range(n - 1)), f'r{n - 1} ::= "a"']
    )


def chain_schema(n: int, link: str) -> str:
    def node(i: int) -> dict:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        if link == "ref":
            return ref
        if link == "allOf":
            return {"allOf": [ref]}
        return {"type": "object", "properties": {"x": ref}}

    defs = {f"d{i}": node(i) for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


VECTORS: dict[str, StructuredOutputsParams | None] = {
    "baseline (no constraint)": None,
    "lark chain 3000": StructuredOutputsParams(grammar=lark_chain(3000)),
    "lark chain 12000": StructuredOutputsParams(grammar=lark_chain(12000)),
    "gbnf chain 3000": StructuredOutputsParams(grammar=gbnf_chain(3000)),
    "gbnf chain 12000": StructuredOutputsParams(grammar=gbnf_chain(12000)),
    "$ref chain 3000": StructuredOutputsParams(json=chain_schema(3000, "ref")),
    "allOf chain 3000": StructuredOutputsParams(json=chain_schema(3000, "allOf")),
    "property $ref chain 3000": StructuredOutputsParams(json=chain_schema(3000, "prop")),
    "regex a{1000000}": StructuredOutputsParams(regex="a{1000000}"),
    "empty language": StructuredOutputsParams(grammar='start: "a" start'),
    "impossible regex [^\\s\\S]": StructuredOutputsParams(regex=r"[^\s\S]"),
}


async def bystander(engine: AsyncEngine, gaps: list[float], done: asyncio.Event) -> None:
    last = time.perf_counter()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    async for _ in engine.generate("Once upon a time", params):
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    done.set()


async def main(model: str) -> None:
    engine: AsyncEngine | None = None
    try:
        for name, params in VECTORS.items():
            if engine is None or engine.failure is not None:
                if engine is not None:
                    await engine.close()
                engine = AsyncEngine(model, transport="zmq")
                await engine.start()
                warm = SamplingParams(
                    max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a")
                )
                async for _ in engine.generate("hi", warm):  # the backend's tokenizer wrap
                    pass
            gaps: list[float] = []
            done = asyncio.Event()
            task = asyncio.create_task(bystander(engine, gaps, done))
            await asyncio.sleep(0.3)
            began = time.perf_counter()
            try:
                text, finish = "", None
                asked = SamplingParams(max_tokens=8, structured_outputs=params)
                async for out in engine.generate("Write:", asked):
                    text, finish = out.text, out.finish_reason
                answer = f"ok finish={finish} text={text[:20]!r}"
            except Exception as exc:  # what a caller sees
                answer = f"{type(exc).__name__}: {str(exc)[:110]}"
            took = time.perf_counter() - began
            try:
                await asyncio.wait_for(task, 300)
                by = (
                    f"bystander done, gaps median {sorted(gaps)[len(gaps) // 2] * 1e3:.0f} ms"
                    f" worst {max(gaps) * 1e3:.0f} ms"
                )
            except Exception as exc:
                by = f"bystander FAILED: {type(exc).__name__}: {str(exc)[:80]}"
            print(
                f"{name}: {answer} in {took * 1e3:.0f} ms; {by}; engine "
                f"{'DEAD' if engine.failure is not None else 'alive'}",
                flush=True,
            )
    finally:
        if engine is not None:
            await engine.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"))
