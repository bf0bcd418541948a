"""Attention over a bf16 KV cache, before and after in one process (docs/performance.md §12.2):

- prefill: :func:`~stages.execute.attention.paged_attention_forward` over one layer at
  SmolLM2-135M's heads (9 query, 3 KV, D 64) with ``KVCache.bf16_prefill`` off (fp32 flash
  attention over the widened cache, as before) and on (bf16), for whole prompts and for chunks
  over a prefix read back from the cache;
- decode: the paged decode kernel's portable build (each bf16 widened to fp32, as before)
  against this CPU's (VDPBF16PS where it has AVX512-BF16), over 30 layers' caches (cold, as a
  decode step reads them).

The variants alternate, best of ``--rounds``, by the process's CPU time (a call preempted on a
loaded machine is not charged for the others' time); µs per layer.

    OMP_NUM_THREADS=1 python -m benchmarks.bf16_attention --rounds 5
"""

from __future__ import annotations

import argparse
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30


def best_of(rounds: int, variants: dict[str, Callable[[], None]], calls: int) -> dict[str, float]:
    """Each variant's best CPU time per call (µs), the variants alternating each round."""
    best = dict.fromkeys(variants, float("inf"))
    for run in variants.values():
        run()  # warm
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.process_time()
            run()
            best[name] = min(best[name], (time.process_time() - start) / calls * 1e6)
    return best


def prefill_call(
    cache: Any, table: list[int], prefix: int, inputs: tuple[Any, Any, Any]
) -> Callable[[], None]:
    """One layer's attention of a chunk (``inputs``: query, key, value) at position ``prefix``
    of the sequence with blocks ``table``."""
    import torch

    from stages.execute.attention import (
        build_step_metadata,
        forward_context,
        paged_attention_forward,
    )

    count = inputs[0].shape[2]
    metadata, _ = build_step_metadata(
        kv_cache=cache, block_tables=[table], query_starts=[prefix], query_lens=[count],
        num_decode=0, decode_mode="grouped", max_model_len=prefix + count,
        device=torch.device("cpu"),
    )  # fmt: skip
    module = types.SimpleNamespace(layer_idx=0)

    def run() -> None:
        with forward_context(metadata):
            paged_attention_forward(module, *inputs, None)  # type: ignore[arg-type]

    return run


def decode_call(
    kernel: Any, caches: list[tuple[Any, Any]], query: Any, tables: Any, lens: Any, out: Any
) -> Callable[[], None]:
    """The decode kernel over every layer's cache in turn."""

    def run() -> None:
        for key_cache, value_cache in caches:
            kernel(query, key_cache, value_cache, tables, lens, out, BLOCK, HEAD_DIM**-0.5)

    return run


def prefill(rounds: int, shapes: Sequence[tuple[int, int]]) -> None:
    import torch

    from stages.execute.attention import KVCache

    for prefix, count in shapes:
        length = prefix + count
        blocks = -(-length // BLOCK)
        caches = {}
        for name in ("fp32", "bf16"):
            cache = KVCache.allocate(
                num_layers=1, num_blocks=blocks + 1, block_size=BLOCK, num_kv_heads=KV_HEADS,
                head_dim=HEAD_DIM, dtype=torch.bfloat16, device=torch.device("cpu"),
            )  # fmt: skip
            cache.bf16_prefill = name == "bf16"
            caches[name] = cache
        table = list(range(1, blocks + 1))
        query = torch.randn(1, HEADS, count, HEAD_DIM)
        key = torch.randn(1, KV_HEADS, count, HEAD_DIM)
        value = torch.randn(1, KV_HEADS, count, HEAD_DIM)

        inputs = (query, key, value)
        best = best_of(
            rounds,
            {name: prefill_call(cache, table, prefix, inputs) for name, cache in caches.items()},
            1,
        )
        print(
            f"prefill {count} tokens after {prefix} cached: fp32 {best['fp32']:.0f} us, "
            f"bf16 {best['bf16']:.0f} us, {best['fp32'] / best['bf16']:.2f}x",
            flush=True,
        )


def decode(rounds: int, shapes: Sequence[tuple[int, int]]) -> None:
    import torch

    from stages.execute.native import (
        KERNEL_SOURCE,
        PORTABLE_DEFINE,
        PagedDecodeKernel,
        build_library,
        paged_decode_kernel,
    )

    native = paged_decode_kernel()
    assert native is not None, "the paged decode kernel does not build here"
    portable = PagedDecodeKernel(build_library(KERNEL_SOURCE, defines=(PORTABLE_DEFINE,)))
    print(f"decode kernel: VDPBF16PS {'on' if native.bf16_dot else 'off (no AVX512-BF16)'}")
    for rows, context in shapes:
        blocks = rows * -(-context // BLOCK) + 1
        shape = (blocks * BLOCK, KV_HEADS, HEAD_DIM)
        caches = [
            (torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(LAYERS)
        ]
        tables = (torch.randperm(blocks - 1) + 1).view(rows, -1)
        lens = torch.full((rows,), context, dtype=torch.long)
        query = torch.randn(HEADS, rows, HEAD_DIM)
        out = torch.empty(rows, HEADS, HEAD_DIM)

        arguments = (caches, query, tables, lens, out)
        best = best_of(
            rounds,
            {"widen": decode_call(portable, *arguments), "dot": decode_call(native, *arguments)},
            LAYERS,
        )
        print(
            f"decode {rows} x {context}: widening {best['widen']:.0f} us/layer, "
            f"VDPBF16PS {best['dot']:.0f} us/layer, {best['widen'] / best['dot']:.2f}x",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_prefill:
        prefill(args.rounds, [(0, 64), (0, 256), (0, 1000), (1000, 256), (1000, 64)])
    if not args.skip_decode:
        decode(args.rounds, [(1, 1000), (1, 4000), (16, 500), (64, 100), (64, 250)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
