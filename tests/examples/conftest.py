"""Shared by the example tests: the examples directory is importable (``import
custom_pipeline``), as it is for ``python examples/<name>.py``; processes spawned by an engine
inherit it through ``sys.path``."""

from __future__ import annotations

import sys

from tests.examples.running import EXAMPLES

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
