"""Fused CPU ops for the decoder layers of HF causal LMs in fp32: each RMSNorm in one pass, and
each gated MLP's gate and up projections as one packed GEMM followed by one SiLU-and-mul pass
(:class:`~stages.execute.native.FusedOpsKernel`, ``kernels/fused_cpu.c``).

HF's ``LlamaRMSNorm`` runs six torch ops (pow, mean, add, rsqrt, mul, mul) over its input and
``LlamaMLP`` two GEMMs then ``act_fn(gate) * up`` (two more passes); on a CPU each op is a trip
through memory plus a dispatch, the decode steps' small tensors mostly dispatch, and a 2,048-token
prefill chunk's mostly memory (measured on SmolLM2-135M shapes, one thread: RMSNorm 10-16 µs to
2-6 µs at 1-64 rows, 294 to 138 µs at 2,048; SiLU-and-mul 37 to 20 µs at 64 rows, 2.5 to 1.6 ms
at 2,048). The fused forms follow vLLM's ``RMSNorm`` and ``SiluAndMul`` custom ops
(``vllm/model_executor/layers/layernorm.py``, ``activation.py``) and its merged gate/up
projection (``MergedColumnParallelLinear``).

:func:`use_fused_ops` swaps them in module by module: an RMSNorm (a module whose class name ends
in ``RMSNorm`` with a 1-D ``weight`` and a ``variance_epsilon``) becomes :class:`FusedRMSNorm`;
a gated MLP (``gate_proj`` and ``up_proj`` already :class:`~stages.execute.cpu.PackedLinear`
without bias, a ``down_proj``, a SiLU ``act_fn``) becomes :class:`FusedGatedMLP`, whose one
packed weight is the two panels concatenated (no second copy). Every kind of module is checked
against its own forward on random inputs first, once per class and shape, so a variant that
computes something else (Gemma's ``1 + weight``, say) is left alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from stages.execute.cpu import PackedLinear
from stages.execute.native import FusedOpsKernel, PackedGemmKernel

__all__ = ["FusedGatedMLP", "FusedRMSNorm", "use_fused_ops"]

logger = logging.getLogger("actorline.execute")

# Relative to the largest output: fused and torch's ops differ by rounding only (~1e-7).
_PROBE_TOLERANCE = 1e-5
_PROBE_ROWS = (1, 5, 40)
_SILU_NAMES = ("SiLU", "SiLUActivation")


class FusedRMSNorm(torch.nn.Module):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last axis in one pass."""

    def __init__(self, weight: torch.nn.Parameter, eps: float, kernel: FusedOpsKernel) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)
        self._kernel = kernel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return self._kernel.rms_norm(hidden_states, self.weight.detach(), self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon} (fused)"


class FusedGatedMLP(torch.nn.Module):
    """``down(silu(x W_gate^T) * (x W_up^T))`` with the gate and up projections as one packed
    GEMM (``gate_up``: gate's columns, then up's) and the activation in one pass."""

    def __init__(
        self, gate_up: PackedLinear, down_proj: torch.nn.Module, kernel: FusedOpsKernel
    ) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down_proj = down_proj
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return self.down_proj(self._kernel.silu_mul(self.gate_up(x)))


def use_fused_ops(model: Any, gemm: PackedGemmKernel | None, kernel: FusedOpsKernel) -> int:
    """Swap ``model``'s fp32 CPU RMSNorms and gated MLPs for their fused forms (see the module
    docstring); gated MLPs only where ``gemm`` packed their projections.

    Returns:
        How many modules were replaced.
    """
    replacements: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []
    checked: dict[tuple[type, tuple[int, ...]], bool] = {}
    for name, module in model.named_modules():
        fused = _fused_form(module, gemm, kernel)
        if fused is None:
            continue
        key = (type(module), tuple(_width(module)))
        if key not in checked:
            checked[key] = _agrees(module, fused)
        if checked[key]:
            replacements.append((name, module, fused))
    for name, _, fused in replacements:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, fused)
    return len(replacements)


def _fused_form(
    module: torch.nn.Module, gemm: PackedGemmKernel | None, kernel: FusedOpsKernel
) -> torch.nn.Module | None:
    weight = getattr(module, "weight", None)
    if (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 1
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and isinstance(getattr(module, "variance_epsilon", None), float)
    ):
        return FusedRMSNorm(weight, module.variance_epsilon, kernel)  # type: ignore[arg-type]
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    down, act = getattr(module, "down_proj", None), getattr(module, "act_fn", None)
    if (
        gemm is not None
        and isinstance(gate, PackedLinear)
        and isinstance(up, PackedLinear)
        and isinstance(down, torch.nn.Module)
        and type(act).__name__ in _SILU_NAMES
        and gate.bias is None
        and up.bias is None
        and gate.in_features == up.in_features
        and gate.out_features == up.out_features
    ):
        # NOTE: panels are [N / 16, K, 16]: concatenating two packed weights along the panel
        # axis is packing their concatenated rows. The originals are freed with the module.
        packed = torch.cat([gate.packed.detach(), up.packed.detach()])
        return FusedGatedMLP(PackedLinear(packed, None, gemm), down, kernel)
    return None


def _width(module: torch.nn.Module) -> tuple[int, ...]:
    gate = getattr(module, "gate_proj", None)
    if isinstance(gate, PackedLinear):
        return (gate.in_features, gate.out_features)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return tuple(weight.shape)


def _agrees(module: torch.nn.Module, fused: torch.nn.Module) -> bool:
    """Whether ``fused`` computes what ``module`` does on random rows (a few row counts)."""
    width = _width(module)[0]
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in _PROBE_ROWS:
            probe = torch.randn(1, rows, width, generator=generator) * 2.0
            expected = module(probe)
            try:
                got = fused(probe)
            except RuntimeError as error:
                logger.info("execute: fused %s unavailable (%s)", type(module).__name__, error)
                return False
            scale = max(expected.abs().max().item(), 1.0)
            if got.shape != expected.shape or not (
                (got - expected).abs().max().item() <= _PROBE_TOLERANCE * scale
            ):
                logger.warning(
                    "execute: fused form of %s disagrees with it; not used", type(module).__name__
                )
                return False
    return True
