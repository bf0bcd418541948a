"""vLLM's Prometheus metric names, beside actorline's own (:mod:`pipeline.engine.metrics`).

Dashboards, autoscalers and routers built for vLLM read ``vllm:``-prefixed metrics with a
``model_name`` label (vLLM's Grafana dashboard, KEDA scalers, the Gateway API inference
extension's endpoint picker, which reads ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``). :class:`VllmMetrics` exposes the same names, types, labels,
meanings and bucket boundaries as vLLM's ``PrometheusStatLogger``
(``vllm/v1/metrics/loggers.py``), in the registry of an
:class:`~pipeline.engine.metrics.EngineMetrics`, so the ``actorline_*`` metrics stay as they are.

Labels: ``model_name`` (the served model name) and ``engine``: the engine replica (with data
parallelism, the replica's name, ``"0"``, ``"1"``, ...; ``"0"`` with one engine), as vLLM
labels each engine core. Per-request metrics carry the replica that ran the request (a
request that never reached a scheduler counts under ``"0"``).

What is measured where (the table in ``docs/serving.md``, "Metrics and health"):

- at the engine API, per request: time to first token, inter-token latency (also under vLLM's
  older name ``time_per_output_token_seconds``), end-to-end latency, the decode time (first
  to last token), prompt and generation tokens, ``max_tokens``, requests finished by reason;
- by the scheduler, per request, on its own clock: the queue time (arrival at the scheduler
  to its first scheduled chunk) and the prefill time (from there to its first token); the
  inference time is prefill plus decode, as in vLLM (``vllm/v1/metrics/stats.py``);
- per engine step (the step's :class:`~stages.messages.EngineStats`): the tokens it computed
  (``iteration_tokens_total``);
- at scrape time, from the latest stats: requests running and waiting, KV cache usage (also
  under the older ``gpu_cache_usage_perc``), prefix-cache queries and hits, preemptions, and
  ``cache_config_info``.

Each of an HTTP request's ``n`` choices runs as its own engine request, one of its
parent's (:class:`~stages.messages.GenerateRequest`'s ``parent_id`` and ``n``), as vLLM's
parallel sampling makes children of one parent (``vllm/v1/engine/parallel_sampling.py``,
``observe_finished_request``): ``vllm:request_params_n`` (the parent's ``n``) and
``vllm:request_max_num_generation_tokens`` (its longest choice) are observed once per parent,
when its last choice ends; every other per-request metric once per choice, as vLLM's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.engine.async_engine import AsyncEngine, EngineObserver
from stages.messages import EngineStats, GenerateRequest, RequestOutput, RequestRejected

__all__ = [
    "E2E_BUCKETS",
    "ITERATION_TOKENS_BUCKETS",
    "PARAMS_N_BUCKETS",
    "PREFIX",
    "TIME_PER_OUTPUT_TOKEN_BUCKETS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "VllmMetrics",
    "build_1_2_5_buckets",
]

#: the prefix of vLLM's metric names
PREFIX = "vllm:"
#: the labels of every vLLM metric here
LABELS = ("model_name", "engine")
#: the ``engine`` label of a single engine (vLLM's first engine core index)
SINGLE_ENGINE = "0"
#: finish reasons pre-created in ``vllm:request_success_total`` (vLLM's FinishReason, and
#: actorline's "error")
FINISHED_REASONS = ("stop", "length", "abort", "error")

# Bucket boundaries as vLLM's PrometheusStatLogger sets them (vllm/v1/metrics/loggers.py).
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TIME_PER_OUTPUT_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
#: the token-count buckets' bound when the model's length is not known yet
DEFAULT_MAX_MODEL_LEN = 1 << 16


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclasses.dataclass(slots=True)
class _Request:
    """What the observer remembers about one running request (monotonic seconds)."""

    sent: float
    max_tokens: int | None
    parent_id: str = ""
    n: int = 1
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    scheduler_times: tuple[float, float, str] | None = None
    engine: str = SINGLE_ENGINE
    # the request's engine's children of the per-token metrics, set at its first token
    inter_token_latency: Histogram | None = None
    generation_tokens: Counter | None = None


def _engine_label(replica: str) -> str:
    return replica or SINGLE_ENGINE


_M = TypeVar("_M", Histogram, Counter)


class _Family(Generic[_M]):
    """A labelled prometheus_client metric with its children cached by engine label."""

    __slots__ = ("_children", "_model_name", "metric")

    def __init__(self, metric: _M, model_name: str) -> None:
        self.metric: _M = metric
        self._model_name = model_name
        self._children: dict[str, _M] = {}
        self(SINGLE_ENGINE)  # scraped from the start, as vLLM creates each engine's at once

    def __call__(self, engine: str) -> _M:
        child = self._children.get(engine)
        if child is None:
            child = self._children[engine] = self.metric.labels(self._model_name, engine)
        return child


class _Renamed(Collector):
    """The samples of ``metric`` under another name (a histogram's ``_bucket``, ``_sum``,
    ``_count`` and ``_created`` samples renamed alike)."""

    def __init__(self, metric: Histogram, name: str, documentation: str) -> None:
        self._metric = metric
        self._name = name
        self._documentation = documentation

    def collect(self) -> Iterator[Metric]:
        for family in self._metric.collect():
            renamed = Metric(self._name, self._documentation, family.type)
            renamed.samples = [
                sample._replace(name=self._name + sample.name.removeprefix(family.name))
                for sample in family.samples
            ]
            yield renamed


class _VllmRequestObserver(EngineObserver):
    """Turns the engine's per-request events and step stats into vLLM's histograms and
    counters."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self._requests: dict[str, _Request] = {}
        self._steps: dict[str, int] = {}  # replica -> num_steps last observed
        # parent id -> [its choices still running, the most tokens one of them generated
        # (-1: none finished without an error)]
        self._parents: dict[str, list[int]] = {}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> _Family[Histogram]:
            metric = Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=registry)
            return _Family(metric, model_name)

        def counter(name: str, doc: str) -> _Family[Counter]:
            return _Family(Counter(PREFIX + name, doc, LABELS, registry=registry), model_name)

        tokens = build_1_2_5_buckets(max_model_len)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TIME_PER_OUTPUT_TOKEN_BUCKETS,
        )
        # NOTE: vLLM's older name for the same observations, copied from the inter-token
        # histogram at scrape time rather than observed twice per token.
        registry.register(
            _Renamed(
                self.inter_token_latency.metric,
                PREFIX + "time_per_output_token_seconds",
                "Histogram of time per output token in seconds (the observations of "
                "vllm:inter_token_latency_seconds, under vLLM's older name).",
            )
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TIME_PER_OUTPUT_TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            E2E_BUCKETS,
        )
        self.queue = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            E2E_BUCKETS,
        )
        self.inference = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            E2E_BUCKETS,
        )
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            E2E_BUCKETS,
        )
        self.decode = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            E2E_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=registry,
        )
        self._success = success
        self._model_name = model_name
        for reason in FINISHED_REASONS:
            success.labels(model_name, SINGLE_ENGINE, reason)

    # -- hooks ----------------------------------------------------------------------------------

    def request_sent(self, request: GenerateRequest) -> None:
        self._requests[request.request_id] = _Request(
            time.monotonic(), request.params.max_tokens, request.parent_id, request.n
        )
        if request.n > 1:
            self._parents.setdefault(request.parent_id, [request.n, -1])

    def output_received(self, output: RequestOutput) -> None:
        request = self._requests.get(output.request_id)
        if request is None:  # the caller already left
            return
        now = time.monotonic()
        times = output.scheduler_times
        if times is not None and request.scheduler_times is None:
            request.scheduler_times = times
            request.engine = _engine_label(times[2])
        new_tokens = len(output.token_ids) - request.num_tokens
        if new_tokens > 0:
            generated = request.generation_tokens
            if generated is None or request.last_token is None:  # its first token
                engine = request.engine
                request.first_token = now
                request.num_prompt_tokens = output.num_prompt_tokens
                request.inter_token_latency = self.inter_token_latency(engine)
                generated = request.generation_tokens = self.generation_tokens(engine)
                self.time_to_first_token(engine).observe(now - request.sent)
                self.prompt_tokens(engine).inc(output.num_prompt_tokens)
            else:
                assert request.inter_token_latency is not None
                gap = (now - request.last_token) / new_tokens
                for _ in range(new_tokens):
                    request.inter_token_latency.observe(gap)
            request.last_token = now
            request.num_tokens = len(output.token_ids)
            generated.inc(new_tokens)
        elif output.embedding is not None:  # an embedding: its prompt computed, no tokens
            request.num_prompt_tokens = output.num_prompt_tokens
            self.prompt_tokens(request.engine).inc(output.num_prompt_tokens)
        if output.finish_reason is not None:
            self._finish(output.request_id, output.finish_reason, now)

    def request_rejected(self, rejected: RequestRejected) -> None:
        request = self._requests.pop(rejected.request_id, None)
        if request is not None:
            self._choice_ended(request, None)

    def request_ended(self, request_id: str, error: BaseException | None) -> None:
        if request_id in self._requests:  # no finish output and no rejection was seen
            self._finish(request_id, "abort" if error is None else "error", time.monotonic())

    def stats_received(self, stats: EngineStats) -> None:
        last = self._steps.get(stats.replica, 0)
        if stats.num_steps > last:
            self._steps[stats.replica] = stats.num_steps
            if stats.step_tokens > 0:
                self.iteration_tokens(_engine_label(stats.replica)).observe(stats.step_tokens)

    # -- finishing ------------------------------------------------------------------------------

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        request = self._requests.pop(request_id)
        times = request.scheduler_times
        engine = request.engine
        self._success.labels(self._model_name, engine, reason).inc()
        if reason == "error":  # the engine failed it: no latency to speak of (as actorline's)
            self._choice_ended(request, None)
            return
        self.e2e(engine).observe(now - request.sent)
        self.request_prompt_tokens(engine).observe(request.num_prompt_tokens)
        self.request_generation_tokens(engine).observe(request.num_tokens)
        self._choice_ended(request, request.num_tokens)
        if request.max_tokens is not None:
            self.params_max_tokens(engine).observe(request.max_tokens)
        if times is None or request.first_token is None or request.last_token is None:
            return  # it never reached its first token: no queue, prefill or decode to time
        queue_seconds, prefill_seconds, _ = times
        decode_seconds = request.last_token - request.first_token
        self.queue(engine).observe(queue_seconds)
        self.prefill(engine).observe(prefill_seconds)
        self.decode(engine).observe(decode_seconds)
        self.inference(engine).observe(prefill_seconds + decode_seconds)
        if request.num_tokens > 1:
            self.request_time_per_output_token(engine).observe(
                decode_seconds / (request.num_tokens - 1)
            )

    def _choice_ended(self, request: _Request, num_tokens: int | None) -> None:
        """Count a request's end toward its parent (``num_tokens`` None: it ended without
        an answer); a parent is observed once, when its last choice ends, if any of them
        answered."""
        if request.n <= 1:
            if num_tokens is not None:
                self.request_max_generation_tokens(request.engine).observe(num_tokens)
                self.params_n(request.engine).observe(1)
            return
        parent = self._parents.get(request.parent_id)
        if parent is None:
            return
        parent[0] -= 1
        if num_tokens is not None:
            parent[1] = max(parent[1], num_tokens)
        if parent[0] > 0:
            return
        del self._parents[request.parent_id]
        if parent[1] >= 0:
            self.request_max_generation_tokens(request.engine).observe(parent[1])
            self.params_n(request.engine).observe(request.n)


class _VllmSnapshotCollector(Collector):
    """vLLM's scheduler gauges and counters, read from the engine's latest stats at scrape
    time (in the HTTP server's thread: it only reads immutable snapshots)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def _stats(self) -> list[tuple[str, EngineStats | None]]:
        """(engine label, latest stats) of each live replica, or of the one engine."""
        engine = self._engine
        replicas = engine.replicas
        if not replicas:
            return [(SINGLE_ENGINE, engine.stats)]
        return [
            (_engine_label(status.replica), engine.replica_stats.get(status.replica))
            for status in replicas
            if status.alive
        ]

    def collect(self) -> Iterator[Metric]:
        labels = list(LABELS)
        running = GaugeMetricFamily(
            PREFIX + "num_requests_running",
            "Number of requests in model execution batches.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting", "Number of requests waiting to be processed.",
            labels=labels,
        )  # fmt: skip
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            labels=labels,
        )  # fmt: skip
        gpu_usage = GaugeMetricFamily(
            PREFIX + "gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
            "vllm:kv_cache_usage_perc instead.",
            labels=labels,
        )
        queries = CounterMetricFamily(
            PREFIX + "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels=labels,
        )
        hits = CounterMetricFamily(
            PREFIX + "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels=labels,
        )
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions", "Cumulative number of preemption from the engine.",
            labels=labels,
        )  # fmt: skip
        # vLLM's spec_decode counters (vllm/v1/spec_decode/metrics.py), 0 without it
        drafts = CounterMetricFamily(
            PREFIX + "spec_decode_num_drafts", "Number of spec decoding drafts.", labels=labels
        )
        draft_tokens = CounterMetricFamily(
            PREFIX + "spec_decode_num_draft_tokens", "Number of draft tokens.", labels=labels
        )
        accepted = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens", "Number of accepted tokens.",
            labels=labels,
        )  # fmt: skip
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*labels, "position"],
        )
        info = self._engine.info
        for engine, stats in self._stats():
            values = [self._model_name, engine]
            drafts.add_metric(values, stats.spec_num_drafts if stats else 0)
            draft_tokens.add_metric(values, stats.spec_num_draft_tokens if stats else 0)
            accepted.add_metric(values, stats.spec_num_accepted_tokens if stats else 0)
            for position, count in enumerate(stats.spec_accepted_per_position if stats else ()):
                per_position.add_metric([*values, str(position)], count)
            # NOTE: before the first engine step there are no stats yet: every block is free.
            total = stats.kv_blocks_total if stats else 0
            used = total - stats.kv_blocks_free if stats else 0
            running.add_metric(values, stats.num_running if stats else 0)
            waiting.add_metric(values, stats.num_waiting if stats else 0)
            usage.add_metric(values, used / total if total else 0.0)
            gpu_usage.add_metric(values, used / total if total else 0.0)
            queries.add_metric(values, stats.prefix_cache_queries if stats else 0)
            hits.add_metric(values, stats.prefix_cache_hits if stats else 0)
            preemptions.add_metric(values, stats.num_preemptions if stats else 0)
        yield from (running, waiting, usage, gpu_usage, queries, hits, preemptions)
        yield from (drafts, draft_tokens, accepted, per_position)
        if info is not None:
            # An info metric as vLLM writes it: a gauge set to 1 whose labels are the cache
            # configuration (vLLM's CacheConfig.metrics_info()).
            config = {
                "block_size": str(info.block_size),
                "num_gpu_blocks": str(info.num_blocks),
                "enable_prefix_caching": str(info.enable_prefix_caching),
                "cache_dtype": info.kv_cache_dtype,
                "sliding_window": str(info.sliding_window),
            }
            cache_info = GaugeMetricFamily(
                PREFIX + "cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=[*LABELS, *config],
            )
            for engine, _ in self._stats():
                cache_info.add_metric([self._model_name, engine, *config.values()], 1.0)
            yield cache_info


class VllmMetrics:
    """vLLM's metrics of ``engine`` in ``registry``, labelled ``model_name=model_name``.

    Per-request metrics count from construction on; :meth:`aclose` detaches from the engine.
    ``max_model_len`` bounds the token-count buckets (default: the engine's, once known).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        registry: CollectorRegistry,
        model_name: str,
        *,
        max_model_len: int | None = None,
    ) -> None:
        if max_model_len is None:
            info = engine.info
            max_model_len = (
                info.max_model_len
                if info is not None
                else engine.options.max_model_len or DEFAULT_MAX_MODEL_LEN
            )
        self.engine = engine
        self.model_name = model_name
        self._observer = _VllmRequestObserver(registry, model_name, max_model_len)
        registry.register(_VllmSnapshotCollector(engine, model_name))
        engine.add_observer(self._observer)

    def close(self) -> None:
        """Detach from the engine (the metrics stay in the registry). Idempotent."""
        self.engine.remove_observer(self._observer)
