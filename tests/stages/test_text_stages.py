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


# -- the engine's stop token, and text held back at a finish ---------------------------------


def test_engine_stop_token_text_is_left_out_unless_asked(default_model_dir: Path) -> None:
    """An engine stop (a stop token id, or EOS) ends on a token whose text is not part of the
    output (vLLM V1): the token stays in token_ids. include_stop_str_in_output keeps it; a
    request ending on the same token by length keeps it too."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    ids = tokenizer.encode(" Paris.", add_special_tokens=False) + newline
    outputs, _ = stream(
        default_model_dir, ids, SamplingParams(stop_token_ids=tuple(newline)), "stop"
    )
    assert outputs[-1].text == " Paris." and outputs[-1].token_ids == tuple(ids)
    assert "".join(output.delta for output in outputs) == " Paris."
    kept = SamplingParams(stop_token_ids=tuple(newline), include_stop_str_in_output=True)
    outputs, _ = stream(default_model_dir, ids, kept, "stop")
    assert outputs[-1].text == " Paris.\n"
    outputs, _ = stream(default_model_dir, ids, SamplingParams(), "length")
    assert outputs[-1].text == " Paris.\n"

    (end_of_turn,) = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    with_eos = [*tokenizer.encode(" Hi!", add_special_tokens=False), end_of_turn]
    shown = SamplingParams(skip_special_tokens=False)
    outputs, _ = stream(default_model_dir, with_eos, shown, "stop")
    assert outputs[-1].text == " Hi!" and outputs[-1].token_ids[-1] == end_of_turn
    outputs, _ = stream(
        default_model_dir, with_eos, shown.replace(include_stop_str_in_output=True), "stop"
    )
    assert outputs[-1].text == " Hi!<|im_end|>"


def test_held_back_text_is_delivered_at_length(default_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    # " three" could be the start of the stop string: held back until the request finishes
    outputs, _ = stream(default_model_dir, ids, SamplingParams(stop=(" three four",)), "length")
    assert outputs[-2].text == " one two"
    final = outputs[-1]
    assert final.finish_reason == "length" and final.text == " one two three"
    assert final.delta == " three"


def abort_midway(
    model: Path, token_ids: list[int], params: SamplingParams
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """Feed ``token_ids`` one per step, then abort the request as the API does: the outputs
    before the abort, and what stop-check sends for the abort."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = tuple(tokenizer.encode(PROMPT))

    async def body() -> tuple[list[RequestOutput], list[RequestOutput]]:
        streamed: list[RequestOutput] = []
        async with await text_pipeline(model).start() as running:
            await running.send("in", EngineRequest("r1", prompt_ids, params))
            for token in token_ids:
                await running.send("in", EngineOutputs(("r1",), ((token,),), (None,), (None,)))
                batch = await running.receive("out")
                assert isinstance(batch, RequestOutputs)
                streamed.extend(batch.outputs)
            await running.send("in", AbortRequests(("r1",)))
            # a later request's output shows that everything the abort caused came before it
            await running.send("in", EngineRequest("r2", prompt_ids, SamplingParams()))
            await running.send(
                "in", EngineOutputs(("r2",), ((token_ids[0],),), ("length",), (None,))
            )
            answered: list[RequestOutput] = []
            while True:
                batch = await running.receive("out")
                assert isinstance(batch, RequestOutputs)
                answered.extend(o for o in batch.outputs if o.request_id == "r1")
                if any(o.request_id == "r2" for o in batch.outputs):
                    return streamed, answered

    return asyncio.run(asyncio.wait_for(body(), 120))


def test_an_abort_delivers_the_held_back_text(default_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    streamed, (final,) = abort_midway(default_model_dir, ids, SamplingParams(stop=(" three four",)))
    assert streamed[-1].text == " one two"  # " three" held back
    assert final.finish_reason == "abort" and final.stop_reason is None
    assert final.text == " one two three" and final.delta == " three"
    assert final.token_ids == tuple(ids)
    # without stop strings nothing is held: the API ends such a stream itself, no output here
    streamed, answered = abort_midway(default_model_dir, ids, SamplingParams())
    assert streamed[-1].text == " one two three" and answered == []


def test_an_abort_that_overtakes_its_request_leaves_no_state(default_model_dir: Path) -> None:
    # The API sends aborts straight to detokenize while the request still passes tokenize:
    # the request arriving after its abort must be dropped, not tracked forever.
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt_ids = tuple(tokenizer.encode(PROMPT))

    async def body() -> None:
        async with await text_pipeline(default_model_dir).start() as running:
            await running.send("in", AbortRequests(("early",)))
            await running.send("in", EngineRequest("early", prompt_ids, SamplingParams()))
            await running.send("in", EngineRequest("r1", prompt_ids, SamplingParams()))
            await running.send("in", EngineOutputs(("r1",), ((11,),), ("length",), (None,)))
            batch = await running.receive("out")
            assert isinstance(batch, RequestOutputs)
            assert [o.request_id for o in batch.outputs] == ["r1"]
            detokenize = running.stage("detokenize")
            stop_check = running.stage("stop_check")
            assert isinstance(detokenize, DetokenizeStage)
            assert isinstance(stop_check, StopCheckStage)
            assert detokenize._requests == {} and stop_check._requests == {}
            assert len(detokenize._early_aborts) == 0

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_prefetched_tokenizer_goes_to_the_next_load(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import TokenizersBackend

    from stages.tokenize import load_tokenizer, prefetch_tokenizer

    loads: list[str] = []
    real = TokenizersBackend.from_pretrained

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        loads.append(str(args[0]))
        return real(*args, **kwargs)

    # NOTE: the tiny model's tokenizer is the plain class, which loads without AutoTokenizer
    monkeypatch.setattr(TokenizersBackend, "from_pretrained", counting)
    model = str(tiny_model_dir)
    prefetch_tokenizer(model)
    prefetch_tokenizer(model)  # one at a time per model
    first = load_tokenizer(model)  # waits for the prefetch and takes it
    assert len(loads) == 1
    second = load_tokenizer(model)  # taken: a load of its own
    assert len(loads) == 2 and second is not first
    assert second.encode("Hi") == first.encode("Hi")
    prefetch_tokenizer(str(tiny_model_dir / "missing"))
    with pytest.raises(Exception, match="missing"):
        load_tokenizer(str(tiny_model_dir / "missing"))  # the error of a plain load
