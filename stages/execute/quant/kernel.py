"""The weight-only quantized GEMM (``kernels/quant_gemm.c``), built like the other native
kernels (:func:`stages.execute.native.build_library`: compiled on first use with the system C
compiler, cached by source, flags and CPU) and called through ctypes (docs/architecture.md
§6.3).

torch 2.13's CPU weight-only ops were measured first, at SmolLM2-135M's shapes on this 2-core
machine: ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` are fast only with bf16
activations (23-25 µs at one row of ``[1536, 576]``, against 49 µs for ``F.linear`` in fp32);
with fp32 activations, which the engine keeps, they take 0.6-1.3 ms at one row and 63-209 ms at
64 (12-300 times ``F.linear``). Hence this kernel, which widens 4- and 8-bit weights to fp32
in registers.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from stages.execute.native import NativeKernelError, build_library

__all__ = ["QUANT_SOURCE", "QuantGemmKernel", "quant_gemm_kernel"]

logger = logging.getLogger(__name__)

QUANT_SOURCE = Path(__file__).parents[1] / "kernels" / "quant_gemm.c"  # stages/execute/kernels/
# The kernel's format codes (kernels/quant_gemm.c: FORMAT_Q8, FORMAT_Q4, FORMAT_Q4F).
_FORMAT_CODES = {"q8": 0, "q4": 1, "q4f": 2}
_INT8_ACTIVATIONS = 16  # kernels/quant_gemm.c: ACT_Q8
_INT8_DOT = {0: "plain", 1: "avx2", 2: "vnni"}  # kernels/quant_gemm.c: actorline_quant_int8_dot


class QuantGemmKernel:
    """``y = x @ W^T + b`` with ``W`` in a quantized block layout
    (:class:`stages.execute.quant.layers.QuantizedWeight`), and rows of ``W`` as fp32."""

    def __init__(self, library: Path) -> None:
        self.path = library
        lib = ctypes.CDLL(str(library))
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._gemm = lib.actorline_quant_gemm
        self._gemm.argtypes = [pointer, i64, i64, pointer, i32, pointer, i64, pointer, i32]
        self._gemm.restype = i32
        #: the GEMM's address under :class:`~stages.execute.native.NativeGemm`'s convention
        self.gemm_address = ctypes.cast(lib.actorline_quant_gemm, ctypes.c_void_p).value or 0
        #: its column-range entry (:attr:`~stages.execute.native.NativeGemm.part`)
        self.gemm_part_address = (
            ctypes.cast(lib.actorline_quant_gemm_part, ctypes.c_void_p).value or 0
        )
        self._rows = lib.actorline_quant_rows
        self._rows.argtypes = [pointer, i32, i64, i64, pointer, i64, pointer]
        self._rows.restype = i32
        self._block_bytes = lib.actorline_quant_block_bytes
        self._block_bytes.argtypes = [i32]
        self._block_bytes.restype = i64
        self._pack = lib.actorline_quant_pack
        self._pack.argtypes = [pointer, i32, i64, i64, pointer]
        self._pack.restype = i32
        self._format_of = lib.actorline_quant_format_of
        self._format_of.argtypes = [i32]
        self._format_of.restype = i32
        #: whether the int8-activation dot products run on VNNI instructions (AVX512-VNNI or
        #: AVX-VNNI, compiled in under ``-march=native``); elsewhere they run on plain integer
        #: vectors, the same sums, slower
        self.vnni = bool(lib.actorline_quant_vnni())
        #: what the int8 dot products run on: ``"vnni"`` (vpdpbusd), ``"avx2"`` (vpmaddubsw and
        #: vpmaddwd, llama.cpp's AVX2 way) or ``"plain"`` (plain integer vectors)
        # (absent from a build of an older source: a benchmark's baseline)
        dot = getattr(lib, "actorline_quant_int8_dot", None)
        self.int8_dot = _INT8_DOT[int(dot()) if dot is not None else 2 * self.vnni]
        #: whether ``quant_activations="auto"`` picks int8 here: where the dot products run on
        #: byte multiply-adds (VNNI or AVX2), measured faster than fp32 activations at every
        #: row count of the default model's shapes (docs/performance.md §12.1, §12.4)
        self.int8_preferred = self.int8_dot != "plain"

    def format_code(self, fmt: str, int8_activations: bool = False) -> int:
        """The kernel's code for ``fmt`` (the ``format`` argument of its GEMM), with the bit
        that quantizes the activations to int8 blocks (llama.cpp's Q8_0) when
        ``int8_activations``."""
        return _FORMAT_CODES[fmt] | (_INT8_ACTIVATIONS if int8_activations else 0)

    def block_bytes(self, fmt: str) -> int:
        """Bytes of one (16 columns x 32 inputs) block record of ``fmt``."""
        return int(self._block_bytes(_FORMAT_CODES[fmt]))

    def format_of(self, ggml_type: int) -> str | None:
        """The block format a GGML tensor type is packed into, or None (not served)."""
        code = int(self._format_of(ggml_type))
        return next((name for name, value in _FORMAT_CODES.items() if value == code), None)

    def pack(self, raw: torch.Tensor, ggml_type: int, k: int) -> tuple[str, torch.Tensor]:
        """Pack ``raw [N, bytes per row]`` (uint8, contiguous: llama.cpp's blocks of a GGML
        type, ``k`` inputs per row) into the kernel's block records.

        Returns:
            ``(format, blocks [ceil(N / 16), K / 32, block bytes])``.

        Raises:
            NativeKernelError: the type or shape is not one the kernel serves.
        """
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        fmt = self.format_of(ggml_type)
        if fmt is None:
            raise NativeKernelError(f"quantized GEMM kernel: GGML type {ggml_type} is not served")
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        rows = raw.shape[0]
        if (
            raw.dtype != torch.uint8
            or raw.dim() != 2
            or not raw.is_contiguous()
            or k % block_size
            or raw.shape[1] != k // block_size * type_size
        ):
            raise NativeKernelError(
                f"quantized GEMM kernel: {tuple(raw.shape)} {raw.dtype} bytes are not rows of "
                f"{k} inputs of GGML type {ggml_type}"
            )
        blocks = torch.empty(-(-rows // 16), k // 32, self.block_bytes(fmt), dtype=torch.uint8)
        status = self._pack(raw.data_ptr(), ggml_type, rows, k, blocks.data_ptr())
        if status != 0:
            raise NativeKernelError(
                f"quantized GEMM kernel cannot pack a [{rows}, {k}] tensor of GGML type {ggml_type}"
            )
        return fmt, blocks

    def gemm(
        self,
        x: torch.Tensor,  # [M, K] fp32 contiguous
        blocks: torch.Tensor,  # [N / 16, K / 32, block bytes] uint8 contiguous
        fmt: str,
        bias: torch.Tensor | None,  # [N] fp32 contiguous
        int8_activations: bool = False,
    ) -> torch.Tensor:
        """``[M, N]`` outputs; with ``int8_activations`` each row of ``x`` is first rounded to
        llama.cpp's Q8_0 blocks (:func:`~stages.execute.quant.layers.q8_0_activations`) and
        the dot products are integer.

        Raises:
            NativeKernelError: the kernel refused the arguments or ran out of memory.
        """
        rows, k = x.shape
        n = blocks.shape[0] * 16
        if (
            x.dtype != torch.float32
            or not x.is_contiguous()
            or blocks.dim() != 3
            or blocks.dtype != torch.uint8
            or not blocks.is_contiguous()
            or blocks.shape[1] * 32 != k
            or blocks.shape[2] != self.block_bytes(fmt)
            or (bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32))
        ):
            raise NativeKernelError(
                f"quantized GEMM kernel cannot serve {tuple(x.shape)} {x.dtype} inputs against "
                f"{fmt} blocks {tuple(blocks.shape)}"
            )
        out = torch.empty(rows, n)
        status = self._gemm(
            x.data_ptr(), rows, k, blocks.data_ptr(), self.format_code(fmt, int8_activations),
            bias.data_ptr() if bias is not None else None, n, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            reason = "out of memory" if status == 1 else "arguments it cannot serve"
            raise NativeKernelError(f"quantized GEMM kernel failed: {reason}")
        return out

    def rows(
        self, blocks: torch.Tensor, fmt: str, k: int, out_features: int, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the ``[out_features, k]`` matrix in ``blocks``, as fp32
        ``[*ids.shape, K]``, rounded as llama.cpp dequantizes.

        Raises:
            NativeKernelError: an id is outside the matrix, or the blocks do not hold it.
        """
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if (
            blocks.dim() != 3
            or blocks.shape[1] * 32 != k
            or blocks.shape[0] * 16 < out_features
            or not blocks.is_contiguous()
        ):
            raise NativeKernelError(
                f"quantized rows: blocks {tuple(blocks.shape)} do not hold [{out_features}, {k}]"
            )
        if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < out_features):
            raise NativeKernelError(
                f"quantized rows: a token id outside the embedding's {out_features} rows"
            )
        out = torch.empty(flat.numel(), k)
        status = self._rows(
            blocks.data_ptr(), _FORMAT_CODES[fmt], k, blocks.shape[0] * 16, flat.data_ptr(),
            flat.numel(), out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise NativeKernelError("quantized rows: the kernel refused its arguments")
        return out.view(*ids.shape, k)


@functools.cache
def quant_gemm_kernel() -> QuantGemmKernel | None:
    """The quantized GEMM kernel, built or loaded once per process; ``None`` (reason logged
    once) when it cannot be built here."""
    try:
        return QuantGemmKernel(build_library(QUANT_SOURCE))
    except (NativeKernelError, OSError) as error:
        logger.warning("native quant_gemm unavailable: %s", error)
        return None
