"""Single-stream latency and small-batch throughput: ``actorline serve --http-port`` against
llama.cpp's ``llama-server`` (:mod:`pipeline.bench.llamacpp_peer`: built on first use) over
their OpenAI-style HTTP APIs, on the same weights, in each format (:data:`FORMATS`: fp32,
bf16, the default model's own Q4_1 GGUF).

Each round runs, per format, each server in its own fresh process, one at a time (the order
alternates between rounds), with the same number of slots (the largest stream count) and the
same context per slot. Each server gets one short warm-up request, then the workloads: one
stream of ``--tokens`` tokens (256), then ``--streams`` concurrent streams (4 and 16) of
``--concurrent-tokens`` tokens (128) each. Every request is the offline benchmark's kind of
prompt (:mod:`pipeline.bench.workload`; chat template applied, sent as token ids; a different
prompt per stream, the same ones for both servers), greedy (``temperature`` 0) with
``ignore_eos``, streamed from ``/v1/completions`` by
:func:`~pipeline.bench.http_load.stream_completion`. Measured from the client:

- one stream: tokens/s after the first token (the tokens after the first over the time from
  the first text event to the last) and TTFT (send to first text event);
- N streams: aggregate tokens/s (every stream's tokens over the time from the first send to
  the last stream's end) and the median TTFT.

Each figure keeps its best round; the ratio actorline / llama.cpp is printed per format and
workload (the targets of issue 36: >= 1.0x at one stream, >= 1.5x at 4 and 16), and each
system's one stream as a share of the **step bound**: the tokens/s of a stream that reads every
weight once a step (:func:`~pipeline.bench.roof.step_weight_bytes`: the format's bytes) at the
memory read rate :func:`~pipeline.bench.roof.measure_bandwidth` measures before and after the
rounds (the better of the two; the target: at least 90%). llama.cpp runs
with ``--llamacpp-threads`` threads (every core by default), actorline with its own default
(torch's, every core).

With ``--speculative-config JSON`` actorline also runs with speculative decoding
(``actorline+spec``, a fresh server alternated with the plain one in every round), and the
report adds its ratio over actorline without it and its acceptance rate (drafted and accepted
tokens from the server's ``/metrics``). ``--prompts copy`` makes every prompt ask for a text
to be rewritten (the text itself in the prompt, :data:`COPY_TEXTS` of the workload's texts
long so that the rewrite covers the tokens measured: copy-heavy work, where the n-gram
proposer's drafts are accepted) instead of the ordinary chat prompts (docs/speculative.md).
Where the peer runs, llama.cpp runs with its own speculative decoding too
(``llama.cpp+spec``: the same n-gram config as its ``--spec-type ngram-simple``, a draft
model's GGUF file as its ``draft-simple`` without repacking, see
:func:`~pipeline.bench.llamacpp_peer.speculative_arguments`), and the report adds its ratio
over llama.cpp without it, actorline+spec's over it, and its acceptance rate (its
``timings``' ``draft_n`` and ``draft_n_accepted``).

    actorline bench latency [--peer llamacpp|none] [--formats fp32 bf16 q4_1] [--rounds N]
        [--tokens 256] [--streams 4 16] [--llamacpp-threads N] [--quick] [--json]
        [--speculative-config JSON] [--prompts chat|copy]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.bench.http_load import StreamTrace, stream_completion
from pipeline.bench.llamacpp_peer import (
    FORMATS,
    LLAMACPP_VERSION,
    LlamaFormat,
    parse_timings,
    speculative_arguments,
    speculative_repack,
)
from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main

__all__ = [
    "ACTORLINE",
    "ACTORLINE_SPEC",
    "COPY_TEXTS",
    "LLAMACPP",
    "LLAMACPP_SPEC",
    "PEERS",
    "LatencyConfig",
    "LatencyResult",
    "WorkloadRun",
    "actorline_command",
    "add_arguments",
    "copy_prompt",
    "copy_prompts",
    "format_latency",
    "main",
    "measure_streams",
    "peer_speculative_options",
    "ratios",
    "run_from_args",
    "run_latency",
    "speculative_ratios",
    "summarize",
]

ACTORLINE = "actorline"
ACTORLINE_SPEC = "actorline+spec"
PROMPT_KINDS = ("chat", "copy")
#: the workload's texts (~100 tokens each) one copy prompt's text joins: its rewrite then runs
#: past the one stream's 256 tokens (of one text, the rewrite ended after ~110 of them and the
#: rest, past the end of text, ignore_eos, was a new made-up conversation: no copy work)
COPY_TEXTS = 3
LLAMACPP = "llama.cpp"
LLAMACPP_SPEC = "llama.cpp+spec"
PEERS = ("llamacpp",)
SERVED_NAME = "bench-model"
_WARMUP_TOKENS = 8
_HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True, slots=True)
class LatencyConfig:
    """The run: which formats, how many rounds, the single stream's tokens, the concurrent
    stream counts and their tokens, llama.cpp's threads (None: every core) and the context
    each slot holds.

    Raises:
        ValueError: an unknown format or peer, or a count that is not positive.
    """

    model: str = "smollm2-135m"
    formats: tuple[str, ...] = ("fp32", "bf16", "q4_1")
    peers: tuple[str, ...] = PEERS
    rounds: int = 2
    tokens: int = 256
    streams: tuple[int, ...] = (4, 16)
    concurrent_tokens: int = 128
    llamacpp_threads: int | None = None
    context_per_slot: int = 1024
    seed: int = 0
    speculative_config: str | None = None
    prompts: str = "chat"

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_KINDS:
            raise ValueError(f"prompts must be one of {PROMPT_KINDS}, got {self.prompts!r}")
        if self.speculative_config is not None and "llamacpp" in self.peers:
            speculative_arguments(self.speculative_config)  # refuses what llama.cpp lacks
        elif self.speculative_config is not None:
            from stages.speculative import parse_speculative_config

            parse_speculative_config(self.speculative_config)
        unknown = [name for name in self.formats if name not in FORMATS]
        if unknown or not self.formats:
            raise ValueError(f"formats must be among {list(FORMATS)}, got {list(self.formats)}")
        if any(peer not in PEERS for peer in self.peers):
            raise ValueError(f"peers must be among {list(PEERS)}, got {list(self.peers)}")
        counts = (self.rounds, self.tokens, self.concurrent_tokens, self.context_per_slot)
        if min(counts) < 1 or any(count < 1 for count in self.streams):
            raise ValueError("rounds, tokens, streams and context_per_slot must be >= 1")
        if self.llamacpp_threads is not None and self.llamacpp_threads < 1:
            raise ValueError(f"llamacpp_threads must be >= 1, got {self.llamacpp_threads}")

    @property
    def slots(self) -> int:
        """The parallel sequences each server is sized for."""
        return max((1, *self.streams))

    @property
    def threads(self) -> int:
        """llama.cpp's threads."""
        return self.llamacpp_threads or os.cpu_count() or 1

    @classmethod
    def quick(cls, **overrides: Any) -> LatencyConfig:
        """A smoke-test run: fp32, one round, 32 tokens, 4 streams of 16."""
        values: dict[str, Any] = {
            "formats": ("fp32",),
            "rounds": 1,
            "tokens": 32,
            "streams": (4,),
            "concurrent_tokens": 16,
        }
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadRun:
    """One system on one workload in one format: ``streams`` requests at once, ``tokens``
    generated in ``seconds`` (first send to last end), the aggregate ``tokens_per_second``,
    the mean per-stream ``decode_tokens_per_second`` after the first token, the median
    ``ttft_ms``, and the server's own decode rate where it reports one (llama.cpp's
    ``timings``, mean over streams) with its speculative draft and accepted tokens (summed
    over streams; 0 where it did not draft)."""

    system: str
    format: str
    streams: int
    tokens: int
    seconds: float
    tokens_per_second: float
    decode_tokens_per_second: float
    ttft_ms: float
    server_tokens_per_second: float | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def headline(self) -> float:
        """The figure compared: tokens/s after the first token at one stream, aggregate
        tokens/s at several."""
        return self.decode_tokens_per_second if self.streams == 1 else self.tokens_per_second


@dataclasses.dataclass(frozen=True, slots=True)
class LatencyResult:
    """The best run per (format, streams, system), every round's headline figures, the
    ratios actorline / llama.cpp (``"<format> @ <streams>"``) and the conditions."""

    model: str
    best: tuple[WorkloadRun, ...]
    rounds: dict[str, list[float]]
    ratios: dict[str, float]
    llamacpp_version: str
    llamacpp_threads: int
    load_average: tuple[float, float, float]
    load_average_end: tuple[float, float, float]
    cpu_count: int
    #: actorline+spec over actorline per "<format> @ <streams>", and its acceptance rate
    speculative_ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    acceptance_rate: float | None = None
    #: llama.cpp+spec over llama.cpp, actorline+spec over llama.cpp+spec (per "<format> @
    #: <streams>"), and llama.cpp's own acceptance rate (its timings, every round)
    peer_speculative_ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    spec_vs_peer_ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    peer_acceptance_rate: float | None = None
    #: llama.cpp+spec's llama-server options beyond llama.cpp's (see peer_speculative_options)
    peer_speculative_options: tuple[str, ...] = ()
    #: the memory read rate (GB/s, the best of before and after the rounds) and the bytes of
    #: weights a decode step reads per format: the one-stream step bound (step_bounds)
    bandwidth_gbs: float | None = None
    step_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    def step_bounds(self) -> dict[str, float]:
        """Per format, the tokens/s of one stream that reads every weight once a step at the
        measured read rate (keys and values, under 2% of a step's bytes here, left out: the
        bound is the higher for it)."""
        if not self.bandwidth_gbs:
            return {}
        rate = self.bandwidth_gbs * 1e9
        return {name: rate / size for name, size in self.step_bytes.items() if size > 0}


def summarize(system: str, fmt: str, traces: Sequence[StreamTrace]) -> WorkloadRun:
    """One workload's figures out of its streams' traces (see the module docstring).

    Raises:
        ValueError: no traces, or a stream without any text event.
        pipeline.bench.llamacpp_peer.LlamaPeerError: malformed server timings.
    """
    if not traces:
        raise ValueError("no streams to summarize")
    if any(not trace.token_times for trace in traces):
        raise ValueError(f"{system} ({fmt}): a stream ended without any text")
    counts = [trace.usage_tokens or len(trace.token_times) for trace in traces]
    began = min(trace.sent for trace in traces)
    seconds = max(trace.finished for trace in traces) - began
    rates = []
    for trace, count in zip(traces, counts):
        span = trace.token_times[-1] - trace.token_times[0]
        rates.append((count - 1) / span if span > 0 and count > 1 else 0.0)
    parsed = [
        timings
        for timings in (parse_timings({"timings": t.timings}) for t in traces if t.timings)
        if timings is not None
    ]
    server = [timings.predicted_per_second for timings in parsed]
    return WorkloadRun(
        system=system,
        format=fmt,
        streams=len(traces),
        tokens=sum(counts),
        seconds=seconds,
        tokens_per_second=sum(counts) / seconds if seconds > 0 else 0.0,
        decode_tokens_per_second=statistics.fmean(rates),
        ttft_ms=1000.0 * statistics.median(t.token_times[0] - t.sent for t in traces),
        server_tokens_per_second=statistics.fmean(server) if server else None,
        draft_tokens=sum(timings.draft_tokens for timings in parsed),
        accepted_tokens=sum(timings.accepted_tokens for timings in parsed),
    )


def _payload(prompt: Sequence[int], max_tokens: int) -> dict[str, object]:
    return {
        "model": SERVED_NAME,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


async def measure_streams(
    port: int, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[StreamTrace]:
    """Stream one request per prompt from ``127.0.0.1:port``, all at once; their traces."""
    return list(
        await asyncio.gather(
            *(stream_completion(_HOST, port, _payload(p, max_tokens)) for p in prompts)
        )
    )


def actorline_command(model: str, fmt: LlamaFormat, config: LatencyConfig) -> list[str]:
    """``actorline serve`` on a free HTTP port in ``fmt``, sized like the peer."""
    return [
        sys.executable, "-m", "pipeline.cli", "serve", "--model", model, "--http-port", "0",
        "--served-model-name", SERVED_NAME, "--max-num-seqs", str(config.slots),
        "--max-model-len", str(config.context_per_slot), *fmt.actorline_arguments(),
    ]  # fmt: skip


def _workloads(
    config: LatencyConfig, prompts: list[list[int]]
) -> list[tuple[list[list[int]], int]]:
    """(prompts, max_tokens) per workload: one stream, then each stream count; a different
    prompt for every stream of a server's life."""
    plan = [(prompts[1:2], config.tokens)]
    start = 2
    for count in config.streams:
        plan.append((prompts[start : start + count], config.concurrent_tokens))
        start += count
    return plan


def _run_server(
    system: str,
    fmt: LlamaFormat,
    command: list[str],
    port: int | None,
    config: LatencyConfig,
    prompts: list[list[int]],
) -> list[WorkloadRun]:
    from pipeline.bench.servers import serve_process

    async def measure(bound: int) -> list[WorkloadRun]:
        await measure_streams(bound, prompts[:1], _WARMUP_TOKENS)
        runs = []
        for batch, limit in _workloads(config, prompts):
            run = summarize(system, fmt.name, await measure_streams(bound, batch, limit))
            print(
                f"latency: {system} {fmt.name} @ {run.streams}: {run.headline:.1f} tokens/s, "
                f"TTFT {run.ttft_ms:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
            runs.append(run)
        return runs

    with serve_process(command, None, port) as bound:
        runs = asyncio.run(measure(bound))
        if system == ACTORLINE_SPEC:
            _ACCEPTANCE.append(_spec_counters(bound))
        return runs


#: (drafted, accepted) tokens of each speculative server's life, read before it stops
_ACCEPTANCE: list[tuple[float, float]] = []


def _spec_counters(port: int) -> tuple[float, float]:
    """The drafted and accepted tokens the server on ``port`` counted (its ``/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{_HOST}:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {"drafted": 0.0, "accepted": 0.0}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("actorline_spec_decode_num_draft_tokens_total"):
            values["drafted"] += float(value.split()[0])
        elif name.startswith("actorline_spec_decode_num_accepted_tokens_total"):
            values["accepted"] += float(value.split()[0])
    return values["drafted"], values["accepted"]


def copy_prompt(text: str) -> str:
    """A copy-heavy prompt: rewrite ``text`` (given in full) in other words, keeping it."""
    return (
        "Rewrite the following paragraph, keeping its sentences and wording where you can, "
        f"and fixing only its punctuation:\n\n{text}\n\n{text}"
    )


def copy_prompts(texts: Sequence[str]) -> list[str]:
    """One copy-heavy prompt per text: each rewrites its text and the :data:`COPY_TEXTS` - 1
    after it (wrapping around), joined as one paragraph."""
    count = len(texts)
    joined = (" ".join(texts[(i + j) % count] for j in range(COPY_TEXTS)) for i in range(count))
    return [copy_prompt(text) for text in joined]


def ratios(best: Sequence[WorkloadRun]) -> dict[str, float]:
    """actorline's headline over llama.cpp's per format and stream count."""
    ours = {(r.format, r.streams): r for r in best if r.system == ACTORLINE}
    theirs = {(r.format, r.streams): r for r in best if r.system == LLAMACPP}
    return {
        f"{fmt} @ {streams}": ours[(fmt, streams)].headline / run.headline
        for (fmt, streams), run in theirs.items()
        if (fmt, streams) in ours and run.headline > 0
    }


def speculative_ratios(
    best: Sequence[WorkloadRun], system: str = ACTORLINE_SPEC, over: str = ACTORLINE
) -> dict[str, float]:
    """``system``'s headline over ``over``'s per format and stream count (by default
    actorline+spec over actorline)."""
    plain = {(r.format, r.streams): r for r in best if r.system == over}
    return {
        f"{r.format} @ {r.streams}": r.headline / plain[(r.format, r.streams)].headline
        for r in best
        if r.system == system
        and (r.format, r.streams) in plain
        and plain[(r.format, r.streams)].headline > 0
    }


def run_latency(config: LatencyConfig) -> LatencyResult:
    """Every round, format and server in turn (see the module docstring).

    Raises:
        pipeline.bench.llamacpp_peer.LlamaPeerError: llama.cpp could not be built or
            converted to.
        RuntimeError: a server did not start.
    """
    from pipeline.bench import llamacpp_peer
    from pipeline.bench.roof import measure_bandwidth, step_weight_bytes
    from pipeline.bench.servers import free_port
    from pipeline.bench.workload import WorkloadSpec, make_workload, prompt_ids
    from stages.models import resolve_model
    from stages.tokenize import load_tokenizer

    resolved = resolve_model(config.model)
    tokenizer = load_tokenizer(config.model)
    count = 2 + sum(config.streams)
    workload = make_workload(WorkloadSpec(num_requests=count, seed=config.seed))
    texts = [request.prompt for request in workload]
    if config.prompts == "copy":
        texts = copy_prompts(texts)
    prompts = [prompt_ids(tokenizer, text) for text in texts]
    _ACCEPTANCE.clear()
    binary: Path | None = None
    ggufs: dict[str, Path] = {}
    if "llamacpp" in config.peers:
        binary = llamacpp_peer.ensure_llama_server()
        for name in config.formats:
            ggufs[name] = llamacpp_peer.ensure_gguf(FORMATS[name], resolved.path, resolved.gguf)
    step_bytes = {
        name: step_weight_bytes(resolved.path, name, resolved.gguf) for name in config.formats
    }
    bandwidth = measure_bandwidth()
    load_average = os.getloadavg()
    best: dict[tuple[str, int, str], WorkloadRun] = {}
    rounds: dict[str, list[float]] = {}
    peer_drafts = [0, 0]  # llama.cpp+spec's draft and accepted tokens, every round
    for index in range(config.rounds):
        for name in config.formats:
            fmt = FORMATS[name]
            systems: list[tuple[str, list[str], int | None]] = [
                (ACTORLINE, actorline_command(config.model, fmt, config), None)
            ]
            if config.speculative_config is not None:
                spec = ["--speculative-config", config.speculative_config]
                command = actorline_command(config.model, fmt, config) + spec
                systems.append((ACTORLINE_SPEC, command, None))
            if binary is not None:
                peer_systems: list[tuple[str, str | None]] = [(LLAMACPP, None)]
                if config.speculative_config is not None:
                    peer_systems.append((LLAMACPP_SPEC, config.speculative_config))
                for system, speculative in peer_systems:
                    port = free_port()
                    command = llamacpp_peer.server_command(
                        binary,
                        ggufs[name],
                        port,
                        threads=config.threads,
                        slots=config.slots,
                        context_per_slot=config.context_per_slot,
                        repack=fmt.repack,
                        speculative=speculative,
                    )
                    systems.append((system, command, port))
            if index % 2:
                systems.reverse()
            for system, command, known_port in systems:
                for run in _run_server(system, fmt, command, known_port, config, prompts):
                    peer_drafts[0] += run.draft_tokens
                    peer_drafts[1] += run.accepted_tokens
                    key = (run.format, run.streams, run.system)
                    rounds.setdefault(f"{key[0]} @ {key[1]} {key[2]}", []).append(run.headline)
                    if key not in best or run.headline > best[key].headline:
                        best[key] = run
    ordered = tuple(best[key] for key in sorted(best, key=_order(config)))
    load_average_end = os.getloadavg()
    bandwidth = max(bandwidth, measure_bandwidth())
    return LatencyResult(
        model=config.model,
        best=ordered,
        rounds=rounds,
        ratios=ratios(ordered),
        llamacpp_version=LLAMACPP_VERSION,
        llamacpp_threads=config.threads,
        load_average=load_average,
        load_average_end=load_average_end,
        cpu_count=os.cpu_count() or 0,
        speculative_ratios=speculative_ratios(ordered),
        acceptance_rate=_acceptance_rate(),
        peer_speculative_ratios=speculative_ratios(ordered, LLAMACPP_SPEC, LLAMACPP),
        spec_vs_peer_ratios=speculative_ratios(ordered, ACTORLINE_SPEC, LLAMACPP_SPEC),
        peer_acceptance_rate=peer_drafts[1] / peer_drafts[0] if peer_drafts[0] else None,
        peer_speculative_options=peer_speculative_options(config),
        bandwidth_gbs=bandwidth,
        step_bytes=step_bytes,
    )


def peer_speculative_options(config: LatencyConfig) -> tuple[str, ...]:
    """The options llama.cpp+spec's ``llama-server`` runs with beyond its speculation-less
    twin's (empty without a speculative config or the peer): the speculative ones, and
    ``--no-repack`` where a draft model turns repacking off for a format that allows it
    (:func:`~pipeline.bench.llamacpp_peer.speculative_repack`).

    Raises:
        ValueError: the speculative config is not valid.
        pipeline.bench.llamacpp_peer.LlamaPeerError: llama.cpp has no counterpart for it.
    """
    if config.speculative_config is None or "llamacpp" not in config.peers:
        return ()
    options = speculative_arguments(config.speculative_config)
    repacks = any(FORMATS[name].repack for name in config.formats)
    if repacks and not speculative_repack(config.speculative_config):
        options = ["--no-repack", *options]
    return tuple(options)


def _acceptance_rate() -> float | None:
    drafted = sum(d for d, _ in _ACCEPTANCE)
    accepted = sum(a for _, a in _ACCEPTANCE)
    return accepted / drafted if drafted else None


def _order(config: LatencyConfig) -> Any:
    systems = (ACTORLINE, ACTORLINE_SPEC, LLAMACPP, LLAMACPP_SPEC)
    return lambda key: (config.formats.index(key[0]), key[1], systems.index(key[2]))


def format_latency(result: LatencyResult) -> str:
    """The readable report: one row per format, stream count and system, then the ratios."""
    rows = []
    for run in result.best:
        key = f"{run.format} @ {run.streams} {run.system}"
        rows.append(
            [
                run.format,
                run.streams,
                run.system,
                run.headline,
                run.ttft_ms,
                run.tokens_per_second,
                run.server_tokens_per_second,
                " ".join(f"{rate:.1f}" for rate in result.rounds.get(key, ())),
            ]
        )
    table = format_table(
        ["format", "streams", "system", "tokens/s", "TTFT ms", "aggregate", "server's", "rounds"],
        rows,
        title=f"latency over HTTP: {result.model}, streamed /v1/completions (greedy, "
        f"ignore_eos); tokens/s is after the first token at 1 stream, aggregate at N; "
        f"llama.cpp {result.llamacpp_version} with {result.llamacpp_threads} threads; "
        f"{result.cpu_count} CPUs, load average {result.load_average[0]:.2f} at start, "
        f"{result.load_average_end[0]:.2f} at the end",
    )
    lines = [table]
    for key, ratio in result.ratios.items():
        target = 1.0 if key.endswith("@ 1") else 1.5
        verdict = "met" if ratio >= target else "not met"
        lines.append(f"ratio actorline / llama.cpp, {key} streams: {ratio:.2f}x "
                     f"(target >= {target}x: {verdict})")  # fmt: skip
    lines += _step_bound_lines(result)
    for key, ratio in result.speculative_ratios.items():
        lines.append(f"ratio actorline+spec / actorline, {key} streams: {ratio:.2f}x")
    if result.acceptance_rate is not None:
        lines.append(f"speculative acceptance rate: {result.acceptance_rate:.2f}")
    for key, ratio in result.peer_speculative_ratios.items():
        lines.append(f"ratio llama.cpp+spec / llama.cpp, {key} streams: {ratio:.2f}x")
    for key, ratio in result.spec_vs_peer_ratios.items():
        lines.append(f"ratio actorline+spec / llama.cpp+spec, {key} streams: {ratio:.2f}x")
    if result.peer_acceptance_rate is not None:
        lines.append(f"llama.cpp speculative acceptance rate: {result.peer_acceptance_rate:.2f}")
    if result.peer_speculative_options:
        lines.append(
            "llama.cpp+spec runs llama-server with "
            + " ".join(result.peer_speculative_options)
            + (
                " (a draft model inherits the target's repacking, and its Q4_1 AMX kernel "
                "dies of SIGILL here; an fp32/bf16 target has nothing to repack)"
                if "--no-repack" in result.peer_speculative_options
                else ""
            )
        )
    return "\n".join(lines)


def _step_bound_lines(result: LatencyResult) -> list[str]:
    """Per format, each system's one stream as a share of the step bound (the target of issue
    36: at least 90%)."""
    lines = []
    for name, bound in result.step_bounds().items():
        runs = [run for run in result.best if run.format == name and run.streams == 1]
        if not runs:
            continue
        shares = [f"{run.system} {run.headline / bound:.0%}" for run in runs]
        ours = next((run for run in runs if run.system == ACTORLINE), None)
        verdict = ""
        if ours is not None:
            verdict = f" (target >= 90%: {'met' if ours.headline >= 0.9 * bound else 'not met'})"
        megabytes = result.step_bytes[name] / 1e6
        lines.append(
            f"step bound, {name} @ 1 stream: {bound:.1f} tokens/s ({megabytes:,.1f} MB of "
            f"weights a step at {result.bandwidth_gbs:.1f} GB/s); " + ", ".join(shares) + verdict
        )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The latency benchmark's command-line options."""
    add_common_arguments(parser, profile=False)
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=(*PEERS, "none"),
        help="the peer to compare with (llamacpp: llama-server built on first use under the "
        "cache directory; the default; none: actorline alone)",
    )
    parser.add_argument(
        "--formats", nargs="+", choices=tuple(FORMATS), default=None, help="formats (all three)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="alternating rounds, best kept (2)"
    )
    parser.add_argument("--tokens", type=int, default=None, help="the single stream's tokens (256)")
    parser.add_argument(
        "--streams", type=int, nargs="+", default=None, help="concurrent stream counts (4 16)"
    )
    parser.add_argument(
        "--concurrent-tokens", type=int, default=None, help="tokens per concurrent stream (128)"
    )
    parser.add_argument(
        "--llamacpp-threads", type=int, default=None, help="llama-server's -t (every core)"
    )
    parser.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help="also run actorline with this speculative_config, alternated with it plain",
    )  # fmt: skip
    parser.add_argument(
        "--prompts", choices=PROMPT_KINDS, default=None,
        help="chat (the offline workload's prompts) or copy (rewrite a paragraph given in full)",
    )  # fmt: skip


def config_from_args(args: argparse.Namespace) -> LatencyConfig:
    """The configuration the options ask for (``--quick`` shrinks the defaults).

    Raises:
        ValueError: an option is out of range (see :class:`LatencyConfig`), or ``--peer none``
            beside a peer.
    """
    if "none" in args.peer and len(set(args.peer)) > 1:
        raise ValueError("--peer none runs actorline alone: not with another --peer")
    base = LatencyConfig.quick() if args.quick else LatencyConfig()
    given = {
        "formats": tuple(args.formats) if args.formats else None,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "streams": tuple(args.streams) if args.streams else None,
        "concurrent_tokens": args.concurrent_tokens,
        "llamacpp_threads": args.llamacpp_threads,
        "peers": tuple(p for p in dict.fromkeys(args.peer) if p != "none") if args.peer else None,
        "speculative_config": args.speculative_config,
        "prompts": args.prompts,
    }
    return dataclasses.replace(
        base, model=args.model, **{k: v for k, v in given.items() if v is not None}
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    result = run_latency(config_from_args(args))
    print_result(result, format_latency(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``actorline bench latency``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)
