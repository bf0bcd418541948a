"""Prometheus metrics (pipeline/metrics.py) over a real engine: a real HTTP scrape lists every
metric with its type, and under load the counters move by exactly what the requests did,
histograms get observations, gauges show work in flight, and per-stage statistics (polled
from both hosts) grow. Also ``actorline serve --metrics-port`` as a subprocess."""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pipeline import AsyncEngine, PipelineClosedError, PromptTooLongError, SamplingParams
from pipeline.cli import main
from pipeline.engine.metrics import EngineMetrics
from pipeline.runtime.control import HANDLE_SECONDS_BUCKETS
from pipeline.server.client import Client
from stages.messages import RequestOutput

T = TypeVar("T")
REPOSITORY = Path(__file__).resolve().parents[3]
RUN_TIMEOUT = 240.0
#: seconds to wait for a background poll to show new statistics
POLL_WAIT = 30.0

#: every metric the endpoint must list, with its Prometheus type
EXPECTED = {
    "actorline_requests_running": "gauge",
    "actorline_requests_waiting": "gauge",
    "actorline_kv_blocks_used": "gauge",
    "actorline_kv_blocks_free": "gauge",
    "actorline_prefix_cache_hit_rate": "gauge",
    "actorline_prefix_cache_hits": "counter",
    "actorline_prefix_cache_queries": "counter",
    "actorline_preemptions": "counter",
    "actorline_time_to_first_token_seconds": "histogram",
    "actorline_inter_token_latency_seconds": "histogram",
    "actorline_e2e_request_latency_seconds": "histogram",
    "actorline_prompt_tokens": "counter",
    "actorline_generation_tokens": "counter",
    "actorline_requests_finished": "counter",
    "actorline_requests_rejected": "counter",
    "actorline_stage_queue_depth": "gauge",
    "actorline_stage_messages_handled": "counter",
    "actorline_stage_handle_seconds": "histogram",
}
STAGES = ("tokenize", "admit", "schedule", "execute", "detokenize", "stop_check", "parse")
BLOCK_SIZE = 16
#: KV blocks of the test engine: six 60-token requests need 24, so some are preempted
NUM_BLOCKS = 20
MAX_MODEL_LEN = 256
#: the model name the vLLM metrics are labelled with
SERVED = "served-tiny"


def run(coroutine: Coroutine[Any, Any, T], timeout: float = RUN_TIMEOUT) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


class Scrape:
    """One parsed scrape of ``/metrics``: families by name, and sample values."""

    def __init__(self, text: str) -> None:
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples = {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in self.families.values()
            for sample in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]


def fetch(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return Scrape(response.read().decode())


async def scrape(port: int) -> Scrape:
    return await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/metrics")


async def drain(stream: Any) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None and last.finished
    return last


async def wait_for(predicate: Any, what: str, timeout: float = POLL_WAIT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def tokens(start: int, count: int) -> list[int]:
    """A prompt of ``count`` token ids (ordinary vocabulary entries)."""
    return list(range(start, start + count))


@pytest.mark.slow
def test_scrape_lists_every_metric_and_values_move_under_load(tiny_model_dir: Path) -> None:
    async def body() -> None:
        engine = AsyncEngine(
            str(tiny_model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
        )  # fmt: skip
        async with engine, EngineMetrics(engine, poll_interval=0.1, model_name=SERVED) as metrics:
            port = metrics.start_http_server("127.0.0.1", 0)
            before = await scrape(port)
            for name, kind in EXPECTED.items():
                assert name in before.families, f"{name} is not listed"
                assert before.families[name].type == kind, name
            assert before.value("actorline_generation_tokens_total") == 0
            assert {s.labels["stage"] for s in before.families["actorline_stage_queue_depth"]
                    .samples} == set(STAGES)  # fmt: skip

            finals: list[RequestOutput] = []
            # 1. work in flight shows in the gauges; then the request is aborted
            long_stream = engine.generate(
                tokens(500, 10), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            )
            first = await anext(long_stream)
            # the scheduler's queue and prefill times reach the caller on its first output
            assert first.scheduler_times is not None
            queue_seconds, prefill_seconds, replica = first.scheduler_times
            assert queue_seconds >= 0 and prefill_seconds > 0 and replica == ""

            async def running() -> bool:
                return engine.stats is not None and engine.stats.num_running >= 1

            await wait_for(running, "the long request to run")
            during = await scrape(port)
            assert during.value("actorline_requests_running") >= 1
            assert during.value("actorline_kv_blocks_used") >= 1
            assert (
                during.value("actorline_kv_blocks_used") + during.value("actorline_kv_blocks_free")
                == NUM_BLOCKS
            )
            await engine.abort(first.request_id)
            finals.append(await drain(long_stream))

            # 2. the same 48-token prompt twice: the second is served from the prefix cache
            shared = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            for _ in range(2):
                finals.append(await drain(engine.generate(tokens(1000, 48), shared)))

            # 3. six 60-token requests at once on 20 blocks: some are preempted
            batch = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            finals += await asyncio.gather(
                *(drain(engine.generate(tokens(2000 + 100 * i, 20), batch)) for i in range(6))
            )

            # 4. a prompt longer than the model: rejected by admission
            with pytest.raises(PromptTooLongError):
                await drain(engine.generate(tokens(3000, MAX_MODEL_LEN + 10), shared))

            async def settled() -> bool:
                stats = engine.stats
                if stats is None or stats.num_running or stats.num_waiting:
                    return False
                polled = metrics.stage_samples.get("execute")
                return polled is not None and polled.handled > before.value(
                    "actorline_stage_messages_handled_total", stage="execute"
                )

            await wait_for(settled, "the engine to drain and a statistics poll")
            after = await scrape(port)

        def grew(name: str, **labels: str) -> float:
            return after.value(name, **labels) - before.value(name, **labels)

        generated = [output for output in finals if output.token_ids]
        num_tokens = sum(len(output.token_ids) for output in finals)
        assert grew("actorline_generation_tokens_total") == num_tokens
        assert grew("actorline_prompt_tokens_total") == sum(
            output.num_prompt_tokens for output in generated
        )
        reasons = collections.Counter(str(output.finish_reason) for output in finals)
        assert sum(reasons.values()) == 9 and reasons["length"] >= 8
        for reason, count in reasons.items():
            assert grew("actorline_requests_finished_total", finish_reason=reason) == count
        assert grew("actorline_requests_rejected_total", kind="prompt_too_long") == 1
        assert grew("actorline_time_to_first_token_seconds_count") == len(generated)
        assert grew("actorline_e2e_request_latency_seconds_count") == len(finals)
        itl = grew("actorline_inter_token_latency_seconds_count")
        assert 0 < itl <= num_tokens - len(generated)
        for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
            name = f"actorline_{histogram}_seconds"
            observations = after.value(f"{name}_count")
            assert after.value(f"{name}_bucket", le="+Inf") == observations
            assert after.value(f"{name}_sum") > 0
        assert grew("actorline_prefix_cache_hits_total") >= 48 - BLOCK_SIZE
        assert grew("actorline_prefix_cache_queries_total") > 0
        assert 0 < after.value("actorline_prefix_cache_hit_rate") <= 1
        assert grew("actorline_preemptions_total") > 0
        assert after.value("actorline_requests_running") == 0
        assert after.value("actorline_requests_waiting") == 0
        for stage in STAGES:
            handled = grew("actorline_stage_messages_handled_total", stage=stage)
            assert handled > 0, stage
            assert after.value("actorline_stage_queue_depth", stage=stage) >= 0
            # per-message handling times: every message in one bucket, buckets cumulative
            name = "actorline_stage_handle_seconds"
            assert grew(f"{name}_count", stage=stage) == handled
            assert after.value(f"{name}_bucket", stage=stage, le="+Inf") == after.value(
                f"{name}_count", stage=stage
            )
            counts = [
                after.value(f"{name}_bucket", stage=stage, le=str(bound))
                for bound in HANDLE_SECONDS_BUCKETS
            ]
            assert counts == sorted(counts)
        assert grew("actorline_stage_handle_seconds_sum", stage="execute") > 0

        # vLLM's names (pipeline/engine/vllm_metrics.py) count the same requests, labelled
        # with the served model name and the one engine.
        def grew_vllm(name: str, **labels: str) -> float:
            return grew("vllm:" + name, model_name=SERVED, engine="0", **labels)

        assert grew_vllm("generation_tokens_total") == num_tokens
        assert grew_vllm("prompt_tokens_total") == grew("actorline_prompt_tokens_total")
        for reason, count in reasons.items():
            assert grew_vllm("request_success_total", finished_reason=reason) == count
        assert grew_vllm("e2e_request_latency_seconds_count") == len(finals)
        assert grew_vllm("time_to_first_token_seconds_count") == len(generated)
        assert grew_vllm("inter_token_latency_seconds_count") == itl
        for phase in ("queue", "prefill", "decode", "inference"):
            # every request here had a first token (the aborted one too)
            assert grew_vllm(f"request_{phase}_time_seconds_count") == len(generated), phase
        assert grew_vllm("request_generation_tokens_sum") == num_tokens
        # preempted requests waited again, but their queue time ends at their first schedule
        assert grew_vllm("request_queue_time_seconds_sum") >= 0
        for counter in ("preemptions_total", "prefix_cache_hits_total",
                        "prefix_cache_queries_total"):  # fmt: skip
            vllm_name = "num_" + counter if counter == "preemptions_total" else counter
            assert grew_vllm(vllm_name) == grew("actorline_" + counter), counter
        steps = grew("actorline_engine_steps_total")
        assert 0 < grew_vllm("iteration_tokens_total_count") <= steps
        assert grew_vllm("iteration_tokens_total_sum") >= num_tokens
        assert after.value(
            "vllm:kv_cache_usage_perc", model_name=SERVED, engine="0"
        ) == after.value("actorline_kv_cache_usage_ratio")

    run(body())


def test_metrics_use_their_own_registry_and_check_their_options(tiny_model_dir: Path) -> None:
    engine = AsyncEngine(str(tiny_model_dir), transport="memory")  # not started
    with pytest.raises(ValueError, match="poll_interval"):
        EngineMetrics(engine, poll_interval=0)
    first, second = EngineMetrics(engine), EngineMetrics(engine)  # no duplicate-name clash
    assert first.registry is not second.registry
    shared = CollectorRegistry()
    EngineMetrics(engine, shared)
    assert shared.get_sample_value("actorline_generation_tokens_total") == 0

    async def start_unstarted() -> None:
        with pytest.raises(PipelineClosedError):
            await EngineMetrics(engine).start()

    run(start_unstarted())


def test_serve_rejects_a_bad_metrics_port(tiny_model_dir: Path, capsys: Any) -> None:
    status = main(["serve", "--model", str(tiny_model_dir), "--metrics-port", "70000"])
    assert status == 2
    assert "--metrics-port" in capsys.readouterr().err


@pytest.mark.slow
def test_actorline_serve_metrics_port(tiny_model_dir: Path, tmp_path: Path) -> None:
    command = [
        sys.executable, "-c", "import sys; from pipeline.cli import main; sys.exit(main())",
        "serve", "--model", str(tiny_model_dir), "--port", "0", "--metrics-port", "0",
        "--num-blocks", "64",
    ]  # fmt: skip
    stderr = (tmp_path / "stderr.txt").open("w")
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        cwd=REPOSITORY,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    try:
        serving = lines.get(timeout=RUN_TIMEOUT)
        metrics_line = lines.get(timeout=30)
        assert serving.startswith("serving actorline.v1.Generation on 127.0.0.1:"), serving
        assert metrics_line.startswith("metrics on http://127.0.0.1:"), metrics_line
        url = metrics_line.removeprefix("metrics on ")
        before = fetch(url)
        assert set(EXPECTED) <= set(before.families)
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        with Client(serving.rsplit(" ", 1)[1]) as client:
            outputs = list(client.generate("Hello", params))
        assert outputs[-1].finish_reason == "length"
        after = fetch(url)
        assert after.value("actorline_generation_tokens_total") == 5
        assert after.value("actorline_requests_finished_total", finish_reason="length") == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.close()


def test_the_metrics_server_drops_idle_connections_and_bounds_them(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that connects and sends nothing is dropped after the read timeout, and
    connections beyond the cap are closed on arrival: idle clients cannot pile up threads."""
    from pipeline.engine import metrics as metrics_module

    monkeypatch.setattr(metrics_module._MetricsRequestHandler, "timeout", 3.0)
    metrics = EngineMetrics(AsyncEngine(str(tiny_model_dir), transport="memory"))
    port = metrics.start_http_server("127.0.0.1", 0)
    try:
        idle = [
            socket.create_connection(("127.0.0.1", port), timeout=30)
            for _ in range(metrics_module.METRICS_MAX_CONNECTIONS)
        ]
        extra = socket.create_connection(("127.0.0.1", port), timeout=30)
        assert extra.recv(1) == b""  # over the cap: closed at once
        extra.close()
        for connection in idle:  # each dropped by its read timeout, none answered
            assert connection.recv(1) == b""
            connection.close()
        # the slots are free again: a scrape is served
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            assert b"actorline_generation_tokens_total" in reply.read()
    finally:
        metrics.stop_http_server()
