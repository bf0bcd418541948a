"""The framework's ceiling: the null model over the zmq topology, 256 streaming requests.

    python benchmarks/ceiling.py [--profile] [--quick] [--json]

(also ``actorline bench ceiling``; the logic lives in :mod:`pipeline.bench.ceiling`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.bench.ceiling import main

if __name__ == "__main__":
    sys.exit(main())
