"""The small GPU benchmark ``.ci/cuda-check`` runs (docs/architecture.md §6.4):
which attention backend ``auto`` should pick on CUDA, and what CUDA graphs buy.

1. **kernel**: one layer's decode attention (``paged_attention_forward``, the K/V write
   included) at SmolLM2-135M's head shapes in bf16, gather + one padded SDPA (today's CUDA
   path) against FlexAttention reading the block tables in place, for batches of 1, 8 and 32
   with uniform contexts and with ragged ones (gather pads every row to the longest).
2. **engine**: decode steps of :class:`~stages.execute.runner.ModelRunner` on a randomly
   initialised model of SmolLM2-135M's shapes (no download: the machine has no network),
   CUDA graphs on and off, each backend, batches of 1, 8 and 32.

Each figure is the median of timed repetitions after warm-ups (the warm-ups compile flex);
results are written to ``--out`` (JSON) after every measurement, so a run cut short by its
time budget keeps what it measured. Usage: ``python .ci/cuda_bench.py --out bench.json``;
``--smoke`` runs tiny shapes on CPU (eager FlexAttention) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stages.execute.attention import (  # noqa: E402
    KVCache,
    build_step_metadata,
    forward_context,
    paged_attention_forward,
)
from stages.execute.config import ExecuteConfig  # noqa: E402
from stages.execute.runner import ModelRunner  # noqa: E402
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep  # noqa: E402
from stages.params import SamplingParams  # noqa: E402

HQ, HKV, D, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention
SMOLLM2_SHAPES = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


class _Layer(torch.nn.Module):
    layer_idx = 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(run: Any, device: torch.device, repeats: int, warmups: int = 3) -> float:
    for _ in range(warmups):
        run()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def kernel_case(batch: int, contexts: list[int], flex: bool, device: torch.device) -> float:
    """Median ms of one layer's decode attention over ``contexts`` (one per row)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    blocks_per_row = [-(-length // BLOCK) for length in contexts]
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=sum(blocks_per_row) + 1,
        block_size=BLOCK,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=dtype,
        device=device,
    )
    cache.key[0].normal_()
    cache.value[0].normal_()
    order = (torch.randperm(sum(blocks_per_row)) + 1).tolist()  # shuffled physical blocks
    tables, taken = [], 0
    for count in blocks_per_row:
        tables.append(order[taken : taken + count])
        taken += count
    metadata, _ = build_step_metadata(
        kv_cache=cache,
        block_tables=tables,
        query_starts=[length - 1 for length in contexts],
        query_lens=[1] * batch,
        num_decode=batch,
        decode_mode="padded",
        max_model_len=max(contexts),
        device=device,
        flex=flex,
    )
    query = torch.randn(1, HQ, batch, D, device=device, dtype=dtype)
    key = torch.randn(1, HKV, batch, D, device=device, dtype=dtype)
    value = torch.randn_like(key)
    layer = _Layer()

    def run() -> None:
        with torch.inference_mode(), forward_context(metadata):
            paged_attention_forward(layer, query, key, value, None, scaling=D**-0.5)

    return _median_ms(run, device, repeats=50 if device.type == "cuda" else 3)


def engine_case(
    model_dir: Path,
    backend: str,
    graphs: bool,
    batches: list[int],
    device: torch.device,
    prompt_len: int = 256,
    steps: int = 24,
) -> dict[str, Any]:
    """ms per decode step for each batch size, on one loaded runner."""
    config = ExecuteConfig(
        model=str(model_dir),
        device=str(device),
        dtype="bfloat16" if device.type == "cuda" else "float32",
        num_blocks=2048,
        max_model_len=1024,
        use_cuda_graphs=graphs,
        cuda_graph_max_batch_size=max(batches),
        attention_backend=backend,
    )
    began = time.perf_counter()
    runner = ModelRunner(config)
    runner.load()
    result: dict[str, Any] = {"load_s": round(time.perf_counter() - began, 2)}
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    step_id = 0
    for batch in batches:
        ids = [f"b{batch}r{row}" for row in range(batch)]
        requests = tuple(
            EngineRequest(
                request_id,
                tuple(torch.randint(3, 49152, (prompt_len,), generator=generator).tolist()),
                params,
            )
            for request_id in ids
        )
        runner.execute(
            SchedulerStep(step_id, requests, tuple(ScheduledChunk(i, 0, prompt_len) for i in ids))
        )
        step_id += 1
        computed = prompt_len
        times = []
        for repeat in range(steps):
            chunks = tuple(ScheduledChunk(i, computed, 1) for i in ids)
            _synchronize(device)
            start = time.perf_counter()
            runner.execute(SchedulerStep(step_id, (), chunks))
            _synchronize(device)
            if repeat >= steps // 6:  # warm-ups: flex compiles each new shape
                times.append((time.perf_counter() - start) * 1000)
            step_id += 1
            computed += 1
        runner.execute(SchedulerStep(step_id, (), (), finished=tuple(ids)))
        step_id += 1
        median = statistics.median(times)
        result[f"batch_{batch}"] = {
            "ms_per_step": round(median, 3),
            "tokens_per_s": round(batch * 1000 / median, 1),
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON results file")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds, then stop")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args()
    if args.smoke:
        device = torch.device("cpu")
        batches, longest_contexts, prompt_len, steps = [1, 4], (80,), 16, 6
        shapes = {**SMOLLM2_SHAPES, "hidden_size": 144, "num_hidden_layers": 2}
        shapes.update(intermediate_size=128)
    elif not torch.cuda.is_available():
        print("cuda_bench: no CUDA device (--smoke runs on CPU)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        batches, longest_contexts, prompt_len, steps = [1, 8, 32], (512, 4096), 256, 24
        shapes = SMOLLM2_SHAPES
    deadline = time.monotonic() + args.budget
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "kernel_ms": {},
        "engine": {},
        "errors": [],
    }

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=2))

    cases = []
    for batch in batches:
        for longest in longest_contexts:
            cases.append((f"B{batch}_uniform{longest}", batch, [longest] * batch))
            if batch > 1:  # contexts spread evenly from 64 up to the longest
                spread = [64 + (longest - 64) * row // (batch - 1) for row in range(batch)]
                cases.append((f"B{batch}_ragged64-{longest}", batch, spread))
    for name, batch, contexts in cases:
        for backend, flex in (("gather_sdpa", False), ("flex", True)):
            if time.monotonic() > deadline:
                results["errors"].append(f"budget spent before kernel {name} {backend}")
                save()
                return 0
            try:
                value = round(kernel_case(batch, contexts, flex, device), 4)
                results["kernel_ms"].setdefault(name, {})[backend] = value
            except Exception:
                results["errors"].append(f"kernel {name} {backend}: {traceback.format_exc()}")
            save()
            print(f"kernel {name} {backend}: {results['kernel_ms'].get(name)}", flush=True)

    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        torch.manual_seed(0)
        model_dir = Path(scratch) / "smollm2-shapes"
        LlamaForCausalLM(LlamaConfig(**shapes)).save_pretrained(model_dir)
        for backend in ("gather_sdpa", "flex"):
            for graphs in (True, False) if device.type == "cuda" else (False,):
                key = f"{backend}_{'graphs' if graphs else 'eager'}"
                if time.monotonic() > deadline:
                    results["errors"].append(f"budget spent before engine {key}")
                    break
                try:
                    results["engine"][key] = engine_case(
                        model_dir, backend, graphs, batches, device, prompt_len, steps
                    )
                except Exception:
                    results["errors"].append(f"engine {key}: {traceback.format_exc()}")
                save()
                print(f"engine {key}: {results['engine'].get(key)}", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
