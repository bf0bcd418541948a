"""actorline's benchmarks (DESIGN §7), importable so the installed CLI can run them:
``actorline bench {offline,online,ceiling,split}`` or ``python benchmarks/<name>.py``.

- :mod:`pipeline.bench.offline`: throughput against HF ``generate`` and HF continuous batching;
- :mod:`pipeline.bench.online`: TTFT and inter-token latency under Poisson arrivals;
- :mod:`pipeline.bench.ceiling`: the framework alone, with the null model;
- :mod:`pipeline.bench.split`: single process against the zmq split;
- :mod:`pipeline.bench.profile`: the per-stage table every benchmark prints with ``--profile``.

Benchmarks measure; they are never timed tests.
"""

__all__: list[str] = []
