"""Tests of stages/execute/quant/apply.py through the model runner: int8 weights of tiny
models of several families, GGUF files written here at Q4_0, Q8_0 and Q4_K, and the default
model's own GGUF weights (Q4_1 and Q8_0), give greedy tokens identical to HF ``generate`` on
the same dequantized weights; what cannot be served is refused naming ``quantization``.

Which reference each compares to: with ``quant_activations="fp32"`` (weight-only) HF on the
dequantized weights as they are; with ``"int8"`` the same HF model with each quantized
linear's input rounded to llama.cpp's Q8_0 blocks first (a forward pre-hook running
:func:`~stages.execute.quant.layers.q8_0_activations`), which is what the kernel computes. The
default model runs both ways (plain HF disagrees with int8 activations at one step of its
prompts: 8-bit activations move logits by more than that step's margin)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.native import fused_ops_kernel, packed_gemm_kernel, paged_decode_kernel
from stages.execute.quant.kernel import quant_gemm_kernel
from stages.execute.quant.layers import (
    QuantEmbedding,
    QuantLinear,
    dequantize,
    q8_0_activations,
)
from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest
from stages.models import resolve_model
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


def round_linear_inputs(reference: HFReference, runner: ModelRunner) -> None:
    """Make ``reference``'s linears that the runner quantized round their inputs to Q8_0
    blocks, as the runner's int8-activation kernel does."""
    for name, module in runner.model.named_modules():
        if isinstance(module, QuantLinear):
            assert module.int8_activations
            reference.model.get_submodule(name).register_forward_pre_hook(
                lambda _module, inputs: (q8_0_activations(inputs[0]), *inputs[1:])
            )


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(4)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (3, 17, 30, 9)]


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen2", "gpt2", "mistral (sliding window)"])
def test_int8_weights_match_hf_on_the_dequantized_weights(family: str, tmp_path: Path) -> None:
    model_type, fields = SERVED[family]
    directory = build(model_type, fields, tmp_path / "model")
    runner = ModelRunner(
        ExecuteConfig(
            model=str(directory), num_blocks=64, quantization="int8", quant_activations="fp32"
        )
    )
    info = runner.load()
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.format == "q8" and not m.int8_activations for m in quantized)
    assert isinstance(runner.model.get_input_embeddings(), QuantEmbedding)
    fp32 = ModelRunner(ExecuteConfig(model=str(directory), num_blocks=64)).load()
    assert info.quantization == "int8" and info.weight_bytes < fp32.weight_bytes / 2
    batch = prompts(512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(batch)]
    report = drive(runner, requests, chunk_size=8)
    reference = HFReference(dequantized_copy(runner, directory, tmp_path / "dequantized"))
    assert report.outputs == {f"r{i}": reference.greedy(p, MAX_TOKENS) for i, p in enumerate(batch)}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_activations_match_hf_with_q8_0_rounded_linear_inputs(
    family: str, tmp_path: Path
) -> None:
    """``quant_activations="int8"`` (on any CPU: VNNI or plain integer vectors): greedy tokens
    (chunked prefill, batched decode) identical to HF on the dequantized weights whose
    quantized linears round their inputs to Q8_0 blocks."""
    model_type, fields = SERVED[family]
    directory = build(model_type, fields, tmp_path / "model")
    config = ExecuteConfig(
        model=str(directory), num_blocks=64, quantization="int8", quant_activations="int8"
    )
    runner = ModelRunner(config)
    runner.load()
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.int8_activations for m in quantized)
    batch = prompts(512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(batch)]
    report = drive(runner, requests, chunk_size=8)
    reference = HFReference(dequantized_copy(runner, directory, tmp_path / "dequantized"))
    round_linear_inputs(reference, runner)
    assert report.outputs == {f"r{i}": reference.greedy(p, MAX_TOKENS) for i, p in enumerate(batch)}


def test_auto_activations_are_int8_where_the_dot_products_are_native(tiny_model_dir: Path) -> None:
    kernel = quant_gemm_kernel()
    assert kernel is not None
    runner = ModelRunner(
        ExecuteConfig(model=str(tiny_model_dir), num_blocks=8, quantization="int8")
    )
    runner.load()
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert quantized and {m.int8_activations for m in quantized} == {kernel.int8_preferred}
    gemm = quantized[0].native_gemm()  # the activations' bit travels in the format code
    assert gemm.format == kernel.format_code(quantized[0].format, kernel.int8_preferred)


#: a tiny Llama whose linears' inputs (256, 512) are whole Q4_K super-blocks of 256 weights
GGUF_LLAMA: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.05,
    tie_word_embeddings=False,  # the head is a tensor of its own (output.weight)
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
#: GGML type -> the packed format stages/execute/quant/layers.py serves it as
GGUF_FORMATS = {"Q4_0": "q4", "Q8_0": "q8", "Q4_K": "q4f"}


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` fp32 weights as llama.cpp's Q4_K blocks (``[rows, cols / 256 * 144]``
    bytes), which the gguf package cannot quantize (its ``Q4_K`` only dequantizes).

    The layout and the two-level scales are llama.cpp's ``quantize_row_q4_K_ref``
    (ggml/src/ggml-quants.c): per 256 weights an fp16 ``d`` and ``dmin``, eight 6-bit
    sub-block scales and mins packed in 12 bytes, and 4-bit quants, ``x = d*sc*q - dmin*m``.
    Each sub-block's scale and min are its plain range (llama.cpp searches for better ones with
    ``make_qkx2_quants``): a coarser quantization, in the same format."""
    rows = weights.shape[0]
    x = weights.astype(np.float32).reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks of 32
    low = np.minimum(x.min(axis=2), 0.0)
    scale, offset = (x.max(axis=2) - low) / 15, -low
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (offset.max(axis=1) / 63).astype(np.float16)

    def divide(values: np.ndarray, by: np.ndarray) -> np.ndarray:
        return np.divide(values, by, out=np.zeros_like(values), where=by > 0)

    sc = np.clip(np.round(divide(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(divide(offset, dmin.astype(np.float32)[:, None])), 0, 63)
    mn = mn.astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    shift = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.round(divide(x + shift, np.broadcast_to(step, x.shape))), 0, 15)
    q = q.astype(np.uint8)
    # gguf/quants.py Q4_K.get_scale_min: bytes 0-3 hold sc[0:4] and sc[4:8]'s top two bits,
    # 4-7 the same for the mins, 8-11 the low nibbles of sc[4:8] and mn[4:8]
    scales = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            mn[:, :4] | (mn[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 0xF) | (mn[:, 4:] & 0xF) << 4,
        ],
        axis=1,
    )
    quants = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # sub-blocks 2j, 2j+1 share bytes
    halves = [d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8)]
    return np.concatenate([*halves, scales, quants], axis=1).reshape(rows, -1)


def quantize_blocks(weights: np.ndarray, ggml_type: str) -> np.ndarray:
    """``[rows, cols]`` fp32 weights as rows of ``ggml_type`` blocks (bytes)."""
    if ggml_type == "Q4_K":
        return quantize_q4_k(weights)
    return gguf_quantize(weights, GGMLQuantizationType[ggml_type])


def write_gguf(model: Any, ggml_type: str, path: Path) -> Path:
    """``model`` (an HF Llama) written as a GGUF file as llama.cpp's ``convert_hf_to_gguf.py``
    writes one: its metadata, a byte-level BPE tokenizer, the q/k rows permuted
    (``LlamaModel.permute``) and every matrix in ``ggml_type`` (norms F32)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    # the 256 bytes (GPT-2's byte alphabet), and merges of letter pairs up to the vocabulary
    tokens = ["<pad>", "<s>", "</s>", *bytes_to_unicode().values()]
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [(a, b) for a in letters for b in letters][: config.vocab_size - len(tokens)]
    tokens += [a + b for a, b in pairs]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3: control, 1: normal
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        base = names.get_name(name.removesuffix(".weight"))
        assert base is not None, name
        values = tensor.numpy().astype(np.float32)
        if base.endswith((".attn_q", ".attn_k")):
            count = heads if base.endswith(".attn_q") else kv_heads
            values = (
                values.reshape(count, 2, values.shape[0] // count // 2, values.shape[1])
                .swapaxes(1, 2)
                .reshape(values.shape)
            )
        if values.ndim == 1:
            writer.add_tensor(f"{base}.weight", values)
        else:
            raw = quantize_blocks(values, ggml_type)
            writer.add_tensor(f"{base}.weight", raw, raw_dtype=GGMLQuantizationType[ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("ggml_type", list(GGUF_FORMATS))
def test_a_gguf_files_blocks_of_each_type_run_as_they_are(
    ggml_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Llama written as a GGUF file with every matrix in ``ggml_type`` runs with
    ``quantization="gguf"``: every linear (the untied head included) and the embeddings on
    the file's own blocks, and greedy tokens (chunked prefill, batched decode) identical to HF
    ``generate`` on the converted checkpoint, transformers' dequantization of the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for kernel in (paged_decode_kernel, packed_gemm_kernel, fused_ops_kernel, quant_gemm_kernel):
        kernel()  # built (or loaded) from the real cache: only the file's conversion moves
    monkeypatch.setenv("ACTORLINE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **GGUF_LLAMA))
    path = write_gguf(source, ggml_type, tmp_path / f"tiny-{ggml_type}.gguf")
    config = ExecuteConfig(
        model=str(path), num_blocks=64, quantization="gguf", quant_activations="fp32"
    )
    runner = ModelRunner(config)
    info = runner.load()
    linears = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert {m.format for m in linears} == {GGUF_FORMATS[ggml_type]}
    assert isinstance(runner.model.get_input_embeddings(), QuantEmbedding)
    assert info.quantization == "gguf"
    batch = prompts(GGUF_LLAMA["vocab_size"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(batch)]
    report = drive(runner, requests, chunk_size=8)
    # The reference is the converted checkpoint: the same file, dequantized by transformers.
    # It is the source model's weights through this type's quantization (q/k unpermuted).
    converted = resolve_model(path).path
    reference = HFReference(converted)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        original = source.get_parameter(name).detach().numpy()
        raw = quantize_blocks(original, ggml_type)
        dense = gguf_dequantize(raw, GGMLQuantizationType[ggml_type]).reshape(original.shape)
        expected = torch.from_numpy(dense)
        assert torch.equal(reference.model.get_parameter(name), expected), name
    assert report.outputs == {f"r{i}": reference.greedy(p, MAX_TOKENS) for i, p in enumerate(batch)}


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_the_default_models_gguf_weights_run_as_they_are(
    default_model_dir: Path, activations: str
) -> None:
    from transformers import AutoTokenizer

    config = ExecuteConfig(
        model="smollm2-135m", num_blocks=64, quantization="gguf", quant_activations=activations
    )
    runner = ModelRunner(config)
    info = runner.load()
    formats = {m.format for m in runner.model.modules() if isinstance(m, QuantLinear)}
    assert formats == {"q4", "q8"}  # Q4_1 linears, the Q8_0 head tied to the embeddings
    # The file's own types: token_embd is Q8_0 and there is no output tensor (tied), so the
    # head is a Q8_0 QuantLinear and the embeddings read its blocks: one copy for both.
    head, embeddings = runner.model.get_output_embeddings(), runner.model.get_input_embeddings()
    assert isinstance(head, QuantLinear) and head.format == "q8"
    assert isinstance(embeddings, QuantEmbedding) and embeddings.tied
    assert embeddings.blocks.data_ptr() == head.blocks.data_ptr()
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
    if activations == "fp32":
        assert report.outputs == {f"r{i}": reference.greedy(p, 12) for i, p in enumerate(batch)}
        return
    # int8: its quantized linears round their inputs to Q8_0 blocks, as the kernel does. Each
    # linear then agrees with the kernel to ~3e-7, but over 30 layers an input that fp32
    # rounding (fused norms, another summation order) moves across a rounding boundary of its
    # block, whose step an outlier makes large (max|x| / 127, up to ~0.8 here), moves logits by
    # up to ~1: exact greedy equality is not a sound check. The bound: teacher-forced on the
    # engine's tokens, each is the reference's top-1 or within 0.25 of it, and nearly all are
    # its top-1 (plain HF: the 6th output of the first prompt differs, by 0.22).
    round_linear_inputs(reference, runner)
    gaps = []
    for i, prompt in enumerate(batch):
        tokens = report.outputs[f"r{i}"]
        with torch.inference_mode():
            logits = reference.model(torch.tensor([[*prompt, *tokens]])).logits[0]
        for step, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + step]
            gaps.append(float(row.max() - row[token]))
    assert max(gaps) <= 0.25, gaps
    assert sum(gap == 0.0 for gap in gaps) >= 0.9 * len(gaps), gaps


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
    with pytest.raises(ExecuteConfigError, match="must be one of") as caught:
        ExecuteConfig(quantization="int8", quant_activations="int4")
    assert caught.value.field == "quant_activations"
    with pytest.raises(ExecuteConfigError, match="applies to quantized weights") as caught:
        ExecuteConfig(quant_activations="int8")  # no quantized weights to take them
    assert caught.value.field == "quant_activations"


@pytest.mark.usefixtures("no_c_compiler")
def test_without_a_c_compiler_quantization_is_refused(tiny_model_dir: Path) -> None:
    runner = ModelRunner(
        ExecuteConfig(model=str(tiny_model_dir), num_blocks=8, quantization="int8")
    )
    with pytest.raises(ExecuteConfigError, match=r"quantization.*could not be built"):
        runner.load()
