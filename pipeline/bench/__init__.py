"""actorline's benchmarks (docs/performance.md), run by the installed CLI as
``actorline bench NAME``; each states its figure against a peer run in the same minutes:

- :mod:`pipeline.bench.offline`: throughput against HF ``generate``, HF continuous batching
  and, with ``--peer vllm``, vLLM-CPU (:mod:`pipeline.bench.hf`, :mod:`pipeline.bench.vllm_peer`);
- :mod:`pipeline.bench.online`: TTFT and inter-token latency under Poisson arrivals, in process
  or over HTTP against vLLM's server (:mod:`pipeline.bench.online_http`);
- :mod:`pipeline.bench.ceiling`: the framework alone, with the null model;
- :mod:`pipeline.bench.coldstart`: a whole process to its first token, against plain HF;
- :mod:`pipeline.bench.roof`: the GEMM roof the offline figures are read against;
- :mod:`pipeline.bench.transports`: the links against raw pyzmq and raw grpc.aio;
- :mod:`pipeline.bench.quantization`: 4/8-bit weights against fp32;
- :mod:`pipeline.bench.parallel`: tensor, data parallelism and Ray against one local engine
  (``offline``/``ceiling`` options);
- :mod:`pipeline.bench.profile`: the per-stage table every benchmark prints with ``--profile``.

The experiments and records (ablations, the grammar-engine comparison, kernel studies, the
soak, the process split, hostile HTTP bodies) live outside the installed packages, in the
checkout's ``benchmarks/`` (``python -m benchmarks.NAME``); nothing here imports them.

Benchmarks measure; they are never timed tests.
"""

__all__: list[str] = []
