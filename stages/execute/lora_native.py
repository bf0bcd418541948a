"""The module path's LoRA delta in native code (docs/lora.md "What runs where"): one ctypes
call per wrapped linear, ``actorline_lora_delta`` of ``kernels/step_graph.c``, the very shrink
and expand the CPU step graph adds after its linears (one source for the delta math), where the
torch form (:meth:`~stages.execute.lora_segments.StepSegments.add_delta`) takes three calls and
multiplies every row by every adapter of the step (the masked shrink, then an expand over all
their rank columns). Each row is shrunk by its own adapter's ``A`` only (a base row costs
nothing) and expanded by its own ``B``, as vLLM's punica kernels shrink and expand per row's
adapter (``vllm/lora/ops/torch_ops/lora_ops.py``: ``bgmv_shrink`` / ``bgmv_expand``); the
threads split the shrink by rows, then the expand by ranges of output columns.

The weights are the concatenated ``A [sum R, in]`` and ``B^T [sum R, out]`` the torch form
multiplies (:class:`~stages.execute.lora_segments.StepSegments` keeps them per set of
adapters); an :class:`LoRAEntry` points at them with each adapter group's rank columns, and is
kept beside them. Where the library does not build (no compiler), :func:`native_lora_delta` is
None and the torch form runs.

The sums run in another order than torch's GEMMs: the deltas agree to rounding
(tests/stages/execute/test_lora_native.py), not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence

import numpy as np
import torch

from stages.execute.step_graph import step_graph_library

__all__ = ["LoRAEntry", "NativeLoRADelta", "lora_offsets", "native_lora_delta"]

logger = logging.getLogger("actorline.execute")

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class LoRAEntry(ctypes.Structure):
    """``step_graph.c``'s ``sg_lora``: one linear's concatenated ``a [rank, in]``, ``bt [rank,
    out]`` and each group's rank columns ``[offsets[g], offsets[g + 1])``."""

    _fields_ = [("a", _p), ("bt", _p), ("offsets", _p), ("rank", _i64), ("out", _i64)]


def lora_offsets(widths: Sequence[int], count: int) -> np.ndarray:
    """The ``count + 1`` rank offsets of groups of rank ``widths`` (0: the group leaves the
    linear alone); the groups past ``len(widths)`` empty."""
    offsets = np.zeros(count + 1, dtype=np.int64)
    offsets[1 : len(widths) + 1] = np.cumsum(widths)
    offsets[len(widths) + 1 :] = offsets[len(widths)]
    return offsets


class NativeLoRADelta:
    """``actorline_lora_delta`` of a loaded step graph library (see the module docstring)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.actorline_lora_delta
        function.argtypes = [_p, _p, _i64, _p, _i64, _i64, _i64, _p, _i64, _p, ctypes.c_int]
        function.restype = ctypes.c_int
        self._function = function

    @staticmethod
    def entry(
        a: torch.Tensor, bt: torch.Tensor, widths: Sequence[int]
    ) -> tuple[LoRAEntry, np.ndarray]:
        """The entry of the concatenated ``a [R, in]`` and ``bt [R, out]`` (fp32, contiguous,
        on the CPU; the caller keeps them alive while the entry is used) with the groups' rank
        ``widths``, and its offsets array (keep it with the entry).

        Raises:
            ValueError: ``a`` or ``bt`` is not a contiguous fp32 CPU matrix, or their ranks
                differ from each other or from the widths' sum.
        """
        for name, tensor in (("a", a), ("bt", bt)):
            if (
                tensor.dtype != torch.float32
                or tensor.device.type != "cpu"
                or tensor.dim() != 2
                or not tensor.is_contiguous()
            ):
                raise ValueError(f"the LoRA {name} must be a contiguous fp32 CPU matrix")
        if a.shape[0] != bt.shape[0] or sum(widths) != a.shape[0]:
            raise ValueError(
                f"the LoRA weights' ranks differ: a {a.shape[0]}, bt {bt.shape[0]}, "
                f"groups {sum(widths)}"
            )
        offsets = lora_offsets(widths, len(widths))
        entry = LoRAEntry(a.data_ptr(), bt.data_ptr(), offsets.ctypes.data, a.shape[0],
                          bt.shape[1])  # fmt: skip
        return entry, offsets

    def add(
        self,
        entry: LoRAEntry,
        groups: np.ndarray,
        count: int,
        x: torch.Tensor,
        out: torch.Tensor,
        scratch: torch.Tensor,
        threads: int,
    ) -> None:
        """``out [T, N] +=`` the delta of each row of ``x [T, in]`` under its group
        (``groups``: ``T`` int64, ``-1`` the base model, else below ``count``), over
        ``entry``'s columns (at most ``N``); ``scratch``: at least ``T * rank`` fp32.

        Raises:
            ValueError: shapes, dtypes or strides the kernel does not take, or a group out of
                range (nothing written).
        """
        rows = x.shape[0]
        if (
            x.dim() != 2
            or out.dim() != 2
            or out.shape[0] != rows
            or x.dtype != torch.float32
            or out.dtype != torch.float32
            or x.stride(1) != 1
            or out.stride(1) != 1
            or groups.dtype != np.int64
            or groups.shape[0] < rows
            or scratch.numel() < rows * entry.rank
        ):
            raise ValueError("the native LoRA delta takes fp32 rows with unit column stride")
        status = self._function(
            ctypes.addressof(entry), groups.ctypes.data, count, x.data_ptr(), x.stride(0), rows,
            x.shape[1], out.data_ptr(), out.stride(0), scratch.data_ptr(), threads,
        )  # fmt: skip
        if status != 0:
            raise ValueError(
                f"the native LoRA delta refused its arguments (status {status}): a row's group "
                f"outside -1..{count - 1}, or shapes that do not fit"
            )


@functools.cache
def native_lora_delta() -> NativeLoRADelta | None:
    """The native delta, from the step graph's library (built once per process); None where
    it cannot be built here (the torch form runs, reason logged once)."""
    library = step_graph_library()
    if library is None:
        return None
    try:
        return NativeLoRADelta(library.library)
    except AttributeError as error:  # a library built from an older source
        logger.warning("native LoRA delta unavailable, using torch's: %s", error)
        return None
