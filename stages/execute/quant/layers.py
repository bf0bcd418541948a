"""Weight-only quantized linears and embeddings: 4- and 8-bit weights in memory, fp32
activations, dequantized inside the GEMM (docs/architecture.md §6.3).

A :class:`QuantizedWeight` holds an ``[N, K]`` matrix as block records of 16 output columns
by 32 inputs (the layout of ``kernels/quant_gemm.c``), in one of three formats:

- ``q8``: int8 quants and an fp16 scale per 32 inputs, ``w = d * q`` (llama.cpp's Q8_0, and
  the int8 quantization of an fp32 checkpoint: :func:`quantize_int8`);
- ``q4``: 4-bit quants with an fp16 scale and offset, ``w = d * q + m`` (Q4_1; Q4_0 is
  ``m = -8d``, exact in fp16);
- ``q4f``: the same with fp32 scale and offset (Q4_K, whose sub-block scales ``d * sc`` need
  more than fp16).

:func:`pack_gguf` packs llama.cpp's blocks of those GGML types (as a GGUF file stores them)
into that layout, in C; :func:`dequantize` gives the fp32 matrix back rounded exactly as
llama.cpp (and the gguf package, and so transformers) dequantizes, which is how a GGUF model's
quantized weights are checked against the checkpoint it was converted to.
"""

from __future__ import annotations

import dataclasses

import torch

from stages.execute.native import NativeGemm
from stages.execute.quant.kernel import QuantGemmKernel

__all__ = [
    "GROUP",
    "PANEL",
    "Q8_0",
    "QUANT_FORMATS",
    "QuantEmbedding",
    "QuantLinear",
    "QuantizedWeight",
    "dequantize",
    "pack_gguf",
    "q8_0_activations",
    "quantize_int8",
]

PANEL = 16  # output columns per block record
GROUP = 32  # inputs per block record (one scale each)
QUANT_FORMATS = ("q8", "q4", "q4f")
Q8_0 = 8  # GGML's type number of Q8_0 (ggml.h: GGML_TYPE_Q8_0)


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """An ``[out_features, in_features]`` matrix in the kernel's block layout:
    ``blocks [ceil(N / 16), K / 32, block bytes]`` uint8 (rows past ``out_features`` are zero
    padding)."""

    format: str
    out_features: int
    in_features: int
    blocks: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def leading_rows(self, panels: int) -> QuantizedWeight:
        """The matrix's first ``panels * 16`` rows (a view), or itself when shorter."""
        if self.blocks.shape[0] <= panels:
            return self
        return QuantizedWeight(self.format, panels * PANEL, self.in_features, self.blocks[:panels])


def pack_gguf(
    raw: torch.Tensor, ggml_type: int, in_features: int, kernel: QuantGemmKernel
) -> QuantizedWeight:
    """Pack ``raw [N, bytes per row]``, ``N`` rows of ``in_features`` inputs in llama.cpp's
    blocks of ``ggml_type`` (Q8_0, Q4_0, Q4_1 or Q4_K).

    Raises:
        stages.execute.native.NativeKernelError: another type, or bytes that do not fit.
    """
    fmt, blocks = kernel.pack(raw, ggml_type, in_features)
    return QuantizedWeight(fmt, int(raw.shape[0]), in_features, blocks)


def dequantize(weight: QuantizedWeight, kernel: QuantGemmKernel) -> torch.Tensor:
    """The fp32 ``[N, K]`` matrix, rounded as llama.cpp dequantizes (``d * q``, then
    ``+ m``)."""
    ids = torch.arange(weight.out_features)
    return kernel.rows(weight.blocks, weight.format, weight.in_features, weight.out_features, ids)


def quantize_int8(weight: torch.Tensor, kernel: QuantGemmKernel) -> QuantizedWeight:
    """Symmetric int8 quantization of an fp32 ``[N, K]`` weight, one fp16 scale per 32 inputs:
    llama.cpp's Q8_0 bit for bit (``ggml-quants.c``: ``quantize_row_q8_0_ref``; the gguf
    package's ``Q8_0.quantize_blocks``): ``d = max|w| / 127``, ``q = roundf(w * (1 / d))``
    (halves away from zero), ``d`` stored in fp16; then packed.

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    out_features, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"int8 quantization needs inputs in groups of 32, got {in_features}")
    scale, quants = _q8_0(weight.detach().float())
    raw = torch.cat(
        [scale.half().view(torch.uint8), quants.view(torch.uint8)], dim=2
    )  # [N, G, 34]: Q8_0 blocks
    return pack_gguf(raw.reshape(out_features, -1).contiguous(), Q8_0, in_features, kernel)


def _q8_0(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of ``matrix [R, K]`` (``quantize_row_q8_0_ref``): the fp32 scales
    ``[R, K / 32, 1]`` (stored as fp16) and the int8 quants ``[R, K / 32, 32]``."""
    rows, columns = matrix.shape
    groups = matrix.reshape(rows, columns // GROUP, GROUP)
    scale = groups.abs().amax(dim=2, keepdim=True) / 127  # [R, G, 1] fp32
    inverse = torch.where(scale == 0, 0.0, 1 / scale)
    scaled = groups * inverse
    magnitude = scaled.abs()
    floored = magnitude.floor()
    quants = (scaled.sign() * (floored + (2 * (magnitude - floored)).floor())).to(torch.int8)
    return scale, quants


def q8_0_activations(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` (fp32) as the quantized GEMM's int8 path sees it: each row rounded to
    llama.cpp's Q8_0 blocks (an fp16 scale per 32 inputs, int8 quants) and dequantized. The
    reference for that path: ``F.linear(q8_0_activations(x), dequantize(W))``.

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    columns = x.shape[-1]
    if columns % GROUP:
        raise ValueError(f"Q8_0 activations need inputs in groups of 32, got {columns}")
    scale, quants = _q8_0(x.detach().float().reshape(-1, columns))
    return (quants.float() * scale.half().float()).reshape(x.shape)


class QuantLinear(torch.nn.Module):
    """A linear over a :class:`QuantizedWeight` (fp32 in, fp32 out), run by the quantized
    GEMM kernel. It holds no fp32 weight. With ``int8_activations`` its inputs are rounded to
    llama.cpp's Q8_0 blocks inside the kernel and the dot products are integer (VNNI where the
    CPU has it): :func:`q8_0_activations` says what it computes."""

    blocks: torch.Tensor

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        kernel: QuantGemmKernel,
        *,
        int8_activations: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.format = weight.format
        self.int8_activations = int8_activations
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), False)
        self._kernel = kernel
        padded = weight.blocks.shape[0] * PANEL
        self._padded_bias: torch.Tensor | None = None
        if bias is not None:
            self._padded_bias = bias.detach().float().contiguous()
            if padded != self.out_features:
                pad = self._padded_bias.new_zeros(padded - self.out_features)
                self._padded_bias = torch.cat([self._padded_bias, pad])

    @property
    def weight_data(self) -> QuantizedWeight:
        return QuantizedWeight(self.format, self.out_features, self.in_features, self.blocks)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = input.reshape(-1, self.in_features).contiguous()
        output = self._kernel.gemm(
            flat, self.blocks, self.format, self._padded_bias, self.int8_activations
        )
        if output.shape[1] != self.out_features:
            output = output[:, : self.out_features]
        return output.reshape(*input.shape[:-1], self.out_features)

    def native_gemm(self) -> NativeGemm:
        """This linear as C code calls it (:class:`~stages.execute.native.NativeGemm`): its
        rows are ``blocks.shape[0] * 16`` wide, padded past ``out_features``; the format
        code carries the int8-activation bit where this linear uses it."""
        bias = self._padded_bias
        return NativeGemm(
            function=self._kernel.gemm_address,
            weights=self.blocks.data_ptr(),
            format=self._kernel.format_code(self.format, self.int8_activations),
            bias=0 if bias is None else bias.data_ptr(),
            n=int(self.blocks.shape[0]) * PANEL,
            k=self.in_features,
            owner=(self.blocks, bias),
            part=self._kernel.gemm_part_address,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}, int8_activations={self.int8_activations}"
        )


class QuantEmbedding(torch.nn.Module):
    """Input embeddings read out of a :class:`QuantizedWeight`: their own, or the LM head's
    when the two are tied (the same blocks tensor, so no second copy); ``scale`` multiplies
    the rows, as scaled word embeddings do (Gemma's ``embed_scale``)."""

    blocks: torch.Tensor

    def __init__(
        self,
        weight: QuantizedWeight,
        kernel: QuantGemmKernel,
        scale: torch.Tensor | None = None,
        *,
        tied: bool = False,
    ) -> None:
        super().__init__()
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features
        self.format = weight.format
        self.tied = tied
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.scale = scale
        self._kernel = kernel

    @property
    def weight_data(self) -> QuantizedWeight:
        return QuantizedWeight(self.format, self.num_embeddings, self.embedding_dim, self.blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
        rows = self._kernel.rows(
            self.blocks, self.format, self.embedding_dim, self.num_embeddings, input_ids
        )
        return rows if self.scale is None else rows * self.scale
