"""The parse stage in the real pipeline (the tiny random model, every stage in this process):
a reasoning parser moves a chat's ``<think>`` part into ``reasoning`` (deepseek_r1: an output
without ``</think>`` is all reasoning), leaving other requests alone; a named function through
the Python API answers with a call whose arguments follow its schema."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import jsonschema
import pytest

from pipeline.engine.async_engine import AsyncEngine
from stages.errors import InvalidRequestError
from stages.messages import RequestOutput, ToolSpec
from stages.params import SamplingParams
from stages.tools import ToolUse

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}


async def last(engine: AsyncEngine, prompt: object, **options: object) -> list[RequestOutput]:
    outputs = []
    async for output in engine.generate(prompt, **options):  # type: ignore[arg-type]
        outputs.append(output)
    return outputs


@pytest.mark.slow
def test_reasoning_and_a_named_call_through_the_pipeline(tiny_model_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(
            str(tiny_model_dir), transport="memory", reasoning_parser="deepseek_r1",
            num_blocks=64,
        )  # fmt: skip
        async with engine:
            greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            chat = await last(engine, [{"role": "user", "content": "Hi"}], sampling_params=greedy)
            # the same prompt as a plain prompt wrapped by the template: not parsed
            plain = await last(engine, "Hi", sampling_params=greedy, chat_template=True)
            assert plain[-1].reasoning == "" and plain[-1].text
            # deepseek_r1: no </think> in a random model's output, so all of it is reasoning,
            # streamed as it grew
            assert chat[-1].text == "" and chat[-1].reasoning == plain[-1].text
            reasonings = [output.reasoning for output in chat]
            assert all(b.startswith(a) for a, b in itertools.pairwise(reasonings))
            assert len(set(reasonings)) > 2

            weather = ToolSpec("get_weather", "weather", json.dumps(SCHEMA))
            named = await last(
                engine,
                [{"role": "user", "content": "Weather?"}],
                sampling_params=SamplingParams(max_tokens=60, temperature=1.0, seed=4),
                tools=ToolUse((weather,), "get_weather"),
            )
            final = named[-1]
            assert final.finish_reason == "tool_calls" and final.reasoning == ""
            (call,) = final.tool_calls
            assert call.name == "get_weather" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.arguments), SCHEMA)

    asyncio.run(main())


@pytest.mark.slow
def test_llm_chat_with_tools_required(tiny_model_dir: Path) -> None:
    """vLLM's ``LLM.chat(..., tools=...)`` shape: OpenAI tool dicts, ``required``."""
    from pipeline.engine.llm import LLM

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    with LLM(str(tiny_model_dir), transport="memory", num_blocks=64) as llm:
        (output,) = llm.chat(
            [{"role": "user", "content": "Weather?"}],
            SamplingParams(max_tokens=80, temperature=1.0, seed=2),
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        assert output.finish_reason == "tool_calls" and output.text == ""
        (call,) = output.tool_calls
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
        with pytest.raises(InvalidRequestError) as caught:
            llm.chat([{"role": "user", "content": "x"}], tools=[{"function": {"name": "a b"}}])
        assert caught.value.field == "tools[0].function.name"
