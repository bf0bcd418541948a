"""actorline's experiments and records: benchmarks that answered a design question or guard
a past finding, kept runnable from a checkout (``python -m benchmarks.NAME``) but not
installed with the packages (benchmarks/README.md). They may import the packages; nothing in
``pipeline``, ``transports``, ``stages`` or ``plugins`` imports them (tests/test_layering.py).
"""

__all__: list[str] = []
