"""Tests of stages/execute/runner.py: packed continuous batching is token-identical to HF
``generate`` run per request, through chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from stages.execute.attention import KVCache
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.runner import ModelRunner, StepError
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
from stages.params import SamplingParams
from tests.stages.execute.driving import HFReference, drive

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
# Ten prompts of different lengths (3..120 tokens), random ids from a fixed seed.
PROMPT_LENGTHS = (3, 9, 17, 30, 45, 64, 80, 120, 5, 33)


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length,), generator=generator).tolist() for length in lengths]


def make_requests(
    prompts: list[list[int]], params: SamplingParams = GREEDY, prefix: str = "r"
) -> list[EngineRequest]:
    return [EngineRequest(f"{prefix}{i}", tuple(p), params) for i, p in enumerate(prompts)]


def load_runner(model_dir: Path, **fields: object) -> ModelRunner:
    runner = ModelRunner(ExecuteConfig(model=str(model_dir), **fields))  # type: ignore[arg-type]
    runner.load()
    return runner


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> HFReference:
    return HFReference(tiny_model_dir)


def expected_outputs(
    reference: HFReference, prompts: list[list[int]], prefix: str = "r"
) -> dict[str, list[int]]:
    return {f"{prefix}{i}": reference.greedy(p, MAX_TOKENS) for i, p in enumerate(prompts)}


@pytest.mark.parametrize(
    "decode_attention", ["auto", "native", "grouped", "padded", "per_sequence"]
)
def test_batched_greedy_matches_per_request_generate(
    tiny_model_dir: Path, reference: HFReference, decode_attention: str
) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    runner = load_runner(tiny_model_dir, num_blocks=128, decode_attention=decode_attention)
    report = drive(runner, make_requests(prompts))
    assert report.max_requests_per_step >= 8
    assert report.outputs == expected_outputs(reference, prompts)
    # Everything freed at the end.
    assert report.results[-1].free_blocks == 128


def test_static_padded_decode_path_matches(tiny_model_dir: Path, reference: HFReference) -> None:
    """The CUDA-graph code path (static buffers, padded batch sizes, trash-block padding),
    run eagerly on CPU."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    runner = ModelRunner(
        ExecuteConfig(model=str(tiny_model_dir), num_blocks=128, cuda_graph_max_batch_size=16),
        force_static_decode=True,
    )
    runner.load()
    report = drive(runner, make_requests(prompts))
    assert report.outputs == expected_outputs(reference, prompts)


def test_chunked_prefill_matches(tiny_model_dir: Path, reference: HFReference) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    runner = load_runner(tiny_model_dir, num_blocks=128)
    report = drive(runner, make_requests(prompts), chunk_size=16, max_batch_tokens=96)
    chunked = [c for step in report.steps for c in step.chunks if c.start > 0 and c.num_tokens > 1]
    assert chunked, "no prompt was split into chunks"
    assert report.outputs == expected_outputs(reference, prompts)


def test_prefix_caching_hits_and_matches(tiny_model_dir: Path, reference: HFReference) -> None:
    shared = random_prompts((70,), seed=2)[0]
    tails = random_prompts((1, 4, 9, 16, 23, 30, 2, 11), seed=3)
    prompts = [shared + tail for tail in tails]
    runner = load_runner(tiny_model_dir, num_blocks=128)
    requests = make_requests(prompts)
    first = drive(runner, requests[:1])
    rest = drive(runner, requests[1:], chunk_size=16)
    outputs = {**first.outputs, **rest.outputs}
    assert outputs == expected_outputs(reference, prompts)
    # The shared 70 tokens hold 4 full blocks of 16: every later request hits 64 tokens.
    assert first.cached_tokens == {"r0": 0}
    assert set(rest.cached_tokens.values()) == {64}
    final = rest.results[-1]
    assert final.prefix_cache_hits == 64 * 7
    assert final.prefix_cache_queries == sum(len(p) for p in prompts)
    # Cached tokens were not recomputed.
    computed = sum(result.num_computed_tokens for result in rest.results)
    decoded = sum(len(outputs[f"r{i}"]) - 1 for i in range(1, len(prompts)))
    assert computed == sum(len(p) - 64 for p in prompts[1:]) + decoded


def test_preemption_when_cache_is_too_small(tiny_model_dir: Path, reference: HFReference) -> None:
    prompts = random_prompts((30, 41, 25, 52, 37, 19, 44, 33), seed=4)
    # 10 blocks of 16 tokens; all eight requests together need about 30.
    runner = load_runner(tiny_model_dir, num_blocks=10, enable_prefix_caching=False)
    report = drive(runner, make_requests(prompts))
    assert report.preempted_by_execute, "the cache was big enough; nothing was preempted"
    assert report.outputs == expected_outputs(reference, prompts)
    assert report.results[-1].free_blocks == 10


def test_scheduler_preemption_recomputes_with_prefix_hits(
    tiny_model_dir: Path, reference: HFReference
) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    runner = load_runner(tiny_model_dir, num_blocks=128)
    report = drive(runner, make_requests(prompts), preempt_after={"r3": 4, "r7": 1, "r5": 9})
    assert report.outputs == expected_outputs(reference, prompts)
    # r7 (120-token prompt) restarts from 0 and finds its committed blocks in the cache.
    restarts = [r.cached_tokens["r7"] for r in report.results if "r7" in r.cached_tokens]
    assert restarts == [0, 112]


def test_seeded_sampling_survives_preemption(tiny_model_dir: Path) -> None:
    prompts = random_prompts((20, 33), seed=5)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    plain = drive(load_runner(tiny_model_dir, num_blocks=64), make_requests(prompts, params))
    preempted = drive(
        load_runner(tiny_model_dir, num_blocks=64),
        make_requests(prompts, params),
        preempt_after={"r0": 3, "r1": 6},
    )
    assert plain.outputs == preempted.outputs
    assert all(len(tokens) == 10 for tokens in plain.outputs.values())


def test_abort_frees_blocks_in_the_same_step(tiny_model_dir: Path) -> None:
    prompts = random_prompts((40, 20), seed=6)
    runner = load_runner(tiny_model_dir, num_blocks=32, enable_prefix_caching=False)
    requests = make_requests(prompts)
    first = runner.execute(
        SchedulerStep(
            0, tuple(requests), (ScheduledChunk("r0", 0, 40), ScheduledChunk("r1", 0, 20))
        )
    )
    assert first.free_blocks == 32 - 3 - 2
    second = runner.execute(
        SchedulerStep(1, chunks=(ScheduledChunk("r0", 40, 1), ScheduledChunk("r1", 20, 1)))
    )
    assert second.free_blocks == 32 - 3 - 2
    aborted = runner.execute(
        SchedulerStep(2, chunks=(ScheduledChunk("r1", 21, 1),), finished=("r0",))
    )
    assert aborted.request_ids == ("r1",)
    assert aborted.free_blocks == 32 - 2
    assert not runner.has_request("r0")
    assert runner.allocator is not None and runner.allocator.block_table("r0") == []
    # A free-only step for the rest.
    done = runner.execute(SchedulerStep(3, finished=("r1",)))
    assert done.free_blocks == 32 and done.request_ids == ()


def test_logprobs_are_reported_for_requests_that_ask(tiny_model_dir: Path) -> None:
    prompts = random_prompts((12, 7), seed=8)
    runner = load_runner(tiny_model_dir, num_blocks=16)
    requests = [
        EngineRequest("with", tuple(prompts[0]), GREEDY.replace(logprobs=3)),
        EngineRequest("without", tuple(prompts[1]), GREEDY),
    ]
    result = runner.execute(
        SchedulerStep(
            0, tuple(requests), (ScheduledChunk("with", 0, 12), ScheduledChunk("without", 0, 7))
        )
    )
    assert result.request_ids == ("with", "without")
    assert result.logprob_request_ids == ("with",)
    (entry,) = result.logprobs
    assert entry.token_id == result.token_ids[0]
    assert entry.rank == 1 and len(entry.top_token_ids) == 3


def test_step_errors(tiny_model_dir: Path) -> None:
    runner = load_runner(tiny_model_dir, num_blocks=16)
    request = make_requests(random_prompts((10,), seed=9))[0]
    with pytest.raises(StepError, match="unknown request"):
        runner.execute(SchedulerStep(0, chunks=(ScheduledChunk("nobody", 0, 1),)))
    runner.execute(SchedulerStep(1, (request,)))
    with pytest.raises(StepError, match="already registered"):
        runner.execute(SchedulerStep(2, (request,)))
    with pytest.raises(StepError, match="ends past"):
        runner.execute(SchedulerStep(3, chunks=(ScheduledChunk("r0", 0, 11),)))
    with pytest.raises(StepError, match="starts past"):
        runner.execute(SchedulerStep(4, chunks=(ScheduledChunk("r0", 4, 2),)))
    with pytest.raises(StepError, match="two chunks"):
        runner.execute(
            SchedulerStep(5, chunks=(ScheduledChunk("r0", 0, 4), ScheduledChunk("r0", 4, 2)))
        )
    # A bad step changes nothing, not even the parts before the error.
    other = make_requests(random_prompts((5,), seed=11), prefix="x")[0]
    bad = SchedulerStep(
        6, (other,), (ScheduledChunk("x0", 0, 5), ScheduledChunk("ghost", 0, 1)), ("r0",)
    )
    with pytest.raises(StepError, match="unknown request"):
        runner.execute(bad)
    assert not runner.has_request("x0") and runner.has_request("r0")
    assert runner.allocator is not None and runner.allocator.num_free_blocks == 16
    with pytest.raises(RuntimeError, match="load"):
        ModelRunner(ExecuteConfig(model=str(tiny_model_dir))).execute(SchedulerStep(0))


def test_capacity_is_reported(tiny_model_dir: Path) -> None:
    runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), num_blocks=20, block_size=8))
    info = runner.load()
    assert info.num_blocks == 20 and info.block_size == 8
    assert info.max_model_len == 160  # capped by the cache (the model allows 1024)
    assert info.vocab_size == 49152 and info.eos_token_ids == (2,)
    per_block = KVCache.bytes_per_block(
        num_layers=2, block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    assert info.kv_cache_bytes == 21 * per_block  # plus the reserved block
    assert (info.dtype, info.device) == ("float32", "cpu")

    by_memory = load_runner(tiny_model_dir, kv_cache_memory=100 * per_block * 2)
    assert by_memory.info is not None and by_memory.info.num_blocks == 99
    assert by_memory.info.max_model_len == 1024

    with pytest.raises(ExecuteConfigError, match="max_model_len"):
        load_runner(tiny_model_dir, num_blocks=4, max_model_len=100)
    with pytest.raises(ExecuteConfigError, match="max_position_embeddings"):
        load_runner(tiny_model_dir, num_blocks=400, max_model_len=2048)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": -3}, "num_blocks"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"seed": -1}, "seed"),
        ({"decode_attention": "fast"}, "decode_attention"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
        ({"model": " "}, "model"),
    ],
)
def test_config_validation(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ExecuteConfigError, match=name) as caught:
        ExecuteConfig(**fields)  # type: ignore[arg-type]
    assert caught.value.field == name


def test_another_architecture_matches(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Qwen2 (q/k/v biases, its own attention module) runs through the same path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_sliding_window=False,
        initializer_range=0.1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    prompts = random_prompts((5, 19, 33, 8, 26, 41, 12, 3), seed=10)
    runner = load_runner(tmp_path, num_blocks=64)
    report = drive(runner, make_requests(prompts), chunk_size=16)
    assert report.outputs == expected_outputs(HFReference(tmp_path), prompts)


def copy_model_without_generation_config(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    (target / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["eos_token_id"] = [2, 5]
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_eos_ids_fall_back_to_the_model_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_without_generation_config(tiny_model_dir, tmp_path / "model")
    info = ModelRunner(ExecuteConfig(model=str(model_dir), num_blocks=8)).load()
    assert info.eos_token_ids == (2, 5)


# ----------------------------------------------------------------- the real model
SMOLLM_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
)


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_batched_matches_per_request_generate(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in SMOLLM_PROMPTS]
    runner = load_runner(default_model_dir, num_blocks=64)
    report = drive(runner, make_requests(prompts), chunk_size=8)
    reference = HFReference(default_model_dir)
    assert report.outputs == expected_outputs(reference, prompts)


@pytest.mark.slow
@pytest.mark.model
def test_gguf_path_loads(default_model_dir: Path) -> None:
    """A .gguf path loads the model itself: its first greedy token is HF's on the same
    weights (``default_model_dir``, the HF directory converted from that GGUF)."""
    from stages.models import ALIASES

    alias = ALIASES["smollm2-135m"]
    spec = importlib.util.find_spec(alias.package)
    assert spec is not None and spec.submodule_search_locations
    gguf = Path(next(iter(spec.submodule_search_locations))) / alias.filename
    runner = ModelRunner(ExecuteConfig(model=str(gguf), num_blocks=8))
    info = runner.load()
    assert info.model == gguf.stem
    assert info.vocab_size == 49152 and info.max_model_len == 128
    prompt_ids = (1, 504, 3458, 282)
    prompt = EngineRequest("g", prompt_ids, GREEDY)
    result = runner.execute(SchedulerStep(0, (prompt,), (ScheduledChunk("g", 0, 4),)))
    assert result.request_ids == ("g",)
    assert list(result.token_ids) == HFReference(default_model_dir).greedy(prompt_ids, 1)


# ----------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_cuda_graph_decode_matches_generate(tiny_model_dir: Path) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    runner = load_runner(
        tiny_model_dir, device="cuda", num_blocks=128, cuda_graph_max_batch_size=16
    )
    assert runner._decode_graphs is not None
    report = drive(runner, make_requests(prompts))
    eager = drive(
        load_runner(tiny_model_dir, device="cuda", num_blocks=128, use_cuda_graphs=False),
        make_requests(prompts),
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
    assert eager.outputs == expected
