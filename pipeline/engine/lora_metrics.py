"""LoRA adapter metrics (docs/lora.md, "Metrics"), in an
:class:`~pipeline.engine.metrics.EngineMetrics`' registry when the engine has ``enable_lora``:

- ``actorline_lora_requests_total{adapter}``: requests sent with each adapter (a counter;
  each of an HTTP request's ``n`` choices counts, as each is an engine request);
- ``actorline_lora_adapters_loaded``: the adapters served by name (``--lora-modules`` and
  ``/v1/load_lora_adapter``, less those unloaded), where a server gave its adapters
  (:meth:`LoRAMetrics.serve`);
- vLLM's ``vllm:lora_requests_info`` (``vllm/v1/metrics/loggers.py``, ``gauge_lora_info``):
  one sample whose labels are ``max_lora`` and the comma-separated names of the adapters of
  the ``running_lora_adapters`` and ``waiting_lora_adapters`` requests, set to the time of the
  scrape (vLLM sets it to the time of its last update: ``set_to_current_time``).

Running and waiting are seen from the engine API: a request is waiting from its sending to
its first output (admission, the queue, its adapter's load and its prefill), running from
then to its end.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.engine.async_engine import AsyncEngine, EngineObserver
from stages.messages import GenerateRequest, RequestOutput

__all__ = ["LoRAMetrics"]


class _AdapterRequests(EngineObserver):
    """Counts each adapter's requests and knows which are waiting and running."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "actorline_lora_requests",
            "Requests sent with each LoRA adapter.",
            ("adapter",),
            registry=registry,
        )
        self.waiting: dict[str, str] = {}  # request id -> adapter name
        self.running: dict[str, str] = {}

    def request_sent(self, request: GenerateRequest) -> None:
        if request.lora is not None:
            self.requests.labels(request.lora.lora_name).inc()
            self.waiting[request.request_id] = request.lora.lora_name

    def output_received(self, output: RequestOutput) -> None:
        name = self.waiting.pop(output.request_id, None)
        if name is not None:
            self.running[output.request_id] = name

    def request_ended(self, request_id: str, error: BaseException | None) -> None:
        self.waiting.pop(request_id, None)
        self.running.pop(request_id, None)


class _Snapshot(Collector):
    def __init__(self, metrics: LoRAMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        served = metrics.served
        if served is not None:
            loaded = GaugeMetricFamily(
                "actorline_lora_adapters_loaded",
                "LoRA adapters served by name (--lora-modules and /v1/load_lora_adapter, "
                "less those unloaded).",
            )
            loaded.add_metric([], len(served))
            yield loaded
        observer = metrics.observer
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        info.add_metric(
            [
                str(metrics.max_loras),
                ",".join(sorted(set(observer.waiting.values()))),
                ",".join(sorted(set(observer.running.values()))),
            ],
            time.time(),
        )
        yield info


class LoRAMetrics:
    """The LoRA metrics of ``engine`` in ``registry`` (see the module docstring); requests
    count from construction on, :meth:`close` detaches from the engine."""

    def __init__(self, engine: AsyncEngine, registry: CollectorRegistry) -> None:
        self.engine = engine
        self.max_loras = engine.options.max_loras
        #: the adapters served by name (None: no server gave them, no gauge)
        self.served: Collection[str] | None = None
        self.observer = _AdapterRequests(registry)
        registry.register(_Snapshot(self))
        engine.add_observer(self.observer)

    def serve(self, adapters: Collection[str]) -> None:
        """Report ``adapters`` (a live view: the names a server serves now) as loaded."""
        self.served = adapters

    def close(self) -> None:
        """Detach from the engine (the metrics stay in the registry). Idempotent."""
        self.engine.remove_observer(self.observer)
