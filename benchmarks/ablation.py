"""What each execute-stage optimization is worth: the offline workload through the scheduler
and the model runner with everything on, then with each optimization switched off in turn
(a fresh process each).

    python benchmarks/ablation.py [--only NAME ...] [--quick] [--json]

(also ``actorline bench ablation``; the logic lives in :mod:`pipeline.bench.ablation`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.bench.ablation import main

if __name__ == "__main__":
    sys.exit(main())
