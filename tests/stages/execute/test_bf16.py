"""Native bf16 weights on CPU (stages.execute.bf16): the bf16 GEMM on both of its paths against
torch on bf16-rounded operands, the bf16 model against references, and ``dtype="auto"``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stages.execute.bf16 import (
    AMX_FEATURES,
    TORCH_ROWS,
    WIDEN_FEATURES,
    BF16Embedding,
    BF16GemmKernel,
    BF16Linear,
    bf16_gemm_kernel,
    choose_cpu_dtype,
    cpu_flags,
)
from stages.execute.config import ExecuteConfig
from stages.execute.cpu import PackedLinear
from stages.execute.native import packed_gemm_kernel
from stages.execute.runner import ModelRunner
from stages.messages import SamplingParams

from .driving import drive
from .test_runner import PROMPT_LENGTHS, SMOLLM_PROMPTS, make_requests, random_prompts

ROWS = (1, 2, 3, 4, 5, 11, 12, 13, 24, 25, 37, 100)
# Logit margins under this are within the noise bf16-rounded activations add (tiny model).
_BF16_NOISE = 2e-2
# ... and with K/V rounded to bf16 too (SmolLM2-135M): rounding amplifies float noise between
# two correct paths into whole bf16 steps of K/V. Measured: the one step where the engine and the
# emulating reference part (prompt 3, step 21; the engine the same over an fp32 and a bf16
# cache) has a reference margin of 0.003 without K/V rounding and 0.021 with it.
_BF16_KV_NOISE = 5e-2
SHAPES = ((16, 1), (32, 7), (48, 33), (80, 64), (96, 577), (160, 1536))  # (N, K): tails, panels


def kernels() -> list[BF16GemmKernel]:
    native, portable = bf16_gemm_kernel(), bf16_gemm_kernel(portable=True)
    assert native is not None and portable is not None, "the C compiler should work"
    assert not portable.native
    return [native, portable]


@pytest.mark.parametrize("path", ["native", "portable"])
def test_bf16_gemm_matches_torch_on_bf16_rounded_operands(path: str) -> None:
    kernel = kernels()[path == "portable"]
    generator = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = torch.randn(n, k, generator=generator)
        bias = torch.randn(n, generator=generator)
        packed = kernel.pack(weight)
        assert packed.dtype == torch.bfloat16 and packed.shape == (n // 16, (k + 1) // 2, 16, 2)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator) * 3
            expected = F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias)
            for with_bias in (True, False):
                got = kernel(x, packed, k, bias if with_bias else None)
                want = expected if with_bias else expected - bias
                scale = max(want.abs().max().item(), 1.0)
                error = (got - want).abs().max().item()
                assert error <= 2e-6 * scale * max(1.0, k**0.5 / 8), (n, k, rows, error)


def test_the_instruction_path_is_used_where_the_cpu_has_it() -> None:
    native = kernels()[0]
    assert native.native == ("avx512_bf16" in cpu_flags())
    # AMX tiles wherever the CPU lists them (this Linux grants the tile state), never without.
    assert native.amx == (native.native and set(AMX_FEATURES) <= cpu_flags())
    assert not kernels()[1].amx and not bf16_gemm_kernel(amx=False).amx  # type: ignore[union-attr]


def amx_kernel() -> BF16GemmKernel:
    if not set(AMX_FEATURES) <= cpu_flags():
        pytest.skip("the CPU has no AMX-BF16")
    kernel = kernels()[0]
    assert kernel.amx, "the CPU has AMX-BF16: the kernel should multiply on its tiles"
    return kernel


# (N, K): one panel, odd panel counts (a lone last panel), K tails of every kind (under one
# tile, one short of a tile, one over, odd K) and the default model's K; rows: M tails around
# the 16-row tiles and 32-row blocks, and more rows than one pass at K 577 / 1536 (and, there,
# the rows from which the call walks row blocks outside).
AMX_SHAPES = ((16, 1), (48, 7), (80, 31), (32, 32), (48, 33), (96, 64), (48, 577), (112, 1536))
AMX_ROWS = (1, 2, 15, 16, 17, 31, 32, 33, 47, 64, 100, 500)


def test_amx_tiles_match_torch_on_bf16_rounded_operands() -> None:
    kernel = amx_kernel()
    generator = torch.Generator().manual_seed(2)
    for n, k in AMX_SHAPES:
        weight = torch.randn(n, k, generator=generator)
        bias = torch.randn(n, generator=generator)
        packed = kernel.pack(weight)
        # past amx_block_rows_first the tiles walk row blocks outside, chunks of panels inside
        first = kernel.amx_block_rows_first
        for rows in (*AMX_ROWS, first, first + 17):
            if rows >= 500 and k not in (577, 1536):
                continue
            x = torch.randn(rows, k, generator=generator) * 3
            expected = F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias)
            for with_bias in (True, False):
                got = kernel.tiles(x, packed, k, bias if with_bias else None)
                want = expected if with_bias else expected - bias
                scale = max(want.abs().max().item(), 1.0)
                error = (got - want).abs().max().item()
                assert error <= 2e-6 * scale * max(1.0, k**0.5 / 8), (n, k, rows, error)


def test_amx_tiles_never_read_past_a_panel() -> None:
    """K tails: a B tile read past its panel would multiply what follows (the next panel's
    first lines, here holding inf; after the last panel, NaN) by the activations' zero padding,
    which gives NaN."""
    kernel = amx_kernel()
    generator = torch.Generator().manual_seed(3)
    for k in (7, 33, 63):
        weight = torch.randn(48, k, generator=generator)
        weight[16, 0] = weight[32, 0] = float("inf")  # the first line of panels 1 and 2
        packed = kernel.pack(weight)
        room = torch.full((packed.numel() + 64 * 32,), float("nan"), dtype=torch.bfloat16)
        room[: packed.numel()] = packed.flatten()
        poisoned = room[: packed.numel()].view(packed.shape)
        x = torch.randn(40, k, generator=generator)
        got = kernel.tiles(x, poisoned, k, None)
        finite = [column for column in range(48) if column not in (16, 32)]
        assert torch.isfinite(got[:, finite]).all(), k
        assert torch.isinf(got[:, [16, 32]]).all(), k
        expected = F.linear(x.bfloat16().float(), weight.bfloat16().float())
        assert torch.allclose(got[:, finite], expected[:, finite], rtol=1e-5, atol=1e-4), k


def test_the_kernel_multiplies_on_tiles_from_amx_rows() -> None:
    """Below ``amx_rows`` the call is the VDPBF16PS GEMM bit for bit, from there the tiles."""
    kernel = amx_kernel()
    plain = bf16_gemm_kernel(amx=False)
    assert plain is not None and not plain.amx
    generator = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(64, 96, generator=generator), torch.randn(64, generator=generator)
    packed = kernel.pack(weight)
    for rows in (1, kernel.amx_rows - 1, kernel.amx_rows, 3 * kernel.amx_rows + 1):
        x = torch.randn(rows, 96, generator=generator)
        got = kernel(x, packed, 96, bias)
        if rows < kernel.amx_rows:
            assert torch.equal(got, plain(x, packed, 96, bias)), rows
        else:
            assert torch.equal(got, kernel.tiles(x, packed, 96, bias)), rows


@pytest.mark.parametrize("amx", [True, False], ids=["amx-where-present", "no-amx"])
def test_bf16_linear_and_embedding_read_one_copy_of_the_weights(amx: bool) -> None:
    """A bf16 linear made from an fp32 packed one computes its weights rounded to bf16 at every
    row count (the native kernel, with AMX tiles where present; without them torch's bf16
    matmul from ``TORCH_ROWS``); the embedding tied to it gives the rounded rows."""
    gemm, kernel = packed_gemm_kernel(), bf16_gemm_kernel(amx=amx)
    assert gemm is not None and kernel is not None
    linear = torch.nn.Linear(33, 64)
    packed = PackedLinear.from_linear(linear, gemm)
    bf16 = BF16Linear.from_packed(packed, kernel)
    weight = linear.weight.detach().bfloat16().float()
    assert torch.equal(bf16.weight_view().float(), weight)
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 7, TORCH_ROWS - 1, TORCH_ROWS, 300):
            x = torch.randn(1, rows, 33, generator=generator)
            expected = F.linear(x.bfloat16().float(), weight, linear.bias)
            got = bf16(x)
            # From TORCH_ROWS on torch rounds its product to bf16: 2^-8 of each output.
            tolerance = 1e-5 if bf16.native_rows(rows) else 2**-8
            assert got.shape == expected.shape and got.dtype == torch.float32
            assert torch.allclose(got, expected, rtol=tolerance, atol=tolerance), rows
        embedding = BF16Embedding(bf16, torch.tensor(2.0))
        ids = torch.tensor([[0, 5, 17, 63], [16, 31, 32, 1]])
        assert torch.equal(embedding(ids), weight[ids] * 2.0)


def test_cpu_dtype_auto_follows_the_feature_flags() -> None:
    native = kernels()[0]
    bare = ["fpu", "sse2", "avx2", "avx512f", "avx512bw", "avx512_vnni"]
    assert choose_cpu_dtype(bare, native)[0] == "float32"
    assert "emulated" in choose_cpu_dtype(bare, native)[1]
    if native.native:
        assert choose_cpu_dtype([*bare, "avx512_bf16"], native)[0] == "bfloat16"
        assert choose_cpu_dtype([*bare, "amx_bf16"], native)[0] == "bfloat16"
    assert choose_cpu_dtype([*bare, "avx512_bf16"], None)[0] == "float32"
    assert choose_cpu_dtype([*bare, "avx512_bf16"], kernels()[1])[0] == "float32"
    # AVX2 + FMA: the portable path widens bf16 (docs/performance.md §12.3), the native build
    # too where the flags do not list AVX512-BF16
    for kernel in kernels():
        chosen, reason = choose_cpu_dtype([*bare, "fma"], kernel)
        assert chosen == "bfloat16" and "widens" in reason
    assert choose_cpu_dtype([*bare, "fma", "avx512_bf16"], kernels()[1])[0] == "bfloat16"
    assert choose_cpu_dtype([*bare, "fma"], None)[0] == "float32"
    assert choose_cpu_dtype(["fpu", "sse2", "fma"], kernels()[1])[0] == "float32"


_BF16_KV_ATTENTION = "actorline_test_bf16_kv_sdpa"


def _bf16_kv_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,  # [1, Hkv, L, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention over keys and values rounded to bf16, as a bf16 KV cache
    holds them (the rest in fp32)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rounded_key, rounded_value = key.bfloat16().float(), value.bfloat16().float()
    output, _ = sdpa_attention_forward(
        module, query, rounded_key, rounded_value, attention_mask, **kwargs
    )
    return output, None


def emulating_reference(model_dir: Path, *, kv_bf16: bool = True) -> torch.nn.Module:
    """transformers' model with our numerics: weights rounded to bf16 (loaded in bf16), the rest
    in fp32, each linear's input rounded to bf16 (what the bf16 GEMM multiplies), and with
    ``kv_bf16`` the keys and values rounded to bf16 (what a bf16 KV cache holds)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(_BF16_KV_ATTENTION, _bf16_kv_sdpa)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.bfloat16,
        attn_implementation=_BF16_KV_ATTENTION if kv_bf16 else "sdpa",
    )
    model = model.eval().float()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    return model


def greedy(
    model: torch.nn.Module, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """HF greedy tokens and each step's top-2 logit margin."""
    with torch.inference_mode():
        generated = model.generate(  # type: ignore[operator]
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    margins = []
    for logits in generated.logits:
        top = torch.topk(logits[0].float(), 2).values
        margins.append((top[0] - top[1]).item())
    return generated.sequences[0, len(prompt) :].tolist(), margins


#: the tiny model's prompts of the parity test below, and their greedy length
_TINY_PROMPTS = random_prompts(PROMPT_LENGTHS[:6], seed=3)
_TINY_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_references(
    tiny_model_dir: Path,
) -> dict[bool, list[tuple[list[int], list[float]]]]:
    """The emulating reference's greedy tokens and margins on :data:`_TINY_PROMPTS`, with K/V
    rounded to bf16 (key True) and without, each computed once for the module (two of the
    parity test's three cases share the bf16-K/V one); the reference model loads on first use."""

    class Lazy(dict[bool, list[tuple[list[int], list[float]]]]):
        def __missing__(self, kv_bf16: bool) -> list[tuple[list[int], list[float]]]:
            model = emulating_reference(tiny_model_dir, kv_bf16=kv_bf16)
            self[kv_bf16] = [greedy(model, prompt, _TINY_TOKENS) for prompt in _TINY_PROMPTS]
            return self[kv_bf16]

    return Lazy()


@pytest.mark.parametrize(
    ("kv_cache_dtype", "use_cuda_graphs"),
    [("auto", True), ("auto", False), ("float32", True)],
    ids=["bf16-kv-step-graph", "bf16-kv-module-path", "fp32-kv-step-graph"],
)
def test_tiny_model_in_bf16_matches_the_emulating_reference(
    tiny_model_dir: Path,
    tiny_references: dict[bool, list[tuple[list[int], list[float]]]],
    kv_cache_dtype: str,
    use_cuda_graphs: bool,
) -> None:
    """Through the step graph (decode steps of one native call) and the module path, over the
    bf16 KV cache ``auto`` gives bf16 weights and over an fp32 one."""
    runner = ModelRunner(
        ExecuteConfig(
            model=str(tiny_model_dir),
            dtype="bfloat16",
            num_blocks=64,
            kv_cache_dtype=kv_cache_dtype,
            use_cuda_graphs=use_cuda_graphs,
        )
    )
    info = runner.load()
    assert info.dtype == "bfloat16"
    kv_bf16 = kv_cache_dtype == "auto"
    assert info.kv_cache_dtype == ("bfloat16" if kv_bf16 else "float32")
    assert isinstance(runner.model.lm_head, BF16Linear)
    assert isinstance(runner.model.get_input_embeddings(), BF16Embedding)
    assert (runner.step_graph is not None) == use_cuda_graphs
    prompts = _TINY_PROMPTS
    params = SamplingParams(max_tokens=_TINY_TOKENS, temperature=0.0)
    report = drive(runner, make_requests(prompts, params))
    if runner.step_graph is not None:
        assert runner.step_graph.steps > 0
    compared = 0
    for index, (tokens, margins) in enumerate(tiny_references[kv_bf16]):
        got = report.outputs[f"r{index}"]
        # bf16 rounding of the activations turns float noise between two correct paths into
        # bf16-sized noise: compare up to the first step whose reference margin is within it.
        close = next((step for step, m in enumerate(margins) if m < _BF16_NOISE), len(tokens))
        assert got[:close] == tokens[:close], (index, close)
        compared += close
    assert compared >= 2 * len(prompts), compared  # the check is not vacuous


@pytest.mark.slow  # two loads of the tiny model: ~11 s on the loaded 2-core machine
def test_step_graph_decodes_on_the_tiles_as_the_module_path(tiny_model_dir: Path) -> None:
    """Decode steps of 12 rows (from ``amx_rows`` on: the tiles, through ``NativeGemm`` from C)
    give the module path's greedy tokens."""
    kernel = amx_kernel()
    prompts = random_prompts((5, 9, 17, 3, 30, 12, 7, 21, 4, 11, 16, 8), seed=5)
    assert len(prompts) >= kernel.amx_rows
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outputs = []
    for graphs in (True, False):
        config = ExecuteConfig(
            model=str(tiny_model_dir), dtype="bfloat16", num_blocks=64, use_cuda_graphs=graphs
        )
        runner = ModelRunner(config)
        runner.load()
        assert (runner.step_graph is not None) == graphs
        report = drive(runner, make_requests(prompts, params))
        assert report.max_requests_per_step == len(prompts)
        if runner.step_graph is not None:
            assert runner.step_graph.steps >= 4  # the 12-row decode steps ran in C
        outputs.append(report.outputs)
    assert outputs[0] == outputs[1]


def test_dtype_auto_picks_bf16_where_the_cpu_multiplies_it(tiny_model_dir: Path) -> None:
    """And its KV cache follows (kv_cache_dtype auto: the model's dtype)."""
    expected, _ = choose_cpu_dtype(cpu_flags(), bf16_gemm_kernel())
    info = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), dtype="auto", num_blocks=8)).load()
    assert info.dtype == expected
    assert info.kv_cache_dtype == expected
    if {"avx512_bf16"} <= cpu_flags() or set(WIDEN_FEATURES) <= cpu_flags():
        assert expected == "bfloat16"


@pytest.mark.slow
@pytest.mark.model
# two HF references generating on CPU and two engine runs (300 s ran out at load 15; 900 s at
# load 15-20 with both paths)
@pytest.mark.timeout(1800)
def test_smollm2_in_bf16_greedy_parity(default_model_dir: Path) -> None:
    """32 greedy tokens of four prompts, over the bf16 KV cache (kv_cache_dtype auto), through
    the step graph and the module path, against transformers' model in bf16 (measured: one
    prompt identical, three part at HF-bf16 margins of 0, 1 and 2 bf16 steps, where HF's own
    rounding decides) and against the emulating reference (see docs/performance.md §12.2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in SMOLLM_PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    outputs = []
    for use_cuda_graphs in (True, False):
        runner = ModelRunner(
            ExecuteConfig(
                model=str(default_model_dir),
                dtype="bfloat16",
                num_blocks=64,
                use_cuda_graphs=use_cuda_graphs,
            )
        )
        info = runner.load()
        assert (info.dtype, info.kv_cache_dtype) == ("bfloat16", "bfloat16")
        assert (runner.step_graph is not None) == use_cuda_graphs
        outputs.append(drive(runner, make_requests(prompts, params), chunk_size=8).outputs)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16)
    emulating = emulating_reference(default_model_dir)
    for index, prompt in enumerate(prompts):
        # HF in bf16 rounds every activation and its logits to bf16 (8 bits): where its top two
        # logits are within two bf16 steps of each other, greedy may go either way.
        hf_tokens, hf_margins = greedy(hf_bf16.eval(), prompt, 32)
        # The emulating reference computes what we compute (up to summation order).
        tokens, margins = greedy(emulating, prompt, 32)
        close = next((step for step, m in enumerate(margins) if m < _BF16_KV_NOISE), len(tokens))
        for path, output in zip(("step graph", "module path"), outputs, strict=True):
            got = output[f"r{index}"]
            pairs = zip(got, hf_tokens, strict=False)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            if first is not None:
                assert hf_margins[first] <= 0.25, (path, index, first, hf_margins[first])
            assert got[:close] == tokens[:close], (path, index, close)
