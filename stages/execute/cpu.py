"""CPU tuning for the model runner: glibc allocator settings and the linears' GEMM kernels.

**Allocator.** A prefill step allocates and frees tensors of ~10 MB (``[2048, 1536]`` fp32
activations). glibc serves blocks above its mmap threshold with fresh ``mmap`` calls and
returns freed heap tops to the kernel past its trim threshold, so every such tensor is
page-faulted in again (~300,000 minor faults per 1,600-token prefill step here, ~15% of its
time). :func:`tune_allocator` pins both thresholds so freed blocks are reused;
:func:`release_free_memory` hands what is free back to the kernel once (after loading).

**Linears.** Where the C compiler works, every fp32 linear whose output size is a multiple
of 16 runs on :mod:`stages.execute.native`'s packed-weight GEMM (:class:`PackedLinear`: the
weight repacked once at load into 16-column panels, replacing the original, so memory stays
the same), the LM head included; when the head is tied to the input embeddings, those read
their rows out of the packed head (:class:`PackedEmbedding`). Measured against the MKL paths
below on 2 AVX2 cores: 1.4-1.7x at 16-64 rows, 2-3x at 4-8, 1.1-1.3x for prefill's 128-2048,
LM head 1.4-1.8x at 8-64 rows.

Without the compiler: ``F.linear`` (MKL's sgemm as ``x @ W^T``) is slow at the row counts of
decode steps. For the decoder layers' linears ``W @ x^T`` (MKL's small-N path) is faster from 2
to 128 rows, with 9..16 rows padded to 16 (see :class:`CPULinear`); from 192 rows on (prefill)
``F.linear`` is faster again. For the LM head (``[M, 576] x [576, 49152]``) oneDNN's fp32 inner
product (the op inductor lowers CPU linears to, ``torch.ops.mkldnn._linear_pointwise``) took
about half MKL's time at every M from 1 to 64 (M=1: 5 ms vs 8.4; M=12: 11.5 vs 21; M=64: 32 vs
41, two cores); for the decoder layers' linears it was no faster. Rounding differs from MKL's by
summation order only (~1e-6 relative), and every swapped kernel is checked at load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F

from stages.execute.native import GEMM_PANEL, NativeGemm, PackedGemmKernel, packed_gemm_kernel

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "PADDED_ROWS",
    "SMALL_ROWS",
    "TRANSPOSED_ROWS",
    "TRIM_THRESHOLD_BYTES",
    "CPULMHead",
    "CPULinear",
    "PackedEmbedding",
    "PackedLinear",
    "file_backed_ranges",
    "onednn_linear_available",
    "prefault_pages",
    "release_file_pages",
    "release_free_memory",
    "tied_embedding_agrees",
    "tune_allocator",
    "use_cpu_linears",
]

logger = logging.getLogger("actorline.execute")

# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit
# (DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB): blocks up to it come from the heap.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, as a first write would
_PREFAULT_CHUNK = 8 * 1024 * 1024
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# Free memory at the top of a heap is returned to the kernel only past this much: more than
# one step's transient activations, so steps stop page-faulting them back in.
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
# The LM head swap is kept only if oneDNN agrees with F.linear this closely (relative to the
# largest logit) on a random probe: a wrong kernel would be far off.
_PROBE_TOLERANCE = 1e-4
_PROBE_ROWS = (1, 3, 8, 12, 24, 200)
# The packed GEMM is probed on at most this many output columns of a weight: more panels only
# make its thread loop longer, and probing the whole LM head took 0.6 s of every start.
_PROBE_MAX_COLUMNS = 2048
# Row counts computed as W @ x^T (MKL's small-N path): 2..SMALL_ROWS as they are, up to
# PADDED_ROWS padded to PADDED_ROWS (measured: 16 rows ran as fast as 8, 12 rows slowly), and
# above that up to TRANSPOSED_ROWS as they are again (measured, best of 5 interleaved runs of
# SmolLM2-135M's 30 layers: 0.71-0.85x F.linear's time at 16..128 rows, 1.35x at 192 and more).
SMALL_ROWS_MIN = 2
SMALL_ROWS = 8
PADDED_ROWS = 16
TRANSPOSED_ROWS = 128


@functools.cache
def _libc() -> Any | None:
    """glibc, loaded once (``find_library`` runs ``ldconfig``), or None elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None  # not glibc (musl, macOS)
    return libc


def tune_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring).

    Returns:
        Whether both settings took effect (False where the C library is not glibc).
    """
    libc = _libc()
    if libc is None:
        return False
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mmap_ok and trim_ok


def release_free_memory() -> bool:
    """Return the C heap's free pages to the kernel (glibc ``malloc_trim(0)``): load-time
    garbage (checkpoint parsing, the probe) stops counting as resident.

    Returns:
        Whether anything was released (False where the C library is not glibc).
    """
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


_MADV_DONTNEED = 4  # Linux <sys/mman.h>


def file_backed_ranges() -> list[tuple[int, int]]:
    """The ``[start, end)`` address ranges of this process's file mappings (Linux; empty
    elsewhere)."""
    ranges: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    start, _, end = fields[0].partition("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return ranges


def release_file_pages(tensor: torch.Tensor, file_ranges: list[tuple[int, int]]) -> int:
    """Drop from this process's resident set the memory pages that only ``tensor`` occupies,
    where ``tensor`` is a view of a file mapping (a checkpoint loaded with mmap): the kernel
    reads them back from the file if they are touched again, so nothing is lost, and the pages
    stop counting twice once the tensor has been copied (packed) elsewhere. Pages shared with
    a neighbour, or outside file mappings (anonymous memory would read back as zeros), are
    left alone.

    Returns:
        How many bytes were released (0 where this is not Linux/glibc).
    """
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last <= first or not any(lo <= start and end <= hi for lo, hi in file_ranges):
        return 0
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED):
        return 0
    return last - first


def prefault_pages(tensor: torch.Tensor) -> None:
    """Fault in the pages of ``tensor`` (a view of an anonymous mapping, page-aligned) on a
    daemon thread, ``madvise(MADV_POPULATE_WRITE)`` 8 MiB at a time (ctypes releases the GIL
    for each call). Where the call is missing (a kernel before 5.14, not glibc) or refused (no
    memory), the pages are left to fault on first write."""
    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()

    def run(keep: torch.Tensor) -> None:  # ``keep`` holds the mapping while this runs
        libc = _libc()
        if libc is None:
            return
        for offset in range(0, size, _PREFAULT_CHUNK):
            length = min(_PREFAULT_CHUNK, size - offset)
            if libc.madvise(
                ctypes.c_void_p(start + offset), ctypes.c_size_t(length), _MADV_POPULATE_WRITE
            ):
                logger.debug(
                    "execute: pages left to fault on first write (madvise: errno %d)",
                    ctypes.get_errno(),
                )
                return

    threading.Thread(target=run, args=(tensor,), name="actorline-prefault", daemon=True).start()


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's fused linear op for CPU tensors."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class CPULinear(torch.nn.Linear):
    """An fp32 CPU ``nn.Linear`` that picks its GEMM by the number of rows ``M`` (see the
    module docstring): ``F.linear`` for one row and for more than ``TRANSPOSED_ROWS``;
    ``W @ x^T`` for ``2..SMALL_ROWS`` rows and for ``PADDED_ROWS+1..TRANSPOSED_ROWS`` rows, and
    for the rows between padded with zeros to ``PADDED_ROWS`` (padding rows never mix into the
    real ones: every output is its own dot product).

    Installed on existing modules by :func:`use_cpu_linears` (a class swap: parameters and
    any weight tying stay as they are).
    """

    # Rows above SMALL_ROWS and up to this are padded to it; 0: never pad.
    padded_rows = PADDED_ROWS
    # Rows above padded_rows and up to this run as W @ x^T unpadded; 0: never.
    transposed_rows = TRANSPOSED_ROWS

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        rows = input.numel() // self.in_features
        small = SMALL_ROWS_MIN <= rows <= SMALL_ROWS or (
            self.padded_rows < rows <= self.transposed_rows
        )
        if not (small or SMALL_ROWS < rows <= self.padded_rows):
            return self._large(input)
        flat = input.reshape(rows, self.in_features)  # [M, K]
        if not small:
            padded = flat.new_zeros(self.padded_rows, self.in_features)  # [P, K]
            padded[:rows] = flat
            flat = padded
        output = torch.mm(self.weight, flat.t()).t()[:rows]  # [M, N], transposed strides
        if self.bias is not None:
            output = output + self.bias
        return output.contiguous().view(*input.shape[:-1], self.out_features)

    def _large(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


class CPULMHead(CPULinear):
    """:class:`CPULinear` for the LM head: oneDNN's inner product instead of ``F.linear``,
    no padding (oneDNN beats padded ``W @ x^T`` there)."""

    padded_rows = 0
    transposed_rows = 0

    def _large(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(input, self.weight, self.bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """An fp32 CPU linear over a weight packed into 16-column panels ``[N / 16, K, 16]``,
    computed by :class:`~stages.execute.native.PackedGemmKernel` (see the module docstring).
    It holds no ``[N, K]`` weight: the packed copy replaces it."""

    def __init__(
        self, packed: torch.Tensor, bias: torch.Tensor | None, kernel: PackedGemmKernel
    ) -> None:
        super().__init__()
        self.in_features = int(packed.shape[1])
        self.out_features = int(packed.shape[0] * packed.shape[2])
        self.packed = torch.nn.Parameter(packed, requires_grad=False)
        self.bias = bias
        self._kernel = kernel

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernel: PackedGemmKernel) -> PackedLinear:
        return cls(kernel.pack(linear.weight), linear.bias, kernel)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = input.reshape(-1, self.in_features).contiguous()  # [M, K]
        bias = self.bias.detach() if self.bias is not None else None
        output = self._kernel(flat, self.packed, bias)  # [M, N]
        return output.view(*input.shape[:-1], self.out_features)

    def native_gemm(self) -> NativeGemm:
        """This linear as C code calls it (:class:`~stages.execute.native.NativeGemm`)."""
        kernel = self._kernel
        return NativeGemm.of_panels(
            kernel.gemm_address, self.packed, self.bias, self.out_features, self.in_features,
            kernel.gemm_part_address,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (packed)"


class PackedEmbedding(torch.nn.Module):
    """Input embeddings tied to a :class:`PackedLinear` LM head: row ``v`` is column ``v`` of
    the packed head, ``packed[v // 16, :, v % 16]``, so the tie costs no second copy. ``scale``
    multiplies the rows, as scaled word embeddings do (Gemma's ``embed_scale``)."""

    def __init__(self, head: PackedLinear, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
        packed = self.head.packed
        rows = packed[input_ids // GEMM_PANEL, :, input_ids % GEMM_PANEL]
        return rows if self.scale is None else rows * self.scale


def tied_embedding_agrees(original: torch.nn.Module, candidate: torch.nn.Module) -> bool:
    """Whether ``candidate`` gives ``original``'s rows (exactly) for a spread of token ids: an
    embedding subclass may do more than look rows up (scale them, say), and a replacement
    that lost that would be silently wrong."""
    count = int(getattr(original, "num_embeddings", 0))
    if count < 1:
        return False
    ids = torch.linspace(0, count - 1, steps=min(count, 64)).long().unsqueeze(0)
    with torch.inference_mode():
        expected, got = original(ids), candidate(ids)
    return bool(got.shape == expected.shape and torch.equal(got, expected))


def use_cpu_linears(model: Any, *, native: bool = True, verify: bool = True) -> int:
    """Put ``model``'s plain fp32 CPU ``nn.Linear`` modules on the fastest kernels here
    (see the module docstring), after checking each distinct weight shape's kernel against
    ``F.linear`` on random rows (``verify``; off for a load whose checks passed before, see
    :mod:`stages.execute.probe_cache`): :class:`PackedLinear` where the native GEMM builds
    (and ``native``), else a class swap to :class:`CPULinear` (the output embeddings to
    :class:`CPULMHead`, where oneDNN is available).

    Returns:
        How many modules were replaced or swapped (a kind of kernel that disagreed is used for
        none of them).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    ]
    kernel = packed_gemm_kernel() if native else None
    packed = (
        _use_packed_linears(model, linears, head, kernel, verify) if kernel is not None else set()
    )
    swaps: list[tuple[torch.nn.Linear, type[CPULinear]]] = []
    for name, module in linears:
        if name not in packed:
            is_head = module is head and onednn_linear_available()
            swaps.append((module, CPULMHead if is_head else CPULinear))
    checked: set[tuple[type[CPULinear], tuple[int, ...]]] = set()
    for module, kind in swaps if verify else ():
        key = (kind, tuple(module.weight.shape))
        if key not in checked:
            if not _agrees(module, kind):
                return len(packed)
            checked.add(key)
    for module, kind in swaps:
        # NOTE: a class swap keeps the module object, its parameters and the tie between
        # the LM head and the input embeddings; only forward changes.
        module.__class__ = kind
    return len(packed) + len(swaps)


def _use_packed_linears(
    model: Any,
    linears: list[tuple[str, torch.nn.Linear]],
    head: Any,
    kernel: PackedGemmKernel,
    verify: bool = True,
) -> set[str]:
    """Replace each packable linear by a :class:`PackedLinear` (and tied input embeddings by
    a :class:`PackedEmbedding`), one at a time so only one extra weight is ever resident.

    Returns:
        The names of the linears replaced; none when the kernel disagreed with ``F.linear``
        on the first module of some shape.
    """
    packable = [(name, m) for name, m in linears if m.out_features % GEMM_PANEL == 0]
    checked: set[tuple[int, int, bool]] = set()
    for _, module in packable if verify else ():
        key = (module.out_features, module.in_features, module.bias is not None)
        if key in checked:
            continue
        probe = _leading_columns(module, _PROBE_MAX_COLUMNS)
        agrees = _same_outputs(probe, PackedLinear.from_linear(probe, kernel))
        if not agrees:  # the probe's packed copy is freed here, before any other is made
            return set()
        checked.add(key)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = (
        head is not None
        and isinstance(embeddings, torch.nn.Embedding)
        and embeddings.weight is getattr(head, "weight", None)
        and embeddings.max_norm is None
    )
    file_ranges = file_backed_ranges()
    for name, module in packable:
        packed = PackedLinear.from_linear(module, kernel)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, packed)
        if module is head and tied and embeddings is not None:
            scale = getattr(embeddings, "embed_scale", None)
            candidate = PackedEmbedding(packed, scale if isinstance(scale, torch.Tensor) else None)
            # NOTE: a subclass that does something else keeps its own module (and the weight).
            if tied_embedding_agrees(embeddings, candidate):
                model.set_input_embeddings(candidate)
        # NOTE: a checkpoint loaded with mmap keeps the whole file mapped while any of its
        # tensors (the norms) lives, so the replaced weights' pages would stay resident next
        # to their packed copies (+0.5 GB for SmolLM2-135M); drop them as we go.
        release_file_pages(module.weight, file_ranges)
    return {name for name, _ in packable}


def _leading_columns(module: torch.nn.Linear, columns: int) -> torch.nn.Linear:
    """``module`` itself, or a linear over its first ``columns`` outputs (sharing weights)."""
    if module.out_features <= columns:
        return module
    # NOTE: built on the meta device: no allocation, and no draw from the global generator
    part = torch.nn.Linear(module.in_features, columns, bias=module.bias is not None, device="meta")
    part.weight = torch.nn.Parameter(module.weight.detach()[:columns], requires_grad=False)
    if module.bias is not None:
        part.bias = torch.nn.Parameter(module.bias.detach()[:columns], requires_grad=False)
    return part


def _same_outputs(module: torch.nn.Linear, candidate: torch.nn.Module) -> bool:
    """Whether ``candidate`` matches ``F.linear`` on ``module``'s weights for a few row
    counts (one per kernel path); a wrong kernel would be far off, rounding is ~1e-6."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in _PROBE_ROWS:
            probe = torch.randn(1, rows, module.in_features, generator=generator)  # [1, M, K]
            expected = F.linear(probe, module.weight, module.bias)  # [1, M, N]
            try:
                got = candidate(probe)
            except RuntimeError as error:
                logger.info("execute: %s unavailable (%s)", type(candidate).__name__, error)
                return False
            scale = max(expected.abs().max().item(), 1.0)
            if got.shape != expected.shape or not (
                (got - expected).abs().max().item() <= _PROBE_TOLERANCE * scale
            ):
                logger.warning(
                    "execute: %s disagrees with F.linear; not used", type(candidate).__name__
                )
                return False
    return True


def _agrees(module: torch.nn.Linear, kind: type[CPULinear]) -> bool:
    """Whether ``kind``'s forward matches ``F.linear`` on ``module``'s weights."""
    original = module.__class__
    module.__class__ = kind
    try:
        return _same_outputs(module, module)
    finally:
        module.__class__ = original
