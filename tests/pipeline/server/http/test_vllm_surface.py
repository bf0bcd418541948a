"""vLLM's surface of ``actorline serve --http-port`` (the shared tiny-model server of
:mod:`tests.pipeline.server.http.conftest`): ``/v1/models`` cards as vLLM's clients read them,
``model`` left out, ``/tokenize`` (both forms) and ``/detokenize`` agreeing with the model's
own tokenizer and with what generation counts, ``/version``, 404 and 405 with a code, and no
field silently ignored: every field the server does not implement is a 400 naming it unless
its value asks for what the server does anyway; gRPC reflection as v1 and v1alpha."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import grpc
import grpc.aio
import openai
import pytest
from transformers import AutoTokenizer

from tests.pipeline.server.http.conftest import API_KEY, IGNORE_EOS, MODEL
from tests.pipeline.server.serving import ServeProcess

pytestmark = pytest.mark.slow


def call(
    serve: ServeProcess, path: str, body: dict[str, Any] | None = None, key: str | None = API_KEY
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(serve.base_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_model_cards_carry_vllms_fields(client: openai.OpenAI) -> None:
    card = client.models.list().data[0]
    extra = card.model_extra or {}
    assert card.id == MODEL
    assert extra["root"] and extra["parent"] is None
    permission = extra["permission"][0]
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True


def test_model_may_be_left_out(openai_serve: ServeProcess) -> None:
    status, body = call(
        openai_serve, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **IGNORE_EOS}
    )
    assert status == 200, body
    assert body["model"] == MODEL and body["usage"]["completion_tokens"] == 2


def test_model_may_be_named_by_its_root(openai_serve: ServeProcess, client: openai.OpenAI) -> None:
    """``vllm bench serve`` without ``--model`` sends the card's ``root`` to ``/tokenize``."""
    root = (client.models.list().data[0].model_extra or {})["root"]
    status, body = call(openai_serve, "/tokenize", {"model": root, "prompt": "Hi"})
    assert status == 200 and body["count"] > 0, body
    body = {"model": root, "prompt": "Hi", "max_tokens": 1}
    status, answer = call(openai_serve, "/v1/completions", body)
    assert status == 200 and answer["model"] == MODEL, answer
    status, answer = call(openai_serve, "/v1/completions", body | {"model": "other"})
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer


def test_tokenize_and_detokenize_agree_with_the_tokenizer(
    openai_serve: ServeProcess, tiny_model_dir: Any, client: openai.OpenAI
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Hello there, general Kenobi"
    status, body = call(openai_serve, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200, body
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert completion.usage is not None and completion.usage.prompt_tokens == body["count"]

    status, back = call(openai_serve, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == tokenizer.decode(body["tokens"])

    if tokenizer.chat_template:
        messages = [{"role": "user", "content": "Hi there"}]
        status, chat = call(openai_serve, "/tokenize", {"messages": messages})
        assert status == 200, chat
        answer = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=1,  # type: ignore[arg-type]
        )
        assert answer.usage is not None and answer.usage.prompt_tokens == chat["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "colour": []}, "colour"),
        ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
    ],
    ids=["both-forms", "no-form", "unknown-field", "not-a-token"],
)
def test_token_endpoints_refuse_bad_bodies(
    openai_serve: ServeProcess, path: str, body: dict[str, Any], param: str
) -> None:
    status, answer = call(openai_serve, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_token_endpoints_need_the_key_and_version_does_not(openai_serve: ServeProcess) -> None:
    status, answer = call(openai_serve, "/tokenize", {"prompt": "a"}, key=None)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    status, version = call(openai_serve, "/version", key=None)
    assert status == 200 and version["version"]


def test_unknown_paths_and_methods_have_a_code(openai_serve: ServeProcess) -> None:
    status, answer = call(openai_serve, "/nothing-here")
    assert status == 404 and answer["error"]["code"] == "not_found"
    status, answer = call(openai_serve, "/version", {"x": 1})
    assert status == 405 and answer["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"logits_processors": ["x"]}, "logits_processors"),
        ("/v1/completions", {"cache_salt": "x"}, "cache_salt"),
        ("/v1/completions", {"add_special_tokens": False}, "add_special_tokens"),
        ("/v1/completions", {"no_such_field": 1}, "no_such_field"),
        ("/v1/completions", {"store": True}, "store"),
        ("/v1/completions", {"priority": 3}, "priority"),
        ("/v1/completions", {"chat_template": "{{ x }}"}, "chat_template"),
        ("/v1/completions", {"add_generation_prompt": False}, "add_generation_prompt"),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"x": True}},
         "stream_options.x"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": "x"}]},
         "messages[0].name"),
    ],
)  # fmt: skip
def test_fields_not_implemented_are_refused_by_name(
    openai_serve: ServeProcess, path: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    body |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [
        {"role": "user", "content": "Hi"}]}  # fmt: skip
    status, answer = call(openai_serve, path, body | extra)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["code"] == "unsupported_value"
    assert param.split(".")[-1].split("[")[0] in answer["error"]["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"store": False, "service_tier": "auto", "metadata": None},
        {"add_special_tokens": True, "spaces_between_special_tokens": True, "priority": 0},
        {"skip_special_tokens": False, "include_stop_str_in_output": True},
    ],
)
def test_fields_at_values_the_server_honours_are_accepted(
    openai_serve: ServeProcess, extra: dict[str, Any]
) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **IGNORE_EOS, **extra}
    status, answer = call(openai_serve, "/v1/completions", body)
    assert status == 200, answer


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_grpc_reflection_is_served_as_v1_and_v1alpha(
    openai_serve: ServeProcess, version: str
) -> None:
    """grpcurl asks ``grpc.reflection.v1`` first; both answer the services and their
    schemas."""
    from grpc_reflection.v1alpha import reflection_pb2

    async def ask() -> list[reflection_pb2.ServerReflectionResponse]:
        assert openai_serve.address is not None
        async with grpc.aio.insecure_channel(openai_serve.address) as channel:
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            queries = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="actorline.v1.Generation"
                ),
            ]
            return [reply async for reply in call(iter(queries))]

    listed, schema = asyncio.run(ask())
    names = {service.name for service in listed.list_services_response.service}
    assert "actorline.v1.Generation" in names and "grpc.health.v1.Health" in names
    assert schema.file_descriptor_response.file_descriptor_proto
