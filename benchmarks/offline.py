"""Offline throughput: actorline (zmq and memory topologies) against HF transformers
``generate`` (static batches) and HF continuous batching, on SmolLM2-135M, fp32, CPU.

    python benchmarks/offline.py [--quick] [--json] [--profile]

(also ``actorline bench offline``; the logic lives in :mod:`pipeline.bench.offline`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.bench.offline import main

if __name__ == "__main__":
    sys.exit(main())
