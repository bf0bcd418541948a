"""Weight-only quantization of a loaded model, ``ExecuteConfig.quantization``
(docs/architecture.md §6.3): its fp32 linears (the LM head included) and input embeddings are
replaced by :class:`~stages.execute.quant.layers.QuantLinear` and
:class:`~stages.execute.quant.layers.QuantEmbedding` over 4- or 8-bit weights; activations, the
KV cache and everything else stay fp32.

- ``"gguf"``: the model's GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K), as they are
  (:mod:`stages.execute.quant.gguf`). Each packed weight must dequantize to the fp32
  checkpoint's weight exactly (the checkpoint is the same file, dequantized by transformers)
  on a spread of rows (reading only those rows of the checkpoint, whose pages then never
  become resident), else that linear stays fp32 and a warning names it.
- ``"int8"``: any fp32 checkpoint, quantized at load to int8 with an fp16 scale per 32 inputs
  (:func:`~stages.execute.quant.layers.quantize_int8`, llama.cpp's Q8_0).

The linears are ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's, transposed). A linear
whose inputs are not a multiple of 32, or whose tensor the file holds in another type, stays
fp32 (and then runs on the packed fp32 GEMM). The kernel is checked once per format and
shape against ``F.linear`` over the dequantized weight before it serves.

``ExecuteConfig.quant_activations`` says what the weights multiply: ``"int8"`` rounds each
input row to llama.cpp's Q8_0 blocks inside the kernel (integer dot products; the probe then
compares with ``F.linear`` over :func:`~stages.execute.quant.layers.q8_0_activations` of its
inputs), ``"fp32"`` keeps them (weight-only), ``"auto"`` is ``"int8"`` where the kernel's
int8 dot products run on byte multiply-adds, VNNI or AVX2
(:attr:`~stages.execute.quant.kernel.QuantGemmKernel.int8_preferred`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stages.execute.config import ExecuteConfigError
from stages.execute.cpu import file_backed_ranges, release_file_pages
from stages.execute.native import NativeKernelError
from stages.execute.quant.gguf import GGUFWeights
from stages.execute.quant.kernel import QuantGemmKernel, quant_gemm_kernel
from stages.execute.quant.layers import (
    GROUP,
    QuantEmbedding,
    QuantizedWeight,
    QuantLinear,
    dequantize,
    q8_0_activations,
    quantize_int8,
)

__all__ = ["QuantizationReport", "quantize_model", "weight_bytes"]

logger = logging.getLogger("actorline.execute")

_PROBE_ROWS = (1, 3, 9, 17, 40)  # every kernel path (direct, dequantized panels, int8 blocks)
_PROBE_TOLERANCE = 1e-4  # relative to the largest output: rounding is ~1e-6
_PROBE_PANELS = 16  # panels of a big weight the probe runs (256 columns)
_CHECKED_ROWS = 16  # rows of each GGUF weight compared with the checkpoint's


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizationReport:
    """What :func:`quantize_model` did: modules per format (``q8``, ``q4``, ``q4f``), the
    linears and embeddings left fp32, and whether the linears take int8 activations."""

    mode: str
    formats: dict[str, int]
    kept: tuple[str, ...]
    int8_activations: bool = False


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor counted once (tied and
    shared ones included once)."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for tensor in tensors:
        pointer = tensor.data_ptr()
        if pointer not in seen:
            seen.add(pointer)
            total += tensor.numel() * tensor.element_size()
    return total


def quantize_model(
    model: Any, mode: str, gguf: Path | None, activations: str = "fp32", layer_offset: int = 0
) -> QuantizationReport:
    """Replace ``model``'s fp32 CPU linears and input embeddings by quantized ones (see the
    module docstring), one at a time (the fp32 weight's file pages are dropped as each goes);
    ``activations`` is ``ExecuteConfig.quant_activations``; ``layer_offset``: where a
    pipeline shard's layers start in the whole model (its GGUF tensors are found by that
    place, docs/parallelism.md).

    Raises:
        ExecuteConfigError: ``quantization`` cannot be served here (``"gguf"`` for a model
            that did not come from a GGUF file, or the kernel does not build).
        NativeKernelError: the kernel disagrees with ``F.linear`` on the probe.
    """
    kernel = quant_gemm_kernel()
    if kernel is None:
        raise ExecuteConfigError(
            "quantization",
            f"({mode!r}) needs the native quantized GEMM kernel, which could not be built "
            "here (see the log): install a C compiler or leave quantization unset",
        )
    int8_activations = activations == "int8" or (activations == "auto" and kernel.int8_preferred)
    source: GGUFWeights | None = None
    if mode == "gguf":
        if gguf is None:
            raise ExecuteConfigError(
                "quantization",
                "'gguf' runs a GGUF file's own weights, and this model is an HF checkpoint; "
                "use a .gguf model (or an alias shipped as one) or quantization='int8'",
            )
        source = GGUFWeights(gguf, model, kernel, layer_offset)
    names: dict[int, list[str]] = defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names[id(parameter)].append(name)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = (
        isinstance(embeddings, torch.nn.Embedding)
        and head is not None
        and embeddings.weight is getattr(head, "weight", None)
    )
    formats: dict[str, int] = defaultdict(int)
    kept: list[str] = []
    probed: set[tuple[str, int, int, bool]] = set()
    file_ranges = file_backed_ranges()
    quantized_head: QuantLinear | None = None
    for name, module in list(model.named_modules()):
        matrix = _linear_matrix(module)
        if matrix is None:
            continue
        weight = _quantized(matrix, names[id(module.weight)], source, kernel)
        if weight is None:
            kept.append(name)
            continue
        linear = QuantLinear(weight, module.bias, kernel, int8_activations=int8_activations)
        key = (weight.format, weight.out_features, weight.in_features, module.bias is not None)
        if key not in probed:
            _probe(linear, kernel)
            probed.add(key)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
        formats[weight.format] += 1
        if module is head:
            quantized_head = linear
        release_file_pages(module.weight, file_ranges)
    if isinstance(embeddings, torch.nn.Embedding):
        replacement = _quantized_embeddings(
            embeddings, quantized_head if tied else None, names, source, kernel
        )
        if replacement is None:
            kept.append("input embeddings")
        else:
            model.set_input_embeddings(replacement)
            formats[replacement.format] += 1
            release_file_pages(embeddings.weight, file_ranges)
    report = QuantizationReport(mode, dict(formats), tuple(kept), int8_activations)
    logger.info(
        "execute: quantization %s: %s, kept fp32: %s, activations %s (quant_activations %r%s)",
        mode, report.formats, kept, "int8" if int8_activations else "fp32", activations,
        f", int8 dot products on {kernel.int8_dot}",
    )  # fmt: skip
    return report


def _linear_matrix(module: torch.nn.Module) -> torch.Tensor | None:
    """The ``[out, in]`` fp32 CPU weight of a linear: ``nn.Linear``'s own, or the transpose of
    transformers' ``Conv1D`` (GPT-2's ``x @ W + b`` with ``W [in, out]``); None for anything
    else."""
    weight = getattr(module, "weight", None)
    if not (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
    ):
        return None
    if type(module) is torch.nn.Linear:
        return weight
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers."):
        return weight.t()
    return None


def _quantized(
    weight: torch.Tensor,
    names: Sequence[str],
    source: GGUFWeights | None,
    kernel: QuantGemmKernel,
) -> QuantizedWeight | None:
    """``weight`` quantized (from ``source``'s file, else to int8), or None where it stays
    fp32."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    if source is None:
        return quantize_int8(weight, kernel)
    packed = source.quantized(names)
    if packed is None:
        return None
    shape = (packed.out_features, packed.in_features)
    # NOTE: rows spread by a stride prime to any head size: a wrong row order (a missed
    # permutation) moves most of them, and the checkpoint's other pages stay unread.
    rows = torch.arange(_CHECKED_ROWS) * 7919 % packed.out_features
    if shape != tuple(weight.shape) or not torch.equal(
        kernel.rows(packed.blocks, packed.format, packed.in_features, packed.out_features, rows),
        weight[rows],
    ):
        logger.warning(
            "execute: %s in %s does not dequantize to the checkpoint's weight; it stays fp32",
            names[0] if names else "a tensor",
            source.path,
        )
        return None
    return packed


def _quantized_embeddings(
    embeddings: torch.nn.Embedding,
    head: QuantLinear | None,
    names: dict[int, list[str]],
    source: GGUFWeights | None,
    kernel: QuantGemmKernel,
) -> QuantEmbedding | None:
    """Embeddings reading a quantized matrix: the quantized head's when tied, else their own;
    None where they stay as they are (a subclass that does more than scale its rows)."""
    if embeddings.max_norm is not None:
        return None
    scale = getattr(embeddings, "embed_scale", None)
    scale = scale if isinstance(scale, torch.Tensor) else None
    ids = torch.linspace(0, embeddings.num_embeddings - 1, steps=64).long()
    with torch.inference_mode():
        expected = F.embedding(ids, embeddings.weight)
        if not torch.equal(embeddings(ids), expected if scale is None else expected * scale):
            return None  # it does something besides a (scaled) lookup
    if head is not None:
        return QuantEmbedding(head.weight_data, kernel, scale, tied=True)
    weight = _quantized(embeddings.weight, names[id(embeddings.weight)], source, kernel)
    return QuantEmbedding(weight, kernel, scale) if weight is not None else None


def _probe(linear: QuantLinear, kernel: QuantGemmKernel) -> None:
    """Check the kernel against ``F.linear`` over the dequantized weight on a few row
    counts (the leading panels of a big weight), over the inputs rounded to Q8_0 where the
    linear takes int8 activations.

    Raises:
        NativeKernelError: it disagrees.
    """
    weight = linear.weight_data.leading_rows(_PROBE_PANELS)
    bias = linear.bias.detach()[: weight.out_features] if linear.bias is not None else None
    probe = QuantLinear(weight, bias, kernel, int8_activations=linear.int8_activations)
    dense = dequantize(weight, kernel).double()
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in _PROBE_ROWS:
            x = torch.randn(rows, weight.in_features, generator=generator)
            seen = q8_0_activations(x) if linear.int8_activations else x
            expected = F.linear(seen.double(), dense, bias.double() if bias is not None else None)
            error = (probe(x).double() - expected).abs().max().item()
            if not error <= _PROBE_TOLERANCE * max(expected.abs().max().item(), 1.0):
                raise NativeKernelError(
                    f"the quantized GEMM kernel ({weight.format}) disagrees with F.linear "
                    f"(max error {error:.3g} at {rows} rows)"
                )
