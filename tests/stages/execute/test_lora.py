"""Tests of stages/execute/lora.py on the model runner: an adapter's greedy tokens are HF's
with the adapter merged (``merge_and_unload``); base rows and rows of two adapters share
steps, each as its own reference; prefix-cache blocks never cross adapters; the delta
follows any base linear; the bank keeps max_cpu_loras adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.lora import LoRABank, LoRALinear
from stages.execute.runner import ModelRunner
from stages.lora import LoRAAdapterError, LoRARequest
from stages.messages import EngineRequest
from stages.params import SamplingParams
from tests.stages.execute.driving import HFReference, drive
from tests.stages.execute.lora_adapters import make_adapter

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return three_adapters(tiny_model_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str, HFReference]:
    return merged_references(tiny_model_dir, adapters)


def three_adapters(tiny_model_dir: Path, root: Path) -> dict[str, Path]:
    """Three adapters of the tiny model under ``root``, each beside its merged model."""
    return {
        "a1": make_adapter(tiny_model_dir, root / "a1", seed=1),
        # attention only, rsLoRA scaling: the fused gate/up takes no delta
        "a2": make_adapter(
            tiny_model_dir,
            root / "a2",
            seed=2,
            rank=4,
            targets=("q_proj", "v_proj", "o_proj"),
            rslora=True,
        ),
        # the MLP only, gate without up: half of the fused projection's delta is zero
        "a3": make_adapter(tiny_model_dir, root / "a3", seed=3, targets=("gate_proj", "down_proj")),
    }


def merged_references(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str, HFReference]:
    """HF on the base model and on each adapter merged."""
    refs = {"base": HFReference(tiny_model_dir)}
    for name, path in adapters.items():
        refs[name] = HFReference(Path(f"{path}-merged"))
    return refs


def lora_of(adapters: dict[str, Path], name: str) -> LoRARequest:
    return LoRARequest(name, int(name[1:]), str(adapters[name]))


def prompts_of(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in lengths]


def load_runner(model_dir: Path, **fields: object) -> ModelRunner:
    config = ExecuteConfig(model=str(model_dir), enable_lora=True, max_loras=3, **fields)  # type: ignore[arg-type]
    runner = ModelRunner(config)
    runner.load()
    return runner


def test_mixed_batch_of_base_and_adapters_matches_merged_hf(
    tiny_model_dir: Path, adapters: dict[str, Path], references: dict[str, HFReference]
) -> None:
    """Base requests and requests of three adapters, packed into the same steps (prefill
    chunks and decode rows), each greedy-identical to HF with its adapter merged."""
    runner = load_runner(tiny_model_dir, num_blocks=128)
    prompts = prompts_of((5, 19, 33, 48), seed=7)
    requests = []
    for index, prompt in enumerate(prompts):
        for name in ("base", "a1", "a2", "a3"):
            lora = None if name == "base" else lora_of(adapters, name)
            requests.append(EngineRequest(f"{name}-{index}", tuple(prompt), GREEDY, lora=lora))
    report = drive(runner, requests, chunk_size=20)
    assert report.max_requests_per_step == len(requests)  # one step held them all
    for index, prompt in enumerate(prompts):
        for name in ("base", "a1", "a2", "a3"):
            expected = references[name].greedy(prompt, MAX_TOKENS)
            assert report.outputs[f"{name}-{index}"] == expected, (name, index)
    # the adapters change the tokens (the test would pass on an engine that ignored them)
    for name in ("a1", "a2", "a3"):
        assert any(
            report.outputs[f"{name}-{i}"] != report.outputs[f"base-{i}"] for i in range(4)
        ), name


def test_single_adapter_alone_matches_its_run_in_a_mixed_batch(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    runner = load_runner(tiny_model_dir, num_blocks=64)
    prompt = prompts_of((23,), seed=11)[0]
    a1 = lora_of(adapters, "a1")
    alone = drive(runner, [EngineRequest("x", tuple(prompt), GREEDY, lora=a1)])
    mixed = drive(
        runner,
        [
            EngineRequest("b", tuple(prompt), GREEDY),
            EngineRequest("y", tuple(prompt), GREEDY, lora=a1),
            EngineRequest("z", tuple(prompt), GREEDY, lora=lora_of(adapters, "a2")),
        ],
    )
    assert mixed.outputs["y"] == alone.outputs["x"]
    assert mixed.outputs["b"] != alone.outputs["x"]


def test_prefix_cache_blocks_never_cross_adapters(
    tiny_model_dir: Path, adapters: dict[str, Path], references: dict[str, HFReference]
) -> None:
    """A prompt cached under a1 serves a1 again, never the base model or a2 (their own
    blocks then serve themselves)."""
    runner = load_runner(tiny_model_dir, num_blocks=64, block_size=16)
    prompt = prompts_of((50,), seed=5)[0]
    a1, a2 = lora_of(adapters, "a1"), lora_of(adapters, "a2")

    def run(request_id: str, lora: LoRARequest | None) -> tuple[list[int], int]:
        report = drive(runner, [EngineRequest(request_id, tuple(prompt), GREEDY, lora=lora)])
        return report.outputs[request_id], report.cached_tokens.get(request_id, 0)

    first, cached = run("a1-first", a1)
    assert cached == 0
    again, cached = run("a1-again", a1)
    assert cached == 48 and again == first == references["a1"].greedy(prompt, MAX_TOKENS)
    base, cached = run("base", None)
    assert cached == 0 and base == references["base"].greedy(prompt, MAX_TOKENS)
    other, cached = run("a2", a2)
    assert cached == 0 and other == references["a2"].greedy(prompt, MAX_TOKENS)
    base_again, cached = run("base-again", None)
    assert cached == 48 and base_again == base


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_delta_follows_any_base_linear(tiny_model_dir: Path, quantization: str | None) -> None:
    """The wrapper adds ``scale * (x A^T) B^T`` to whatever the base linear computes
    (packed fp32, int8 blocks), only on its adapter's rows."""
    runner = load_runner(tiny_model_dir, num_blocks=16, quantization=quantization)
    wrapped = runner.model.model.layers[0].self_attn.q_proj
    assert isinstance(wrapped, LoRALinear)
    bank = runner.lora
    assert bank is not None
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(8, wrapped.in_features, generator=generator)
    b = torch.randn(wrapped.out_features, 8, generator=generator)
    adapter = bank.adapter_of_weights({(0, "q_proj"): (a, b)}, scale=0.5)
    x = torch.randn(1, 6, wrapped.in_features, generator=generator)
    with torch.inference_mode():
        base = wrapped.base(x)
        with bank.rows([(None, 0, 2), (adapter, 2, 6)]):
            got = wrapped(x)
    expected = base.clone()
    expected[0, 2:] += 0.5 * (x[0, 2:] @ a.t()) @ b.t()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0, :2], base[0, :2], rtol=0, atol=0)


def test_bank_keeps_max_cpu_loras_and_never_unloads_one_in_use(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    runner = load_runner(tiny_model_dir, num_blocks=16, max_cpu_loras=3)
    bank = runner.lora
    assert isinstance(bank, LoRABank)
    bank.max_cpu_loras = 2
    a1, a2, a3 = (lora_of(adapters, name) for name in ("a1", "a2", "a3"))
    bank.acquire(a1, set())
    bank.acquire(a2, set())
    bank.acquire(a3, {1})  # a1 in use: a2, the least recently used free one, goes
    assert [lora.lora_name for lora in bank.loaded()] == ["a1", "a3"]
    bank.acquire(a2, set())
    assert [lora.lora_name for lora in bank.loaded()] == ["a3", "a2"]
    assert bank.loads == 4


def test_bank_refuses_bad_adapters_and_loads_nothing(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    runner = load_runner(tiny_model_dir, num_blocks=16, max_lora_rank=4)
    bank = runner.lora
    assert bank is not None
    with pytest.raises(LoRAAdapterError, match="rank 8 is above max_lora_rank 4"):
        bank.acquire(lora_of(adapters, "a1"), set())
    with pytest.raises(LoRAAdapterError, match=r"adapter_config\.json is missing"):
        bank.acquire(LoRARequest("gone", 9, str(tmp_path)), set())
    bank.acquire(lora_of(adapters, "a2"), set())
    with pytest.raises(LoRAAdapterError, match="lora_int_id 2 is adapter 'a2'"):
        bank.acquire(LoRARequest("other", 2, str(adapters["a3"])), set())
    assert [lora.lora_name for lora in bank.loaded()] == ["a2"]


def test_lora_config_refuses_fewer_kept_adapters_than_a_batch_holds() -> None:
    ExecuteConfig(enable_lora=True, tensor_parallel_size=2)  # sharded (test_lora_parallel.py)
    with pytest.raises(ExecuteConfigError, match="max_cpu_loras"):
        ExecuteConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(1800)  # the adapter made, merged and saved from the 135M model, two HF copies
def test_smollm2_adapter_matches_merged_hf(default_model_dir: Path, tmp_path: Path) -> None:
    """The default model (its own Llama class, fused gate/up, packed linears) with a rank-8
    adapter on every projection, base and adapter rows in one batch, as HF merged."""
    from transformers import AutoTokenizer

    adapter = make_adapter(default_model_dir, tmp_path / "smol", seed=4)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def add(a, b):")]
    runner = load_runner(default_model_dir, num_blocks=64)
    lora = LoRARequest("smol", 1, str(adapter))
    requests = [EngineRequest(f"b{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]
    requests += [EngineRequest(f"l{i}", tuple(p), GREEDY, lora=lora) for i, p in enumerate(prompts)]
    report = drive(runner, requests)
    base, merged = HFReference(default_model_dir), HFReference(Path(f"{adapter}-merged"))
    for index, prompt in enumerate(prompts):
        assert report.outputs[f"b{index}"] == base.greedy(prompt, MAX_TOKENS)
        assert report.outputs[f"l{index}"] == merged.greedy(prompt, MAX_TOKENS)
        assert report.outputs[f"l{index}"] != report.outputs[f"b{index}"]
