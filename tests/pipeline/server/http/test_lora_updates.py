"""LoRA adapters changed while ``actorline serve`` runs (docs/lora.md): vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (on with vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), their refusals, an unload while a stream of the
adapter runs, an API key bound to an adapter, and the LoRA metrics at ``/metrics``; driven by
the official openai client and httpx against the real server process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc
from tests.pipeline.server.http.conftest import (
    EXIT_TIMEOUT,
    MODEL,
    Metrics,
    metrics,
    openai_serve_arguments,
)
from tests.pipeline.server.serving import ServeProcess
from tests.stages.execute.driving import HFReference
from tests.stages.execute.lora_adapters import make_adapter

PROMPT = [101, 2045, 3077, 517, 9000, 12, 77, 4242, 31, 5]
MAX_TOKENS = 8
ADMIN = "admin-key"
TENANT = "tenant-key"  # bound to a1

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime-lora")
    return {
        "a1": make_adapter(tiny_model_dir, root / "a1", seed=41),
        "a2": make_adapter(tiny_model_dir, root / "a2", seed=42, targets=("q_proj", "down_proj")),
        "big": make_adapter(tiny_model_dir, root / "big", seed=43, rank=16, merged=False),
    }


@pytest.fixture(scope="module")
def serve(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    directory = tmp_path_factory.mktemp("runtime-lora-serve")
    keys = directory / "keys.txt"
    keys.write_text(f"{ADMIN}\n{TENANT} lora=a1\n")
    process = ServeProcess(
        openai_serve_arguments(
            tiny_model_dir, "--num-blocks", "64", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"a1={adapters['a1']}",
            "--api-key-file", str(keys),
        ),
        directory / "stderr.txt",
        env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )  # fmt: skip
    try:
        yield process
        process.process.send_signal(signal.SIGINT)
        assert process.process.wait(timeout=EXIT_TIMEOUT) == 0, process.stderr[-3000:]
        assert "Traceback" not in process.stderr, process.stderr[-3000:]
    finally:
        process.kill()


def client(serve: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.http_url, api_key=key, max_retries=0)


def post(
    serve: ServeProcess, path: str, body: dict[str, object], key: str = ADMIN
) -> httpx.Response:
    return httpx.post(
        f"{serve.http_url}/{path}", json=body, headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )  # fmt: skip


def greedy(made: openai.OpenAI, model: str) -> tuple[str, list[int]]:
    response = made.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    return response.model, list((response.choices[0].model_extra or {})["token_ids"])


def model_ids(made: openai.OpenAI) -> list[str]:
    return [card.id for card in made.models.list().data]


def test_load_serve_and_unload_an_adapter_at_run_time(
    serve: ServeProcess, adapters: dict[str, Path]
) -> None:
    admin = client(serve, ADMIN)
    assert model_ids(admin) == [MODEL, "a1"]
    loaded = post(serve, "load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters["a2"])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'a2' added successfully."
    cards = {card.id: card.model_extra or {} for card in admin.models.list().data}
    assert list(cards) == [MODEL, "a1", "a2"] and cards["a2"]["parent"] == MODEL
    served_as, tokens = greedy(admin, "a2")
    assert served_as == "a2"
    assert tokens == HFReference(Path(f"{adapters['a2']}-merged")).greedy(PROMPT, MAX_TOKENS)
    # gRPC serves it too (one set of adapters for both front ends)
    with grpc.insecure_channel(serve.address or "") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT), lora_name="a2",
            sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                              ignore_eos=True),
        )  # fmt: skip
        metadata = (("authorization", f"Bearer {ADMIN}"),)
        assert [t for r in stub.Generate(request, metadata=metadata) for t in r.token_ids] == tokens
    # an unload while a stream of the adapter runs: the stream ends as it would have
    stream = admin.completions.create(
        model="a2", prompt=PROMPT, max_tokens=48, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = next(iter(stream))
    assert first.model == "a2"
    unloaded = post(serve, "unload_lora_adapter", {"lora_name": "a2"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'a2' removed successfully."
    finish = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
    assert finish[-1] == "length"
    assert model_ids(admin) == [MODEL, "a1"]
    with pytest.raises(openai.NotFoundError, match="'a2' does not exist"):
        greedy(admin, "a2")
    again = post(serve, "unload_lora_adapter", {"lora_name": "a2"})
    assert again.status_code == 404 and "The lora adapter 'a2' cannot be found." in again.text
    # loaded again from another path: a new adapter (a new id), served as its files say
    reloaded = post(
        serve, "load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters["a1"])}
    )
    assert reloaded.status_code == 200, reloaded.text
    assert greedy(admin, "a2")[1] == greedy(admin, "a1")[1]
    assert post(serve, "unload_lora_adapter", {"lora_name": "a2"}).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "problem"),
    [
        ({"lora_name": "a1", "lora_path": "/x"}, 400, "adapter 'a1' has already been loaded."),
        ({"lora_name": "big", "lora_path": "BIG"}, 400, "'big': rank 16 is above max_lora_rank 8"),
        ({"lora_name": "gone", "lora_path": "/no/such"}, 400, "'/no/such' is not a directory"),
        ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": MODEL, "lora_path": "/x"}, 400, "is the base model's name"),
        ({"lora_name": "x", "lora_path": "/x", "base": 1}, 400, "base"),
    ],
)  # fmt: skip
def test_bad_loads_are_refused_by_name_and_serve_nothing(
    serve: ServeProcess, adapters: dict[str, Path], body: dict[str, object], status: int,
    problem: str,
) -> None:  # fmt: skip
    if body.get("lora_path") == "BIG":
        body = {**body, "lora_path": str(adapters["big"])}
    refused = post(serve, "load_lora_adapter", body)
    assert refused.status_code == status, refused.text
    assert problem in refused.json()["error"]["message"]
    assert model_ids(client(serve, ADMIN)) == [MODEL, "a1"]


def test_the_endpoints_need_a_key_that_is_not_bound(serve: ServeProcess) -> None:
    body = {"lora_name": "a2", "lora_path": "/x"}
    assert post(serve, "load_lora_adapter", body, key="wrong").status_code == 401
    bound = post(serve, "load_lora_adapter", body, key=TENANT)
    assert bound.status_code == 403 and "bound to the LoRA adapter 'a1'" in bound.text
    assert post(serve, "unload_lora_adapter", {"lora_name": "a1"}, key=TENANT).status_code == 403
    assert post(serve, "unload_lora_adapter", {}).status_code == 400


def test_a_bound_key_always_runs_its_adapter(serve: ServeProcess) -> None:
    admin, tenant = client(serve, ADMIN), client(serve, TENANT)
    adapter = greedy(admin, "a1")
    assert greedy(tenant, MODEL) == adapter  # the base model's name: served by a1
    assert greedy(tenant, "a1") == adapter
    assert greedy(admin, MODEL)[1] != adapter[1]
    with pytest.raises(openai.PermissionDeniedError, match="bound to the LoRA adapter 'a1'"):
        greedy(tenant, "other")
    with pytest.raises(openai.PermissionDeniedError, match="serves completions and chats only"):
        tenant.embeddings.create(model=MODEL, input="hi")
    chat = tenant.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "a1"
    # over gRPC the same key runs a1 with no lora_name, and may not name another adapter
    with grpc.insecure_channel(serve.address or "") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        metadata = (("authorization", f"Bearer {TENANT}"),)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling_params=params)
        tokens = [t for r in stub.Generate(request, metadata=metadata) for t in r.token_ids]
        assert tokens == adapter[1]
        other = pb.GenerateRequest(text="hi", sampling_params=params, lora_name="other")
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(other, metadata=metadata))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "bound to the LoRA adapter 'a1'" in (refused.value.details() or "")


def test_lora_metrics_are_scraped(serve: ServeProcess) -> None:
    admin = client(serve, ADMIN)
    before = metrics(serve).get(
        ("actorline_lora_requests_total", frozenset({("adapter", "a1")})), 0
    )
    greedy(admin, "a1")
    greedy(admin, "a1")
    scraped = metrics(serve)
    after = scraped[("actorline_lora_requests_total", frozenset({("adapter", "a1")}))]
    assert after == before + 2
    assert scraped[("actorline_lora_adapters_loaded", frozenset())] == 1
    assert lora_info(scraped) == [("", "")]
    # while a stream of a1 runs, vLLM's info gauge names a1 among the running adapters
    stream = admin.completions.create(
        model="a1", prompt=PROMPT, max_tokens=48, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    assert lora_info(metrics(serve)) == [("", "a1")]
    assert [chunk for chunk in stream][-1].choices[0].finish_reason == "length"
    assert lora_info(metrics(serve)) == [("", "")]


def lora_info(scraped: Metrics) -> list[tuple[str, str]]:
    """vLLM's lora_requests_info samples as (waiting, running) adapters (max_lora checked)."""
    samples = [dict(labels) for name, labels in scraped if name == "vllm:lora_requests_info"]
    assert all(labels["max_lora"] == "2" for labels in samples)
    return [(s["waiting_lora_adapters"], s["running_lora_adapters"]) for s in samples]
