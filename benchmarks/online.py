"""Online latency: Poisson arrivals at a few rates against AsyncEngine streaming; TTFT and
inter-token latency p50/p99 per rate.

    python benchmarks/online.py [--rates 1 2 4] [--requests 24] [--quick] [--json]

(also ``actorline bench online``; the logic lives in :mod:`pipeline.bench.online`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.bench.online import main

if __name__ == "__main__":
    sys.exit(main())
