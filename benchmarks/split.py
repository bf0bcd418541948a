"""What the process split buys or costs on this machine: the same workloads (a small offline
one on the real model, and the null-model ceiling) single-process vs the zmq split.

    python benchmarks/split.py [--quick] [--json]

(also ``actorline bench split``; the logic lives in :mod:`pipeline.bench.split`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.bench.split import main

if __name__ == "__main__":
    sys.exit(main())
