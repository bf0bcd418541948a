"""vLLM's metric names at ``/metrics`` of a real ``actorline serve --http-port`` (the package's
shared server, the tiny model served as ``tiny``), after real requests: every metric vLLM's
own Grafana dashboard queries exists with the ``model_name`` label, as do those the Gateway
API inference extension and KEDA read, with vLLM's types and bucket boundaries, and the
histograms and counters moved by exactly what the requests did."""

from __future__ import annotations

import math
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.engine.vllm_metrics import (
    E2E_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    build_1_2_5_buckets,
)
from tests.pipeline.server.http.conftest import IGNORE_EOS, MODEL
from tests.pipeline.server.serving import ServeProcess

#: every metric sample name the panels of vLLM's Grafana dashboard query in their ``expr``
#: (vllm-project/vllm, examples/online_serving/prometheus_grafana/grafana.json, commit
#: 004f771f3a6b49597546b05c7d83686d1e121fa0), each with ``{model_name="$model_name"}``
DASHBOARD_SAMPLES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
#: what the Gateway API inference extension's endpoint picker and KEDA scalers read
GATEWAY_SAMPLES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
)
#: vLLM's metric families (vllm/v1/metrics/loggers.py) with their Prometheus types
TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
}
#: (max_tokens, stream) of the requests the test sends
REQUESTS = ((5, False), (3, False), (7, True))
LABELS = {"model_name": MODEL, "engine": "0"}


class Scrape:
    """One parsed scrape: metric families by name, and samples by (name, labels)."""

    def __init__(self, serve: ServeProcess) -> None:
        with urllib.request.urlopen(serve.base_url + "/metrics", timeout=60) as response:
            text = response.read().decode()
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples = [sample for family in self.families.values() for sample in family.samples]

    def value(self, name: str, **labels: str) -> float:
        """The one sample ``name`` with ``model_name``, ``engine`` and ``labels``."""
        wanted = {**LABELS, **labels}
        found = [s.value for s in self.samples if s.name == name and s.labels == wanted]
        assert len(found) == 1, f"{name}{wanted}: {found}"
        return found[0]

    def buckets(self, name: str) -> list[float]:
        return [
            float(s.labels["le"])
            for s in self.samples
            if s.name == name + "_bucket" and s.labels.get("model_name") == MODEL
        ]


def send(client: openai.OpenAI) -> tuple[int, int]:
    """Send :data:`REQUESTS`; the prompt and completion tokens they used (from usage)."""
    prompt = completion = 0
    for max_tokens, stream in REQUESTS:
        if not stream:
            answer = client.completions.create(
                model=MODEL, prompt="the metrics of", max_tokens=max_tokens, extra_body=IGNORE_EOS
            )
            assert answer.usage is not None
            prompt += answer.usage.prompt_tokens
            completion += answer.usage.completion_tokens
            continue
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
        assert len(usage) == 1
        prompt += usage[0].prompt_tokens
        completion += usage[0].completion_tokens
    assert completion == sum(max_tokens for max_tokens, _ in REQUESTS)  # ignore_eos
    return prompt, completion


@pytest.fixture(scope="module")
def scrapes(openai_serve: ServeProcess) -> tuple[Scrape, Scrape, int, int]:
    """A scrape before and after :func:`send`, and the prompt and completion tokens sent."""
    before = Scrape(openai_serve)
    with openai.OpenAI(
        base_url=openai_serve.http_url, api_key="test-key-0123", max_retries=0
    ) as client:
        prompt, completion = send(client)
    return before, Scrape(openai_serve), prompt, completion


def test_every_dashboard_and_gateway_metric_is_served_with_the_model_name(
    scrapes: tuple[Scrape, Scrape, int, int],
) -> None:
    _, after, _, _ = scrapes
    for name in (*DASHBOARD_SAMPLES, *GATEWAY_SAMPLES):
        labelled = [s for s in after.samples if s.name == name]
        assert labelled, f"{name} is not served"
        assert all(s.labels.get("model_name") == MODEL for s in labelled), labelled
    for name, kind in TYPES.items():
        assert after.families[name].type == kind, name
    # Every vLLM metric carries the served model name and the engine.
    for sample in after.samples:
        if sample.name.startswith("vllm:"):
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
    # actorline's own metrics are still there, unchanged.
    assert "actorline_requests_running" in after.families


def test_buckets_are_vllms(scrapes: tuple[Scrape, Scrape, int, int]) -> None:
    _, after, _, _ = scrapes
    assert after.buckets("vllm:time_to_first_token_seconds") == [
        *TIME_TO_FIRST_TOKEN_BUCKETS,
        math.inf,
    ]
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert after.buckets("vllm:" + name) == [*TIME_PER_OUTPUT_TOKEN_BUCKETS, math.inf]
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after.buckets("vllm:" + name) == [*E2E_BUCKETS, math.inf]
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    max_model_len = 1024  # the tiny model's (max_position_embeddings)
    assert after.buckets("vllm:request_prompt_tokens") == [
        *build_1_2_5_buckets(max_model_len),
        math.inf,
    ]


def test_counts_follow_the_requests(scrapes: tuple[Scrape, Scrape, int, int]) -> None:
    before, after, prompt, completion = scrapes
    sent = len(REQUESTS)

    def moved(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert moved("vllm:request_success_total", finished_reason="length") == sent
    assert moved("vllm:prompt_tokens_total") == prompt
    assert moved("vllm:generation_tokens_total") == completion
    for histogram in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
    ):
        assert moved(f"vllm:{histogram}_count") == sent, histogram
    gaps = completion - sent  # every token after each request's first
    assert moved("vllm:inter_token_latency_seconds_count") == gaps
    assert moved("vllm:time_per_output_token_seconds_count") == gaps
    assert moved("vllm:request_prompt_tokens_sum") == prompt
    assert moved("vllm:request_generation_tokens_sum") == completion
    assert moved("vllm:request_params_max_tokens_sum") == completion
    assert moved("vllm:request_params_n_sum") == sent
    # The inference time is the prefill and decode times, each request's within its e2e.
    inference = moved("vllm:request_inference_time_seconds_sum")
    prefill = moved("vllm:request_prefill_time_seconds_sum")
    decode = moved("vllm:request_decode_time_seconds_sum")
    assert prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode)
    queue = moved("vllm:request_queue_time_seconds_sum")
    assert 0 <= queue + inference <= moved("vllm:e2e_request_latency_seconds_sum")
    # Each engine step computed at least one token; the requests' tokens took a step each.
    steps = moved("vllm:iteration_tokens_total_count")
    assert steps >= max(max_tokens for max_tokens, _ in REQUESTS)
    assert moved("vllm:iteration_tokens_total_sum") >= completion
    # Gauges: idle now, in vLLM's 0..1 usage scale.
    assert after.value("vllm:num_requests_running") == 0
    assert after.value("vllm:num_requests_waiting") == 0
    assert 0 <= after.value("vllm:kv_cache_usage_perc") <= 1
    assert after.value("vllm:kv_cache_usage_perc") == after.value("vllm:gpu_cache_usage_perc")
    assert moved("vllm:prefix_cache_queries_total") >= 0
    info = [s for s in after.samples if s.name == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["num_gpu_blocks"] == "128"
    assert info[0].labels["cache_dtype"] == "float32"  # the KV cache's (kv_cache_dtype auto)


def test_n_is_the_requests_and_counted_once_per_prompt(
    openai_serve: ServeProcess, client: openai.OpenAI
) -> None:
    """vLLM observes a parent's ``n`` and its longest choice once, when its last choice
    ends; every choice's own metrics once per choice."""
    before = Scrape(openai_serve)
    answer = client.completions.create(
        model=MODEL, prompt=["one", "two"], n=3, max_tokens=4, seed=1, extra_body=IGNORE_EOS
    )
    assert len(answer.choices) == 6
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert len(chat.choices) == 2
    after = Scrape(openai_serve)

    def moved(name: str) -> float:
        return after.value(name) - before.value(name)

    # three parents: each prompt of the completion (n=3), the chat (n=2)
    assert moved("vllm:request_params_n_count") == 3
    assert moved("vllm:request_params_n_sum") == 3 + 3 + 2
    assert moved("vllm:request_max_num_generation_tokens_count") == 3
    assert moved("vllm:request_max_num_generation_tokens_sum") == 4 + 4 + 3
    # per choice, as vLLM's children
    assert moved("vllm:request_params_max_tokens_count") == 8
    assert moved("vllm:request_params_max_tokens_sum") == 6 * 4 + 2 * 3
    assert moved("vllm:request_generation_tokens_count") == 8
    assert moved("vllm:e2e_request_latency_seconds_count") == 8
