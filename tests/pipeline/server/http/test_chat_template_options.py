"""vLLM's chat template fields of a request (``chat_template``, ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``) through the real HTTP front end (the
shared server of :mod:`tests.pipeline.server.http.conftest`, which trusts requests' own
templates) with the official ``openai`` client, checked against ``/tokenize`` given the same
fields and against the tokenizer itself; their refusals, each a 400 naming its field; a
server that does not trust a request's template refusing it; the same over gRPC."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import openai
import pytest
from transformers import AutoTokenizer

from pipeline.engine.async_engine import AsyncEngine
from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc
from pipeline.server.convert import rendering_from_proto, request_to_proto
from pipeline.server.http.errors import ApiError
from pipeline.server.http.state import HttpService
from stages.chat_template import make_rendering
from stages.params import SamplingParams
from tests.pipeline.server.http.conftest import API_KEY, MODEL
from tests.pipeline.server.http.test_vllm_surface import call
from tests.pipeline.server.serving import ServeProcess, bearer

pytestmark = pytest.mark.slow

#: a template of the request's own, reading a variable of its own
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content | upper if shout else m.content }}\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hello there"}]


def chat_prompt_ids(client: openai.OpenAI, messages: Any, **extra: Any) -> list[int]:
    """The prompt token ids the server used for a chat (``return_token_ids``)."""
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={"return_token_ids": True, **extra},
    )  # fmt: skip
    ids = (answer.model_extra or {})["prompt_token_ids"]
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    return list(ids)


@pytest.mark.parametrize(
    ("extra", "template_call"),
    [
        ({"chat_template": TEMPLATE, "chat_template_kwargs": {"shout": True}},
         {"chat_template": TEMPLATE, "shout": True, "add_generation_prompt": True}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"chat_template": TEMPLATE, "chat_template_kwargs": {"shout": False},
          "add_generation_prompt": False},
         {"chat_template": TEMPLATE, "shout": False, "add_generation_prompt": False}),
    ],
)  # fmt: skip
def test_chat_renders_with_the_requests_options(
    client: openai.OpenAI,
    openai_serve: ServeProcess,
    tiny_model_dir: Path,
    extra: dict[str, Any],
    template_call: dict[str, Any],
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, **template_call)
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert chat_prompt_ids(client, MESSAGES, **extra) == expected
    status, tokens = call(openai_serve, "/tokenize", {"messages": MESSAGES, **extra})
    assert status == 200 and tokens["tokens"] == expected, tokens


def test_continue_final_message_prefills_the_answer(
    client: openai.OpenAI, openai_serve: ServeProcess, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    history = [*MESSAGES, {"role": "assistant", "content": "General Kenobi, you are"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    ids = chat_prompt_ids(client, history, **fields)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nGeneral Kenobi, you are")
    status, tokens = call(openai_serve, "/tokenize", {"messages": history, **fields})
    assert status == 200 and tokens["tokens"] == ids
    streamed = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=3, stream=True,
        extra_body={**fields, "ignore_eos": True},
    )  # fmt: skip
    assert sum(len(chunk.choices[0].delta.content or "") for chunk in streamed if chunk.choices)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"chat_template": "{% if %}"}, "chat_template", "not a valid Jinja"),
        ({"chat_template": "{{ raise_exception('nope') }}"}, "chat_template", "nope"),
        ({"chat_template": "{{ messages.__class__.__mro__ }}"}, "chat_template", "Security"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs",
         "does not read"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "dict"),
        ({"add_generation_prompt": None}, "add_generation_prompt", "bool"),
        ({"chat_template": "x" * 70_000}, "chat_template", "at most"),
    ],
)  # fmt: skip
def test_bad_options_are_a_400_naming_them(
    openai_serve: ServeProcess, extra: dict[str, Any], param: str, words: str
) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
        ("/tokenize", {"messages": MESSAGES}),
    ):
        status, answer = call(openai_serve, path, body | extra)
        assert status == 400, (path, answer)
        error = answer["error"]
        assert error["param"] == param, (path, error)
        assert re.search(words, error["message"]), (path, error)


def test_options_of_a_chat_are_refused_on_a_prompt(openai_serve: ServeProcess) -> None:
    for name, value in (("chat_template", TEMPLATE), ("add_generation_prompt", False)):
        status, answer = call(openai_serve, "/tokenize", {"prompt": "Hi", name: value})
        assert status == 400 and answer["error"]["param"] == name, answer
        status, answer = call(openai_serve, "/v1/completions", {"prompt": "Hi", name: value})
        assert status == 400 and answer["error"]["param"] == name, answer


def test_a_server_that_does_not_trust_templates_refuses_them(tiny_model_dir: Path) -> None:
    engine = AsyncEngine(model=str(tiny_model_dir))  # never started: refused before it
    rendering = make_rendering(TEMPLATE)
    choices = [(MESSAGES, SamplingParams(max_tokens=1))]
    with pytest.raises(ApiError) as caught:
        HttpService(engine, MODEL).check("r", choices, "", None, rendering)
    assert caught.value.status == 400 and caught.value.param == "chat_template"
    assert "--trust-request-chat-template" in str(caught.value)
    # the other options need no trust: they reach the engine (not started here: a 503)
    with pytest.raises(ApiError) as caught:
        HttpService(engine, MODEL).check("r", choices, "", None, make_rendering(None, None, False))
    assert caught.value.status == 503


def test_the_options_round_trip_through_the_proto() -> None:
    rendering = make_rendering(TEMPLATE, {"shout": True}, False, True)
    request = request_to_proto(MESSAGES, rendering=rendering)
    assert rendering_from_proto(request) == rendering
    assert rendering_from_proto(request_to_proto(MESSAGES)) is None
    defaults = pb.GenerateRequest(chat_template_options=pb.ChatTemplateOptions())
    assert rendering_from_proto(defaults) is None  # add_generation_prompt unset: true


def test_options_over_grpc(openai_serve: ServeProcess, tiny_model_dir: Path) -> None:
    """The Generation service takes the same options (``chat_template_options``): the
    prompt's token count is the tokenizer's rendering's; bad options are INVALID_ARGUMENT
    naming the field."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, chat_template=TEMPLATE, shout=True, add_generation_prompt=True
    )
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    good = request_to_proto(MESSAGES, params, rendering=make_rendering(TEMPLATE, {"shout": True}))
    bad = request_to_proto(MESSAGES, params, rendering=make_rendering(None, None, True, True))

    async def main() -> tuple[list[Any], grpc.aio.AioRpcError]:
        assert openai_serve.address is not None
        async with grpc.aio.insecure_channel(openai_serve.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            responses = [r async for r in stub.Generate(good, metadata=bearer(API_KEY))]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(bad, metadata=bearer(API_KEY)):
                    pass
            return responses, caught.value

    responses, refused = asyncio.run(main())
    assert responses[-1].usage.prompt_tokens == expected
    assert responses[-1].usage.completion_tokens == 2
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "continue_final_message" in (refused.details() or "")
