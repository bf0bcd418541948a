"""The concatenated LoRA delta (stages/execute/lora_segments.py): a step of several adapters
(each on some projections, of different ranks) and base rows gives, in two GEMMs, what the
loop over its row groups gives (one adapter beside base rows too); the concatenated weights are
kept per set of adapters."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.execute.config import ExecuteConfig
from stages.execute.lora import LoRALinear
from stages.execute.runner import ModelRunner


def test_concatenated_delta_equals_the_loop_over_groups(tiny_model_dir: Path) -> None:
    runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), num_blocks=8, enable_lora=True))
    runner.load()
    bank = runner.lora
    assert bank is not None
    q_proj = runner.model.model.layers[0].self_attn.q_proj
    gate_up = runner.model.model.layers[1].mlp.gate_up
    assert isinstance(q_proj, LoRALinear) and isinstance(gate_up, LoRALinear)
    generator = torch.Generator().manual_seed(3)

    def pair(rank: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        shape = bank.targets[target]
        a = torch.randn(rank, shape.in_features, generator=generator)
        return a, torch.randn(shape.out_features, rank, generator=generator)

    adapters = [
        bank.adapter_of_weights(
            {(0, "q_proj"): pair(8, "q_proj"), (1, "up_proj"): pair(8, "up_proj")}, 0.5
        ),
        bank.adapter_of_weights({(0, "q_proj"): pair(4, "q_proj")}, 2.0),
        bank.adapter_of_weights({(1, "gate_proj"): pair(16, "gate_proj")}, 1.0),
    ]
    spans = [(adapters[1], 0, 1), (None, 1, 3), (adapters[0], 3, 4), (adapters[2], 4, 9),
             (adapters[0], 9, 12), (None, 12, 13)]  # fmt: skip
    x_q = torch.randn(1, 13, q_proj.in_features, generator=generator)
    x_mlp = torch.randn(1, 13, gate_up.in_features, generator=generator)
    got, expected = {}, {}
    with torch.inference_mode():
        for segmented, outputs in ((True, got), (False, expected)):
            bank.segmented = segmented
            with bank.rows(spans):
                assert (bank.step_segments is not None) is segmented
                outputs["q"], outputs["mlp"] = q_proj(x_q), gate_up(x_mlp)
        base_q = q_proj.base(x_q)
    for name in ("q", "mlp"):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5)
    # one adapter beside base rows takes the concatenated path too; on every row, one
    # shrink and one addmm_
    one_spans = [(None, 0, 4), (adapters[0], 4, 13)]
    outputs = []
    with torch.inference_mode():
        for segmented in (True, False):
            bank.segmented = segmented
            with bank.rows(one_spans):
                assert (bank.step_segments is not None) is segmented
                outputs.append((q_proj(x_q), gate_up(x_mlp)))
        with bank.rows([(adapters[0], 0, 13)]):
            assert bank.step_segments is None
            every_row = q_proj(x_q)
    for got_one, expected_one in zip(outputs[0], outputs[1], strict=True):
        torch.testing.assert_close(got_one, expected_one, rtol=1e-5, atol=1e-5)
    delta = adapters[0].deltas[0, "q_proj"]
    torch.testing.assert_close(
        every_row, base_q + (x_q @ delta.a.t()) @ delta.b.t(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(got["q"][0, 1:3], base_q[0, 1:3], rtol=0, atol=0)  # base rows
    assert not torch.equal(got["q"][0, :1], base_q[0, :1])
    # one set of adapters: its weights concatenated once, kept for the next step
    bank.segmented = True
    with bank.rows(spans):
        segments = bank.step_segments
        assert segments is not None
        first = segments.weights((0, "q_proj"))
    with bank.rows(spans):
        segments = bank.step_segments
        assert segments is not None and segments.weights((0, "q_proj")) is first
