"""Prometheus metrics of an :class:`~pipeline.engine.async_engine.AsyncEngine`.

::

    async with AsyncEngine("smollm2-135m") as engine, EngineMetrics(engine) as metrics:
        port = metrics.start_http_server("127.0.0.1", 9400)   # GET http://127.0.0.1:9400/metrics
        ...

``actorline serve --metrics-port 9400`` does the same for the gRPC server. Every metric of
this module is in the ``actorline_`` namespace and lives in the :class:`EngineMetrics`' own
:class:`~prometheus_client.CollectorRegistry` (never the process-global one), so several
engines in one process do not collide. Beside them, the same registry holds vLLM's metric
names (``vllm:`` prefix, ``model_name`` label; :mod:`pipeline.engine.vllm_metrics`), so
dashboards and autoscalers made for vLLM work unchanged.

Three sources feed them:

- per request, an :class:`~pipeline.engine.async_engine.EngineObserver` attached to the
  engine: time to first token, inter-token latency, end-to-end latency (histograms), prompt
  and generation tokens, requests finished by ``finish_reason`` and rejected by ``kind`` (counters);
- at scrape time, the engine's latest :class:`~stages.messages.EngineStats` (sent by the
  scheduler with every step): requests running and waiting, KV blocks used and free,
  prefix-cache queries, hits and hit rate, preemptions, engine steps, engine restarts;
- polled every ``poll_interval`` seconds, :meth:`RunningPipeline.statistics
  <pipeline.runtime.running.RunningPipeline.statistics>`: per-stage mailbox depth, messages
  handled and seconds spent handling them (label ``stage``), and the generation throughput
  over the last interval.

The metric set follows vLLM's (``vllm/v1/metrics/loggers.py``: ``num_requests_running``,
``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds``, ...); the bucket boundaries are our own, spanning GPU decode
steps (milliseconds) to long CPU requests (minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from pipeline.engine.async_engine import AsyncEngine, EngineObserver
from pipeline.engine.lora_metrics import LoRAMetrics
from pipeline.engine.vllm_metrics import VllmMetrics
from pipeline.runtime.control import HANDLE_SECONDS_BUCKETS
from stages.errors import ERROR_KINDS
from stages.messages import GenerateRequest, RequestOutput, RequestRejected
from transports.tasks import TaskSet

__all__ = [
    "DEFAULT_POLL_INTERVAL",
    "E2E_LATENCY_BUCKETS",
    "FINISH_REASONS",
    "INTER_TOKEN_LATENCY_BUCKETS",
    "NAMESPACE",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "EngineMetrics",
]

logger = logging.getLogger("actorline.metrics")

#: the prefix of every metric name
NAMESPACE = "actorline"
#: seconds between two polls of the pipeline's per-stage statistics
DEFAULT_POLL_INTERVAL = 1.0
#: finish reasons a request can end with (pre-created so every one is scraped from the start)
FINISH_REASONS = ("stop", "length", "abort", "error")

# Seconds. A GPU reaches its first token in milliseconds, a long prompt on CPU in seconds.
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
# A CUDA-graph decode step takes ~1-10 ms, a CPU one 10-500 ms.
INTER_TOKEN_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
E2E_LATENCY_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip

#: how many poll intervals a statistics query may take before it is given up on
_POLL_TIMEOUT_INTERVALS = 5.0


@dataclasses.dataclass(slots=True)
class _RequestTiming:
    """What the observer remembers about one running request (monotonic seconds)."""

    sent: float
    last_token: float | None = None
    num_tokens: int = 0
    prompt_counted: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _StageSample:
    queued: int
    handled: int
    handle_seconds: float
    handle_buckets: tuple[int, ...]


class _RequestObserver(EngineObserver):
    """Turns the engine's per-request events into histogram observations and counters."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._requests: dict[str, _RequestTiming] = {}
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival at the engine API to its first token.",
            namespace=NAMESPACE,
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "inter_token_latency_seconds",
            "Seconds between two consecutive generated tokens of a request.",
            namespace=NAMESPACE,
            buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "e2e_request_latency_seconds",
            "Seconds from a request's arrival to its end (any finish reason but error).",
            namespace=NAMESPACE,
            buckets=E2E_LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "prompt_tokens",
            "Prompt tokens of the requests that started generating.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "generation_tokens",
            "Tokens generated.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.finished = Counter(
            "requests_finished",
            "Requests that ended, by finish reason (abort: cancelled by the caller; error: "
            "the engine failed).",
            ("finish_reason",),
            namespace=NAMESPACE,
            registry=registry,
        )
        self.rejected = Counter(
            "requests_rejected",
            "Requests refused before running, by kind (invalid, prompt_too_long, "
            "rate_limited, overloaded, error).",
            ("kind",),
            namespace=NAMESPACE,
            registry=registry,
        )
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        for kind in ERROR_KINDS:
            self.rejected.labels(kind)
        self._generated_total = 0  # mirrors generation_tokens for the throughput gauge

    @property
    def generated_total(self) -> int:
        return self._generated_total

    def request_sent(self, request: GenerateRequest) -> None:
        self._requests[request.request_id] = _RequestTiming(time.monotonic())

    def output_received(self, output: RequestOutput) -> None:
        timing = self._requests.get(output.request_id)
        if timing is None:  # the caller already left: nobody measures this request any more
            return
        now = time.monotonic()
        new_tokens = len(output.token_ids) - timing.num_tokens
        if new_tokens > 0:
            if not timing.prompt_counted:
                self.prompt_tokens.inc(output.num_prompt_tokens)
                timing.prompt_counted = True
            if timing.last_token is None:
                self.time_to_first_token.observe(now - timing.sent)
                # NOTE: a first output carrying several tokens has no gaps to measure
            else:
                gap = (now - timing.last_token) / new_tokens
                for _ in range(new_tokens):
                    self.inter_token_latency.observe(gap)
            timing.last_token = now
            timing.num_tokens = len(output.token_ids)
            self.generation_tokens.inc(new_tokens)
            self._generated_total += new_tokens
        elif output.embedding is not None and not timing.prompt_counted:
            # an embedding: its prompt was computed, nothing generated (docs/serving.md)
            self.prompt_tokens.inc(output.num_prompt_tokens)
            timing.prompt_counted = True
        if output.finish_reason is not None:
            self._finish(output.request_id, output.finish_reason, now)

    def request_rejected(self, rejected: RequestRejected) -> None:
        if self._requests.pop(rejected.request_id, None) is not None:
            self.rejected.labels(rejected.kind).inc()

    def request_ended(self, request_id: str, error: BaseException | None) -> None:
        if request_id in self._requests:  # no finish output and no rejection was seen
            self._finish(request_id, "abort" if error is None else "error", time.monotonic())

    def _finish(self, request_id: str, finish_reason: str, now: float) -> None:
        timing = self._requests.pop(request_id)
        self.finished.labels(finish_reason).inc()
        if finish_reason != "error":
            self.e2e_latency.observe(now - timing.sent)


class _SnapshotCollector(Collector):
    """Reads the latest engine stats and stage statistics when the registry is scraped (in the
    HTTP server's thread: it only reads immutable snapshots)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self._metrics.engine.stats
        name = f"{NAMESPACE}_"

        def gauge(metric: str, documentation: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name + metric, documentation, value=value)

        def counter(metric: str, documentation: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name + metric, documentation, value=value)

        running = stats.num_running if stats else 0
        waiting = stats.num_waiting if stats else 0
        # NOTE: before the first engine step there are no stats yet: every block is free.
        info = self._metrics.engine.info
        info_blocks = info.num_blocks if info is not None else 0
        total = stats.kv_blocks_total if stats else info_blocks
        free = stats.kv_blocks_free if stats else info_blocks
        queries = stats.prefix_cache_queries if stats else 0
        hits = stats.prefix_cache_hits if stats else 0
        yield gauge("requests_running", "Requests being computed by the scheduler.", running)
        yield gauge("requests_waiting", "Requests queued in the scheduler.", waiting)
        yield gauge("kv_blocks_used", "KV cache blocks in use.", total - free)
        yield gauge("kv_blocks_free", "KV cache blocks free (or held only by the prefix cache).",
                    free)  # fmt: skip
        yield gauge("kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1).",
                    (total - free) / total if total else 0.0)  # fmt: skip
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      queries)  # fmt: skip
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", hits)
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries since start (0-1).",
                    hits / queries if queries else 0.0)  # fmt: skip
        yield counter("preemptions", "Requests preempted (KV blocks ran out), since start.",
                      stats.num_preemptions if stats else 0)  # fmt: skip
        yield counter("engine_steps", "Engine steps run.", stats.num_steps if stats else 0)
        yield gauge(
            "execute_threads",
            "Threads the execute stage steps on (one while the machine is oversubscribed; 0: "
            "not reported yet).",
            stats.execute_threads if stats else 0,
        )
        # speculative decoding (docs/speculative.md): 0 without it
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified, since start.",
                      stats.spec_num_draft_tokens if stats else 0)  # fmt: skip
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted, since start.",
                      stats.spec_num_accepted_tokens if stats else 0)  # fmt: skip
        yield counter(
            "spec_decode_num_drafts_dropped",
            "Drafts the draft model failed to deliver (it raised, or its host answered late "
            "or died), since start.",
            stats.spec_num_drafts_dropped if stats else 0,
        )
        yield counter(
            "spec_decode_draft_host_restarts",
            "Times a lost draft host placed apart was restarted alone, since start.",
            sum(self._metrics.engine.draft_restarts.values()),
        )
        yield counter(
            "engine_restarts",
            "Times a fresh engine replaced one that died or froze (restart_engine).",
            self._metrics.engine.restarts,
        )
        yield gauge(
            "generation_tokens_per_second",
            "Tokens generated per second over the last statistics poll interval.",
            self._metrics.tokens_per_second,
        )
        yield from self._replica_metrics(name)
        depth = GaugeMetricFamily(
            name + "stage_queue_depth", "Messages waiting in a stage's mailbox.", labels=["stage"]
        )
        handled = CounterMetricFamily(
            name + "stage_messages_handled", "Messages a stage has handled.", labels=["stage"]
        )
        seconds = HistogramMetricFamily(
            name + "stage_handle_seconds",
            "Seconds a stage took to handle each message.",
            labels=["stage"],
        )
        for stage, sample in self._metrics.stage_samples.items():
            depth.add_metric([stage], sample.queued)
            handled.add_metric([stage], sample.handled)
            seconds.add_metric([stage], _cumulative(sample.handle_buckets), sample.handle_seconds)
        yield from (depth, handled, seconds)

    def _replica_metrics(self, name: str) -> Iterator[Metric]:
        """With data parallelism: each engine replica's state and latest stats."""
        engine = self._metrics.engine
        replicas = engine.replicas
        if not replicas:
            return
        labels = ["replica"]
        up = GaugeMetricFamily(
            name + "replica_up", "1 while an engine replica lives, 0 once it died.", labels=labels
        )
        running = GaugeMetricFamily(
            name + "replica_requests_running", "Requests an engine replica computes.", labels=labels
        )
        waiting = GaugeMetricFamily(
            name + "replica_requests_waiting", "Requests queued in a replica.", labels=labels
        )
        free = GaugeMetricFamily(
            name + "replica_kv_blocks_free", "KV cache blocks free in a replica.", labels=labels
        )
        steps = CounterMetricFamily(
            name + "replica_engine_steps", "Engine steps a replica ran.", labels=labels
        )
        restarts = CounterMetricFamily(
            name + "replica_restarts",
            "Times an engine replica was restarted on its own after it died or froze "
            "(restart_engine).",
            labels=labels,
        )
        for status in replicas:
            up.add_metric([status.replica], 1.0 if status.alive else 0.0)
            restarts.add_metric([status.replica], engine.replica_restarts.get(status.replica, 0))
            stats = engine.replica_stats.get(status.replica)
            if stats is None or not status.alive:
                continue
            running.add_metric([status.replica], stats.num_running)
            waiting.add_metric([status.replica], stats.num_waiting)
            free.add_metric([status.replica], stats.kv_blocks_free)
            steps.add_metric([status.replica], stats.num_steps)
        yield from (up, running, waiting, free, steps, restarts)


def _cumulative(buckets: tuple[int, ...]) -> list[tuple[str, float]]:
    """Prometheus histogram buckets (``le`` bound, cumulative count) from per-bucket counts
    over HANDLE_SECONDS_BUCKETS and a last, unbounded bucket."""
    bounds = [*map(str, HANDLE_SECONDS_BUCKETS), "+Inf"]
    counts = itertools.accumulate(buckets) if buckets else [0] * len(bounds)
    return list(zip(bounds, map(float, counts)))


class EngineMetrics:
    """Prometheus metrics of ``engine`` in ``registry`` (a new CollectorRegistry by default):
    actorline's, and vLLM's names labelled ``model_name`` (the served model name; default: the
    engine's model).

    Per-request metrics count from construction on. :meth:`start` (or ``async with``) begins
    polling per-stage statistics every ``poll_interval`` seconds; :meth:`start_http_server`
    serves ``/metrics``; :meth:`aclose` stops both and detaches from the engine.

    Raises (from the constructor): ValueError for a ``poll_interval`` that is not > 0.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        registry: CollectorRegistry | None = None,
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        model_name: str | None = None,
    ) -> None:
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        self.engine = engine
        self.registry = registry if registry is not None else CollectorRegistry()
        self.poll_interval = float(poll_interval)
        self.stage_samples: dict[str, _StageSample] = {}
        self.tokens_per_second = 0.0
        self._observer = _RequestObserver(self.registry)
        self.registry.register(_SnapshotCollector(self))
        engine.add_observer(self._observer)
        self.vllm = VllmMetrics(engine, self.registry, model_name or engine.options.model)
        #: with enable_lora, the adapters' metrics (pipeline.engine.lora_metrics)
        self.lora = LoRAMetrics(engine, self.registry) if engine.options.enable_lora else None
        self._poller: asyncio.Task[None] | None = None
        self._tasks = TaskSet("metrics")  # the poller
        self._http: tuple[WSGIServer, threading.Thread] | None = None
        self._throughput_mark: tuple[float, int] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> EngineMetrics:
        """Take a first statistics snapshot, then poll in the background. Idempotent."""
        if self._poller is None:
            await self.refresh()
            self._poller = self._tasks.spawn(self._poll(), name="metrics:poll")
        return self

    def start_http_server(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve the registry at ``http://host:port/metrics`` (prometheus_client's WSGI app on
        a threaded HTTP server; port 0 picks a free one). A connection gets
        :data:`METRICS_READ_TIMEOUT` seconds to send its request, and at most
        :data:`METRICS_MAX_CONNECTIONS` are served at once (more are closed at once), so idle
        or slow clients cannot pile up threads.

        Returns:
            The port listened on.
        Raises:
            RuntimeError: the server is already running. OSError: the address is unusable.
        """
        if self._http is not None:
            raise RuntimeError("the metrics HTTP server is already running")
        server_class = _MetricsServer6 if ":" in host else _MetricsServer
        server = make_server(
            host.strip("[]"),
            port,
            make_wsgi_app(self.registry),
            server_class,
            handler_class=_MetricsRequestHandler,
        )
        thread = threading.Thread(
            target=server.serve_forever, name="actorline-metrics-http", daemon=True
        )
        thread.start()
        self._http = (server, thread)
        bound: int = server.server_port
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def stop_http_server(self) -> None:
        """Stop the HTTP server and release its port. Idempotent."""
        http, self._http = self._http, None
        if http is not None:
            server, thread = http
            server.shutdown()
            server.server_close()
            thread.join()

    async def aclose(self) -> None:
        """Stop polling and the HTTP server and detach from the engine. Idempotent."""
        self.engine.remove_observer(self._observer)
        self.vllm.close()
        if self.lora is not None:
            self.lora.close()
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        if self._http is not None:
            await asyncio.to_thread(self.stop_http_server)

    async def __aenter__(self) -> EngineMetrics:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- statistics -----------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Query the pipeline's statistics now and update the per-stage metrics and the
        throughput gauge.

        Raises:
            PipelineError: the pipeline is closed or failed (or a host did not answer).
            TimeoutError: the hosts did not answer within a few poll intervals.
        """
        hosts = await asyncio.wait_for(
            self.engine.running.statistics(), self.poll_interval * _POLL_TIMEOUT_INTERVALS
        )
        self.stage_samples = {
            stage.name: _StageSample(
                stage.mailbox.queued, stage.handled, stage.handle_seconds, stage.handle_buckets
            )
            for host in hosts
            for stage in host.stages
        }
        now, generated = time.monotonic(), self._observer.generated_total
        if self._throughput_mark is not None:
            then, before = self._throughput_mark
            if now > then:
                self.tokens_per_second = (generated - before) / (now - then)
        self._throughput_mark = (now, generated)

    async def _poll(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.refresh()
                failing = False
            except Exception as exc:  # keep the last snapshot; the engine may be stopping
                if not failing:
                    logger.info("metrics: pipeline statistics unavailable: %s", exc)
                failing = True


#: seconds a metrics connection may take to send its request (and to take each response write)
METRICS_READ_TIMEOUT = 10.0
#: metrics connections served at once; more are closed on arrival
METRICS_MAX_CONNECTIONS = 32


class _MetricsRequestHandler(WSGIRequestHandler):
    """A quiet request handler with a socket timeout: a client that connects and sends
    nothing (or dribbles) is dropped after :data:`METRICS_READ_TIMEOUT` seconds."""

    timeout = METRICS_READ_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


class _MetricsServer(ThreadingWSGIServer):
    """prometheus_client's threaded WSGI server, serving at most
    :data:`METRICS_MAX_CONNECTIONS` connections at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: close it rather than queue a thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6
