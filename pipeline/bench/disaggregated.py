"""Disaggregated prefill and decode against data parallelism on the same cores: ``actorline
bench online --prefill-decode P:D`` (docs/parallelism.md, "Disaggregated prefill and decode").

Both variants run P + D engine processes: ``data_parallel_size=P+D`` (every engine prefills
and decodes) and ``prefill_decode=(P, D)``. Each serves the same mixed stream, Poisson
arrivals of requests that are either **short** (a prompt of ``short_prompt`` tokens,
``short_max_tokens`` to generate: a chat turn) or **long** (a prompt of ``long_prompt``
tokens, ``long_max_tokens`` to generate: a document to summarize), one long in
``long_every``; prompts are random token ids from a fixed seed (no two share a prefix, so no
prefix cache hides a prefill). With data parallelism a long prefill lands on an engine whose
short streams then wait for it; with P/D the prefills run on the prefill engine and the decode
engine only computes each prompt's tail. Reported per variant: the short streams' inter-token
latency p50/p99 (the figure P/D is for), TTFT p50/p99 of short and long requests, output
tokens/s, with P/D the KV transfers: requests, blocks and bytes moved per request, and
requests run whole (fallbacks), and for both the bytes the frontend's process received over
its links (the blocks go straight from the prefill to the decode engine, so with P/D this is
the engines' outputs, as with data parallelism, and no K/V). The variants alternate (fresh
engines each round, ``rounds`` times) and each request's greedy tokens are compared across
them.

With ``ray`` (``--ray ADDRESS``) both variants' engines are Ray actors on that cluster
(``ray_num_cpus`` each), the P/D variant's pinned by ``ray_prefill_decode_resources``: the
prefill engines on one node and the decode engines on another where the cluster has them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.bench.report import format_table
from pipeline.bench.workload import percentile, poisson_arrivals
from pipeline.runtime.spec import MAIN_HOST
from transports.tasks import TaskSet

if TYPE_CHECKING:
    from pipeline.engine.async_engine import AsyncEngine

__all__ = [
    "DisaggregatedConfig",
    "DisaggregatedResult",
    "VariantRun",
    "format_disaggregated",
    "measure_disaggregated",
    "run_disaggregated",
]

_MILLI = 1000.0
#: token ids the random prompts draw from (ordinary words of SmolLM2's vocabulary)
_TOKEN_RANGE = (1000, 20000)


@dataclasses.dataclass(frozen=True, slots=True)
class DisaggregatedConfig:
    """See the module docstring.

    Raises:
        ValueError: a count or size below 1, a rate that is not positive.
    """

    model: str = "smollm2-135m"
    prefill_decode: tuple[int, int] = (1, 1)
    rate: float = 1.0
    num_requests: int = 24
    short_prompt: int = 32
    short_max_tokens: int = 64
    long_prompt: int = 1024
    long_max_tokens: int = 8
    long_every: int = 3
    rounds: int = 2
    transport: str = "zmq"
    seed: int = 0
    #: the Ray cluster's address ("": RAY_ADDRESS, else a new local one; None: not on Ray)
    ray: str | None = None
    ray_auth_token_file: str | None = None
    ray_num_cpus: float = 1.0
    #: the P/D variant's "PREFILL,DECODE" resources (EngineOptions.ray_prefill_decode_resources)
    ray_prefill_decode_resources: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_requests", "short_prompt", "short_max_tokens", "long_prompt",
                     "long_max_tokens", "long_every", "rounds"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.rate > 0:
            raise ValueError(f"rate must be positive requests/s, got {self.rate!r}")

    @classmethod
    def quick(cls, **overrides: object) -> DisaggregatedConfig:
        """A small configuration for smoke tests: 6 requests, prompts of 24 and 160 tokens."""
        values: dict[str, object] = {
            "rate": 4.0,
            "num_requests": 6,
            "short_prompt": 24,
            "short_max_tokens": 16,
            "long_prompt": 160,
            "long_max_tokens": 4,
            "rounds": 1,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class VariantRun:
    """One variant's run (milliseconds): ``variant`` is ``"DP=N"`` or ``"P/D=P:D"``."""

    variant: str
    round: int
    seconds: float
    output_tokens: int
    tokens_per_second: float
    short_itl_p50_ms: float
    short_itl_p99_ms: float
    short_ttft_p50_ms: float
    short_ttft_p99_ms: float
    long_ttft_p50_ms: float
    transfers: int = 0
    blocks_per_transfer: float = 0.0
    bytes_per_transfer: float = 0.0
    fallbacks: int = 0
    #: the bytes the frontend's process (router, detokenizer) received over its links in
    #: the run: the engines' outputs, and with P/D no K/V (the blocks skip it: one hop)
    frontend_bytes_in: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class DisaggregatedResult:
    """Every run, and how many requests gave the same greedy tokens in every run."""

    config: DisaggregatedConfig
    runs: tuple[VariantRun, ...]
    identical: int
    requests: int
    load_average: tuple[float, float, float]


@dataclasses.dataclass(frozen=True, slots=True)
class _Request:
    prompt: tuple[int, ...]
    max_tokens: int
    long: bool


@dataclasses.dataclass(slots=True)
class _Trace:
    sent: float
    token_times: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    token_ids: tuple[int, ...] = ()


def workload(config: DisaggregatedConfig) -> list[_Request]:
    """The mixed requests (one long in ``long_every``, the first long third), from the seed."""
    generator = random.Random(config.seed)
    requests = []
    for index in range(config.num_requests):
        long = index % config.long_every == config.long_every // 2
        length = config.long_prompt if long else config.short_prompt
        prompt = tuple(generator.randrange(*_TOKEN_RANGE) for _ in range(length))
        max_tokens = config.long_max_tokens if long else config.short_max_tokens
        requests.append(_Request(prompt, max_tokens, long))
    return requests


async def _stream(engine: AsyncEngine, request: _Request, trace: _Trace) -> None:
    from stages.params import SamplingParams

    params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
    received = 0
    last: Any = None
    async for output in engine.generate({"prompt_token_ids": list(request.prompt)}, params):
        count = len(output.token_ids) - received
        if count > 0:
            trace.token_times.append((time.perf_counter(), count))
            received += count
        last = output
    trace.token_ids = tuple(last.token_ids) if last is not None else ()


async def _run_variant(
    config: DisaggregatedConfig, disaggregated: bool, round_index: int, requests: list[_Request]
) -> tuple[VariantRun, list[tuple[int, ...]]]:
    from pipeline.engine.async_engine import AsyncEngine
    from stages.disaggregate import PrefillDecodeRouterStage

    prefill, decode = config.prefill_decode
    options: dict[str, Any] = (
        {"prefill_decode": config.prefill_decode}
        if disaggregated
        else {"data_parallel_size": prefill + decode}
    )
    if config.ray is not None:
        options.update(ray=True, ray_num_cpus=config.ray_num_cpus,
                       ray_auth_token_file=config.ray_auth_token_file)  # fmt: skip
        if config.ray:
            options["ray_address"] = config.ray
        if disaggregated:
            options["ray_prefill_decode_resources"] = config.ray_prefill_decode_resources
    variant = f"P/D={prefill}:{decode}" if disaggregated else f"DP={prefill + decode}"
    arrivals = poisson_arrivals(config.rate, len(requests), config.seed)
    async with AsyncEngine(config.model, transport=config.transport, **options) as engine:
        # warm every engine up: one short request per engine, at once
        warm = _Request(requests[0].prompt[:8], 2, False)
        await asyncio.gather(*(_stream(engine, warm, _Trace(0.0)) for _ in range(prefill + decode)))
        router = engine.running.stage("router")
        before = (0, 0, 0, 0)
        if isinstance(router, PrefillDecodeRouterStage):
            before = (router.transfers, router.blocks_moved, router.bytes_moved, router.fallbacks)
        frontend_before = await _frontend_bytes_in(engine)
        traces = [_Trace(0.0) for _ in requests]
        began = time.perf_counter()
        async with TaskSet("bench:disaggregated") as streams:
            tasks = []
            for request, arrival, trace in zip(requests, arrivals, traces):
                delay = began + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                trace.sent = time.perf_counter()
                tasks.append(streams.spawn(_stream(engine, request, trace)))
            await asyncio.gather(*tasks)
        seconds = time.perf_counter() - began
        frontend_in = await _frontend_bytes_in(engine) - frontend_before
        after = before
        if isinstance(router, PrefillDecodeRouterStage):
            after = (router.transfers, router.blocks_moved, router.bytes_moved, router.fallbacks)
    transfers, blocks, nbytes, fallbacks = (a - b for a, b in zip(after, before))
    short_itls: list[float] = []
    short_ttfts: list[float] = []
    long_ttfts: list[float] = []
    for request, trace in zip(requests, traces):
        if not trace.token_times:
            continue
        ttft = trace.token_times[0][0] - trace.sent
        (long_ttfts if request.long else short_ttfts).append(ttft)
        if not request.long:
            pairs = zip(trace.token_times, trace.token_times[1:])
            for (previous, _), (current, count) in pairs:
                short_itls.extend([(current - previous) / count] * count)
    tokens = sum(count for trace in traces for _, count in trace.token_times)
    run = VariantRun(
        variant=variant,
        round=round_index,
        seconds=seconds,
        output_tokens=tokens,
        tokens_per_second=tokens / seconds,
        short_itl_p50_ms=percentile(short_itls, 50) * _MILLI,
        short_itl_p99_ms=percentile(short_itls, 99) * _MILLI,
        short_ttft_p50_ms=percentile(short_ttfts, 50) * _MILLI,
        short_ttft_p99_ms=percentile(short_ttfts, 99) * _MILLI,
        long_ttft_p50_ms=percentile(long_ttfts, 50) * _MILLI,
        transfers=transfers,
        blocks_per_transfer=blocks / transfers if transfers else 0.0,
        bytes_per_transfer=nbytes / transfers if transfers else 0.0,
        fallbacks=fallbacks,
        frontend_bytes_in=frontend_in,
    )
    return run, [trace.token_ids for trace in traces]


async def _frontend_bytes_in(engine: Any) -> int:
    """The bytes the engine's frontend host (``main``) has received over its links."""
    return sum(
        link.bytes_received
        for host in await engine.running.statistics()
        if host.host == MAIN_HOST
        for link in host.links_in.values()
    )


async def measure_disaggregated(config: DisaggregatedConfig) -> DisaggregatedResult:
    """Run the comparison on the running event loop (see the module docstring)."""
    requests = workload(config)
    load_average = os.getloadavg()
    runs: list[VariantRun] = []
    outputs: list[list[tuple[int, ...]]] = []
    for round_index in range(config.rounds):
        for disaggregated in (False, True):
            run, tokens = await _run_variant(config, disaggregated, round_index, requests)
            runs.append(run)
            outputs.append(tokens)
    identical = sum(
        1 for index in range(len(requests)) if len({each[index] for each in outputs}) == 1
    )
    return DisaggregatedResult(config, tuple(runs), identical, len(requests), load_average)


def run_disaggregated(config: DisaggregatedConfig) -> DisaggregatedResult:
    """Run the comparison in a fresh event loop."""
    return asyncio.run(measure_disaggregated(config))


def format_disaggregated(result: DisaggregatedResult) -> str:
    """The readable report."""
    config = result.config
    rows = [
        [
            run.variant,
            run.round + 1,
            run.short_itl_p50_ms,
            run.short_itl_p99_ms,
            run.short_ttft_p50_ms,
            run.short_ttft_p99_ms,
            run.long_ttft_p50_ms,
            run.tokens_per_second,
            run.transfers,
            run.blocks_per_transfer,
            run.bytes_per_transfer / 1024,
            run.fallbacks,
            run.frontend_bytes_in / 2**20,
        ]
        for run in result.runs
    ]
    columns: Sequence[str] = (
        "variant", "round", "short ITL p50 ms", "short ITL p99 ms", "short TTFT p50 ms",
        "short TTFT p99 ms", "long TTFT p50 ms", "tokens/s", "transfers", "blocks/transfer",
        "KiB/transfer", "run whole", "MiB into frontend",
    )  # fmt: skip
    title = (
        f"prefill/decode vs data parallelism: {config.model}, {config.num_requests} requests "
        f"at {config.rate:g} req/s (1 in {config.long_every} long: {config.long_prompt}-token "
        f"prompt, {config.long_max_tokens} tokens; else {config.short_prompt}-token prompt, "
        f"{config.short_max_tokens} tokens), greedy"
    )
    load = ", ".join(f"{value:.2f}" for value in result.load_average)
    return "\n".join(
        [
            format_table(list(columns), rows, title=title),
            f"greedy tokens identical in every run: {result.identical}/{result.requests}; "
            f"load average at start {load}",
        ]
    )
