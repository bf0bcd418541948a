"""Fixtures of the execute-stage tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from transformers import LlamaConfig

from stages.execute.native import fused_ops_kernel, packed_gemm_kernel, paged_decode_kernel
from stages.execute.quant.kernel import quant_gemm_kernel
from stages.execute.step_graph import step_graph_library
from tests.conftest import TINY_LLAMA


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


@pytest.fixture(scope="session")
def tiny6_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny Llama with 6 decoder layers (seeded; 4 query and 2 KV heads, so TP=2 divides
    them; 6 layers split in 2 or 3 shards), the tokenizer of the 2-layer one: the pipeline-
    and PP x TP tests' model (read only: one per session)."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny6-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 6})).save_pretrained(out)
    for name in tiny_model_dir.iterdir():
        if not (out / name.name).exists():
            shutil.copy(name, out / name.name)
    return out


@pytest.fixture(scope="session")
def tiny6_one_engine(tiny6_model_dir: Path) -> Callable[[str | None], list[tuple[int, ...]]]:
    """The 6-layer tiny Llama's greedy outputs of test_pipeline_parallel's PROMPTS on one
    engine (PP=1, a cache that holds them all; the first prompt alone first), per
    ``model_impl`` (None: actorline's own): computed once per session (worker), the reference
    of the pipeline- and PP x TP exactness tests."""
    from tests.stages.execute.test_pipeline_parallel import outputs_of, run

    computed: dict[str | None, list[tuple[int, ...]]] = {}

    def outputs(model_impl: str | None = None) -> list[tuple[int, ...]]:
        if model_impl not in computed:
            impl = {} if model_impl is None else {"model_impl": model_impl}
            computed[model_impl], _ = run(outputs_of(str(tiny6_model_dir), num_blocks=512, **impl))
        return computed[model_impl]

    return outputs
