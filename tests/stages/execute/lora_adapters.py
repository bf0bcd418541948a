"""PEFT LoRA adapters made in the tests from random weights (docs/lora.md): saved as peft
saves them, with the same adapter merged into a full HF checkpoint for the reference."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base_dir: Path,
    out: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ALL_TARGETS,
    rslora: bool = False,
    merged: bool = True,
) -> Path:
    """Save a LoRA adapter of the model at ``base_dir`` to ``out`` (random A and B:
    ``init_lora_weights=False``, so its delta is not zero) and, with ``merged``, the model
    with it merged (``merge_and_unload``) to ``out`` + ``-merged``.

    Returns:
        ``out``.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=rslora,
    )
    model = get_peft_model(base, config)
    # NOTE: peft's random B is small (a kaiming init scaled for training): scaled up so the
    # adapter's greedy tokens differ from the base model's within a few tokens
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(4.0)
    model.save_pretrained(out)
    if merged:
        model.merge_and_unload().save_pretrained(Path(f"{out}-merged"))
    return out
