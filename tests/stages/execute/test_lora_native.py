"""The module path's LoRA delta in native code (stages/execute/lora_native.py, the step
graph's shrink and expand): what torch's concatenated delta gives, to rounding, on a step of
base rows and adapters of other ranks (one leaving a projection alone, a fused gate/up with a
zero half); base rows untouched; out-of-range groups refused; and a runner on the module path
(prefill and decode) with base rows and two adapters greedy-identical to HF with each merged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stages.execute.config import ExecuteConfig
from stages.execute.lora import LoRALinear
from stages.execute.lora_native import NativeLoRADelta, native_lora_delta
from stages.execute.runner import ModelRunner
from stages.lora import LoRARequest
from stages.messages import EngineRequest
from stages.params import SamplingParams
from tests.stages.execute.driving import HFReference, drive
from tests.stages.execute.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def native() -> NativeLoRADelta:
    delta = native_lora_delta()
    if delta is None:
        pytest.skip("the native step graph library does not build here (no C compiler)")
    return delta


def load_runner(model_dir: Path, **fields: object) -> ModelRunner:
    config = ExecuteConfig(model=str(model_dir), enable_lora=True, max_loras=3, **fields)  # type: ignore[arg-type]
    runner = ModelRunner(config)
    runner.load()
    return runner


def test_native_delta_equals_torch_delta(tiny_model_dir: Path, native: NativeLoRADelta) -> None:
    runner = load_runner(tiny_model_dir, num_blocks=8)
    bank = runner.lora
    assert bank is not None and bank.native
    q_proj = runner.model.model.layers[0].self_attn.q_proj
    gate_up = runner.model.model.layers[1].mlp.gate_up
    down = runner.model.model.layers[1].mlp.down_proj
    assert isinstance(q_proj, LoRALinear) and isinstance(gate_up, LoRALinear)
    generator = torch.Generator().manual_seed(5)

    def pair(rank: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        shape = bank.targets[target]
        a = torch.randn(rank, shape.in_features, generator=generator)
        return a, torch.randn(shape.out_features, rank, generator=generator)

    first = {(0, "q_proj"): pair(8, "q_proj"), (1, "up_proj"): pair(8, "up_proj"),
             (1, "down_proj"): pair(8, "down_proj")}  # fmt: skip
    adapters = [
        bank.adapter_of_weights(first, 0.5),
        bank.adapter_of_weights({(0, "q_proj"): pair(4, "q_proj")}, 2.0),  # no MLP delta
        bank.adapter_of_weights({(1, "gate_proj"): pair(16, "gate_proj")}, 1.0),
    ]
    # a prefill segment per adapter, decode rows of each, base rows between
    spans = [(adapters[1], 0, 1), (None, 1, 3), (adapters[0], 3, 21), (adapters[2], 21, 30),
             (adapters[0], 30, 31), (None, 31, 40), (adapters[2], 40, 41)]  # fmt: skip
    rows = 41
    inputs = {
        "q": torch.randn(1, rows, q_proj.in_features, generator=generator),
        "mlp": torch.randn(1, rows, gate_up.in_features, generator=generator),
        "down": torch.randn(1, rows, down.in_features, generator=generator),
    }
    modules = {"q": q_proj, "mlp": gate_up, "down": down}
    outputs: dict[bool, dict[str, torch.Tensor]] = {}
    with torch.inference_mode():
        for use_native in (True, False):
            bank.native = use_native
            with bank.rows(spans):
                segments = bank.step_segments
                assert segments is not None and segments.native is use_native
                outputs[use_native] = {n: modules[n](x) for n, x in inputs.items()}
        base = {name: modules[name].base(x) for name, x in inputs.items()}  # type: ignore[operator]
    for name in inputs:
        torch.testing.assert_close(outputs[True][name], outputs[False][name], rtol=1e-4, atol=1e-4)
        # the base rows are the base linear's, bit for bit
        for start, end in ((1, 3), (31, 40)):
            assert torch.equal(outputs[True][name][0, start:end], base[name][0, start:end])
    # the adapters change their rows (a test of a delta that adds nothing would pass above)
    assert not torch.equal(outputs[True]["q"][0, 3:21], base["q"][0, 3:21])
    assert not torch.equal(outputs[True]["mlp"][0, 21:30], base["mlp"][0, 21:30])
    # an adapter that leaves a projection alone leaves its rows alone
    assert torch.equal(outputs[True]["mlp"][0, 0:1], base["mlp"][0, 0:1])
    assert torch.equal(outputs[True]["down"][0, 21:30], base["down"][0, 21:30])


def test_native_delta_refuses_rows_of_unknown_groups(native: NativeLoRADelta) -> None:
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(12, 32, generator=generator)
    bt = torch.randn(12, 48, generator=generator)
    entry, _offsets = native.entry(a, bt, (8, 4))
    x = torch.randn(3, 32, generator=generator)
    out = torch.zeros(3, 48)
    scratch = torch.empty(3 * 12)
    for bad in ([0, 2, -1], [0, -2, 1]):
        with pytest.raises(ValueError, match=r"outside -1\.\.1"):
            native.add(entry, np.array(bad, dtype=np.int64), 2, x, out, scratch, 1)
        assert torch.count_nonzero(out) == 0  # nothing written
    with pytest.raises(ValueError, match="ranks differ"):
        native.entry(a, bt, (8, 8))
    with pytest.raises(ValueError, match="fp32 rows"):
        native.add(entry, np.array([0, 1, -1], dtype=np.int64), 2, x.double(), out, scratch, 1)
    native.add(entry, np.array([1, -1, 0], dtype=np.int64), 2, x, out, scratch, 2)
    expected = torch.zeros(3, 48)
    expected[0] = (x[0] @ a[8:].t()) @ bt[8:]
    expected[2] = (x[2] @ a[:8].t()) @ bt[:8]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two adapters made and merged, HF references: ~20 s
def test_module_path_mixed_batch_matches_merged_hf(
    tiny_model_dir: Path, tmp_path: Path, native: NativeLoRADelta
) -> None:
    """Base rows and two adapters' rows in the same prefill and decode steps, every step on
    the module path (no step graph) with the native delta: each request greedy-identical to
    HF with its adapter merged, and to the torch delta's run."""
    paths = {
        "a1": make_adapter(tiny_model_dir, tmp_path / "a1", seed=21),
        "a2": make_adapter(tiny_model_dir, tmp_path / "a2", seed=22, rank=4,
                           targets=("q_proj", "k_proj", "up_proj", "down_proj")),
    }  # fmt: skip
    loras = {name: LoRARequest(name, int(name[1:]), str(path)) for name, path in paths.items()}
    runner = load_runner(tiny_model_dir, num_blocks=64, use_cuda_graphs=False)
    assert runner.step_graph is None and runner.lora is not None
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (6, 17, 30)]
    requests = [
        EngineRequest(f"{name}-{i}", tuple(prompt), greedy, lora=loras.get(name))
        for i, prompt in enumerate(prompts)
        for name in ("base", "a1", "a2")
    ]
    runs = {}
    for use_native in (True, False):
        runner.lora.native = use_native
        runs[use_native] = drive(runner, requests, chunk_size=12).outputs
    assert runs[True] == runs[False]
    references = {"base": HFReference(tiny_model_dir)}
    references.update({name: HFReference(Path(f"{path}-merged")) for name, path in paths.items()})
    for i, prompt in enumerate(prompts):
        for name, reference in references.items():
            assert runs[True][f"{name}-{i}"] == reference.greedy(prompt, 8), (name, i)
    for name in paths:
        assert any(runs[True][f"{name}-{i}"] != runs[True][f"base-{i}"] for i in range(3))
