"""The synchronous LLM wrapper, on the real default model and on the tiny one. Tests that
take ``llm`` share the package's engine of default options (each leaves it idle, no observer
attached); a test that needs other options, or closes it, starts its own."""

from __future__ import annotations

import gc
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from pipeline import LLM, InvalidRequestError, PipelineClosedError, SamplingParams
from stages.messages import ChatMessage


@pytest.fixture
def llm(tiny_llm: LLM) -> LLM:
    """The package's engine of default options (tests/pipeline/engine/conftest.py)."""
    return tiny_llm


@pytest.mark.slow
@pytest.mark.model
def test_default_model_knows_the_capital_of_france() -> None:
    with LLM("smollm2-135m") as llm:
        (output,) = llm.generate(
            [[{"role": "user", "content": "What is the capital of France?"}]],
            SamplingParams(max_tokens=24, temperature=0.0),
        )
    assert "Paris" in output.text, output.text
    assert output.finish_reason in ("stop", "length")


def test_outputs_in_order_with_per_prompt_params(llm: LLM) -> None:
    prompts = [f"prompt number {i}" for i in range(10)]
    params = [SamplingParams(max_tokens=i + 1, temperature=0.0, ignore_eos=True) for i in range(10)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == list(range(1, 11))
    assert all(o.finish_reason == "length" for o in outputs)
    # one SamplingParams for all; a single prompt string gives a list of one
    (single,) = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0.0))
    assert single.finish_reason in ("stop", "length")
    with pytest.raises(InvalidRequestError, match="3 SamplingParams for 10 prompts"):
        llm.generate(prompts, params[:3])
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    # still serving after bad input
    assert len(llm.generate(["again"], SamplingParams(max_tokens=2))[0].token_ids) <= 2


@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_during_generate_aborts_the_batch(tiny_model_dir: Path) -> None:
    """SIGINT while generate() waits: KeyboardInterrupt reaches the caller, every request of
    the batch is aborted (all KV blocks free again) and the LLM keeps working."""
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model_dir), transport="memory", num_blocks=256) as llm:
        timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["one", "two", "three"], params, use_tqdm=False)
        timer.join()
        assert llm.engine.num_unfinished_requests == 0  # aborted before generate() returned
        deadline = time.monotonic() + 10
        while not _all_free(llm) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _all_free(llm), llm.engine.stats
        (again,) = llm.generate(["again"], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(again.token_ids) == 3


def _all_free(llm: LLM) -> bool:
    stats = llm.engine.stats
    return (
        stats is not None
        and stats.num_running == 0
        and stats.kv_blocks_free == stats.kv_blocks_total
    )


def test_progress_bar_only_for_large_batches(llm: LLM, capfd: pytest.CaptureFixture[str]) -> None:
    """A batch of PROGRESS_BAR_MIN_PROMPTS or more shows a tqdm bar on stderr by default;
    use_tqdm=False and smaller batches show none."""
    from pipeline.engine.llm import PROGRESS_BAR_MIN_PROMPTS

    assert PROGRESS_BAR_MIN_PROMPTS == 8
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    big = [f"prompt number {i}" for i in range(9)]
    capfd.readouterr()
    assert len(llm.generate(big, params)) == 9
    shown = capfd.readouterr().err
    assert "generating" in shown and "9/9" in shown and "100%" in shown, shown
    assert len(llm.generate(big[:8], params)) == 8
    assert "8/8" in capfd.readouterr().err
    assert len(llm.generate(big, params, use_tqdm=False)) == 9
    assert "generating" not in capfd.readouterr().err
    assert len(llm.generate(big[:7], params)) == 7
    assert "generating" not in capfd.readouterr().err


def test_final_outputs_carry_timing_metrics(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(["one", "two", "three"], params, use_tqdm=False)
    for output in outputs:
        assert output.finish_reason == "length" and output.metrics is not None
        ttft, total = output.metrics.time_to_first_token, output.metrics.total_time
        assert ttft is not None and total is not None, output.metrics
        assert 0 < ttft <= total


def test_bad_sampling_params_in_a_batch_send_nothing(llm: LLM) -> None:
    from pipeline.engine.async_engine import EngineObserver

    class Sent(EngineObserver):
        def __init__(self) -> None:
            self.ids: list[str] = []

        def request_sent(self, request: Any) -> None:
            self.ids.append(request.request_id)

    params = [SamplingParams(max_tokens=4), SamplingParams(top_p=5.0)]
    sent = Sent()
    llm.engine.add_observer(sent)
    try:
        with pytest.raises(InvalidRequestError, match="top_p") as caught:
            llm.generate(["fine", "also fine"], params)
        assert caught.value.field == "top_p"
        assert sent.ids == []  # nothing was sent
        llm.generate(["fine"], params[0])
        assert len(sent.ids) == 1
    finally:
        llm.engine.remove_observer(sent)


def test_chat_messages_as_objects_are_one_conversation(llm: LLM) -> None:
    """A list of ChatMessage is one conversation, as a list of role/content dicts is (and as
    AsyncEngine.generate takes it), in both generate and chat."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    as_dicts = [{"role": "user", "content": "Hi"}]
    as_objects = [ChatMessage("user", "Hi")]
    other = [ChatMessage("user", "Bye")]
    (expected,) = llm.chat(as_dicts, params)
    for outputs in (
        llm.generate(as_objects, params),
        llm.chat(as_objects, params),
        llm.generate([as_objects], params),
    ):
        assert [output.text for output in outputs] == [expected.text]
        assert outputs[0].token_ids == expected.token_ids
    first, second = llm.chat([as_objects, other], params)
    assert first.token_ids == expected.token_ids
    assert second.token_ids == llm.chat(other, params)[0].token_ids


def test_using_a_closed_llm_raises_pipeline_closed_error(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), transport="memory")
    llm.close()
    llm.close()  # idempotent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(PipelineClosedError, match="closed"):
            llm.generate("hello", SamplingParams(max_tokens=2))
        with pytest.raises(PipelineClosedError, match="closed"):
            llm.chat([{"role": "user", "content": "Hi"}])
        with pytest.raises(PipelineClosedError):  # the loop thread underneath refuses too
            llm._loop.run(llm.engine.close())
        gc.collect()  # an un-awaited coroutine warns when it is collected
    assert [str(warning.message) for warning in caught] == []


def test_a_batch_larger_than_the_queue_bound_runs_whole(tiny_model_dir: Path) -> None:
    """As vLLM's offline LLM: every prompt of a batch runs, however many; the engine's queue
    bound and rate limits pace the batch instead of failing it."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [f"prompt {i}" for i in range(12)]
    with LLM(
        str(tiny_model_dir), transport="memory", max_queued_requests=2, requests_per_second=20.0
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(output.token_ids) for output in outputs] == [2] * len(prompts)


def test_vllm_prompt_dicts_and_keyword(llm: LLM) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (by_text,) = llm.generate("hello there", params)
    outputs = llm.generate(
        [{"prompt": "hello there"}, {"prompt_token_ids": [5, 6, 7]}], sampling_params=params
    )
    assert outputs[0].token_ids == by_text.token_ids
    (single,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    assert single.token_ids == outputs[1].token_ids == llm.generate([5, 6, 7], params)[0].token_ids
    with pytest.raises(InvalidRequestError, match="prompt dict") as caught:
        llm.generate({"prompt": "x", "multi_modal_data": {}}, params)
    assert caught.value.field == "prompt"
    with pytest.raises(InvalidRequestError, match="prompt_token_ids must be a list"):
        llm.generate({"prompt_token_ids": "5 6 7"}, params)


def test_chat_takes_vllms_template_options(llm: LLM, tiny_model_dir: Path) -> None:
    """``LLM.chat`` with vLLM's ``chat_template``, ``chat_template_kwargs``,
    ``add_generation_prompt`` and ``continue_final_message``: the prompt is what the
    tokenizer renders with them (the outputs' ``prompt_token_ids``); bad ones are refused by
    name and the LLM goes on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content | upper if shout else m.content }}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    chat = [{"role": "user", "content": "Hi there"}]
    history = [*chat, {"role": "assistant", "content": "Hello, I am"}]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def expected(messages: Any, add_generation_prompt: bool = True, **options: Any) -> Any:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **options
        )
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    (own,) = llm.chat(
        chat, params, use_tqdm=False, chat_template=template,
        chat_template_kwargs={"shout": True},
    )  # fmt: skip
    assert own.prompt_token_ids == expected(chat, chat_template=template, shout=True)
    assert tokenizer.decode(own.prompt_token_ids) == "<user>HI THERE<assistant>"
    assert len(own.token_ids) == 2
    (plain,) = llm.chat(chat, params, use_tqdm=False, add_generation_prompt=False)
    assert plain.prompt_token_ids == expected(chat, add_generation_prompt=False)
    (continued,) = llm.chat(
        history, params, use_tqdm=False, add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    assert continued.prompt_token_ids == expected(
        history, add_generation_prompt=False, continue_final_message=True
    )
    with pytest.raises(InvalidRequestError, match="add_generation_prompt") as caught:
        llm.chat(chat, params, continue_final_message=True)
    assert caught.value.field == "continue_final_message"
    with pytest.raises(InvalidRequestError, match="does not read") as caught:
        llm.chat(chat, params, chat_template_kwargs={"enable_thinking": True})
    assert caught.value.field == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError, match="nope") as caught:
        llm.chat(chat, params, chat_template="{{ raise_exception('nope') }}")
    assert caught.value.field == "chat_template"
    (again,) = llm.chat(chat, params, use_tqdm=False)
    assert again.prompt_token_ids == expected(chat, add_generation_prompt=True)
