"""DESIGN.md's layering: the pure-logic modules (scheduler bookkeeping, block allocator, step
bookkeeping, stop checker, detokenizer state, token bucket, policies, messages) import no
asyncio, zmq, grpc or torch, so they stay testable and reusable on their own."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE_MODULES = (
    "stages.scheduler",
    "stages.policies",
    "stages.execute.allocator",
    "stages.execute.bookkeeping",
    "stages.stop_checker",
    "stages.detokenizer",
    "stages.token_bucket",
    "stages.params",
    "stages.messages",
    "stages.early_aborts",
    "stages.execute.model_length",
)
FORBIDDEN = ("asyncio", "anyio", "zmq", "grpc", "torch")


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_no_runtime(module: str) -> None:
    # A fresh interpreter: this test process has all of them loaded already.
    probe = f"import sys, {module}; print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"{module} imports {result.stdout.strip()}"
