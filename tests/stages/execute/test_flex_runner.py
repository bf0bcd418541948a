"""The engine on ``attention_backend="flex"`` (stages/execute/flex.py) end to end: greedy
tokens equal HF ``generate``'s (and so the gather + SDPA path's) for batched decode, the
CUDA-graph static decode path (eager on CPU), chunked prefill and prefix hits; the variant
families (windows, soft caps, sinks) through the model table's check; config refusals. On
CPU FlexAttention runs eagerly; the compiled kernel and captured graphs run in the
``cuda``-marked tests (``.ci/cuda-check``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.cli.llm import engine_options_from
from pipeline.cli.main import build_parser
from pipeline.engine.options import EngineOptions
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.flex import flex_available, use_flex
from stages.execute.runner import ModelRunner
from tests.stages.execute.driving import HFReference, drive
from tests.stages.execute.test_model_table import check_against_hf
from tests.stages.execute.test_runner import (
    MAX_TOKENS,
    PROMPT_LENGTHS,
    expected_outputs,
    load_runner,
    make_requests,
    random_prompts,
)

needs_flex = pytest.mark.skipif(not flex_available(), reason="torch without FlexAttention")


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> HFReference:
    return HFReference(tiny_model_dir)


@needs_flex
@pytest.mark.slow
def test_batched_flex_matches_generate(tiny_model_dir: Path, reference: HFReference) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    # 64 blocks hold the batch: eager FlexAttention scores every slot of the cache
    runner = load_runner(tiny_model_dir, num_blocks=64, attention_backend="flex")
    assert runner._flex
    report = drive(runner, make_requests(prompts))
    assert report.max_requests_per_step >= 8
    assert report.outputs == expected_outputs(reference, prompts)
    assert report.results[-1].free_blocks == 64


@needs_flex
@pytest.mark.slow
def test_flex_static_decode_path_matches(tiny_model_dir: Path, reference: HFReference) -> None:
    """The CUDA-graph code path with flex (block masks built from the static buffers, padding
    rows that see no key), run eagerly on CPU."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    runner = ModelRunner(
        ExecuteConfig(
            model=str(tiny_model_dir),
            num_blocks=128,
            cuda_graph_max_batch_size=16,
            attention_backend="flex",
        ),
        force_static_decode=True,
    )
    runner.load()
    assert runner._decode_graphs is not None and runner._decode_graphs.flex
    report = drive(runner, make_requests(prompts))
    assert report.outputs == expected_outputs(reference, prompts)


@needs_flex
@pytest.mark.slow
def test_flex_chunked_prefill_and_prefix_hits_match(
    tiny_model_dir: Path, reference: HFReference
) -> None:
    shared = random_prompts((70,), seed=2)[0]
    tails = random_prompts((1, 9, 23, 30), seed=3)
    prompts = [shared + tail for tail in tails]
    runner = load_runner(tiny_model_dir, num_blocks=64, attention_backend="flex")
    requests = make_requests(prompts)
    first = drive(runner, requests[:1], chunk_size=16)  # chunks over a cached prefix
    rest = drive(runner, requests[1:], chunk_size=16)  # prefix hits, then chunks
    assert set(rest.cached_tokens.values()) == {64}
    assert {**first.outputs, **rest.outputs} == expected_outputs(reference, prompts)


@needs_flex
@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "block_size"),
    [("gemma2", 4), ("mistral (sliding window)", 4), ("gpt_oss", 4), ("gemma2", 16)],
)
def test_flex_serves_the_variants(family: str, block_size: int, tmp_path: Path) -> None:
    """Windows (every layer: Mistral; every other layer: Gemma 2), soft-capped scores
    (Gemma 2) and sinks (gpt-oss) through flex, with whole and chunked prefill and a prefix
    hit, against HF ``generate``; blocks of 16 tokens too, as the CUDA twin runs."""
    runner = check_against_hf(family, tmp_path, attention_backend="flex", block_size=block_size)
    assert runner._flex


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"attention_backend": "flash"}, "must be one of"),
        ({"attention_backend": "flex", "decode_attention": "native"}, "applies to 'gather_sdpa'"),
    ],
)
def test_attention_backend_validation(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ExecuteConfigError, match=match) as caught:
        ExecuteConfig(**fields)  # type: ignore[arg-type]
    assert caught.value.field == "attention_backend"


@needs_flex
@pytest.mark.slow
def test_the_engine_option_reaches_the_runner(tiny_model_dir: Path) -> None:
    """``--attention-backend`` and ``attention_backend`` through the whole pipeline (memory
    transport): the flex engine's greedy tokens equal the default engine's."""
    args = build_parser().parse_args(["serve", "--attention-backend", "flex"])
    assert EngineOptions.create(**engine_options_from(args)).attention_backend == "flex"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineOptions(attention_backend="flash")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    outputs = {}
    for backend in ("flex", "auto"):
        # a small cache: eager FlexAttention scores every slot of it
        options = dict(transport="memory", num_blocks=64, attention_backend=backend)
        with LLM(str(tiny_model_dir), **options) as llm:
            outputs[backend] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert outputs["flex"] == outputs["auto"]


def test_flex_on_cuda_refuses_blocks_under_16_keys() -> None:
    """Checked before any GPU work: a Triton tile of flex is one cache block."""
    with pytest.raises(ExecuteConfigError, match="multiple of 16, got 4"):
        use_flex("flex", torch.device("cuda"), 4)
    assert not use_flex("auto", torch.device("cuda"), 4)


def test_auto_keeps_gather_sdpa(tiny_model_dir: Path) -> None:
    """``auto`` is gather + SDPA (the native kernel on CPU) until a GPU measures flex."""
    runner = load_runner(tiny_model_dir, num_blocks=32)
    assert not runner._flex and runner._decode_mode == "native"


# ----------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_flex_cuda_graphs_match_generate(tiny_model_dir: Path) -> None:
    """The compiled kernel inside captured decode graphs and in eager prefill, against HF
    ``generate`` on the GPU (and the gather + SDPA engine's tokens)."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    flex = load_runner(
        tiny_model_dir,
        device="cuda",
        num_blocks=128,
        cuda_graph_max_batch_size=16,
        attention_backend="flex",
    )
    assert flex._flex and flex._decode_graphs is not None
    report = drive(flex, make_requests(prompts), chunk_size=32)
    gather = drive(
        load_runner(tiny_model_dir, device="cuda", num_blocks=128, cuda_graph_max_batch_size=16),
        make_requests(prompts),
        chunk_size=32,
    )
    reference = HFReference(tiny_model_dir)
    reference.model.to("cuda")
    expected = {
        f"r{i}": reference.model.generate(
            torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS, do_sample=False
        )[0, len(p) :].tolist()
        for i, p in enumerate(prompts)
    }
    assert report.outputs == expected
    assert gather.outputs == expected


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["gemma2", "mistral (sliding window)", "gpt_oss"])
def test_flex_cuda_serves_the_variants(family: str, tmp_path: Path) -> None:
    runner = check_against_hf(
        family,
        tmp_path,
        device="cuda",
        attention_backend="flex",
        cuda_graph_max_batch_size=8,
        block_size=16,  # flex on CUDA tiles by cache block, at least 16 keys
    )
    assert runner._flex and runner._decode_graphs is not None
