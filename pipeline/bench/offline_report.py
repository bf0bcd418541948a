"""The offline benchmark's results and their readable report (:mod:`pipeline.bench.offline`)."""

from __future__ import annotations

import dataclasses

from pipeline.bench.profile import Profile, format_profile
from pipeline.bench.report import format_table
from pipeline.bench.roof import Roof, format_share

__all__ = [
    "SPECULATIVE_TARGET_RATIO",
    "STRUCTURED_TARGET_RATIO",
    "DefaultBudgetRun",
    "GrammarCompileTimes",
    "GreedyCheck",
    "OfflineResult",
    "SpeculativeOffline",
    "SystemResult",
    "format_offline",
]

#: structured outputs against unconstrained, in the same run (the issue's target)
STRUCTURED_TARGET_RATIO = 0.9
#: speculative decoding against none at the offline batch size (issue 38's target)
SPECULATIVE_TARGET_RATIO = 0.95


@dataclasses.dataclass(frozen=True, slots=True)
class SystemResult:
    """One system on the workload (its best run of ``runs``): generated tokens in
    ``seconds``; ``roof_share`` the roof's seconds over ``seconds`` (None without a roof)."""

    name: str
    seconds: float
    generated_tokens: int
    tokens_per_second: float
    roof_share: float | None = None
    runs: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class GreedyCheck:
    """A system's greedy outputs against HF ``generate`` run request by request.

    ``identical``: requests whose tokens are equal; ``first_mismatch`` per differing request:
    (index in the workload, first differing position).
    """

    system: str
    requests_checked: int
    identical: int
    first_mismatch: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class DefaultBudgetRun:
    """The zmq engine on the same workload with its default KV budget: ``num_blocks`` KV
    blocks, the engine process's peak and final resident memory, the scheduler's preemptions
    and the throughput (information only; the comparison uses the sized run)."""

    num_blocks: int
    peak_rss_bytes: int | None
    final_rss_bytes: int | None
    preemptions: int
    tokens_per_second: float


@dataclasses.dataclass(frozen=True, slots=True)
class OfflineResult:
    """The systems' throughputs, actorline's ratios to every other system, the roof, the
    greedy checks, the engine process's peak RSS and, with ``--profile``, where actorline's
    time went."""

    model: str
    num_requests: int
    prompt_tokens: int
    requested_tokens: int
    systems: tuple[SystemResult, ...]
    ratios: dict[str, float]
    greedy_checks: tuple[GreedyCheck, ...]
    engine_peak_rss_bytes: int | None
    engine_final_rss_bytes: int | None
    rss_target_bytes: int
    default_budget: DefaultBudgetRun | None
    profiles: dict[str, Profile]
    load_average: tuple[float, float, float]
    load_average_end: tuple[float, float, float]
    cpu_count: int
    roof: Roof | None = None
    repeats: int = 1
    peer_versions: dict[str, str] = dataclasses.field(default_factory=dict)
    quantization: str | None = None
    # the engine's model weights as loaded (EngineInfo.weight_bytes), from the zmq run
    weight_bytes: int | None = None
    grammar_compile: GrammarCompileTimes | None = None
    speculative: SpeculativeOffline | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeOffline:
    """The speculative runs (``--speculative-config``): the config, the draft tokens verified
    and accepted over all of them, and whether the best run's outputs equal the best run's
    without speculation (greedy: they must)."""

    config: str
    draft_tokens: int
    accepted_tokens: int
    identical: bool

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens; None where nothing was drafted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarCompileTimes:
    """The structured run's schema through the engine's own grammar code, in this process:
    loading the backend (wrapping the tokenizer, once per engine), the first compile (cold)
    and a second one of the same schema (cached), in milliseconds."""

    backend_load_ms: float
    cold_ms: float
    cached_ms: float


def format_offline(result: OfflineResult) -> str:
    """The readable report."""
    rows = [
        [
            system.name,
            system.generated_tokens,
            system.seconds,
            system.tokens_per_second,
            format_share(result.roof, system.seconds),
            " ".join(f"{rate:.1f}" for rate in system.runs) if len(system.runs) > 1 else "",
        ]
        for system in result.systems
    ]
    best_of = f", best of {result.repeats} runs" if result.repeats > 1 else ""
    lines = [
        format_table(
            ["system", "generated tokens", "seconds", "tokens/s", "% roof", "all runs"],
            rows,
            title=f"offline throughput: {result.model}"
            + (f" ({result.quantization} weights)" if result.quantization else "")
            + f", {result.num_requests} requests, "
            f"{result.prompt_tokens:,} prompt tokens, {result.requested_tokens:,} tokens "
            f"requested (greedy, ignore_eos{best_of}); {result.cpu_count} CPUs, load average "
            f"{result.load_average[0]:.2f} at start, {result.load_average_end[0]:.2f} at the end",
        )
    ]
    if result.roof is not None:
        roof = result.roof
        lines.append(
            f"roof: {roof.flops / 1e12:.3f} TFLOP of linears in {roof.seconds:.2f} s at this "
            f"machine's best GEMM rate per shape ({roof.mkl_seconds:.2f} s at MKL's); "
            "`actorline bench roof` shows the rates"
        )
        if roof.step_seconds is not None:
            shares = ", ".join(
                f"{system.name} {100.0 * roof.step_seconds / system.seconds:.0f}%"
                for system in result.systems
                if system.seconds > 0
            )
            lines.append(
                f"step bound: {roof.step_seconds:.2f} s (each decode step at the longer of its "
                f"FLOPs and its bytes at {roof.bandwidth_gbs:.1f} GB/s); share of it: {shares}"
            )
    for name, version in result.peer_versions.items():
        lines.append(f"{name}: {version}")
    for name, ratio in result.ratios.items():
        target = f" (target >= {STRUCTURED_TARGET_RATIO}x)" if name.startswith("structured") else ""
        if name.startswith("speculative"):
            target = f" (target >= {SPECULATIVE_TARGET_RATIO}x)"
        lines.append(f"ratio {name}: {ratio:.2f}x{target}")
    spec = result.speculative
    if spec is not None:
        rate = spec.acceptance_rate
        lines.append(
            f"speculative {spec.config}: {spec.draft_tokens} draft tokens verified, "
            f"{spec.accepted_tokens} accepted (acceptance rate "
            + (f"{rate:.2f})" if rate is not None else "-: nothing drafted)")
            + ("; outputs identical to without" if spec.identical else "; outputs DIFFER")
        )
    if result.grammar_compile is not None:
        times = result.grammar_compile
        lines.append(
            f"grammar compile (order schema, llguidance): cold {times.cold_ms:.1f} ms, cached "
            f"{times.cached_ms:.3f} ms; backend load (tokenizer wrap, once) "
            f"{times.backend_load_ms:.0f} ms"
        )
    if result.weight_bytes:
        lines.append(f"engine model weights: {result.weight_bytes / 1e6:.1f} MB")
    for check in result.greedy_checks:
        detail = ", ".join(
            f"request {index} differs from token {position}"
            for index, position in check.first_mismatch
        )
        lines.append(
            f"greedy check {check.system} vs HF generate (one by one): {check.identical}/"
            f"{check.requests_checked} requests identical" + (f" ({detail})" if detail else "")
        )
    if result.engine_peak_rss_bytes is not None:
        verdict = "within" if result.engine_peak_rss_bytes <= result.rss_target_bytes else "OVER"
        lines.append(
            f"engine process peak RSS (zmq topology): "
            f"{result.engine_peak_rss_bytes / 1e9:.2f} GB, {verdict} the "
            f"{result.rss_target_bytes / 1e9:.1f} GB target"
            + (
                f" (resident at the end: {result.engine_final_rss_bytes / 1e9:.2f} GB)"
                if result.engine_final_rss_bytes is not None
                else ""
            )
        )
    default = result.default_budget
    if default is not None and default.peak_rss_bytes is not None:
        verdict = "within" if default.peak_rss_bytes <= result.rss_target_bytes else "OVER"
        lines.append(
            f"engine process peak RSS with the default KV budget ({default.num_blocks} blocks, "
            f"zmq): {default.peak_rss_bytes / 1e9:.2f} GB, {verdict} the "
            f"{result.rss_target_bytes / 1e9:.1f} GB target"
            + (
                f" (resident at the end: {default.final_rss_bytes / 1e9:.2f} GB)"
                if default.final_rss_bytes is not None
                else ""
            )
            + f"; {default.preemptions} preemptions, {default.tokens_per_second:.1f} tokens/s"
        )
    for name, profile in result.profiles.items():
        lines += ["", format_profile(profile, title=name)]
    return "\n".join(lines)
