"""The model table of docs/models.md, checked: a tiny random model of every family listed as
served runs through the execute stage's runner (packed batches, chunked prefill, prefix hits,
paged decode) with greedy tokens identical to HF ``generate`` on the same weights, for full,
sliding-window, soft-capped and sink attention; every family listed as refused is refused at
load with an error naming why. Models are built here from configs (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stages.execute.attention import UnsupportedModelError
from stages.execute.config import ExecuteConfig
from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest
from stages.params import SamplingParams
from tests.stages.execute.driving import HFReference, drive

VOCAB = 512
WINDOW = 8  # shorter than most prompts below, so windows exclude keys in prefill and decode
MAX_TOKENS = 8
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
HALF_WINDOWED = ["sliding_attention", "full_attention"]

#: family -> (model_type, config fields over COMMON); None drops a COMMON field
SERVED: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", dict(use_sliding_window=False)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "phi3": ("phi3", dict(num_key_value_heads=4)),
    "gemma": ("gemma", dict(head_dim=16)),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    # A stray num_key_value_heads (GPT-2's attention has none): shapes come from the modules.
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "gpt_neox": ("gpt_neox", dict(num_key_value_heads=None)),
    "stablelm": ("stablelm", {}),
    "cohere": ("cohere", dict(logit_scale=1.0)),  # its default 1/16 makes near-ties
    "starcoder2": ("starcoder2", dict(sliding_window=None)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        ),
    ),
    # Windowed, soft-capped and sink attention.
    "gemma2": (
        "gemma2",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=HALF_WINDOWED,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=24,
        ),
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            head_dim=16, sliding_window=WINDOW, layer_types=HALF_WINDOWED, query_pre_attn_scalar=24
        ),
    ),
    "mistral (sliding window)": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2 (use_sliding_window)": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "starcoder2 (sliding window)": ("starcoder2", dict(sliding_window=WINDOW)),
    "cohere2": ("cohere2", dict(sliding_window=WINDOW, layer_types=HALF_WINDOWED, logit_scale=1.0)),
    "gpt_oss": (
        "gpt_oss",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=HALF_WINDOWED,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
}

#: model_type -> the seed its weights are drawn with, where seed 0 leaves a near-tie the
#: reference refuses (driving.MIN_ROUTER_MARGIN: seed 0's Mixtral routes a prompt token with a
#: 2e-7 gap between its second and third expert)
SEEDS = {"mixtral": 7}

#: family -> (model_type, config fields over COMMON, what the refusal names)
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "bloom (ALiBi)": ("bloom", dict(n_head=4, n_layer=2), "AttentionInterface"),
    "falcon (ALiBi)": ("falcon", dict(alibi=True), "ALiBi"),
    "mpt": ("mpt", dict(d_model=64, n_heads=4, n_layers=2), "AttentionInterface"),
    "deepseek_v3 (MLA)": (
        "deepseek_v3",
        dict(
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        ),
        "latent attention",
    ),
    "llama4 (chunked attention)": (
        "llama4_text",
        dict(attention_chunk_size=16, num_local_experts=2, intermediate_size_mlp=128, head_dim=16),
        "chunked_attention",
    ),
    "mamba (no attention)": ("mamba", dict(state_size=4, expand=2), "linear_attention"),
    "qwen3_next (linear attention)": (
        "qwen3_next",
        dict(
            head_dim=16,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        "linear_attention",
    ),
}


def build(model_type: str, fields: dict[str, Any], directory: Path) -> Path:
    """A seeded random model of ``model_type`` saved as an HF directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    merged = {key: value for key, value in {**COMMON, **fields}.items() if value is not None}
    torch.manual_seed(SEEDS.get(model_type, 0))
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **merged))
    if model_type == "gpt_oss":  # sinks big enough to matter (they start near 0)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    model.save_pretrained(directory)
    return directory


def prompts() -> list[list[int]]:
    """Prompts of 3..30 tokens; the second and the last share a 16-token prefix."""
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (16,), generator=generator).tolist()
    own = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (3, 13, 30, 5)]
    return [own[0], shared + own[1][:7], own[1], own[2], own[3], shared + own[3]]


def check_against_hf(family: str, directory: Path, **options: Any) -> ModelRunner:
    """Load ``family``'s tiny model (built in ``directory``) with ``ExecuteConfig`` fields
    ``options`` (64 blocks of 4 tokens unless they say otherwise) and check greedy tokens
    equal HF ``generate``'s for every prompt: the first two whole (r1's blocks go to the
    prefix cache), the rest in chunks of 8, where r5 hits r1's first 16 tokens. Returns the
    runner."""
    model_type, fields = SERVED[family]
    build(model_type, fields, directory)
    config_fields = {"num_blocks": 64, "block_size": 4, **options}
    runner = ModelRunner(ExecuteConfig(model=str(directory), **config_fields))
    runner.load()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    batch = prompts()
    requests = [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(batch)]
    first = drive(runner, requests[:2])  # whole prompts; r1's blocks go to the prefix cache
    rest = drive(runner, requests[2:], chunk_size=8)  # chunked; r5 hits r1's first 16 tokens
    # HF on CPU is the reference: it refuses near-ties, so two devices cannot disagree by noise
    reference = HFReference(directory)
    expected = {f"r{i}": reference.greedy(p, MAX_TOKENS) for i, p in enumerate(batch)}
    assert {**first.outputs, **rest.outputs} == expected
    assert max(rest.cached_tokens.values()) >= 16, "the shared prefix was not served"
    return runner


@pytest.mark.parametrize("family", list(SERVED))
def test_family_matches_hf_generate(family: str, tmp_path: Path) -> None:
    check_against_hf(family, tmp_path)


@pytest.mark.parametrize("decode_attention", ["grouped", "padded", "per_sequence"])
def test_torch_decode_paths_serve_windows_and_capped_logits(
    decode_attention: str, tmp_path: Path
) -> None:
    """Gemma 2's sliding and full layers and soft-capped logits through each torch decode path
    (gather + masked attention; docs/models.md, "How the variants are served") instead of the
    native kernel, with chunked prefill and a prefix hit as above."""
    runner = check_against_hf("gemma2", tmp_path, decode_attention=decode_attention)
    assert runner._decode_mode == decode_attention


@pytest.mark.usefixtures("no_c_compiler")
def test_without_a_c_compiler_windows_run_on_torch(tmp_path: Path) -> None:
    """No native kernel builds (no linears, fused ops or decode kernel): windowed Mistral falls
    back to torch throughout, decode on the grouped path, and still matches HF."""
    runner = check_against_hf("mistral (sliding window)", tmp_path / "model")
    assert runner._decode_mode == "grouped"


@pytest.mark.parametrize("family", list(REFUSED))
def test_family_is_refused_naming_why(family: str, tmp_path: Path) -> None:
    model_type, fields, reason = REFUSED[family]
    directory = build(model_type, fields, tmp_path)
    with pytest.raises(UnsupportedModelError, match=reason):
        ModelRunner(ExecuteConfig(model=str(directory), num_blocks=16)).load()


@pytest.mark.parametrize("family", ["gemma2", "mistral (sliding window)", "gpt_oss"])
def test_static_decode_path_serves_the_variants(family: str, tmp_path: Path) -> None:
    """The CUDA-graph decode path (static buffers, masks built inside the graph from the
    context lengths), run eagerly on CPU, for windows, capped logits and sinks."""
    model_type, fields = SERVED[family]
    directory = build(model_type, fields, tmp_path)
    runner = ModelRunner(
        ExecuteConfig(model=str(directory), num_blocks=64, block_size=4),
        force_static_decode=True,
    )
    runner.load()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    batch = prompts()[:4]
    report = drive(runner, [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(batch)])
    reference = HFReference(directory)
    assert report.outputs == {f"r{i}": reference.greedy(p, MAX_TOKENS) for i, p in enumerate(batch)}


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["gemma2", "mistral (sliding window)", "gpt_oss"])
def test_cuda_serves_the_variants(family: str, tmp_path: Path) -> None:
    """On a GPU: eager prefill (whole and chunked), a prefix hit and CUDA-graph decode with
    windows, capped logits and sinks, against HF ``generate`` on CPU: the prompts, chunk size
    and prefix hit of the CPU table test."""
    runner = check_against_hf(family, tmp_path, device="cuda")
    assert runner.device.type == "cuda" and runner._decode_graphs is not None
