"""``POST /v1/embeddings`` of the shared tiny-model server (:mod:`tests.pipeline.server.
http.conftest`: last-token pooling, normalized, the defaults) with the clients users have:
the official ``openai`` client (float and base64, every input form) and langchain's
``OpenAIEmbeddings``, against HF's final hidden states; embeddings beside a running stream;
and the refusals, each a 400 naming its field."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from pipeline import InvalidRequestError
from pipeline.server.client import Client
from tests.pipeline.server.http.conftest import API_KEY, IGNORE_EOS, MODEL, metrics
from tests.pipeline.server.serving import ServeProcess

TEXTS = ["Hello world, this is a test.", "Embeddings for retrieval", "A"]
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, Any]:
    """HF's normalized last-token vectors of :data:`TEXTS`, and the tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden[-1], dim=-1).numpy()

    return {"tokenizer": tokenizer, "embed": embed}


def hf_vector(reference: dict[str, Any], text: str) -> np.ndarray:
    vector: np.ndarray = reference["embed"](reference["tokenizer"](text).input_ids)
    return vector


def assert_close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= TOLERANCE


def call(serve: ServeProcess, body: dict[str, Any], key: str | None = API_KEY) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        serve.base_url + "/v1/embeddings", data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_openai_client_float_and_base64(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert [item.index for item in floats.data] == [0, 1, 2]
    for item, text in zip(floats.data, TEXTS, strict=True):
        assert item.object == "embedding"
        assert_close(item.embedding, hf_vector(reference, text))
    tokens = sum(len(reference["tokenizer"](text).input_ids) for text in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # the client's default asks for base64 and decodes it with numpy
    decoded = client.embeddings.create(model=MODEL, input=TEXTS[0])
    (item,) = decoded.data
    assert_close(item.embedding, hf_vector(reference, TEXTS[0]))


def test_base64_is_little_endian_float32(
    openai_serve: ServeProcess, reference: dict[str, Any]
) -> None:
    status, body = call(openai_serve, {"input": TEXTS[1], "encoding_format": "base64"})
    assert status == 200, body
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(raw) == 64 * 4
    assert_close(np.frombuffer(raw, dtype="<f4"), hf_vector(reference, TEXTS[1]))


def test_token_id_inputs(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    ids = [reference["tokenizer"](text).input_ids for text in TEXTS[:2]]
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert_close(one.data[0].embedding, reference["embed"](ids[0]))
    both = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for item, tokens in zip(both.data, ids, strict=True):
        assert_close(item.embedding, reference["embed"](tokens))
    assert both.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_langchain_openai_embeddings(openai_serve: ServeProcess, reference: dict[str, Any]) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(
        model=MODEL,
        base_url=openai_serve.http_url,
        api_key=API_KEY,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = embeddings.embed_documents(TEXTS)
    for vector, text in zip(documents, TEXTS, strict=True):
        assert_close(vector, hf_vector(reference, text))
    assert_close(embeddings.embed_query(TEXTS[2]), hf_vector(reference, TEXTS[2]))


@pytest.mark.slow
def test_embeddings_beside_a_running_stream(
    client: openai.OpenAI, reference: dict[str, Any]
) -> None:
    """A stream keeps generating while embedding requests come and go in its steps."""
    finish_reasons: list[str | None] = []

    def stream() -> None:
        for chunk in client.completions.create(
            model=MODEL, prompt="count", max_tokens=40, stream=True, extra_body=IGNORE_EOS
        ):
            finish_reasons.append(chunk.choices[0].finish_reason)

    thread = threading.Thread(target=stream)
    thread.start()
    for _ in range(4):
        answer = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        assert_close(answer.data[2].embedding, hf_vector(reference, TEXTS[2]))
    thread.join(timeout=120)
    assert finish_reasons[-1] == "length" and len(finish_reasons) > 1


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["fine", ""]}, "input[1]", "must not be empty"),
        ({"input": [[]]}, "input[0]", "must not be empty"),
        ({"input": "x", "dimensions": 16}, "dimensions", "Matryoshka"),
        ({"input": "x", "dimensions": 0}, "dimensions", ">= 1"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float, base64"),
        ({"input": "x", "dims": 3}, "dims", "does not know this field"),
        ({"input": "x", "add_special_tokens": False}, "add_special_tokens", "accepted only"),
        ({"input": [49152]}, "input", "outside the vocabulary"),
        ({"input": [5] * 1500}, "input", "model's length"),
        ({"input": "x", "normalize": "yes"}, "normalize", "bool"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ],
)
def test_refusals_name_the_field(
    openai_serve: ServeProcess, body: dict[str, Any], param: str, words: str
) -> None:
    status, answer = call(openai_serve, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and words in error["message"], error


def test_key_model_and_truncation(openai_serve: ServeProcess) -> None:
    status, _ = call(openai_serve, {"input": "x"}, key=None)
    assert status == 401
    status, answer = call(openai_serve, {"input": "x", "model": "other"})
    assert status == 404 and answer["error"]["param"] == "model"
    status, answer = call(
        openai_serve, {"input": [5] * 1500, "truncate_prompt_tokens": 100, "user": "u"}
    )
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == 100


def test_grpc_embed_with_the_python_client(
    openai_serve: ServeProcess, reference: dict[str, Any]
) -> None:
    """The same vectors over gRPC (``Embed``), and its refusals naming the field."""
    assert openai_serve.address is not None
    ids = reference["tokenizer"](TEXTS[0]).input_ids
    with Client(openai_serve.address, api_key=API_KEY) as grpc_client:
        vectors = grpc_client.embed([*TEXTS, ids])
        for vector, text in zip(vectors[:3], TEXTS, strict=True):
            assert_close(vector, hf_vector(reference, text))
        assert_close(vectors[3], reference["embed"](ids))
        (raw,) = grpc_client.embed(TEXTS[0], normalize=False)
        assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3
        assert_close(np.asarray(raw) / np.linalg.norm(raw), hf_vector(reference, TEXTS[0]))
        for inputs, options, field in (
            ([], {}, "inputs"),
            (["fine", ""], {}, "inputs[1]"),
            ("x", {"dimensions": 8}, "dimensions"),
            ([[5] * 1500], {}, "prompt"),
        ):
            with pytest.raises(InvalidRequestError) as refused:
                grpc_client.embed(inputs, **options)
            assert refused.value.field == field, refused.value


def test_an_embedding_counts_its_prompt_tokens(
    openai_serve: ServeProcess, client: openai.OpenAI
) -> None:
    """Both metric families count an embedding's prompt (nothing generated), and vLLM's
    success counter its finish."""
    before = metrics(openai_serve)
    answer = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    after = metrics(openai_serve)

    def moved(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    tokens = answer.usage.prompt_tokens
    assert moved("actorline_prompt_tokens_total") == tokens
    assert moved("vllm:prompt_tokens_total", model_name=MODEL, engine="0") == tokens
    assert moved("actorline_generation_tokens_total") == 0
