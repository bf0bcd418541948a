"""Embedding throughput: ``LLM.embed`` over a batch of texts against HF's own batched forward
pass (``AutoModel`` on the padded batch, the last real token's final hidden state,
normalized: the same vectors), alternated in one run, best of ``--repeats``; and the largest
difference between the two answers.

    python -m benchmarks.embeddings [--model smollm2-135m] [--texts 256] [--repeats 3]
    python -m benchmarks.embeddings --quick      # a smoke run whose numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from pipeline import LLM
from stages.models import resolve_model


def texts(count: int) -> list[str]:
    """``count`` different sentences of 8 to 60 words."""
    words = [
        "the",
        "model",
        "pools",
        "each",
        "prompt",
        "into",
        "one",
        "vector",
        "for",
        "retrieval",
        "and",
        "search",
    ]
    return [
        " ".join(words[(index + k) % len(words)] for k in range(8 + index % 53))
        for index in range(count)
    ]


def hf_embed(model: Any, tokenizer: Any, batch: list[str], size: int) -> np.ndarray:
    """HF's vectors, ``size`` texts per forward pass (right padding)."""
    out = []
    for start in range(0, len(batch), size):
        encoded = tokenizer(batch[start : start + size], return_tensors="pt", padding=True)
        with torch.inference_mode():
            hidden = model(**encoded).last_hidden_state  # [B, T, H]
        last = encoded.attention_mask.sum(dim=1) - 1
        vectors = hidden[torch.arange(hidden.shape[0]), last]
        out.append(torch.nn.functional.normalize(vectors, dim=-1).numpy())
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-batch", type=int, default=32, help="texts per HF forward pass")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.texts, args.repeats = 8, 1
    from transformers import AutoModel, AutoTokenizer

    path = resolve_model(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = texts(args.texts)
    tokens = sum(len(ids) for ids in tokenizer(batch).input_ids)
    best = {"actorline": float("inf"), "hf": float("inf")}
    with LLM(args.model) as llm:
        llm.embed(batch[:4], use_tqdm=False)  # warm
        for _ in range(args.repeats):
            began = time.perf_counter()
            ours = np.stack([o.outputs.data for o in llm.embed(batch, use_tqdm=False)])
            best["actorline"] = min(best["actorline"], time.perf_counter() - began)
            began = time.perf_counter()
            theirs = hf_embed(model, tokenizer, batch, args.hf_batch)
            best["hf"] = min(best["hf"], time.perf_counter() - began)
    result = {
        "model": args.model,
        "texts": args.texts,
        "prompt_tokens": tokens,
        "seconds": best,
        "texts_per_second": {name: args.texts / seconds for name, seconds in best.items()},
        "ratio": best["hf"] / best["actorline"],
        "max_abs_difference": float(np.abs(ours - theirs).max()),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, seconds in best.items():
            print(f"{name:10s} {seconds:7.2f} s  {args.texts / seconds:7.1f} texts/s")
        print(f"actorline / hf speed: {result['ratio']:.2f}x over {tokens} prompt tokens; "
              f"largest difference {result['max_abs_difference']:.2e}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
