"""Embeddings through the engine (``AsyncEngine.embed``, ``LLM.embed``) against HF's own
hidden states (``AutoModel(...).last_hidden_state``, after the final norm) pooled the same
way: every pooling type, normalized or not, across chunked prefill, with prefix-cache hits,
in steps shared with generation; and the refusals (empty, too long, bad dimensions, the null
model)."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from pipeline import (
    LLM,
    AsyncEngine,
    InvalidRequestError,
    PoolingParams,
    PromptTooLongError,
    SamplingParams,
)

TEXTS = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog. " * 6,  # longer than a chunk below
    "A",
]
#: float32 through a different kernel path than HF's: agreement to this
TOLERANCE = 2e-5
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@functools.cache
def _hf_model(model_dir: Path) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tokenizer, model


@functools.cache
def _hf_hidden_states(model_dir: Path, text: str) -> torch.Tensor:
    """The final-norm hidden states of ``text``, [T, H] (read-only: callers pool them)."""
    tokenizer, model = _hf_model(model_dir)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden: torch.Tensor = model(input_ids=ids).last_hidden_state[0]
    return hidden


@pytest.fixture(scope="module", autouse=True)
def _forget_hf_models() -> Iterator[None]:
    """The HF models and states cached above live as long as this module's tests."""
    yield
    _hf_hidden_states.cache_clear()
    _hf_model.cache_clear()


def hf_embeddings(
    model_dir: Path, texts: Sequence[str], pooling_type: str, normalize: bool
) -> list[np.ndarray]:
    """HF's reference: the final-norm hidden states of each prompt (tokenized as the engine
    tokenizes a plain prompt), pooled. The hidden states are computed once per model
    directory and prompt for the module run and pooled per call."""
    vectors = []
    for text in texts:
        hidden = _hf_hidden_states(model_dir, text)
        vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling_type]
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        vectors.append(vector.numpy().copy())
    return vectors


def assert_close(got: np.ndarray, want: np.ndarray, tolerance: float = TOLERANCE) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= tolerance * scale


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_every_pooling_type_matches_hf_hidden_states(
    tiny_model_dir: Path, pooling_type: str
) -> None:
    """Normalized (the default) and not, a prompt longer than a step's 16 tokens pooled
    across its chunks, and the same prompts again (a prefix-cache hit for ``last``; ``mean``
    and ``cls`` do not take their rows from the cache) give HF's vectors."""
    normalized = hf_embeddings(tiny_model_dir, TEXTS, pooling_type, True)
    raw = hf_embeddings(tiny_model_dir, TEXTS, pooling_type, False)
    with LLM(
        str(tiny_model_dir),
        transport="memory",
        pooling_type=pooling_type,
        max_num_batched_tokens=16,
        num_blocks=64,
    ) as llm:
        first = llm.embed(TEXTS, use_tqdm=False)
        again = llm.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False)
    for output, want in zip(first, normalized, strict=True):
        assert_close(output.outputs.data, want)
        assert output.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
        assert abs(float(np.linalg.norm(output.outputs.data)) - 1.0) < 1e-5
    for output, want in zip(again, raw, strict=True):
        assert_close(output.outputs.data, want)
    assert [o.num_prompt_tokens for o in first] == [
        len(AutoTokenizer.from_pretrained(tiny_model_dir)(t).input_ids) for t in TEXTS
    ]


def test_engine_without_normalization_and_a_request_that_asks_for_it(
    tiny_model_dir: Path,
) -> None:
    raw = hf_embeddings(tiny_model_dir, TEXTS[:1], "mean", False)
    normalized = hf_embeddings(tiny_model_dir, TEXTS[:1], "mean", True)
    with LLM(
        str(tiny_model_dir), transport="memory", pooling_type="mean", pooling_normalize=False
    ) as llm:
        (plain,) = llm.embed(TEXTS[0], use_tqdm=False)
        (asked,) = llm.embed(TEXTS[0], PoolingParams(normalize=True), use_tqdm=False)
    assert_close(plain.outputs.data, raw[0])
    assert_close(asked.outputs.data, normalized[0])


@pytest.mark.slow
def test_embeddings_share_steps_with_generation(tiny_model_dir: Path) -> None:
    """Embedding requests started among running generations (over the zmq engine process)
    get HF's vectors, and the generations the tokens they get alone."""
    want = hf_embeddings(tiny_model_dir, TEXTS, "mean", True)

    async def run() -> tuple[list[list[int]], list[list[int]], list[np.ndarray]]:
        async with AsyncEngine(
            str(tiny_model_dir), pooling_type="mean", max_num_batched_tokens=32
        ) as engine:

            async def generate(prompt: str) -> list[int]:
                last = None
                async for output in engine.generate(prompt, GREEDY):
                    last = output
                assert last is not None
                return list(last.token_ids)

            alone = [await generate(p) for p in ("one two three", "four five")]
            named = await engine.embed(TEXTS[0], request_id="mine")
            assert named.request_id == "mine" and named.finished
            assert (await engine.embed(TEXTS[0])).request_id  # a fresh id
            mixed = await asyncio.gather(
                generate("one two three"),
                *(engine.embed(text) for text in TEXTS),
                generate("four five"),
                *(engine.embed(text) for text in reversed(TEXTS)),
            )
            vectors = [o.outputs.data for o in (*mixed[1:4], *reversed(mixed[5:8]))]
            return alone, [mixed[0], mixed[4]], vectors

    alone, together, vectors = asyncio.run(run())
    assert together == alone
    for got, expected in zip(vectors, want + want, strict=True):
        assert_close(got, expected)


def test_embeddings_preempted_under_block_pressure_still_match(tiny_model_dir: Path) -> None:
    """A KV cache of 8 blocks, 16-token chunks: two generations running when two long
    mean-pooled embeddings (6 blocks each) arrive. The generations' growth preempts the
    embeddings (the latest arrivals), which are recomputed, and every vector is still HF's (a
    preempted embedding starts its running sum over); every block is free afterwards."""
    long_text = TEXTS[1] * 2
    want = hf_embeddings(tiny_model_dir, [long_text], "mean", True)[0]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[np.ndarray], Any]:
        async with AsyncEngine(
            str(tiny_model_dir), transport="memory", pooling_type="mean", num_blocks=8,
            max_num_batched_tokens=16,
        ) as engine:  # fmt: skip
            started = asyncio.Event()

            async def generate(prompt: str) -> int:
                count = 0
                async for output in engine.generate(prompt, params):
                    count = len(output.token_ids)
                    if count >= 8:
                        started.set()
                return count

            async def embed_later() -> np.ndarray:
                await started.wait()
                return (await engine.embed(long_text)).outputs.data

            results = await asyncio.gather(
                generate("one two three"), generate("four five six"), embed_later(),
                embed_later(),
            )  # fmt: skip
            assert results[:2] == [60, 60]
            deadline = time.monotonic() + 10
            while (stats := engine.stats) is None or stats.kv_blocks_free != 8:
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.02)
            return list(results[2:]), stats

    vectors, stats = asyncio.run(run())
    assert stats.num_preemptions > 0, stats
    for got in vectors:
        assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["data_parallel_size", "tensor_parallel_size"])
def test_parallel_engines_embed(tiny_model_dir: Path, parallel: str) -> None:
    """Two engine replicas behind the router (the vectors pass through it), or the model
    split over two ranks (rank 0 pools the all-reduced hidden states): HF's vectors."""
    want = hf_embeddings(tiny_model_dir, TEXTS, "mean", True)
    with LLM(str(tiny_model_dir), pooling_type="mean", **{parallel: 2}) as llm:
        got = llm.embed(TEXTS * 3, use_tqdm=False)
    for output, expected in zip(got, want * 3, strict=True):
        assert_close(output.outputs.data, expected)


def test_refusals_name_the_field_and_the_engine_goes_on(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), transport="memory", max_model_len=64) as llm:
        with pytest.raises(InvalidRequestError) as empty:
            llm.embed("", use_tqdm=False)
        assert empty.value.field == "prompt"
        with pytest.raises(PromptTooLongError):
            llm.embed("word " * 200, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="Matryoshka") as dims:
            llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
        assert dims.value.field == "dimensions"
        with pytest.raises(InvalidRequestError) as zero:
            llm.embed("hello", PoolingParams(dimensions=0), use_tqdm=False)
        assert zero.value.field == "dimensions"
        with pytest.raises(InvalidRequestError) as normalize:
            llm.embed("hello", PoolingParams(normalize=1), use_tqdm=False)  # type: ignore[arg-type]
        assert normalize.value.field == "normalize"
        # truncate_prompt_tokens=-1 keeps what the model's length allows an embedding
        (kept,) = llm.embed("word " * 200, truncate_prompt_tokens=-1, use_tqdm=False)
        assert kept.num_prompt_tokens == 63
        (fine,) = llm.embed("still serving", use_tqdm=False)
        assert fine.outputs.hidden_size == 64


def test_matryoshka_dimensions_truncate_then_normalize(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A model whose config.json lists Matryoshka sizes takes only those; the vector is the
    first N values of the full one, normalized again."""
    model_dir = tmp_path / "matryoshka"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (model_dir / "config.json").write_text(json.dumps(config))
    (raw,) = hf_embeddings(model_dir, TEXTS[:1], "last", False)
    with LLM(str(model_dir), transport="memory") as llm:
        (short,) = llm.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)
        (unnormalized,) = llm.embed(
            TEXTS[0], PoolingParams(dimensions=32, normalize=False), use_tqdm=False
        )
        with pytest.raises(InvalidRequestError, match="16, 32, 64") as refused:
            llm.embed(TEXTS[0], PoolingParams(dimensions=20), use_tqdm=False)
        assert refused.value.field == "dimensions"
        with pytest.raises(InvalidRequestError, match="at most"):
            llm.embed(TEXTS[0], PoolingParams(dimensions=128), use_tqdm=False)
    assert_close(short.outputs.data, raw[:16] / np.linalg.norm(raw[:16]))
    assert_close(unnormalized.outputs.data, raw[:32])


def test_the_null_model_refuses_embeddings() -> None:
    with LLM("smollm2-135m", transport="memory", null_model=True) as llm:
        with pytest.raises(InvalidRequestError, match="no embeddings") as refused:
            llm.embed("hello", use_tqdm=False)
        assert refused.value.field == "input"
        assert llm.generate("hello", SamplingParams(max_tokens=2))[0].finished


@pytest.mark.slow
@pytest.mark.model
def test_default_model_matches_hf_hidden_states(default_model_dir: Path) -> None:
    """The real model's hidden states, mean-pooled (every row counts); each pooling type's
    own rows are checked on the tiny model above, the same path at a fraction of the cost."""
    want = hf_embeddings(default_model_dir, TEXTS, "mean", True)
    with LLM("smollm2-135m", transport="memory", pooling_type="mean") as llm:
        got = llm.embed(TEXTS, use_tqdm=False)
    for output, expected in zip(got, want, strict=True):
        assert output.outputs.hidden_size == 576
        assert_close(output.outputs.data, expected, tolerance=1e-4)
