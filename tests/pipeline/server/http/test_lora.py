"""LoRA adapters served by ``actorline serve --enable-lora --lora-modules`` (docs/lora.md),
driven by the official openai client and a gRPC stub: /v1/models lists the adapters with
their parent, ``model: "name"`` selects one (greedy tokens as HF's with the adapter merged),
an unknown adapter is a 404 naming it, an adapter over max_lora_rank a 400 naming it, and
gRPC's ``lora_name`` selects the same adapter."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import httpx
import openai
import pytest

from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc
from tests.pipeline.server.http.conftest import EXIT_TIMEOUT, MODEL, openai_serve_arguments
from tests.pipeline.server.serving import ServeProcess
from tests.stages.execute.driving import HFReference
from tests.stages.execute.lora_adapters import make_adapter

PROMPT = [101, 2045, 3077, 517, 9000, 12, 77, 4242, 31, 5]
MAX_TOKENS = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-lora")
    return {
        "a1": make_adapter(tiny_model_dir, root / "a1", seed=11),
        "a2": make_adapter(tiny_model_dir, root / "a2", seed=12, targets=("q_proj", "v_proj")),
        "big": make_adapter(tiny_model_dir, root / "big", seed=13, rank=16, merged=False),
    }


@pytest.fixture(scope="module")
def lora_serve(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    modules = [
        f"a1={adapters['a1']}",
        json.dumps({"name": "a2", "path": str(adapters["a2"])}),
        f"big={adapters['big']}",
    ]
    serve = ServeProcess(
        openai_serve_arguments(
            tiny_model_dir, "--num-blocks", "64", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", *modules,
        ),
        tmp_path_factory.mktemp("lora-serve") / "stderr.txt",
    )  # fmt: skip
    try:
        yield serve
        serve.process.send_signal(signal.SIGINT)
        assert serve.process.wait(timeout=EXIT_TIMEOUT) == 0, serve.stderr[-3000:]
        assert "Traceback" not in serve.stderr, serve.stderr[-3000:]
    finally:
        serve.kill()


@pytest.fixture(scope="module")
def client(lora_serve: ServeProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=lora_serve.http_url, api_key="none", max_retries=0) as made:
        yield made


def greedy_token_ids(client: openai.OpenAI, model: str) -> tuple[str, list[int]]:
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    extra = response.choices[0].model_extra or {}
    return response.model, list(extra["token_ids"])


def test_models_lists_the_adapters_with_the_base_as_parent(
    client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    cards = {card.id: card.model_extra or {} for card in client.models.list().data}
    assert list(cards) == [MODEL, "a1", "a2", "big"]
    assert cards[MODEL]["parent"] is None
    for name in ("a1", "a2", "big"):
        assert cards[name]["parent"] == MODEL
        assert cards[name]["root"] == str(adapters[name])


def test_model_name_selects_the_adapter(
    client: openai.OpenAI, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    base_model, base = greedy_token_ids(client, MODEL)
    assert base_model == MODEL
    assert base == HFReference(tiny_model_dir).greedy(PROMPT, MAX_TOKENS)
    for name in ("a1", "a2"):
        served_as, tokens = greedy_token_ids(client, name)
        assert served_as == name
        assert tokens == HFReference(Path(f"{adapters[name]}-merged")).greedy(PROMPT, MAX_TOKENS)
        assert tokens != base
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "a1" and chat.choices[0].message.content


def test_unknown_and_unservable_adapters_are_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        greedy_token_ids(client, "nope")
    assert "'nope' does not exist" in str(missing.value) and "'a1'" in str(missing.value)
    with pytest.raises(openai.BadRequestError) as too_big:
        greedy_token_ids(client, "big")
    assert "'big'" in str(too_big.value) and "above max_lora_rank 8" in str(too_big.value)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="a1", input="hi")
    assert greedy_token_ids(client, "a1")[0] == "a1"  # the server serves on


def test_runtime_updates_are_off_by_default(lora_serve: ServeProcess) -> None:
    body = {"lora_name": "a3", "lora_path": "/x"}
    for path in ("load_lora_adapter", "unload_lora_adapter"):
        assert httpx.post(f"{lora_serve.http_url}/{path}", json=body).status_code == 404


def test_grpc_lora_name_selects_the_adapter(
    lora_serve: ServeProcess, client: openai.OpenAI
) -> None:
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[list[int], grpc.aio.AioRpcError]:
        assert lora_serve.address is not None
        async with grpc.aio.insecure_channel(lora_serve.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=PROMPT), sampling_params=params, lora_name="a2"
            )
            tokens = [t async for r in stub.Generate(request) for t in r.token_ids]
            unknown = pb.GenerateRequest(text="hi", sampling_params=params, lora_name="nope")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(unknown):
                    pass
            return tokens, caught.value

    tokens, refused = asyncio.run(main())
    assert tokens == greedy_token_ids(client, "a2")[1]
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'nope'" in (refused.details() or "")
