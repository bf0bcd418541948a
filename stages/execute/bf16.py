"""Native bf16 weights on CPU: linears whose weights are bf16 panels, activations fp32.

A model loaded with ``dtype="bfloat16"`` on CPU, where ``kernels/bf16_gemm.c`` builds, keeps
its linears' and LM head's weights in bf16 (half the bytes a decode step reads) and computes
everything else in fp32: activations, norms, the residual stream, rotary embeddings, attention
and the KV cache, as llama.cpp runs a BF16 GGUF (its BF16 matmul converts the activation row to
bf16 and accumulates in fp32; norms and attention stay fp32). So the fp32 fused kernels and the
native paged decode attention keep serving the model.

The model is loaded in bf16 (every weight rounded as transformers rounds it), widened to fp32,
put on the fp32 packed linears (:func:`stages.execute.cpu.use_cpu_linears`, after
:func:`stages.execute.fused.use_fused_ops`), then :func:`use_bf16_linears` turns each
:class:`~stages.execute.cpu.PackedLinear` into a :class:`BF16Linear` (its panels narrowed to
bf16, exact: the values were bf16) and the tied input embeddings into a :class:`BF16Embedding`
reading their rows from the bf16 head.

``dtype="auto"`` on CPU picks bf16 where :func:`choose_cpu_dtype` says the CPU multiplies bf16
natively (AVX512-BF16 or AMX-BF16 in ``/proc/cpuinfo`` and the kernel built on VDPBF16PS) or
widens it with AVX2 and FMA (the portable path below), else fp32 (bf16 emulated would be
slower than fp32).

Where the CPU has AMX-BF16 (``amx_bf16`` and ``amx_tile`` in ``/proc/cpuinfo``, the compiler
targeted it and Linux granted the process the tile state) the kernel multiplies from
:attr:`BF16GemmKernel.amx_rows` rows on with AMX tiles that read the same panels in place
(prefill, batched decode: no unpacked copy of the weight); with AVX512-BF16 alone, from
:data:`TORCH_ROWS` rows on, torch's bf16 matmul over the weight unpacked for the call.

Without AVX512-BF16 (AVX2, AVX-512 before Cooper Lake, NEON) the kernel's portable path serves
every row count: each bf16 weight widened to fp32 (a 16-bit shift) and FMA'd, as llama.cpp runs
a BF16 GGUF on AVX2, in registers at decode's few rows and a panel widened once into an fp32
buffer at many (prefill), register-blocked per vector unit (``kernels/bf16_gemm.c``). A decode
step then reads half fp32's bytes: 1.9-2.0x the fp32 kernel's linears at one row on AVX2,
0.9x at hundreds (docs/performance.md §12.3).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stages.execute.cpu import PackedEmbedding, PackedLinear
from stages.execute.native import (
    GEMM_PANEL,
    NativeGemm,
    NativeKernelError,
    build_library,
)

__all__ = [
    "AMX_FEATURES",
    "BF16_FEATURES",
    "BF16_SOURCE",
    "WIDEN_FEATURES",
    "BF16Embedding",
    "BF16GemmKernel",
    "BF16Linear",
    "bf16_gemm_kernel",
    "choose_cpu_dtype",
    "cpu_flags",
    "use_bf16_linears",
]

logger = logging.getLogger("actorline.execute")

BF16_SOURCE = Path(__file__).with_name("kernels") / "bf16_gemm.c"
BF16_FEATURES = ("avx512_bf16", "amx_bf16")
"""CPU flags (``/proc/cpuinfo``) under which bf16 is multiplied natively."""
AMX_FEATURES = ("amx_bf16", "amx_tile")
"""CPU flags (``/proc/cpuinfo``) the AMX tile GEMM needs, all of them."""
WIDEN_FEATURES = ("avx2", "fma")
"""CPU flags (``/proc/cpuinfo``) under which the bf16 kernel's portable path (bf16 widened to
fp32 in registers, 8-float vectors or wider) beats fp32: ``dtype="auto"`` picks bf16 there."""
_PORTABLE_DEFINE = "ACTORLINE_BF16_PORTABLE"
# The kernel is checked at load against F.linear on bf16-rounded operands: the two differ by
# summation order only (~1e-6 relative to the largest output); a wrong kernel is far off.
_PROBE_TOLERANCE = 1e-4
_PROBE_ROWS = (1, 3, 13, 40)
_AMX_PROBE_ROWS = (200,)  # more rows than one pass of the AMX GEMM holds at K 1536
TORCH_ROWS = 128
"""Where the kernel multiplies on VDPBF16PS without AMX tiles (:attr:`BF16GemmKernel.native`
and not :attr:`~BF16GemmKernel.amx`), from this many rows on (prefill) :class:`BF16Linear`
multiplies with torch's bf16 matmul (oneDNN) over the weight unpacked from its panels for the
call (a transient ``[N, K]`` bf16 copy, small beside the GEMM of so many rows), its output
rounded to bf16 as torch's is; below, the native kernel. Measured on SmolLM2-135M's shapes
(docs/performance.md §12.2): VDPBF16PS wins at decode's few rows (it reads half fp32's bytes),
oneDNN's AVX512-BF16 or AMX kernels win at hundreds of rows. Without AVX512-BF16 torch's bf16
matmul is emulated (7-8x slower than the portable kernel at 256 rows on AVX2, §12.3): the
portable kernel serves every row count there."""


class BF16GemmKernel:
    """``y = x @ W^T + b`` on CPU with ``W`` packed once into bf16 panels ``[N / 16, ceil(K /
    2), 16, 2]``, ``x`` and ``y`` fp32 (``x`` rounded to bf16 inside, fp32 accumulation); see
    ``kernels/bf16_gemm.c``. ``native``: whether this build multiplies with AVX512-BF16's
    VDPBF16PS (else the portable widen-and-FMA path). ``amx``: whether it multiplies on AMX
    tiles from ``amx_rows`` rows on (asked for with ``amx`` and granted: the CPU lists
    :data:`AMX_FEATURES`, the compiler targeted AMX-BF16 and Linux gave the process the tile
    state; see :meth:`tiles`)."""

    def __init__(self, library: Path, *, amx: bool = True) -> None:
        self.path = library
        lib = ctypes.CDLL(str(library))
        self.native = bool(lib.actorline_bf16_native())
        #: the floats per vector and rows per micro-tile this build picked for the CPU
        self.lanes = int(lib.actorline_bf16_lanes())
        self.tile_rows = int(lib.actorline_bf16_rows())
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._gemm = lib.actorline_bf16_gemm_f32
        self._amx_gemm = lib.actorline_bf16_gemm_amx_f32
        for function in (self._gemm, self._amx_gemm):
            function.argtypes = [pointer, i64, i64, pointer, pointer, i64, pointer, ctypes.c_int]
            function.restype = ctypes.c_int
        self.amx_rows = int(lib.actorline_bf16_amx_rows())
        #: from this many rows a call on the tiles walks row blocks outside and chunks of
        #: panels inside (``kernels/bf16_gemm.c``: ``AMX_BLOCK_ROWS_FIRST``)
        self.amx_block_rows_first = int(lib.actorline_bf16_amx_block_rows_first())
        # The library asks Linux for the tile state only where the CPU lists the features.
        self.amx = (
            amx
            and self.native
            and set(AMX_FEATURES) <= cpu_flags()
            and bool(lib.actorline_bf16_amx_enable())
        )
        # C callers get the dispatching entries (tiles from amx_rows rows on) only where granted.
        tiles = "_tiles" if self.amx else ""

        def address(name: str) -> int:
            return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0

        #: the GEMM's address under :class:`~stages.execute.native.NativeGemm`'s convention
        self.gemm_address = address(f"actorline_bf16_gemm{tiles}")
        #: its column-range entry (:attr:`~stages.execute.native.NativeGemm.part`), on the
        #: tiles at the row counts where the whole call is
        self.gemm_part_address = address(f"actorline_bf16_gemm{tiles}_part")
        #: the SiLU-and-mul epilogue of a fused gate/up projection (:meth:`silu_mul`) under
        #: NativeGemm's convention (its output ``n / 2`` columns wide), and its range entry
        self.silu_address = address(f"actorline_bf16_silu_mul{tiles}")
        self.silu_part_address = address(f"actorline_bf16_silu_mul{tiles}_part")
        self._silu = getattr(lib, f"actorline_bf16_silu_mul{tiles}")
        self._silu.argtypes = [pointer, i64, i64, pointer, ctypes.c_int, pointer, i64, pointer,
                               ctypes.c_int]  # fmt: skip
        self._silu.restype = ctypes.c_int

    @staticmethod
    def pack(*weights: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` (fp32 or bf16, CPU, N a multiple of 16) rounded to bf16 as panels
        ``[N / 16, ceil(K / 2), 16, 2]``; several weights of one K are packed one after another
        (a fused gate/up projection).

        Raises:
            NativeKernelError: no weight, or one cannot be packed, or their K differ.
        """
        if not weights:
            raise NativeKernelError("no weight to pack")
        k = weights[0].shape[-1]
        for weight in weights:
            if (
                weight.dim() != 2
                or weight.dtype not in (torch.float32, torch.bfloat16)
                or weight.device.type != "cpu"
                or weight.shape[0] % GEMM_PANEL != 0
                or weight.shape[1] != k
            ):
                raise NativeKernelError(
                    f"cannot pack a {weight.dtype} {weight.device.type} weight of shape "
                    f"{tuple(weight.shape)} as bf16: needs fp32/bf16 on CPU with rows a "
                    f"multiple of {GEMM_PANEL} (and one K for all)"
                )
        pairs = (k + 1) // 2
        total = sum(weight.shape[0] for weight in weights)
        packed = torch.empty(total // GEMM_PANEL, pairs, GEMM_PANEL, 2, dtype=torch.bfloat16)
        panel = 0
        for weight in weights:
            panels = weight.shape[0] // GEMM_PANEL
            source = F.pad(weight.detach().to(torch.bfloat16), (0, 2 * pairs - k))  # [N, 2P]
            packed[panel : panel + panels] = source.view(panels, GEMM_PANEL, pairs, 2).transpose(
                1, 2
            )
            panel += panels
        return packed

    @staticmethod
    def from_panels(panels: torch.Tensor) -> torch.Tensor:
        """fp32 panels ``[N / 16, K, 16]`` (:class:`~stages.execute.native.PackedGemmKernel`'s
        layout) as bf16 panels, without unpacking to ``[N, K]``."""
        count, k, _ = panels.shape
        narrow = F.pad(panels.detach().to(torch.bfloat16), (0, 0, 0, k % 2))  # [P, 2Q, 16]
        return narrow.view(count, (k + 1) // 2, 2, GEMM_PANEL).transpose(2, 3).contiguous()

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, k: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [M, K]`` (contiguous fp32) times the packed weight: ``[M, N]`` fp32; on AMX
        tiles from :attr:`amx_rows` rows on where :attr:`amx`, else with VDPBF16PS (or the
        portable path).

        Raises:
            NativeKernelError: the kernel refused its arguments or could not allocate.
        """
        tiles = self.amx and x.shape[0] >= self.amx_rows
        return self._run(self._amx_gemm if tiles else self._gemm, x, packed, k, bias)

    def tiles(
        self, x: torch.Tensor, packed: torch.Tensor, k: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """As calling the kernel, on AMX tiles whatever the row count.

        Raises:
            NativeKernelError: this kernel has no AMX tiles (:attr:`amx` false), or the kernel
                refused its arguments or could not allocate.
        """
        if not self.amx:
            raise NativeKernelError("bf16 GEMM: no AMX tiles in this process (see .amx)")
        return self._run(self._amx_gemm, x, packed, k, bias)

    def silu_mul(
        self, x: torch.Tensor, packed: torch.Tensor, k: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``silu(gate) * up`` of a fused gate/up projection in one call: ``packed`` holds the
        gate's ``n / 2`` columns, then the up's (:meth:`pack` of the two), ``n`` a multiple of
        32; ``x [M, K]`` contiguous fp32; returns ``[M, n / 2]`` fp32. Each 16 gate columns and
        their up columns are multiplied (on the tiles from :attr:`amx_rows` rows where
        :attr:`amx`, else VDPBF16PS) into a buffer that stays in L1, and only the activation is
        stored: the products are those of calling the kernel, the SiLU-and-mul that of
        ``kernels/fused_cpu.c`` (the same expression, so equal up to rounding).

        Raises:
            NativeKernelError: the kernel refused its arguments or could not allocate.
        """
        return self._run(self._silu, x, packed, k, bias, half=True)

    @staticmethod
    def _run(
        function: Any,
        x: torch.Tensor,
        packed: torch.Tensor,
        k: int,
        bias: torch.Tensor | None,
        *,
        half: bool = False,
    ) -> torch.Tensor:
        rows = x.shape[0]
        n = packed.shape[0] * GEMM_PANEL
        out = torch.empty(rows, n // 2 if half else n)
        if rows == 0:
            return out
        arguments: tuple[int, ...] = (x.data_ptr(), rows, k, packed.data_ptr())
        if half:  # the NativeGemm convention: a format argument after the weights
            arguments = (*arguments, 0)
        status = function(
            *arguments, bias.data_ptr() if bias is not None else None, n, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            reason = {1: "out of memory", 3: "AMX tiles unavailable"}.get(
                status, "arguments it cannot serve"
            )
            raise NativeKernelError(f"bf16 GEMM kernel failed: {reason}")
        return out


@functools.cache
def bf16_gemm_kernel(portable: bool = False, amx: bool = True) -> BF16GemmKernel | None:
    """The bf16 GEMM kernel, built or loaded once per process (``portable``: the widen-and-FMA
    path even where the CPU has AVX512-BF16; ``amx``: multiply on AMX tiles from
    :attr:`BF16GemmKernel.amx_rows` rows on where the CPU and Linux allow it); ``None`` (reason
    logged) where it cannot be built."""
    defines = (_PORTABLE_DEFINE,) if portable else ()
    try:
        kernel = BF16GemmKernel(build_library(BF16_SOURCE, defines=defines), amx=amx)
    except (NativeKernelError, OSError) as error:
        logger.warning("native bf16_gemm unavailable, using torch's bf16 kernels: %s", error)
        return None
    if amx and not portable:
        if kernel.amx:
            logger.info("execute: bf16 GEMM on AMX tiles from %d rows", kernel.amx_rows)
        elif set(AMX_FEATURES) <= cpu_flags():
            logger.info("execute: the CPU has AMX-BF16 but its tiles are unavailable here")
    return kernel


class BF16Linear(torch.nn.Module):
    """A CPU linear over bf16 panels (:class:`BF16GemmKernel`): fp32 in, fp32 out."""

    def __init__(
        self, packed: torch.Tensor, in_features: int, bias: torch.Tensor | None, kernel: Any
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = int(packed.shape[0] * GEMM_PANEL)
        self.packed = torch.nn.Parameter(packed, requires_grad=False)
        self.bias = bias
        self._kernel: BF16GemmKernel = kernel

    @classmethod
    def from_packed(cls, linear: PackedLinear, kernel: BF16GemmKernel) -> BF16Linear:
        """``linear``'s weights (already bf16 values, else rounded to them) as bf16 panels."""
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(kernel.from_panels(linear.packed), linear.in_features, bias, kernel)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernel: BF16GemmKernel) -> BF16Linear:
        bias = linear.bias.detach().float() if linear.bias is not None else None
        return cls(kernel.pack(linear.weight), linear.in_features, bias, kernel)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = input.reshape(-1, self.in_features).float().contiguous()  # [M, K]
        bias = self.bias.detach() if self.bias is not None else None
        if not self.native_rows(flat.shape[0]):
            weight = self.weight_view()  # [N, K] bf16
            output = F.linear(flat.bfloat16(), weight).float()
            if bias is not None:
                output += bias
        else:
            output = self._kernel(flat, self.packed, self.in_features, bias)  # [M, N]
        return output.view(*input.shape[:-1], self.out_features)

    def native_rows(self, rows: int) -> bool:
        """Whether :meth:`forward` multiplies ``rows`` rows on the native kernel (the AMX tiles
        or the portable widen-and-FMA path at every count, VDPBF16PS below
        :data:`TORCH_ROWS`), not torch's matmul: the kernel the step graph calls
        (stages.execute.step_graph)."""
        kernel = self._kernel
        return rows < TORCH_ROWS or kernel.amx or not kernel.native

    def fuses_silu_mul(self, rows: int) -> bool:
        """Whether :meth:`silu_mul` serves ``rows`` rows: this linear is a fused gate/up
        projection of two halves of whole panels, and the native kernel (not torch's matmul,
        see :data:`TORCH_ROWS`) multiplies that many rows."""
        return self.out_features % (2 * GEMM_PANEL) == 0 and self.native_rows(rows)

    def silu_mul(self, input: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N / 2]
        """``silu(gate) * up`` where this linear is a fused gate/up projection (its first half
        of columns the gate's, the second the up's): the GEMM with its SiLU-and-mul epilogue
        (:meth:`BF16GemmKernel.silu_mul`), the fp32 ``[..., N]`` product never stored.

        Raises:
            NativeKernelError: the kernel refused (``out_features`` not a multiple of 32).
        """
        flat = input.reshape(-1, self.in_features).float().contiguous()  # [M, K]
        bias = self.bias.detach() if self.bias is not None else None
        output = self._kernel.silu_mul(flat, self.packed, self.in_features, bias)
        return output.view(*input.shape[:-1], self.out_features // 2)

    def silu_mul_gemm(self) -> NativeGemm:
        """:meth:`silu_mul` as C code calls it: a :class:`~stages.execute.native.NativeGemm`
        over this linear's panels whose ``function`` and ``part`` compute the activation
        (output rows ``n / 2`` wide, ``part``'s columns the gate's)."""
        kernel = self._kernel
        return NativeGemm.of_panels(
            kernel.silu_address, self.packed, self.bias, self.out_features, self.in_features,
            kernel.silu_part_address,
        )  # fmt: skip

    def weight_view(self) -> torch.Tensor:
        """The weight ``[N, K]`` in bf16, unpacked from the panels (a new tensor)."""
        packed = self.packed.detach()
        return packed.transpose(1, 2).reshape(self.out_features, -1)[:, : self.in_features]

    def native_gemm(self) -> NativeGemm:
        """This linear as C code calls it (:class:`~stages.execute.native.NativeGemm`)."""
        kernel = self._kernel
        return NativeGemm.of_panels(
            kernel.gemm_address, self.packed, self.bias, self.out_features, self.in_features,
            kernel.gemm_part_address,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (bf16 panels)"


class BF16Embedding(torch.nn.Module):
    """Input embeddings tied to a :class:`BF16Linear` LM head: row ``v`` is column ``v`` of the
    bf16 panels (``packed[v // 16, :, v % 16, :]``), widened to fp32 and scaled by ``scale``
    where given (Gemma's ``embed_scale``)."""

    def __init__(self, head: BF16Linear, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
        packed = self.head.packed
        pairs = packed[input_ids // GEMM_PANEL, :, input_ids % GEMM_PANEL]  # [..., Q, 2]
        rows = pairs.flatten(-2)[..., : self.embedding_dim].float()
        return rows if self.scale is None else rows * self.scale


def use_bf16_linears(model: Any, kernel: BF16GemmKernel, *, verify: bool = True) -> int:
    """Turn every :class:`~stages.execute.cpu.PackedLinear` of ``model`` (the fused gate/up
    projections and the LM head included) into a :class:`BF16Linear`, and input embeddings
    read from a packed head into a :class:`BF16Embedding`; ``verify``: check the kernel first
    against ``F.linear`` on bf16-rounded operands, once per distinct K.

    Returns:
        How many linears were converted (none where the kernel disagreed).
    """
    places: list[tuple[torch.nn.Module, str, PackedLinear]] = []
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, PackedLinear):
                places.append((parent, child_name, child))
    if verify:
        for width in sorted({linear.in_features for _, _, linear in places}):
            if not _kernel_agrees(kernel, width):
                return 0
    converted: dict[int, BF16Linear] = {}
    for parent, child_name, linear in places:
        if isinstance(parent, PackedEmbedding):
            continue  # replaced whole below
        if id(linear) not in converted:
            converted[id(linear)] = BF16Linear.from_packed(linear, kernel)
        setattr(parent, child_name, converted[id(linear)])
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embeddings, PackedEmbedding):
        head = converted.get(id(embeddings.head))
        if head is None:
            head = converted[id(embeddings.head)] = BF16Linear.from_packed(embeddings.head, kernel)
        model.set_input_embeddings(BF16Embedding(head, embeddings.scale))
    return len(converted)


def _kernel_agrees(kernel: BF16GemmKernel, width: int) -> bool:
    """Whether the kernel matches ``F.linear`` on bf16-rounded operands of inner size
    ``width`` (a random 48-column weight with bias, a few row counts: both sides of
    :attr:`BF16GemmKernel.amx_rows` and several AMX passes where the kernel has tiles)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, width, generator=generator).bfloat16().float()
    bias = torch.randn(48, generator=generator)
    packed = kernel.pack(weight)
    with torch.inference_mode():
        # with tiles also past the rows from which a call walks row blocks outside (an M tail)
        amx_rows = (*_AMX_PROBE_ROWS, kernel.amx_block_rows_first + 17) if kernel.amx else ()
        for rows in _PROBE_ROWS + amx_rows:
            x = torch.randn(rows, width, generator=generator)
            expected = F.linear(x.bfloat16().float(), weight, bias)
            try:
                got = kernel(x, packed, width, bias)
            except RuntimeError as error:
                logger.info("execute: bf16 linears unavailable (%s)", error)
                return False
            scale = max(expected.abs().max().item(), 1.0)
            if not (got - expected).abs().max().item() <= _PROBE_TOLERANCE * scale:
                logger.warning("execute: the bf16 GEMM disagrees with F.linear; not used")
                return False
    return True


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` lists them (empty where unreadable)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    return frozenset()


def choose_cpu_dtype(flags: Iterable[str], kernel: BF16GemmKernel | None) -> tuple[str, str]:
    """What ``dtype="auto"`` means on this CPU: ``("bfloat16", why)`` where the bf16 kernel built
    and the CPU either multiplies bf16 natively (AVX512-BF16 or AMX-BF16 in ``flags``, the
    kernel on VDPBF16PS) or widens it on AVX2 + FMA (:data:`WIDEN_FEATURES`: the portable path,
    measured on AVX2 faster than fp32 at one stream and not slower offline, docs/performance.md
    §12.3), else ``("float32", why)`` (bf16 would be emulated)."""
    flags = set(flags)
    present = [flag for flag in BF16_FEATURES if flag in flags]
    listed = f"the CPU has {'/'.join(present)} but " if present else ""
    if kernel is None:
        return "float32", f"{listed}the bf16 kernel did not build"
    if present and kernel.native:
        tiles = f" (AMX tiles from {kernel.amx_rows} rows)" if kernel.amx else ""
        return "bfloat16", (
            f"the CPU has {'/'.join(present)} and the native bf16 kernel built{tiles}"
        )
    if set(WIDEN_FEATURES) <= flags:
        unused = (
            f" (it lists {'/'.join(present)} but the compiler did not target AVX512-BF16)"
            if present
            else ""
        )
        return "bfloat16", (
            "the CPU has AVX2 and FMA: the bf16 kernel widens bf16 to fp32 as it multiplies "
            f"(half fp32's bytes a decode step){unused}"
        )
    return "float32", (
        "the CPU has neither AVX512-BF16, AMX-BF16 nor AVX2 + FMA (bf16 would be emulated)"
    )
