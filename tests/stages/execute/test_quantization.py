"""Tests of stages/execute/quantization.py through the model runner: int8 weights of tiny
models of several families, and the default model's own GGUF weights, give greedy tokens
identical to HF ``generate`` on the same dequantized weights; what cannot be served is refused
naming ``quantization``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.quant_kernel import quant_gemm_kernel
from stages.execute.quantized import QuantEmbedding, QuantLinear, dequantize
from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest
from stages.params import SamplingParams
from tests.stages.execute.driving import HFReference, drive
from tests.stages.execute.test_model_table import SERVED, build

MAX_TOKENS = 8


def dequantized_copy(runner: ModelRunner, source: Path, directory: Path) -> Path:
    """The HF checkpoint ``source`` with every weight the runner quantized replaced by its
    dequantized value, saved to ``directory``: the reference on the same weights."""
    from transformers import AutoModelForCausalLM

    kernel = quant_gemm_kernel()
    assert kernel is not None
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for name, module in runner.model.named_modules():
            tied = isinstance(module, QuantEmbedding) and module.tied
            if isinstance(module, (QuantLinear, QuantEmbedding)) and not tied:
                dense = dequantize(module.weight_data, kernel)
                target = model.get_submodule(name)  # GPT-2's Conv1D holds [in, out]
                transposed = type(target).__name__ == "Conv1D"
                target.weight.copy_(dense.t() if transposed else dense)
    model.save_pretrained(directory)
    return directory


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(4)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (3, 17, 30, 9)]


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen2", "gpt2", "mistral (sliding window)"])
def test_int8_weights_match_hf_on_the_dequantized_weights(family: str, tmp_path: Path) -> None:
    model_type, fields = SERVED[family]
    directory = build(model_type, fields, tmp_path / "model")
    runner = ModelRunner(ExecuteConfig(model=str(directory), num_blocks=64, quantization="int8"))
    info = runner.load()
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.format == "q8" for m in quantized)
    assert isinstance(runner.model.get_input_embeddings(), QuantEmbedding)
    fp32 = ModelRunner(ExecuteConfig(model=str(directory), num_blocks=64)).load()
    assert info.quantization == "int8" and info.weight_bytes < fp32.weight_bytes / 2
    batch = prompts(512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(batch)]
    report = drive(runner, requests, chunk_size=8)
    reference = HFReference(dequantized_copy(runner, directory, tmp_path / "dequantized"))
    assert report.outputs == {f"r{i}": reference.greedy(p, MAX_TOKENS) for i, p in enumerate(batch)}


@pytest.mark.slow
@pytest.mark.model
def test_the_default_models_gguf_weights_run_as_they_are(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    runner = ModelRunner(ExecuteConfig(model="smollm2-135m", num_blocks=64, quantization="gguf"))
    info = runner.load()
    formats = {m.format for m in runner.model.modules() if isinstance(m, QuantLinear)}
    assert formats == {"q4", "q8"}  # Q4_1 linears, the Q8_0 head tied to the embeddings
    assert sum(isinstance(m, QuantLinear) for m in runner.model.modules()) == 30 * 7 + 1
    fp32_weights = 134_515_008 * 4  # SmolLM2-135M's parameters in fp32
    assert info.weight_bytes <= 0.2 * fp32_weights
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ("The capital of France is", "def fibonacci(n):")
    batch = [tokenizer(text)["input_ids"] for text in texts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(batch)]
    report = drive(runner, requests, chunk_size=8)
    # The converted checkpoint is the same GGUF weights, dequantized by transformers.
    reference = HFReference(default_model_dir)
    assert report.outputs == {f"r{i}": reference.greedy(p, 12) for i, p in enumerate(batch)}


def test_what_cannot_be_served_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ExecuteConfigError, match=r"quantization.*GGUF file.s own weights"):
        ModelRunner(
            ExecuteConfig(model=str(tiny_model_dir), num_blocks=8, quantization="gguf")
        ).load()
    with pytest.raises(ExecuteConfigError, match=r"quantization.*fp32 models on CPU"):
        ModelRunner(
            ExecuteConfig(
                model=str(tiny_model_dir), num_blocks=8, quantization="int8", dtype="bfloat16"
            )
        ).load()
    with pytest.raises(ExecuteConfigError, match="quantization") as caught:
        ExecuteConfig(quantization="int4")
    assert caught.value.field == "quantization"


@pytest.mark.usefixtures("no_c_compiler")
def test_without_a_c_compiler_quantization_is_refused(tiny_model_dir: Path) -> None:
    runner = ModelRunner(
        ExecuteConfig(model=str(tiny_model_dir), num_blocks=8, quantization="int8")
    )
    with pytest.raises(ExecuteConfigError, match=r"quantization.*could not be built"):
        runner.load()
