"""actorline's benchmarks (docs/performance.md), run by the installed CLI,
``actorline bench NAME``, or as ``python -m pipeline.bench.NAME``:

- :mod:`pipeline.bench.offline`: throughput against HF ``generate`` and HF continuous batching;
- :mod:`pipeline.bench.online`: TTFT and inter-token latency under Poisson arrivals;
- :mod:`pipeline.bench.ceiling`: the framework alone, with the null model;
- :mod:`pipeline.bench.split`: single process against the zmq split;
- :mod:`pipeline.bench.ablation`: each execute-stage optimization switched off in turn;
- :mod:`pipeline.bench.transports`: the links against raw pyzmq and raw grpc.aio;
- :mod:`pipeline.bench.http_body`: hostile request bodies, with and without the HTTP body cap;
- :mod:`pipeline.bench.profile`: the per-stage table every benchmark prints with ``--profile``.

Benchmarks measure; they are never timed tests.
"""

__all__: list[str] = []
