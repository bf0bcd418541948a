"""The fused CPU ops: the kernel against torch's ops (tails, strides, threads), and the module
swap on a tiny Llama (norms and gated MLPs replaced, the logits unchanged up to rounding, a
variant norm that computes something else left alone); the rotary embeddings on actorline's
own Llama; the argmax the sampler's greedy rows take."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stages.execute.cpu import PackedLinear, use_cpu_linears
from stages.execute.fused import FusedGatedMLP, FusedRMSNorm, use_fused_ops
from stages.execute.llama import apply_rotary, load_native_llama
from stages.execute.model_impl import native_config
from stages.execute.native import (
    FusedOpsKernel,
    NativeKernelError,
    fused_ops_kernel,
    packed_gemm_kernel,
)
from tests.conftest import TINY_LLAMA


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's LlamaRMSNorm in fp32
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture(scope="module")
def kernel() -> FusedOpsKernel:
    found = fused_ops_kernel()
    assert found is not None, "the C compiler on this machine should build the kernel"
    return found


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [37, 64, 576])
def test_rms_norm_matches_torch(kernel: FusedOpsKernel, dim: int, threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weight = torch.randn(dim)
        for rows in (1, 7, 300):  # 300 x 576 is past the kernel's threading threshold
            x = torch.randn(rows, dim) * 3.0
            got = kernel.rms_norm(x, weight, 1e-5)
            torch.testing.assert_close(got, _reference_rms_norm(x, weight, 1e-5))
        # rows any stride apart (a slice of a wider tensor), leading axes kept
        wide = torch.randn(2, 5, dim + 9)
        view = wide[..., :dim]
        got = kernel.rms_norm(view, weight, 1e-6)
        assert got.shape == (2, 5, dim)
        torch.testing.assert_close(got, _reference_rms_norm(view, weight, 1e-6))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("inter", [5, 48, 1536])
def test_silu_mul_matches_torch(kernel: FusedOpsKernel, inter: int) -> None:
    for rows in (1, 3, 64):
        gate_up = torch.randn(1, rows, 2 * inter) * 6.0  # exp's tails: large |gate|
        gate_up[0, 0, 0], gate_up[0, 0, 1] = 100.0, -100.0
        got = kernel.silu_mul(gate_up)
        expected = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        assert got.shape == (1, rows, inter)
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [16, 64, 6])
def test_rotary_matches_the_models_formula(
    kernel: FusedOpsKernel, head_dim: int, threads: int
) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 7, 300):  # 300 x 12 heads x 64 is past the threading threshold
            # rows any stride apart (slices of one wider projection's output)
            wide = torch.randn(1, rows, 13 * head_dim)
            query, key = wide[..., : 9 * head_dim], wide[..., 9 * head_dim : 12 * head_dim]
            cos, sin = torch.randn(1, rows, head_dim), torch.randn(1, rows, head_dim)
            shape = (1, rows, -1, head_dim)
            expected = [
                apply_rotary(x.view(shape).transpose(1, 2), cos, sin).transpose(1, 2)
                for x in (query, key)
            ]
            untouched = wide[..., 12 * head_dim :].clone()
            kernel.rotary_(query, key, cos, sin)
            torch.testing.assert_close(query.view(shape), expected[0])
            torch.testing.assert_close(key.view(shape), expected[1])
            assert torch.equal(wide[..., 12 * head_dim :], untouched)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_is_torchs_argmax(kernel: FusedOpsKernel, threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, cols in ((1, 1), (3, 5), (64, 49152), (2, 16 * 7 + 3)):
            logits = torch.randn(rows, cols + 11)[:, :cols]  # rows a stride apart
            assert torch.equal(kernel.argmax(logits), logits.argmax(dim=-1))
        inf, nan = float("inf"), float("nan")
        # ties (within a lane, across lanes, in the tail), signed zeros, infinities, NaN
        special = torch.zeros(8, 40)
        special[0] = -inf
        special[1, 5] = special[1, 21] = special[1, 3] = 2.0
        special[2, 38] = special[2, 39] = 1.0
        special[3, ::2] = -0.0
        special[4, 17] = inf
        special[5, 30], special[5, 9] = nan, inf
        special[6, 39] = nan
        special[7, 1] = special[7, 0] = -1.0
        special[7, 2:] = -2.0
        assert kernel.argmax(special).tolist() == special.argmax(dim=-1).tolist()
    finally:
        torch.set_num_threads(previous)


def test_kernel_refuses_what_it_cannot_serve(kernel: FusedOpsKernel) -> None:
    with pytest.raises(NativeKernelError, match="RMSNorm"):
        kernel.rms_norm(torch.randn(3, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(NativeKernelError, match="RMSNorm"):
        kernel.rms_norm(torch.randn(3, 8), torch.ones(7), 1e-5)
    with pytest.raises(NativeKernelError, match="SiLU"):
        kernel.silu_mul(torch.randn(4, 7))
    with pytest.raises(NativeKernelError, match="SiLU"):
        kernel.silu_mul(torch.randn(8, 4).t())
    with pytest.raises(NativeKernelError, match="argmax"):
        kernel.argmax(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(NativeKernelError, match="argmax"):
        kernel.argmax(torch.randn(8, 4).t())
    with pytest.raises(NativeKernelError, match="rotary"):  # cos and sin of another length
        kernel.rotary_(torch.randn(1, 3, 16), torch.randn(1, 3, 8), *torch.randn(2, 1, 4, 8))
    with pytest.raises(NativeKernelError, match="rotary"):  # heads that do not divide
        kernel.rotary_(torch.randn(1, 3, 12), torch.randn(1, 3, 8), *torch.randn(2, 1, 3, 8))


def test_own_llama_gets_the_fused_rotary_with_the_same_logits(
    kernel: FusedOpsKernel, tiny_model_dir: Path
) -> None:
    config = native_config(tiny_model_dir)
    assert config is not None
    model = load_native_llama(tiny_model_dir, config, torch.float32).eval()
    tokens = torch.tensor([[5, 17, 300, 2, 9, 41, 1000]])
    with torch.inference_mode():
        expected = model(input_ids=tokens).logits
    layers = config.num_hidden_layers
    # and one rotary per attention module
    assert use_fused_ops(model, packed_gemm_kernel(), kernel) == 4 * layers + 1
    assert all(layer.self_attn.rotary is not None for layer in model.model.layers)
    with torch.inference_mode():
        got = model(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


class _OnePlusRMSNorm(torch.nn.Module):
    """Gemma's variant: scales by ``1 + weight``; the fused form must not replace it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_tiny_llama_gets_fused_norms_and_mlps_with_the_same_logits(
    kernel: FusedOpsKernel, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 17, 300, 2, 9, 41, 1000]])
    with torch.inference_mode():
        expected = model(input_ids=tokens).logits
    gemm = packed_gemm_kernel()
    layers = model.config.num_hidden_layers
    # two norms and the MLP per layer, and the final norm; before the linears are packed
    assert use_fused_ops(model, gemm, kernel) == 3 * layers + 1
    use_cpu_linears(model)
    for layer in model.model.layers:
        assert type(layer.input_layernorm) is FusedRMSNorm
        assert type(layer.post_attention_layernorm) is FusedRMSNorm
        assert type(layer.mlp) is FusedGatedMLP
        assert type(layer.mlp.gate_up) is PackedLinear
        assert not hasattr(layer.mlp, "gate_proj")  # one packed copy of gate and up
    with torch.inference_mode():
        got = model(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))

    # without the packed GEMM the gate/up projection is one linear over both weights
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert use_fused_ops(plain, None, kernel, verify=False) == 3 * layers + 1
    gate_up = plain.model.layers[0].mlp.gate_up
    assert (
        type(gate_up) is torch.nn.Linear
        and gate_up.out_features == 2 * TINY_LLAMA["intermediate_size"]
    )
    with torch.inference_mode():
        torch.testing.assert_close(plain(input_ids=tokens).logits, expected, rtol=1e-4, atol=1e-4)

    other = torch.nn.Sequential(_OnePlusRMSNorm(16))
    assert use_fused_ops(other, gemm, kernel) == 0
    assert type(other[0]) is _OnePlusRMSNorm
