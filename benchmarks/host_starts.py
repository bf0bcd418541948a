"""Engine starts in one process, with hosts forked by a zygote against hosts spawned
(``ACTORLINE_HOST_START``, :mod:`pipeline.runtime.zygote`): ``--engines`` engines of
``--model`` started one after another in one process (each its own engine host process), each
timed from its start to its first token and stopped; and the CPU time all processes took.
One fresh process per start method, alternating, ``--rounds`` times; prints one JSON line per
process and the medians of the first start and of the later ones.

    python -m benchmarks.host_starts --model smollm2-135m --engines 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


async def _starts(model: str, engines: int) -> list[float]:
    from pipeline import AsyncEngine, SamplingParams

    times = []
    for _ in range(engines):
        started = time.perf_counter()
        async with AsyncEngine(model=model) as engine:
            async for _output in engine.generate("Hi", SamplingParams(max_tokens=1)):
                break
            times.append(time.perf_counter() - started)
    return times


def _one(model: str, engines: int) -> None:
    from pipeline.runtime.zygote import stop_zygotes

    times = asyncio.run(_starts(model, engines))

    stop_zygotes()  # (its hosts' CPU time counts once the zygote is reaped)
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(u.ru_utime + u.ru_stime for u in usage)
    print(json.dumps({"starts_s": [round(t, 3) for t in times], "cpu_s": round(cpu, 2)}))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(args.model, args.engines)
        return 0
    results: dict[str, list[dict[str, object]]] = {"fork": [], "spawn": []}
    for _ in range(args.rounds):
        for method in results:
            command = [sys.executable, "-m", "benchmarks.host_starts", "--one"]
            command += ["--model", args.model, "--engines", str(args.engines)]
            environment = {**os.environ, "ACTORLINE_HOST_START": method}
            output = subprocess.run(
                command, env=environment, capture_output=True, text=True, check=True
            ).stdout
            result = json.loads(output.strip().splitlines()[-1])
            print(method, json.dumps(result), flush=True)
            results[method].append(result)
    for method, runs in results.items():
        firsts = [run["starts_s"][0] for run in runs]  # type: ignore[index]
        laters = [t for run in runs for t in run["starts_s"][1:]]  # type: ignore[index]
        cpus = [run["cpu_s"] for run in runs]
        print(
            f"{method}: first start {statistics.median(firsts):.2f} s, later starts "
            f"{statistics.median(laters) if laters else float('nan'):.2f} s (median), "
            f"CPU {statistics.median(cpus):.1f} s"  # type: ignore[type-var]
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
