"""``kv_cache_dtype`` (stages.execute.config, runner, attention, step_graph): a bf16 KV cache
really is bf16, holds twice the blocks of a byte budget, serves every path that writes and
reads it (the step graph, the module path's native kernel and gather + SDPA, prefix hits), and
unsupported values are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.engine.options import EngineOptions
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.null import NullRunner
from stages.execute.runner import ModelRunner
from stages.params import SamplingParams
from tests.stages.execute.driving import DriveReport, drive
from tests.stages.execute.test_runner import make_requests, random_prompts

# Logprobs carry the logits out: equal top-3 logprobs at every step mean equal logits there.
LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BUDGET = 4 << 20  # bytes of KV cache


def load(model: Path, **fields: object) -> ModelRunner:
    runner = ModelRunner(ExecuteConfig(model=str(model), **fields))  # type: ignore[arg-type]
    runner.load()
    return runner


def logprobs_of(report: DriveReport) -> list[object]:
    return [(r.logprob_request_ids, r.logprobs, r.request_ids, r.token_ids) for r in report.results]


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "expected"),
    [
        ("bfloat16", "auto", torch.bfloat16),
        ("bfloat16", "float32", torch.float32),
        ("float32", "auto", torch.float32),
        ("float32", "bfloat16", torch.bfloat16),
    ],
)
def test_the_cache_holds_the_dtype_asked_and_a_budget_holds_blocks_by_its_bytes(
    tiny_model_dir: Path, dtype: str, kv_cache_dtype: str, expected: torch.dtype
) -> None:
    runner = load(tiny_model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                  kv_cache_memory=BUDGET)  # fmt: skip
    info = runner.info
    assert info is not None and runner.kv_cache is not None
    assert info.kv_cache_dtype == str(expected).removeprefix("torch.")
    assert info.dtype == dtype  # the weights' dtype, whatever the cache holds
    assert {t.dtype for t in (*runner.kv_cache.key, *runner.kv_cache.value)} == {expected}
    # Every block of the budget (one reserved): the whole budget is used, at the cache's width.
    element = torch.empty((), dtype=expected).element_size()
    assert (
        info.kv_cache_bytes
        <= BUDGET
        < info.kv_cache_bytes + info.kv_cache_bytes // (info.num_blocks + 1)
    )
    assert runner.kv_cache.key[0].element_size() == element


def test_a_bf16_cache_doubles_the_blocks_and_the_null_model_counts_the_same(
    tiny_model_dir: Path,
) -> None:
    fields = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=BUDGET)
    wide = ModelRunner(ExecuteConfig(**fields)).load()  # type: ignore[arg-type]
    narrow_config = ExecuteConfig(**fields, kv_cache_dtype="bfloat16")  # type: ignore[arg-type]
    narrow = ModelRunner(narrow_config).load()
    # budget // (bytes / 2) - 1 = 2 (budget // bytes) - 1 or one more
    assert narrow.num_blocks + 1 in (2 * (wide.num_blocks + 1), 2 * (wide.num_blocks + 1) + 1)
    assert narrow.max_model_len >= wide.max_model_len
    null = NullRunner(narrow_config).load()
    assert (null.num_blocks, null.kv_cache_dtype) == (narrow.num_blocks, "bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_step_graph_over_a_bf16_cache_gives_the_module_paths_logits(
    tiny_model_dir: Path, dtype: str
) -> None:
    """The C KV write rounds as torch's ``to(bfloat16)`` does and the kernel widens exactly: the
    step graph's logits equal the module path's bit for bit."""
    fields = dict(dtype=dtype, kv_cache_dtype="bfloat16", num_blocks=128, block_size=4)
    on, off = load(tiny_model_dir, **fields), load(tiny_model_dir, use_cuda_graphs=False, **fields)
    assert on.step_graph is not None and off.step_graph is None
    prompts = random_prompts((3, 8, 13), seed=5)
    requests = make_requests(prompts, LOGPROBS)
    got, expected = drive(on, requests), drive(off, requests)
    assert logprobs_of(got) == logprobs_of(expected)
    assert on.step_graph.steps > 0
    # Every layer's new rows landed in the cache as bf16 (nothing left zero in used slots).
    assert on.kv_cache is not None
    assert all(layer[4 : 4 * 6].abs().sum() > 0 for layer in on.kv_cache.key)


@pytest.mark.slow
@pytest.mark.parametrize("decode_attention", ["native", "grouped", "per_sequence"])
def test_module_path_decode_modes_agree_over_a_bf16_cache(
    tiny_model_dir: Path, decode_attention: str
) -> None:
    """The native kernel reading bf16 in place and gather + SDPA widening what it gathers."""
    prompts = random_prompts((3, 9, 17, 30, 45), seed=6)
    fields = dict(dtype="bfloat16", num_blocks=64, use_cuda_graphs=False)
    reference = drive(load(tiny_model_dir, **fields), make_requests(prompts, GREEDY))
    runner = load(tiny_model_dir, decode_attention=decode_attention, **fields)
    assert runner.info is not None and runner.info.kv_cache_dtype == "bfloat16"
    assert drive(runner, make_requests(prompts, GREEDY)).outputs == reference.outputs


@pytest.mark.slow
def test_flex_attends_a_bf16_cache_in_place(tiny_model_dir: Path) -> None:
    """FlexAttention reads the cache layer in place: its queries take the cache's dtype."""
    prompts = random_prompts((3, 20, 40), seed=2)
    fields = dict(dtype="bfloat16", num_blocks=64, use_cuda_graphs=False)
    reference = drive(load(tiny_model_dir, **fields), make_requests(prompts, GREEDY))
    runner = load(tiny_model_dir, attention_backend="flex", **fields)
    assert runner.info is not None and runner.info.kv_cache_dtype == "bfloat16"
    assert drive(runner, make_requests(prompts, GREEDY)).outputs == reference.outputs


def top_logprobs(report: DriveReport) -> dict[str, list[tuple[float, ...]]]:
    """Each request's top logprobs, step by step."""
    tops: dict[str, list[tuple[float, ...]]] = {}
    for result in report.results:
        for request_id, logprobs in zip(result.logprob_request_ids, result.logprobs, strict=True):
            tops.setdefault(request_id, []).append(logprobs.top_logprobs)
    return tops


@pytest.mark.parametrize("use_cuda_graphs", [True, False], ids=["step-graph", "module-path"])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_a_prefix_hit_on_a_bf16_cache_gives_the_tokens_of_a_whole_prompt(
    tiny_model_dir: Path, use_cuda_graphs: bool, dtype: str
) -> None:
    """A prompt computed whole attends its keys rounded as the cache holds them, so a later
    prompt reading them back from the cache computes the same tokens. With fp32 weights the
    logits agree to float noise (measured: equal; attending unrounded keys instead: 4e-3 apart);
    bf16 weights round each GEMM's inputs differently at other row counts (torch's bf16 matmul
    from ``TORCH_ROWS`` rows), so there the greedy tokens are compared."""
    shared = random_prompts((37,), seed=7)[0]
    tails = random_prompts((1, 5, 12), seed=8)
    prompts = [shared + tail for tail in tails]
    fields = dict(dtype=dtype, kv_cache_dtype="bfloat16", num_blocks=64, block_size=4,
                  use_cuda_graphs=use_cuda_graphs)  # fmt: skip
    whole = drive(load(tiny_model_dir, enable_prefix_caching=False, **fields),
                  make_requests(prompts, LOGPROBS))  # fmt: skip
    cached = load(tiny_model_dir, **fields)
    first = drive(cached, make_requests([shared], LOGPROBS, prefix="s"))
    rest = drive(cached, make_requests(prompts, LOGPROBS))
    assert first.cached_tokens == {"s0": 0}
    assert set(rest.cached_tokens.values()) == {36}  # nine full blocks of four
    assert rest.outputs == whole.outputs
    if dtype == "float32":
        expected, got = top_logprobs(whole), top_logprobs(rest)
        assert expected.keys() == got.keys()
        for request_id, steps in expected.items():
            for want, have in zip(steps, got[request_id], strict=True):
                assert have == pytest.approx(want, abs=1e-4), request_id


def test_unsupported_cache_dtypes_are_refused_by_name() -> None:
    for value in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
        with pytest.raises(ExecuteConfigError, match=f"'{value}' is not supported") as caught:
            ExecuteConfig(kv_cache_dtype=value)
        assert caught.value.field == "kv_cache_dtype"
    for value in ("float16", "bf16", "", None, 2):
        with pytest.raises(ExecuteConfigError, match="kv_cache_dtype must be one of") as caught:
            ExecuteConfig(kv_cache_dtype=value)  # type: ignore[arg-type]
        assert caught.value.field == "kv_cache_dtype"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .* got 'fp8'"):
        EngineOptions(kv_cache_dtype="fp8")
    assert ExecuteConfig(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
