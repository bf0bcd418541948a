"""What loading a LoRA adapter costs the streams already running (docs/lora.md, "Loading"): a
base stream decodes while a request of a fresh adapter arrives; its inter-token gaps before
the adapter request are compared with the longest gap from the request's sending to its
answer (the adapter's load, its prefill and its first token).

    python -m benchmarks.lora_load_stall --model smollm2-135m --rank 64 --rounds 3 \\
        --variant after=. --variant before=/work/main

Each round runs each ``--variant NAME=CHECKOUT`` (alternating, a fresh process each, that
checkout first on ``PYTHONPATH``) and prints one line per run; then the best (lowest) of the
rounds per variant. The adapter covers every projection of every layer at ``--rank``, random
weights written straight as a PEFT directory (the engine's ``EngineInfo`` gives the shapes).
The frontend's check of the adapter's files is done before the stream starts (it is cached),
so the gap measured is the engine's. ``--micro`` (this checkout) times the step thread's
share of one load instead: ``LoRABank.prepare`` (read, check, layout: the step thread's work
per load before it moved to the loader thread) against ``LoRABank.offer`` (its work now).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_adapter(
    directory: Path, targets: list[tuple[str, int, int]], layers: int, rank: int
) -> None:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for name, inputs, outputs in targets:
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, inputs) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.randn(outputs, rank) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank,
              "target_modules": sorted({name for name, _, _ in targets})}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))


async def measure(model: str, rank: int, tokens: int, at: int) -> dict[str, float]:
    from pipeline import AsyncEngine, LoRARequest, SamplingParams

    async with AsyncEngine(model, enable_lora=True, max_lora_rank=rank) as engine:
        info = engine.info
        assert info is not None
        with tempfile.TemporaryDirectory() as root:
            path = Path(root) / "adapter"
            # NOTE: off the event loop (the engine host watches this host's heartbeats)
            await asyncio.to_thread(
                write_adapter, path, list(info.lora_targets), info.lora_layers, rank
            )
            size = (path / "adapter_model.safetensors").stat().st_size
            lora = LoRARequest("fresh", 1, str(path))
            one = SamplingParams(max_tokens=1, temperature=0.0)
            await asyncio.to_thread(
                engine.check, {"prompt_token_ids": [1, 2, 3]}, one, lora_request=lora
            )
            stream = engine.generate(
                "Once upon a time", SamplingParams(max_tokens=tokens, ignore_eos=True)
            )
            stamps: list[tuple[float, int]] = []  # (time, tokens so far)
            sent = answered = 0.0
            adapter_task: asyncio.Task[None] | None = None

            async def adapter_request() -> None:
                nonlocal answered
                async for _ in engine.generate({"prompt_token_ids": [1, 2, 3]}, one,
                                               lora_request=lora):  # fmt: skip
                    pass
                answered = time.perf_counter()

            async for output in stream:
                stamps.append((time.perf_counter(), len(output.token_ids)))
                if adapter_task is None and len(output.token_ids) >= at:
                    sent = time.perf_counter()
                    adapter_task = asyncio.create_task(adapter_request())
            assert adapter_task is not None
            await adapter_task
    gaps_before, gaps_during = [], []
    for (t0, n0), (t1, n1) in itertools.pairwise(stamps):
        gap = (t1 - t0) / max(1, n1 - n0)
        if t1 <= sent:
            gaps_before.append(gap)
        elif t0 <= answered:
            gaps_during.append(t1 - t0)
    return {
        "adapter_mb": size / 1e6,
        "itl_before_ms": 1e3 * statistics.median(gaps_before[5:]),
        "max_gap_during_ms": 1e3 * max(gaps_during),
        "adapter_answer_ms": 1e3 * (answered - sent),
    }


async def micro(model: str, rank: int) -> dict[str, float]:
    """The step thread's share of one adapter load: the whole read, check and layout
    (``LoRABank.prepare``, which the step thread ran itself before loads moved to the loader
    thread) against the swap it does now (``LoRABank.offer``); best of 5 each."""
    from pipeline import AsyncEngine, LoRARequest

    async with AsyncEngine(model, enable_lora=True, max_lora_rank=rank, transport="memory",
                           max_cpu_loras=8) as engine:  # fmt: skip
        info = engine.info
        assert info is not None
        bank = engine.running.stage("execute").runner.lora
        with tempfile.TemporaryDirectory() as root:
            path = Path(root) / "adapter"
            write_adapter(path, list(info.lora_targets), info.lora_layers, rank)
            prepare, offer = [], []
            for number in range(1, 6):
                lora = LoRARequest(f"a{number}", number, str(path))
                began = time.perf_counter()
                adapter = bank.prepare(lora)
                prepare.append(time.perf_counter() - began)
                began = time.perf_counter()
                bank.offer(adapter)
                offer.append(time.perf_counter() - began)
    return {"prepare_ms": 1e3 * min(prepare), "offer_us": 1e6 * min(offer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--at", type=int, default=60, help="send the adapter request then")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=CHECKOUT")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--micro", action="store_true", help="time prepare and offer only")
    args = parser.parse_args()
    if args.micro:
        print(json.dumps(asyncio.run(micro(args.model, args.rank))))
        return
    if args.child:
        print(json.dumps(asyncio.run(measure(args.model, args.rank, args.tokens, args.at))))
        return
    variants = [v.partition("=")[::2] for v in args.variant] or [("this", ".")]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    here = Path(__file__).resolve()
    for round_number in range(args.rounds):
        for name, checkout in variants:
            env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
            command = [sys.executable, str(here), "--child", "--model", args.model,
                       "--rank", str(args.rank), "--tokens", str(args.tokens), "--at",
                       str(args.at)]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            results[name].append(row)
            print(f"round {round_number} {name}: {json.dumps(row)}", flush=True)
    for name, rows in results.items():
        best = min(rows, key=lambda row: row["max_gap_during_ms"])
        print(
            f"{name}: adapter {best['adapter_mb']:.1f} MB, inter-token "
            f"{best['itl_before_ms']:.1f} ms before, longest gap while it loads "
            f"{best['max_gap_during_ms']:.1f} ms (best of "
            f"{len(rows)}; median {statistics.median(r['max_gap_during_ms'] for r in rows):.1f})"
        )


if __name__ == "__main__":
    main()
