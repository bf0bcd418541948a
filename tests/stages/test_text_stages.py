"""The frontend text stages in a real pipeline: detokenize → stop_check, fed engine outputs one
token per step with the real SmolLM2 tokenizer (tokenize's output format, schedule's input)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pipeline import Pipeline
from stages.detokenize import DetokenizeConfig, DetokenizeStage
from stages.messages import (
    AbortRequests,
    EngineOutputs,
    EngineRequest,
    RequestOutput,
    RequestOutputs,
)
from stages.params import SamplingParams
from stages.stop_check import StopCheckStage

PROMPT = "Say something nice:"


def text_pipeline(model: Path) -> Pipeline:
    pipeline = Pipeline("text")
    pipeline.add("detokenize", DetokenizeStage, DetokenizeConfig(str(model)))
    pipeline.add("stop_check", StopCheckStage)
    pipeline.connect("detokenize", "stop_check")
    pipeline.entry("in", "detokenize").exit("out", "stop_check.out").exit(
        "abort", "stop_check.abort"
    )
    return pipeline


def stream(
    model: Path, token_ids: list[int], params: SamplingParams, engine_finish: str | None = "length"
) -> tuple[list[RequestOutput], list[Any]]:
    """Feed ``token_ids`` one per step; the last step carries ``engine_finish``."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = tuple(tokenizer.encode(PROMPT))

    async def body() -> tuple[list[RequestOutput], list[Any]]:
        outputs: list[RequestOutput] = []
        aborts: list[Any] = []
        async with await text_pipeline(model).start() as running:
            await running.send("in", EngineRequest("r1", prompt_ids, params))
            for index, token in enumerate(token_ids):
                last = index == len(token_ids) - 1
                await running.send(
                    "in",
                    EngineOutputs(
                        ("r1",), ((token,),), (engine_finish if last else None,), (None,)
                    ),
                )
                batch = await running.receive("out")
                assert isinstance(batch, RequestOutputs)
                outputs.extend(batch.outputs)
                if outputs and outputs[-1].finished:
                    break
            channel = running.exit_channel("abort")
            while len(channel):
                aborts.append(await running.receive("abort"))
        return outputs, aborts

    return asyncio.run(asyncio.wait_for(body(), 120))


@pytest.mark.parametrize(
    "text",
    [
        "Bonne journée 😀🎉 à tous",
        "日本語のテキストです。",
        "naïve café — 👩‍👩‍👧‍👦 family",
        "한국어 문장 🇫🇷",
    ],
)
def test_emoji_and_cjk_stream_without_partial_characters(
    default_model_dir: Path, text: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    assert len(ids) > len(text.split()), "the text must split characters across tokens"
    outputs, _ = stream(default_model_dir, ids, SamplingParams(max_tokens=len(ids)))
    deltas = [o.delta for o in outputs]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == outputs[-1].text
    assert any(delta == "" for delta in deltas[:-1]), "some token completed no character"
    assert outputs[-1].token_ids == tuple(ids) and outputs[-1].finish_reason == "length"


def test_stop_string_spanning_tokens_is_cut_and_never_partially_streamed(
    default_model_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = " The weather is lovely today, thank you very much for asking."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "thank you very"
    assert len(tokenizer.encode(" " + stop, add_special_tokens=False)) >= 3
    outputs, aborts = stream(default_model_dir, ids, SamplingParams(stop=(stop,)), None)
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == " The weather is lovely today, "
    for output in outputs:  # every streamed prefix is a prefix of the cut text
        assert final.text.startswith(output.text)
        assert "thank" not in output.text
    # stop-check asked schedule to free the request at once
    assert aborts == [AbortRequests(("r1",))]


def test_stop_string_kept_when_asked(default_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode(" one two three four five", add_special_tokens=False)
    params = SamplingParams(stop=("three",), include_stop_str_in_output=True)
    outputs, _ = stream(default_model_dir, ids, params, None)
    assert outputs[-1].text == " one two three"


def test_min_tokens_holds_back_stop_strings(default_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode(" stop here, then go on and stop again", add_special_tokens=False)
    outputs, _ = stream(default_model_dir, ids, SamplingParams(stop=("stop",), min_tokens=3), None)
    final = outputs[-1]
    assert final.finish_reason == "stop"
    # the first "stop" (token 1) comes before min_tokens; the second one ends the request
    assert final.text == " stop here, then go on and "
