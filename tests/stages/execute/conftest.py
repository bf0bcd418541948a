"""Fixtures of the execute-stage tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.execute.native import fused_ops_kernel, packed_gemm_kernel, paged_decode_kernel
from stages.execute.quant.kernel import quant_gemm_kernel
from stages.execute.step_graph import step_graph_library


def _forget_kernels() -> None:
    paged_decode_kernel.cache_clear()
    packed_gemm_kernel.cache_clear()
    fused_ops_kernel.cache_clear()
    quant_gemm_kernel.cache_clear()
    step_graph_library.cache_clear()


@pytest.fixture
def no_c_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """As on a machine without a C compiler, for real: ``$CC`` names no program and the
    kernel cache is empty, so building the native kernels fails and the engine falls back."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ACTORLINE_CACHE_DIR", str(tmp_path / "cache"))
    _forget_kernels()
    yield
    monkeypatch.undo()
    _forget_kernels()  # the next user builds (or loads from the real cache) again
