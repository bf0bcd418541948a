"""Tests of stages/execute/quant/gguf.py on the default model's GGUF file: the tensor table
read as the gguf package reads it, and every linear of the converted HF model mapped to its
GGUF tensor with the packed blocks equal to transformers' dequantized weights (Llama's q/k
permutation included)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from stages.execute.quant.gguf import GGUFWeights, read_tensor_table
from stages.execute.quant.kernel import quant_gemm_kernel
from stages.execute.quant.layers import dequantize
from stages.models import ALIASES

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    alias = ALIASES["smollm2-135m"]
    spec = importlib.util.find_spec(alias.package)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / alias.filename


def test_tensor_table_is_the_gguf_packages(gguf_file: Path) -> None:
    from gguf import GGUFReader

    architecture, tensors = read_tensor_table(gguf_file.read_bytes())
    reader = GGUFReader(gguf_file)
    assert architecture == "llama"
    assert [(t.name, t.ggml_type, t.dims, t.offset, t.nbytes) for t in tensors] == [
        (
            t.name,
            int(t.tensor_type),
            tuple(int(d) for d in t.shape),
            int(t.data_offset),
            int(t.n_bytes),
        )
        for t in reader.tensors
    ]


def test_truncated_or_foreign_files_are_refused(tmp_path: Path, gguf_file: Path) -> None:
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_tensor_table(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ValueError, match="version"):
        read_tensor_table(b"GGUF" + (9).to_bytes(4, "little") + b"\0" * 16)
    # its whole tensor table, but not all of its tensors' data (1 byte short, or its first 2 MiB)
    whole = gguf_file.read_bytes()
    for cut in (len(whole) - 1, 2 << 20):
        with pytest.raises(
            ValueError,
            match=rf"truncated: tensor '[\w.]+' ends at byte \d+ but the file has {cut} bytes",
        ):
            read_tensor_table(whole[:cut])


@pytest.mark.slow
def test_every_linear_maps_to_its_tensor_as_transformers_dequantizes_it(
    gguf_file: Path, default_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    kernel = quant_gemm_kernel()
    assert kernel is not None
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    weights = GGUFWeights(gguf_file, model, kernel)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 30 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    formats = set()
    for name, module in linears.items():
        # the head is tied to the embeddings: its tensor is token_embd.weight
        names = (
            [f"{name}.weight", "model.embed_tokens.weight"]
            if name == "lm_head"
            else [f"{name}.weight"]
        )
        packed = weights.quantized(names)
        assert packed is not None, name
        formats.add(packed.format)
        assert torch.equal(dequantize(packed, kernel), module.weight), name
    assert formats == {"q4", "q8"}  # Q4_1 linears, a Q8_0 embedding
    assert weights.quantized(["model.norm.weight"]) is None  # F32: not a quantized type
