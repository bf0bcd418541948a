"""How long a lost draft host takes to draft again (docs/speculative.md, "Its loss costs
drafts, not requests"): one engine of the default model with its own Q4_1 GGUF drafting on a
host of its own (``"placement": "host"``); each round streams one greedy request, SIGKILLs
the draft host after ``--kill-at`` tokens and times, from the signal, the draft host's restart
(``AsyncEngine.draft_restarts``) and the first accepted drafts after it (an output that brings
more than one token), with the stream's tokens/s before the kill, while it went without drafts and
after; also the engine's info on the draft model's KV cache.

    python -m benchmarks.draft_restart --rounds 2 --tokens 256

Prints one JSON line per round. Needs nothing but the repository and the default model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from typing import Any

from pipeline import AsyncEngine, SamplingParams

__all__ = ["main"]

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def _round(engine: AsyncEngine, tokens: int, kill_at: int, index: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    restarts = engine.draft_restarts.get("draft", 0)
    times: list[float] = []
    killed = restored = drafting = 0.0
    async for output in engine.generate(PROMPT, params, request_id=f"round{index}"):
        now = time.monotonic()
        new = len(output.token_ids) - len(times)
        times.extend([now] * new)
        if not killed and len(output.token_ids) >= kill_at:
            pid = engine.running.pids["engine_draft"]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed = now
        if killed and not restored and engine.draft_restarts.get("draft", 0) > restarts:
            restored = now
        elif restored and not drafting and new > 1:  # a step that accepted drafts
            drafting = now

    def rate(start: float, end: float) -> float | None:
        made = [t for t in times if start < t <= end]
        return round(len(made) / (end - start), 2) if made and end > start else None

    return {
        "round": index,
        "restored_s": round(restored - killed, 2) if restored else None,
        "drafting_again_s": round(drafting - killed, 2) if drafting else None,
        "tokens_per_second": {
            "before": rate(times[0], killed),
            "without_drafts": rate(killed, drafting or times[-1]),
            "after": rate(drafting, times[-1]) if drafting else None,
        },
        "load": os.getloadavg()[0],
    }


async def _run(args: argparse.Namespace) -> None:
    spec = {
        "model": args.model,
        "quantization": "gguf",
        "num_speculative_tokens": args.k,
        "placement": "host",
    }
    async with AsyncEngine(args.model, transport="zmq", speculative_config=spec) as engine:
        info = engine.info
        print(json.dumps({
            "kv_cache": {"blocks": info.num_blocks, "bytes": info.kv_cache_bytes},
            "draft_kv_cache": {"model": info.draft_model, "blocks": info.draft_num_blocks,
                               "bytes": info.draft_kv_cache_bytes, "host": info.draft_host},
        }), flush=True)  # fmt: skip
        for index in range(args.rounds):
            print(json.dumps(await _round(engine, args.tokens, args.kill_at, index)), flush=True)


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and print one JSON line per round."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="target and draft (default)")
    parser.add_argument("--rounds", type=int, default=2, help="kills, one stream each (2)")
    parser.add_argument("--tokens", type=int, default=256, help="each stream's tokens (256)")
    parser.add_argument("--kill-at", type=int, default=32, help="kill after this many (32)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (4)")
    asyncio.run(_run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
