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

:func:`use_fused_ops` swaps them in module by module, before the linears are packed: an RMSNorm
(a module whose class name ends in ``RMSNorm`` with a 1-D ``weight`` and a
``variance_epsilon``) becomes :class:`FusedRMSNorm`; a gated MLP (``gate_proj`` and ``up_proj``
plain fp32 ``nn.Linear`` without bias, a ``down_proj``, a SiLU ``act_fn``) becomes
:class:`FusedGatedMLP`, whose gate/up projection is one :class:`~stages.execute.cpu.PackedLinear`
packed straight from the two weights (no concatenated copy; where the packed GEMM does not
build, one ``nn.Linear`` over the concatenated weights, which :func:`~stages.execute.cpu.
use_cpu_linears` then puts on the MKL dispatch). Every kind of module is checked against its own
forward on random inputs first, once per class and shape (unless ``verify`` is off: a load whose
checks passed before, see :mod:`stages.execute.probe_cache`), so a variant that computes
something else (Gemma's ``1 + weight``, say) is left alone.

actorline's own Llama (:mod:`stages.execute.llama`) also takes the kernel's in-place rotary
embeddings of its query and key projections (one pass where torch runs two slices, a negation,
a cat, two muls and an add per tensor, the decode steps' ~14 dispatches a layer), checked
against the model's own formula the same way.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from stages.execute.bf16 import BF16Linear
from stages.execute.cpu import PackedLinear, file_backed_ranges, release_file_pages
from stages.execute.llama import LlamaAttention, apply_rotary
from stages.execute.native import GEMM_PANEL, FusedOpsKernel, PackedGemmKernel

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
    GEMM (``gate_up``: gate's columns, then up's) and the activation in one pass; where
    ``gate_up`` is bf16 panels (:class:`~stages.execute.bf16.BF16Linear`), the activation is
    the GEMM's epilogue (:meth:`~stages.execute.bf16.BF16Linear.silu_mul`: the gate/up product
    is never stored whole)."""

    def __init__(
        self, gate_up: torch.nn.Module, down_proj: torch.nn.Module, kernel: FusedOpsKernel
    ) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down_proj = down_proj
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        gate_up = self.gate_up
        if type(gate_up) is BF16Linear and gate_up.fuses_silu_mul(x.numel() // x.shape[-1]):
            return self.down_proj(gate_up.silu_mul(x))
        return self.down_proj(self._kernel.silu_mul(gate_up(x)))


def use_fused_ops(
    model: Any, gemm: PackedGemmKernel | None, kernel: FusedOpsKernel, *, verify: bool = True
) -> int:
    """Swap ``model``'s fp32 CPU RMSNorms and gated MLPs for their fused forms (see the module
    docstring), gate/up projections packed with ``gemm`` where given; ``verify``: check each
    kind against its own forward first.

    Returns:
        How many modules were replaced or given the fused rotary embeddings.
    """
    replacements: list[tuple[str, torch.nn.Module]] = []
    checked: dict[tuple[type, tuple[int, ...]], bool] = {}
    file_ranges = file_backed_ranges()
    for name, module in list(model.named_modules()):
        if not _fusable(module):
            continue
        key = (type(module), _width(module))
        if key not in checked:
            checked[key] = not verify or _agrees(module, _fused_form(module, gemm, kernel))
        if checked[key]:
            replacements.append((name, module))
    for name, module in replacements:
        fused = _fused_form(module, gemm, kernel)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, fused)
        if isinstance(fused, FusedGatedMLP):
            # NOTE: as for packed linears (stages.execute.cpu): the replaced weights' pages of
            # an mmap'd checkpoint would stay resident beside the fused copy.
            for part in (module.gate_proj, module.up_proj):
                assert isinstance(part, torch.nn.Linear)
                release_file_pages(part.weight, file_ranges)
    return len(replacements) + _use_fused_rotary(model, kernel, verify=verify)


def _use_fused_rotary(model: Any, kernel: FusedOpsKernel, *, verify: bool) -> int:
    """Give every attention module of actorline's own Llama the kernel's rotary embeddings."""
    modules = [module for module in model.modules() if type(module) is LlamaAttention]
    if not modules:
        return 0
    heads = {module.head_dim for module in modules}
    if verify and not all(_rotary_agrees(kernel, head_dim) for head_dim in heads):
        return 0
    for module in modules:
        module.rotary = kernel.rotary_
    return len(modules)


def _rotary_agrees(kernel: FusedOpsKernel, head_dim: int) -> bool:
    """Whether the kernel's rotary embeddings equal the model's own on random rows."""
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(1, 6, heads * head_dim, generator=generator) for heads in (3, 1))
    cos, sin = (torch.randn(1, 6, head_dim, generator=generator) for _ in range(2))
    shape = (1, 6, -1, head_dim)
    expected = [
        apply_rotary(x.view(shape).transpose(1, 2), cos, sin).transpose(1, 2).reshape(x.shape)
        for x in (query, key)
    ]
    try:
        kernel.rotary_(query, key, cos, sin)
    except RuntimeError as error:
        logger.info("execute: fused rotary embeddings unavailable (%s)", error)
        return False
    if not all(_close(got, want) for got, want in zip((query, key), expected, strict=True)):
        logger.warning("execute: fused rotary embeddings disagree with the model's; not used")
        return False
    return True


def _is_plain_linear(module: object) -> bool:
    return (
        type(module) is torch.nn.Linear
        and module.bias is None
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    )


def _fusable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if type(module).__name__.endswith("RMSNorm"):
        return (
            isinstance(weight, torch.nn.Parameter)
            and weight.dim() == 1
            and weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and isinstance(getattr(module, "variance_epsilon", None), float)
        )
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    return (
        _is_plain_linear(gate)
        and _is_plain_linear(up)
        and isinstance(getattr(module, "down_proj", None), torch.nn.Module)
        and type(getattr(module, "act_fn", None)).__name__ in _SILU_NAMES
        and gate.in_features == up.in_features  # type: ignore[union-attr]
        and gate.out_features == up.out_features  # type: ignore[union-attr]
    )


def _fused_form(
    module: torch.nn.Module, gemm: PackedGemmKernel | None, kernel: FusedOpsKernel
) -> torch.nn.Module:
    """The fused replacement of a module :func:`_fusable` accepted."""
    if type(module).__name__.endswith("RMSNorm"):
        return FusedRMSNorm(module.weight, module.variance_epsilon, kernel)  # type: ignore[arg-type]
    gate, up = module.gate_proj, module.up_proj
    assert isinstance(gate, torch.nn.Linear) and isinstance(up, torch.nn.Linear)
    gate_up: torch.nn.Module
    if gemm is not None and gate.out_features % GEMM_PANEL == 0:
        gate_up = PackedLinear(gemm.pack(gate.weight, up.weight), None, gemm)
    else:
        gate_up = torch.nn.Linear(
            gate.in_features, 2 * gate.out_features, bias=False, device="meta"
        )
        gate_up.weight = torch.nn.Parameter(
            torch.cat([gate.weight.detach(), up.weight.detach()]), requires_grad=False
        )
    down = module.down_proj
    assert isinstance(down, torch.nn.Module)
    return FusedGatedMLP(gate_up, down, kernel)


def _width(module: torch.nn.Module) -> tuple[int, ...]:
    gate = getattr(module, "gate_proj", None)
    if isinstance(gate, torch.nn.Linear):
        return (gate.in_features, gate.out_features)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return tuple(weight.shape)


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same shape, and within the probes' tolerance of the largest output (at least 1)."""
    scale = max(expected.abs().max().item(), 1.0)
    return got.shape == expected.shape and (
        (got - expected).abs().max().item() <= _PROBE_TOLERANCE * scale
    )


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
            if not _close(got, expected):
                logger.warning(
                    "execute: fused form of %s disagrees with it; not used", type(module).__name__
                )
                return False
    return True
