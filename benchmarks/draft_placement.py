"""The draft model beside the target against on a host of its own (docs/speculative.md, "The
draft model's figures"): ``actorline bench latency`` at one stream, the fp32 default model with
its own Q4_1 GGUF drafting, run with ``"placement": "engine"`` then ``"host"``, alternated for
``--pairs`` pairs, each run with and without the draft model in fresh ``actorline serve``
processes. Prints one JSON line per run: tokens/s without and with drafts, the ratio, the
acceptance rate, TTFT and the load average.

    python -m benchmarks.draft_placement --pairs 2 --tokens 256
"""

from __future__ import annotations

import argparse
import json

from pipeline.bench.latency import LatencyConfig, run_latency

__all__ = ["main"]

PLACEMENTS = ("engine", "host")


def main(argv: list[str] | None = None) -> None:
    """Run the alternated pairs and print one JSON line per run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="alternated pairs (2)")
    parser.add_argument("--tokens", type=int, default=256, help="the stream's tokens (256)")
    parser.add_argument("--format", default="fp32", help="the target's format (fp32)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (4)")
    args = parser.parse_args(argv)
    for pair in range(args.pairs):
        for placement in PLACEMENTS:
            spec = json.dumps(
                {
                    "model": "smollm2-135m",
                    "quantization": "gguf",
                    "num_speculative_tokens": args.k,
                    "placement": placement,
                }
            )
            result = run_latency(
                LatencyConfig(
                    formats=(args.format,),
                    peers=(),
                    streams=(),
                    tokens=args.tokens,
                    rounds=1,
                    speculative_config=spec,
                )
            )
            line = {
                "pair": pair,
                "placement": placement,
                "tokens_per_second": {b.system: round(b.headline, 2) for b in result.best},
                "ratio": result.speculative_ratios,
                "acceptance": result.acceptance_rate,
                "ttft_ms": {b.system: round(b.ttft_ms) for b in result.best},
                "load": [result.load_average, result.load_average_end],
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
