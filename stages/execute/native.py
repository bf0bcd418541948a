"""Native CPU kernels, compiled on first use for the machine they run on and loaded with
ctypes: paged decode attention (``kernels/paged_decode.c``), the packed-weight GEMM of
the linears (``kernels/packed_gemm.c``) and the fused RMSNorm and SiLU-and-mul of the decoder
layers (``kernels/fused_cpu.c``).

The C source ships in the package; the first process that needs it compiles it with the
system C compiler (``$CC``, else ``cc``) into ``<cache_dir>/kernels/`` under a name keyed by
the source, the flags and the CPU, writing to a temporary file and renaming it so concurrent
processes never load half a library. Later processes load the cached library (no compiler
needed then). Like ``torch.utils.cpp_extension`` or Triton's JIT cache, minus the C++ and
pybind11 build: the kernel is plain C over raw pointers, so it builds in well under a second.

``-march=native`` lets the compiler use every vector unit of the CPU (AVX2, AVX-512, NEON);
``-fopenmp`` links ``libgomp.so.1``, which resolves to the copy torch already loaded, so the
kernel's threads are torch's threads and nothing oversubscribes the cores.

When no compiler works, :func:`paged_decode_kernel`, :func:`packed_gemm_kernel` and
:func:`fused_ops_kernel` return ``None`` with the reason logged once, and the execute stage
attends with gather + SDPA, runs its linears on MKL and its norms and activations on torch's
ops instead (slower, same results up to rounding).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipeline.runtime import settings

__all__ = [
    "FUSED_SOURCE",
    "GEMM_PANEL",
    "GEMM_SOURCE",
    "KERNEL_SOURCE",
    "PORTABLE_DEFINE",
    "FusedOpsKernel",
    "NativeGemm",
    "NativeKernelError",
    "PackedGemmKernel",
    "PagedDecodeKernel",
    "build_library",
    "fused_ops_kernel",
    "packed_gemm_kernel",
    "paged_decode_kernel",
]

logger = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("kernels") / "paged_decode.c"
GEMM_SOURCE = Path(__file__).with_name("kernels") / "packed_gemm.c"
FUSED_SOURCE = Path(__file__).with_name("kernels") / "fused_cpu.c"
GEMM_PANEL = 16
"""Output columns per packed weight panel: a packable weight has a multiple of this many rows."""
PORTABLE_DEFINE = "ACTORLINE_ATTENTION_PORTABLE"
"""Built with this defined (``build_library(defines=...)``), the paged decode kernel leaves out
its AVX512-BF16 path: the build a CPU without AVX512-BF16 gets (tests run both)."""
_FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
_NATIVE_FLAGS = ("-march=native",)
_LANES = 8  # floats per vector in the kernel: head_dim must be a multiple
_MAX_GROUP = 16  # query heads per KV head
_MAX_HEAD_DIM = 256
_COMPILE_TIMEOUT_S = 120  # each kernel builds in well under a second


_Kernel = TypeVar("_Kernel", "PagedDecodeKernel", "PackedGemmKernel", "FusedOpsKernel")


class NativeKernelError(RuntimeError):
    """A native kernel could not be built or loaded, or refused its arguments."""


@dataclasses.dataclass(frozen=True, slots=True)
class NativeGemm:
    """How C code calls a native linear without Python: ``function`` is the address of

    ``int f(const float *x, int64_t m, int64_t k, const void *weights, int format,
    const float *bias, int64_t n, float *y, int num_threads)``

    computing ``y[m, n] = x[m, k] @ W^T (+ bias)`` (fp32 in and out, rows contiguous; returns 0,
    else an error code), called with ``weights``, ``format`` and ``bias`` (0: none) as given.
    ``n`` may exceed the module's ``out_features`` (panels padded to 16 columns): ``y`` rows are
    ``n`` wide. ``owner`` holds what the pointers point into alive.

    ``part`` (0: none) is the address of the same GEMM restricted to output columns
    ``[col0, col1)`` and run on the calling thread, without an OpenMP region of its own:

    ``int f(const float *x, int64_t m, int64_t k, const void *weights, int format,
    const float *bias, int64_t n, float *y, int64_t col0, int64_t col1, int same_x)``

    (``col0`` a multiple of 32, ``col1`` one of 32 or ``n``; ``y`` is still ``[m, n]``, only
    its columns in the range are written, each exactly as the whole call writes it; ``same_x``
    nonzero: ``x`` holds the rows it held at this thread's last call of ``f``, so what the
    kernel derived from them then, int8 blocks or bf16 pairs, may serve again). The CPU step
    graph's threads each call it for their chunks inside the one OpenMP region of a step
    (``kernels/step_graph.c``)."""

    function: int
    weights: int
    format: int
    bias: int
    n: int
    k: int
    owner: object
    part: int = 0

    @classmethod
    def of_panels(
        cls,
        function: int,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        k: int,
        part: int = 0,
    ) -> NativeGemm:
        """A linear over weight panels ``packed`` (format 0: the kernel knows its layout) and
        an optional ``bias`` ``[n]``, computed by the GEMM at ``function`` (its column-range
        entry at ``part``, 0: none)."""
        bias = bias.detach().contiguous() if bias is not None else None
        return cls(
            function=function,
            weights=packed.data_ptr(),
            format=0,
            bias=0 if bias is None else bias.data_ptr(),
            n=n,
            k=k,
            owner=(packed, bias),
            part=part,
        )


@functools.cache
def _cpu_signature() -> str:
    """What the compiled code depends on: architecture and the CPU's feature flags."""
    features = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                features = line
                break
    return f"{platform.machine()}|{features}"


def build_library(
    source: Path,
    *,
    cache: Path | None = None,
    compiler: str | None = None,
    defines: tuple[str, ...] = (),
) -> Path:
    """Compile ``source`` into a shared library in the kernel cache, or return the cached one.

    Tries ``-march=native`` first, then portable flags (a compiler that lacks it).
    ``defines``: preprocessor names defined for the build (``-DNAME``; part of the cache key).

    Raises:
        NativeKernelError: no compiler, or the source does not compile; the message has the
            compiler's output.
    """
    compiler_command = shlex.split(compiler or os.environ.get("CC") or "cc")
    if not compiler_command or shutil.which(compiler_command[0]) is None:
        raise NativeKernelError(
            f"no C compiler found ({' '.join(compiler_command) or 'empty $CC'!r}); install gcc "
            "or set CC"
        )
    text = source.read_bytes()
    directory = (cache if cache is not None else settings.cache_dir()) / "kernels"
    directory.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for extra in (_NATIVE_FLAGS, ()):
        flags = (*_FLAGS, *extra, *(f"-D{name}" for name in defines))
        identity = (" ".join(compiler_command), " ".join(flags), _cpu_signature())
        digest = hashlib.sha256(b"\0".join([text, *(part.encode() for part in identity)]))
        key = digest.hexdigest()[:16]
        stem = "-".join((source.stem, *(name.lower() for name in defines)))
        target = directory / f"{stem}-{key}.so"
        if target.exists():
            return target
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{stem}-", suffix=".so")
        os.close(handle)
        try:
            try:
                result = subprocess.run(
                    [*compiler_command, *flags, "-o", temporary, str(source)],
                    capture_output=True,
                    text=True,
                    check=False,
                    timeout=_COMPILE_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired:
                raise NativeKernelError(
                    f"compiling {source.name} took over {_COMPILE_TIMEOUT_S} s"
                ) from None
            if result.returncode == 0:
                os.replace(temporary, target)
                return target
            errors.append(f"{' '.join(flags)}: {result.stderr.strip()[-2000:]}")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
    raise NativeKernelError(f"compiling {source.name} failed:\n" + "\n".join(errors))


class PagedDecodeKernel:
    """Decode attention over a token-major paged KV cache, read in place (no gather).

    Serves fp32 CPU queries over an fp32 or bf16 cache (``kv_cache_dtype``), with ``head_dim``
    a multiple of 8 (up to 256) and at most 16 query heads per KV head: :meth:`supports` says
    whether a model's shapes qualify. Over a bf16 cache, where the build has AVX512-BF16
    (:attr:`bf16_dot`), each query is rounded to bf16 and its scores are VDPBF16PS dot
    products (fp32 sums), the softmax and the weighted sum of values fp32; elsewhere each
    element is widened to fp32 as it is read and the arithmetic is fp32 throughout.
    """

    #: the cache dtypes the kernel reads, and each one's entry point
    ENTRY_POINTS = {
        torch.float32: "actorline_paged_decode_f32",
        torch.bfloat16: "actorline_paged_decode_f32_bf16kv",
    }

    def __init__(self, library: Path) -> None:
        self.path = library
        lib = ctypes.CDLL(str(library))
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        #: whether a bf16 cache is attended with VDPBF16PS (queries rounded to bf16)
        self.bf16_dot = bool(lib.actorline_paged_decode_bf16_dot())
        self._functions: dict[torch.dtype, Any] = {}
        #: each cache dtype's entry point's address (the step graph calls it from C)
        self.addresses: dict[torch.dtype, int] = {}
        for dtype, name in self.ENTRY_POINTS.items():
            function = getattr(lib, name)
            function.argtypes = [
                pointer, i64, i64,  # query, row stride, head stride
                pointer, pointer,  # key cache, value cache
                pointer, i64, i64,  # block tables, table stride, table width
                pointer,  # context lengths
                pointer, i64, i64,  # out, row stride, head stride
                i32, i32, i32, i32, i32,  # rows, heads, kv heads, head dim, block size
                i64, ctypes.c_float, i32,  # cache blocks, scale, threads
                i64, ctypes.c_float, pointer,  # window, softcap, sinks
            ]  # fmt: skip
            function.restype = ctypes.c_int
            self._functions[dtype] = function
            self.addresses[dtype] = ctypes.cast(function, ctypes.c_void_p).value or 0

    @staticmethod
    def supports(
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: torch.dtype | None = None,
    ) -> bool:
        """Whether the kernel serves ``dtype`` activations over a ``kv_dtype`` cache (None:
        ``dtype``) on ``device`` with these shapes."""
        return (
            dtype == torch.float32
            and (kv_dtype or dtype) in PagedDecodeKernel.ENTRY_POINTS
            and device.type == "cpu"
            and num_kv_heads > 0
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= _MAX_GROUP
            and head_dim % _LANES == 0
            and head_dim <= _MAX_HEAD_DIM
        )

    def __call__(
        self,
        query: torch.Tensor,  # [Hq, B, D] fp32 (any strides with D contiguous)
        key_cache: torch.Tensor,  # [num_slots, Hkv, D] fp32 or bf16, contiguous
        value_cache: torch.Tensor,  # [num_slots, Hkv, D] as key_cache
        block_tables: torch.Tensor,  # [B, max_blocks] int64, rows contiguous
        context_lens: torch.Tensor,  # [B] int64 contiguous
        out: torch.Tensor,  # [B, Hq, D] (any row/head strides with D contiguous)
        block_size: int,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [Hq] fp32 contiguous
    ) -> None:
        """Attend ``query`` row ``b`` to the first ``context_lens[b]`` positions of its blocks
        (only the last ``window`` of them when given: the blocks before are never read),
        writing ``out[b]``. ``softcap`` caps the scores (``softcap * tanh(s / softcap)``);
        ``sinks`` holds one sink logit per query head (joins the softmax, adds no value).

        Raises:
            NativeKernelError: the kernel refused the arguments or could not allocate.
        """
        num_heads, num_rows, head_dim = query.shape
        num_kv_heads = key_cache.shape[1]
        if (
            query.stride(2) != 1
            or out.stride(2) != 1
            or not key_cache.is_contiguous()
            or not value_cache.is_contiguous()
            or block_tables.stride(1) != 1
            or block_tables.dim() != 2
            or block_tables.shape[0] != num_rows
            or context_lens.shape != (num_rows,)
            or value_cache.shape != key_cache.shape
            or key_cache.shape[2] != head_dim
            or out.shape != (num_rows, num_heads, head_dim)
            or any(t.dtype != torch.float32 for t in (query, out))
            or key_cache.dtype not in self._functions
            or value_cache.dtype != key_cache.dtype
            or not context_lens.is_contiguous()
            or block_tables.dtype != torch.int64
            or context_lens.dtype != torch.int64
            or (
                sinks is not None
                and (
                    sinks.shape != (num_heads,)
                    or sinks.dtype != torch.float32
                    or not sinks.is_contiguous()
                )
            )
        ):
            raise NativeKernelError("paged decode kernel: unsupported tensor layout or dtype")
        if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
            raise NativeKernelError(
                f"paged decode kernel: window ({window}) and softcap ({softcap}) must be positive"
            )
        status = self._functions[key_cache.dtype](
            query.data_ptr(), query.stride(1), query.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
            context_lens.data_ptr(),
            out.data_ptr(), out.stride(0), out.stride(1),
            num_rows, num_heads, num_kv_heads, head_dim, block_size,
            key_cache.shape[0] // block_size, scale, torch.get_num_threads(),
            window or 0, softcap or 0.0, sinks.data_ptr() if sinks is not None else None,
        )  # fmt: skip
        if status != 0:
            reason = "out of memory" if status == 1 else "arguments it cannot serve"
            raise NativeKernelError(f"paged decode kernel failed: {reason}")


class PackedGemmKernel:
    """``y = x @ W^T + b`` in fp32 on CPU over a weight packed once into panels of 16 output
    columns (``[N / 16, K, 16]``); see ``kernels/packed_gemm.c``. ``lanes`` and ``tile_rows``:
    the vector width (floats) and rows per register tile this build picked for the CPU."""

    def __init__(self, library: Path) -> None:
        self.path = library
        lib = ctypes.CDLL(str(library))
        self.lanes = int(lib.actorline_gemm_lanes())
        self.tile_rows = int(lib.actorline_gemm_rows())
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._pack = lib.actorline_pack_weight_f32
        self._pack.argtypes = [pointer, pointer, i64, i64]
        self._pack.restype = None
        self._gemm = lib.actorline_packed_gemm_f32
        self._gemm.argtypes = [pointer, i64, i64, pointer, pointer, i64, pointer, ctypes.c_int]
        self._gemm.restype = ctypes.c_int
        #: the GEMM's address under :class:`NativeGemm`'s calling convention
        self.gemm_address = ctypes.cast(lib.actorline_packed_gemm, ctypes.c_void_p).value or 0
        #: its column-range entry (:attr:`NativeGemm.part`)
        self.gemm_part_address = (
            ctypes.cast(lib.actorline_packed_gemm_part, ctypes.c_void_p).value or 0
        )

    def pack(self, *weights: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` (fp32, CPU, N a multiple of 16) as panels ``[N / 16, K, 16]``;
        several weights of one K are packed one after another into one tensor, as their rows
        concatenated would be (a fused gate/up projection, without the concatenated copy).

        Raises:
            NativeKernelError: a weight cannot be packed, or the weights' K differ.
        """
        for weight in weights:
            if (
                weight.dim() != 2
                or weight.dtype != torch.float32
                or weight.device.type != "cpu"
                or weight.shape[0] % GEMM_PANEL != 0
                or weight.shape[1] != weights[0].shape[1]
            ):
                raise NativeKernelError(
                    f"cannot pack a {weight.dtype} {weight.device.type} weight of shape "
                    f"{tuple(weight.shape)}: needs fp32 on CPU with rows a multiple of "
                    f"{GEMM_PANEL} (and one K for all)"
                )
        if not weights:
            raise NativeKernelError("no weight to pack")
        k = weights[0].shape[1]
        total = sum(weight.shape[0] for weight in weights)
        packed = torch.empty(total // GEMM_PANEL, k, GEMM_PANEL)
        panel = 0
        for weight in weights:
            n = weight.shape[0]
            source = weight.detach().contiguous()
            self._pack(source.data_ptr(), packed[panel : panel + n // GEMM_PANEL].data_ptr(), n, k)
            panel += n // GEMM_PANEL
        return packed

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [M, K]`` (contiguous fp32) times the packed weight: ``[M, N]``."""
        panels, k, _ = packed.shape
        rows = x.shape[0]
        out = torch.empty(rows, panels * GEMM_PANEL)
        if rows == 0:
            return out
        status = self._gemm(
            x.data_ptr(), rows, k, packed.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            panels * GEMM_PANEL, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise NativeKernelError("packed GEMM kernel refused its arguments")
        return out


class FusedOpsKernel:
    """fp32 CPU RMSNorm, SiLU-and-mul and rotary embeddings in one pass each, and a vector
    argmax per row (see ``kernels/fused_cpu.c``)."""

    def __init__(self, library: Path) -> None:
        self.path = library
        lib = ctypes.CDLL(str(library))
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._rms_norm = lib.actorline_rms_norm_f32
        self._rms_norm.argtypes = [pointer, i64, pointer, pointer, i64, i64, ctypes.c_float, i32]
        self._rms_norm.restype = None
        self._silu_mul = lib.actorline_silu_mul_f32
        self._silu_mul.argtypes = [pointer, i64, i64, pointer, i32]
        self._silu_mul.restype = None
        self._rope = lib.actorline_rope_f32
        self._rope.argtypes = [
            pointer, i64, i32, pointer, i64, i32, i64, i32, pointer, pointer, i32,
        ]  # fmt: skip
        self._rope.restype = None
        self._argmax = lib.actorline_argmax_rows_f32
        self._argmax.argtypes = [pointer, i64, i64, i64, pointer, i32]
        self._argmax.restype = None

    def rotary_(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Apply rotary embeddings in place to ``query [1, T, Hq * D]`` and ``key [1, T, Hkv *
        D]`` (fp32 CPU, each row contiguous) with ``cos``/``sin [1, T, D]`` (contiguous): each
        head becomes ``x * cos + rotate_half(x) * sin``, as HF's ``apply_rotary_pos_emb``.

        Raises:
            NativeKernelError: a tensor is not fp32 on CPU, or the layouts or shapes differ.
        """
        tensors = (query, key, cos, sin)
        rows, head_dim = cos.shape[-2], cos.shape[-1]
        if (
            any(t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3 for t in tensors)
            or any(t.shape[:2] != (1, rows) or t.stride(2) != 1 for t in (query, key))
            or sin.shape != cos.shape
            or not cos.is_contiguous()
            or not sin.is_contiguous()
            or head_dim % 2 != 0
            or query.shape[2] % head_dim != 0
            or key.shape[2] % head_dim != 0
        ):
            raise NativeKernelError("fused rotary: needs fp32 CPU [1, T, H * D] rows and [1, T, D]")
        self._rope(
            query.data_ptr(), query.stride(1), query.shape[2] // head_dim,
            key.data_ptr(), key.stride(1), key.shape[2] // head_dim,
            rows, head_dim, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` of fp32 CPU ``logits [rows, V]`` (rows any stride apart,
        each contiguous): the first index of each row's maximum, NaN counting as the maximum.

        Raises:
            NativeKernelError: not a 2-D fp32 CPU tensor with contiguous rows.
        """
        if (
            logits.dtype != torch.float32
            or logits.device.type != "cpu"
            or logits.dim() != 2
            or logits.stride(1) != 1
            or not 0 < logits.shape[1] < 2**31
        ):
            raise NativeKernelError("native argmax: needs fp32 CPU [rows, V] with contiguous rows")
        rows = logits.shape[0]
        out = torch.empty(rows, dtype=torch.int64)
        # NOTE: the kernel splits rows over threads; more threads than rows only wake idle
        # ones and wait for them at the region's end (a one-row greedy step waited ms for a
        # descheduled thread on a loaded machine)
        self._argmax(
            logits.data_ptr(), rows, logits.shape[1], logits.stride(0),
            out.data_ptr(), min(rows, torch.get_num_threads()),
        )  # fmt: skip
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` over the last axis of fp32 ``x``
        (its rows any stride apart, the last axis contiguous); a new contiguous tensor.

        Raises:
            NativeKernelError: ``x`` or ``weight`` is not fp32 on CPU, or their shapes differ.
        """
        dim = x.shape[-1]
        if (
            x.dtype != torch.float32
            or weight.dtype != torch.float32
            or x.device.type != "cpu"
            or weight.shape != (dim,)
            or not weight.is_contiguous()
        ):
            raise NativeKernelError("fused RMSNorm: needs fp32 CPU tensors with a [dim] weight")
        flat = x.reshape(-1, dim)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(flat.shape, dtype=torch.float32)
        self._rms_norm(
            flat.data_ptr(), flat.stride(0), weight.data_ptr(), out.data_ptr(),
            flat.shape[0], dim, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` where ``gate_up [..., 2 * I]`` holds gate then up (fp32,
        contiguous): ``[..., I]``.

        Raises:
            NativeKernelError: not a contiguous fp32 CPU tensor of even width.
        """
        width = gate_up.shape[-1]
        if (
            gate_up.dtype != torch.float32
            or gate_up.device.type != "cpu"
            or width % 2 != 0
            or not gate_up.is_contiguous()
        ):
            raise NativeKernelError("fused SiLU-and-mul: needs a contiguous fp32 CPU [.., 2I]")
        out = torch.empty(*gate_up.shape[:-1], width // 2)
        rows = gate_up.numel() // width if width else 0
        threads = torch.get_num_threads()
        self._silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr(), threads)
        return out


def _load(kind: type[_Kernel], source: Path, fallback: str) -> _Kernel | None:
    try:
        return kind(build_library(source))
    except (NativeKernelError, OSError) as error:
        logger.warning("native %s unavailable, using %s: %s", source.stem, fallback, error)
        return None


@functools.cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The paged decode kernel, built or loaded once per process; ``None`` (reason logged
    once) when it cannot be built here."""
    return _load(PagedDecodeKernel, KERNEL_SOURCE, "gather + SDPA")


@functools.cache
def packed_gemm_kernel() -> PackedGemmKernel | None:
    """The packed GEMM kernel, built or loaded once per process; ``None`` (reason logged
    once) when it cannot be built here."""
    return _load(PackedGemmKernel, GEMM_SOURCE, "MKL")


@functools.cache
def fused_ops_kernel() -> FusedOpsKernel | None:
    """The fused RMSNorm / SiLU-and-mul kernel, built or loaded once per process; ``None``
    (reason logged once) when it cannot be built here."""
    return _load(FusedOpsKernel, FUSED_SOURCE, "torch's ops")
