"""Each pipeline shard process's resident memory at PP=1/2/3 (docs/parallelism.md, "What a
shard loads"): start the engine over ZeroMQ (every shard a process of its own), generate once,
then read ``VmRSS`` (resident now) and ``VmHWM`` (the peak, the load's included) from
``/proc/PID/status`` of each engine host process.

    PYTHONPATH=$PWD python -m benchmarks.pp_memory [--model smollm2-135m] [--sizes 1,2,3] \
        [--dtype float32|bfloat16|auto]

Linux only (``/proc``). Prints one JSON line per size: ``{"pp": N, "hosts": {host: {"rss_mib":
..., "hwm_mib": ...}}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from pipeline import AsyncEngine, SamplingParams

__all__ = ["shard_memory", "status_mib"]


def status_mib(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` of process ``pid`` in MiB, read from ``/proc/PID/status``."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024  # kB
    return {"rss_mib": round(fields["VmRSS"], 1), "hwm_mib": round(fields["VmHWM"], 1)}


async def shard_memory(model: str, size: int, dtype: str) -> dict[str, dict[str, float]]:
    """The memory of each engine host process of ``model`` at PP=``size`` with weights in
    ``dtype``, after one request."""
    engine = AsyncEngine(
        model, transport="zmq", pipeline_parallel_size=size, num_blocks=64, dtype=dtype,
        heartbeat_timeout=60.0,
    )  # fmt: skip
    async with engine:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate("How much memory does a shard hold?", params):
            pass
        pids = engine.running.pids
        return {
            host: status_mib(pid)
            for host, pid in sorted(pids.items())
            if host.startswith("engine") and pid is not None
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sizes", default="1,2,3", help="pipeline sizes, comma-separated")
    parser.add_argument("--dtype", default="float32", help="the weights' dtype (the engine's)")
    args = parser.parse_args()
    for size in (int(text) for text in args.sizes.split(",")):
        hosts = asyncio.run(shard_memory(args.model, size, args.dtype))
        print(json.dumps({"pp": size, "dtype": args.dtype, "hosts": hosts}), flush=True)


if __name__ == "__main__":
    main()
