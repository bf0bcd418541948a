"""Quantized weights against fp32 on one model, in one run (docs/performance.md §12).

Every system runs in a fresh process of its own, and the systems take turns (fp32, gguf, int8,
then again for ``--repeats`` rounds), so the machine's load falls on all of them alike:

- **weights**: the engine's model weights as loaded (``EngineInfo.weight_bytes``);
- **batch-1 decode**: one request through the model runner, a ``--prompt-tokens`` prompt then
  ``--decode-tokens`` decode steps timed (best of three in the process), and the process's
  peak RSS;
- **offline**: the offline benchmark's workload through the zmq engine (``actorline bench
  offline --quantization ...``, actorline alone), tokens/s and the engine process's peak RSS.

Accuracy, once per quantized system, in a fresh process: the greedy tokens of a fixed prompt
set through the engine's runner against HF ``generate`` running the same dequantized weights
(and against the fp32 checkpoint), and, teacher-forced on the runner's tokens, the mean
absolute logit difference between the quantized model and HF on the dequantized weights.
Ratios to fp32 are printed against the targets: 4-bit weights at most 0.2x fp32's, batch-1
decode at least 1.5x, offline throughput at least 0.9x.

    actorline bench quantization [--quick] [--json] [--repeats N]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pipeline.bench.offline import ACTORLINE_ZMQ, OfflineConfig, prompt_ids, run_offline
from pipeline.bench.process import peak_rss_bytes
from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main
from pipeline.bench.workload import WorkloadSpec, make_workload

__all__ = [
    "FP32",
    "TARGETS",
    "AccuracyRun",
    "DecodeRun",
    "QuantizationBenchConfig",
    "QuantizationResult",
    "SystemSummary",
    "add_arguments",
    "format_quantization",
    "main",
    "run_from_args",
    "run_quantization",
]

FP32 = "fp32"
#: target name -> (bound, "max" or "min") against fp32
TARGETS = {
    "4-bit weight memory": (0.2, "max"),
    "batch-1 decode": (1.5, "min"),
    "offline throughput": (0.9, "min"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizationBenchConfig:
    """The run: systems (``fp32``, ``gguf``, ``int8``), rounds, the batch-1 decode shape, the
    offline workload and the accuracy prompt set.

    Raises:
        ValueError: a size is not positive or a system is unknown.
    """

    model: str = "smollm2-135m"
    systems: tuple[str, ...] = (FP32, "gguf", "int8")
    repeats: int = 2
    prompt_tokens: int = 64
    decode_tokens: int = 64
    workload: WorkloadSpec = dataclasses.field(default_factory=WorkloadSpec)
    accuracy_prompts: int = 16
    accuracy_tokens: int = 32
    offline: bool = True

    def __post_init__(self) -> None:
        if not self.systems or any(s not in (FP32, "gguf", "int8") for s in self.systems):
            raise ValueError(f"systems must be among fp32, gguf, int8, got {self.systems}")
        for name in ("repeats", "prompt_tokens", "decode_tokens", "accuracy_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.accuracy_prompts < 0:
            raise ValueError(f"accuracy_prompts must be >= 0, got {self.accuracy_prompts}")

    @classmethod
    def quick(cls, **overrides: Any) -> QuantizationBenchConfig:
        """A smoke run: one round, short decode, 4 offline requests, 2 accuracy prompts."""
        values: dict[str, Any] = {
            "repeats": 1,
            "prompt_tokens": 16,
            "decode_tokens": 8,
            "workload": WorkloadSpec(
                num_requests=4, min_filler=5, max_filler=10, max_tokens_choices=(8,)
            ),
            "accuracy_prompts": 2,
            "accuracy_tokens": 8,
        }
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeRun:
    """One system's batch-1 decode in a fresh process."""

    system: str
    weight_bytes: int
    load_seconds: float
    tokens_per_second: float
    peak_rss_bytes: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class AccuracyRun:
    """One quantized system against HF on the same dequantized weights (``deq``) and on the
    fp32 checkpoint (``fp32``): prompts whose greedy tokens are all identical, the share of
    tokens before the first difference, and teacher-forced logit differences.
    ``int8_activations``: the linears rounded their inputs to Q8_0 (``quant_activations``
    ``auto`` on a CPU with VNNI), so ``deq`` differs from HF by that rounding too."""

    system: str
    prompts: int
    tokens: int
    identical_deq: int
    agreement_deq: float
    identical_fp32: int
    agreement_fp32: float
    mean_logit_diff_deq: float
    max_logit_diff_deq: float
    mean_logit_diff_fp32: float
    top1_agreement_fp32: float
    int8_activations: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class SystemSummary:
    """A system's figures over the rounds (best rate, median kept for the record)."""

    system: str
    weight_bytes: int
    decode_tokens_per_second: tuple[float, ...]
    decode_peak_rss_bytes: int | None
    offline_tokens_per_second: tuple[float, ...]
    engine_peak_rss_bytes: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizationResult:
    model: str
    systems: tuple[SystemSummary, ...]
    ratios: dict[str, dict[str, float]]
    targets: dict[str, dict[str, bool]]
    accuracy: tuple[AccuracyRun, ...]
    load_average: tuple[float, float, float]
    load_average_end: tuple[float, float, float]
    cpu_count: int


def _quantization(system: str) -> str | None:
    return None if system == FP32 else system


def _in_fresh_process(function: Any, *args: Any) -> Any:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def run_quantization(config: QuantizationBenchConfig) -> QuantizationResult:
    """Run every system (see the module docstring)."""
    from stages.models import resolve_model
    from stages.tokenize import load_tokenizer

    resolved = resolve_model(config.model)
    systems = [s for s in config.systems if s != "gguf" or resolved.gguf is not None]
    tokenizer = load_tokenizer(config.model)
    workload = make_workload(config.workload)
    prompts = [prompt_ids(tokenizer, request.prompt) for request in workload]
    decode_prompt = (prompts[0] * (config.prompt_tokens // max(len(prompts[0]), 1) + 1))[
        : config.prompt_tokens
    ]
    load_average = os.getloadavg()
    decodes: dict[str, list[DecodeRun]] = {system: [] for system in systems}
    offline: dict[str, list[tuple[float, int | None]]] = {system: [] for system in systems}
    for _ in range(config.repeats):
        for system in systems:
            decodes[system].append(
                _in_fresh_process(
                    _decode_worker, config.model, system, decode_prompt, config.decode_tokens
                )
            )
            if config.offline:
                run = run_offline(
                    OfflineConfig(
                        model=config.model,
                        workload=config.workload,
                        systems=(ACTORLINE_ZMQ,),
                        check_requests=0,
                        measure_default_budget=False,
                        roof=False,  # only the tokens/s and the engine's RSS are kept
                        quantization=_quantization(system),
                    )
                )
                offline[system].append(
                    (run.systems[0].tokens_per_second, run.engine_peak_rss_bytes)
                )
    accuracy = tuple(
        _in_fresh_process(
            _accuracy_worker,
            config.model,
            system,
            prompts[: config.accuracy_prompts],
            config.accuracy_tokens,
        )
        for system in systems
        if system != FP32 and config.accuracy_prompts
    )
    summaries = tuple(
        SystemSummary(
            system=system,
            weight_bytes=decodes[system][0].weight_bytes,
            decode_tokens_per_second=tuple(run.tokens_per_second for run in decodes[system]),
            decode_peak_rss_bytes=max(
                (run.peak_rss_bytes for run in decodes[system] if run.peak_rss_bytes), default=None
            ),
            offline_tokens_per_second=tuple(rate for rate, _ in offline[system]),
            engine_peak_rss_bytes=max((rss for _, rss in offline[system] if rss), default=None),
        )
        for system in systems
    )
    ratios, targets = _ratios(summaries)
    return QuantizationResult(
        model=config.model,
        systems=summaries,
        ratios=ratios,
        targets=targets,
        accuracy=accuracy,
        load_average=load_average,
        load_average_end=os.getloadavg(),
        cpu_count=os.cpu_count() or 0,
    )


def _ratios(
    summaries: Sequence[SystemSummary],
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, bool]]]:
    by_name = {summary.system: summary for summary in summaries}
    base = by_name.get(FP32)
    ratios: dict[str, dict[str, float]] = {}
    targets: dict[str, dict[str, bool]] = {}
    if base is None:
        return ratios, targets
    for summary in summaries:
        if summary.system == FP32:
            continue
        entry = {"weight memory": summary.weight_bytes / base.weight_bytes}
        if summary.decode_tokens_per_second and base.decode_tokens_per_second:
            entry["batch-1 decode"] = max(summary.decode_tokens_per_second) / max(
                base.decode_tokens_per_second
            )
        if summary.offline_tokens_per_second and base.offline_tokens_per_second:
            entry["offline throughput"] = max(summary.offline_tokens_per_second) / max(
                base.offline_tokens_per_second
            )
        ratios[summary.system] = entry
        verdicts: dict[str, bool] = {}
        for name, (bound, kind) in TARGETS.items():
            key = "weight memory" if name == "4-bit weight memory" else name
            if key not in entry or (name == "4-bit weight memory" and summary.system != "gguf"):
                continue
            verdicts[name] = entry[key] <= bound if kind == "max" else entry[key] >= bound
        targets[summary.system] = verdicts
    return ratios, targets


def _decode_worker(model: str, system: str, prompt: list[int], decode_tokens: int) -> DecodeRun:
    """In a fresh process: load the runner, time batch-1 decode (best of three)."""
    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner
    from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
    from stages.models import loading
    from stages.params import SamplingParams

    began = time.perf_counter()
    blocks = -(-(len(prompt) + decode_tokens + 1) // 16) + 1
    runner = ModelRunner(
        ExecuteConfig(model=model, num_blocks=blocks, quantization=_quantization(system))
    )
    with loading():
        info = runner.load()
    load_seconds = time.perf_counter() - began
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    rates: list[float] = []
    step = 0
    for attempt in range(3):
        request_id = f"decode-{attempt}"
        first = SchedulerStep(
            step,
            (EngineRequest(request_id, tuple(prompt), params),),
            (ScheduledChunk(request_id, 0, len(prompt)),),
        )
        runner.execute(first)
        step += 1
        began = time.perf_counter()
        for position in range(len(prompt), len(prompt) + decode_tokens):
            runner.execute(SchedulerStep(step, chunks=(ScheduledChunk(request_id, position, 1),)))
            step += 1
        rates.append(decode_tokens / (time.perf_counter() - began))
        runner.execute(SchedulerStep(step, finished=(request_id,)))
        step += 1
    return DecodeRun(
        system=system,
        weight_bytes=info.weight_bytes,
        load_seconds=load_seconds,
        tokens_per_second=max(rates),
        peak_rss_bytes=peak_rss_bytes(os.getpid()),
    )


def _greedy_runner(runner: Any, prompts: Sequence[list[int]], tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt, batched through the model runner."""
    from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
    from stages.params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = [f"p{index}" for index in range(len(prompts))]
    requests = tuple(EngineRequest(i, tuple(p), params) for i, p in zip(ids, prompts, strict=True))
    chunks = tuple(ScheduledChunk(i, 0, len(p)) for i, p in zip(ids, prompts, strict=True))
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    result = runner.execute(SchedulerStep(0, requests, chunks))
    for step in range(1, tokens):
        for request_id, token in zip(result.request_ids, result.token_ids, strict=True):
            outputs[request_id].append(token)
        decode = tuple(
            ScheduledChunk(i, len(p) + len(outputs[i]) - 1, 1)
            for i, p in zip(ids, prompts, strict=True)
        )
        result = runner.execute(SchedulerStep(step, chunks=decode))
    for request_id, token in zip(result.request_ids, result.token_ids, strict=True):
        outputs[request_id].append(token)
    runner.execute(SchedulerStep(tokens, finished=tuple(ids)))
    return [outputs[i] for i in ids]


def _agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> tuple[int, float]:
    """(identical sequences, mean share of tokens before the first difference)."""
    identical, shares = 0, []
    for a, b in zip(ours, theirs, strict=True):
        same = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        identical += same == len(a) == len(b)
        shares.append(same / max(len(a), 1))
    return identical, sum(shares) / max(len(shares), 1)


def _accuracy_worker(model: str, system: str, prompts: list[list[int]], tokens: int) -> AccuracyRun:
    """In a fresh process: the quantized runner against HF (see the module docstring)."""
    import torch

    from pipeline.bench import hf
    from stages.execute.config import ExecuteConfig
    from stages.execute.quant.kernel import quant_gemm_kernel
    from stages.execute.quant.layers import QuantEmbedding, QuantLinear, dequantize
    from stages.execute.runner import ModelRunner
    from stages.models import loading, resolve_model

    runner = ModelRunner(
        ExecuteConfig(model=model, num_blocks=512, quantization=_quantization(system))
    )
    with loading():
        runner.load()
    ours = _greedy_runner(runner, prompts, tokens)
    quantized = runner.model
    quantized.set_attn_implementation("sdpa")  # plain HF attention: full logits below
    reference = hf.load_hf_model(resolve_model(model).path)
    sequences = [torch.tensor([p + o]) for p, o in zip(prompts, ours, strict=True)]

    def greedy(model_: Any) -> list[list[int]]:
        pad = 0
        return [list(hf.hf_greedy_reference(model_, p, tokens, pad)) for p in prompts]

    def logit_diffs() -> tuple[float, float, float]:
        total, count, peak, top1 = 0.0, 0, 0.0, 0.0
        with torch.inference_mode():
            for sequence in sequences:
                ours_logits = quantized(input_ids=sequence, use_cache=False).logits[0]
                theirs = reference(input_ids=sequence, use_cache=False).logits[0]
                difference = (ours_logits - theirs).abs()
                total += difference.sum().item()
                count += difference.numel()
                peak = max(peak, difference.max().item())
                top1 += (ours_logits.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        return total / max(count, 1), peak, top1 / max(len(sequences), 1)

    fp32_tokens = greedy(reference)
    mean_fp32, _, top1_fp32 = logit_diffs()
    kernel = quant_gemm_kernel()
    assert kernel is not None
    with torch.no_grad():
        for name, module in quantized.named_modules():
            tied = isinstance(module, QuantEmbedding) and module.tied  # the head's weight
            if isinstance(module, (QuantLinear, QuantEmbedding)) and not tied:
                dense = dequantize(module.weight_data, kernel)
                target = reference.get_submodule(name)  # GPT-2's Conv1D holds [in, out]
                transposed = type(target).__name__ == "Conv1D"
                target.weight.copy_(dense.t() if transposed else dense)
    deq_tokens = greedy(reference)
    mean_deq, max_deq, _ = logit_diffs()
    identical_deq, agreement_deq = _agreement(ours, deq_tokens)
    identical_fp32, agreement_fp32 = _agreement(ours, fp32_tokens)
    return AccuracyRun(
        system=system,
        prompts=len(prompts),
        tokens=tokens,
        identical_deq=identical_deq,
        agreement_deq=agreement_deq,
        int8_activations=kernel.int8_preferred,
        identical_fp32=identical_fp32,
        agreement_fp32=agreement_fp32,
        mean_logit_diff_deq=mean_deq,
        max_logit_diff_deq=max_deq,
        mean_logit_diff_fp32=mean_fp32,
        top1_agreement_fp32=top1_fp32,
    )


def _embedding_weight(module: Any) -> Any:
    from stages.execute.quant.layers import QuantizedWeight

    return QuantizedWeight(
        module.format, module.num_embeddings, module.embedding_dim, module.blocks
    )


def format_quantization(result: QuantizationResult) -> str:
    """The readable report."""
    rows = []
    for summary in result.systems:
        rows.append(
            [
                summary.system,
                summary.weight_bytes / 1e6,
                max(summary.decode_tokens_per_second, default=float("nan")),
                (summary.decode_peak_rss_bytes or 0) / 1e6,
                max(summary.offline_tokens_per_second, default=float("nan")),
                (summary.engine_peak_rss_bytes or 0) / 1e6,
            ]
        )
    lines = [
        format_table(
            [
                "system",
                "weights MB",
                "decode tok/s",
                "peak RSS MB",
                "offline tok/s",
                "engine peak RSS MB",
            ],
            rows,
            title=f"quantized weights against fp32: {result.model}; best of "
            f"{len(result.systems[0].decode_tokens_per_second) if result.systems else 0} "
            f"interleaved rounds; {result.cpu_count} CPUs, load average "
            f"{result.load_average[0]:.2f} at start, {result.load_average_end[0]:.2f} at end",
        )
    ]
    for summary in result.systems:
        lines.append(
            f"  {summary.system}: decode tok/s by round "
            + ", ".join(f"{rate:.1f}" for rate in summary.decode_tokens_per_second)
            + "; offline tok/s by round "
            + ", ".join(f"{rate:.1f}" for rate in summary.offline_tokens_per_second)
        )
    for system, entry in result.ratios.items():
        verdicts = result.targets.get(system, {})
        parts = []
        for name, ratio in entry.items():
            target = next((t for t in TARGETS if name in t), None)
            verdict = ""
            if target is not None and target in verdicts:
                bound, kind = TARGETS[target]
                sign = "<=" if kind == "max" else ">="
                verdict = f" (target {sign} {bound}x: {'met' if verdicts[target] else 'NOT met'})"
            parts.append(f"{name} {ratio:.3f}x{verdict}")
        lines.append(f"{system} / fp32: " + "; ".join(parts))
    for run in result.accuracy:
        lines.append(
            f"accuracy {run.system} ({run.prompts} prompts x {run.tokens} greedy tokens"
            f"{', int8 activations' if run.int8_activations else ''}): vs HF "
            f"on the same dequantized weights {run.identical_deq}/{run.prompts} identical, "
            f"{run.agreement_deq:.1%} of tokens before a difference, mean |logit diff| "
            f"{run.mean_logit_diff_deq:.2e} (max {run.max_logit_diff_deq:.2e}); vs the fp32 "
            f"checkpoint {run.identical_fp32}/{run.prompts} identical, {run.agreement_fp32:.1%}, "
            f"mean |logit diff| {run.mean_logit_diff_fp32:.3f}, top-1 "
            f"{run.top1_agreement_fp32:.1%}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The quantization benchmark's command-line options."""
    add_common_arguments(parser, profile=False)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (2)")
    parser.add_argument("--requests", type=int, default=None, help="offline requests (64)")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=("gguf", "int8", "offline"),
        help="leave a system or the offline runs out (repeatable)",
    )


def config_from_args(args: argparse.Namespace) -> QuantizationBenchConfig:
    base = QuantizationBenchConfig.quick() if args.quick else QuantizationBenchConfig()
    workload = base.workload
    if args.requests is not None:
        workload = dataclasses.replace(workload, num_requests=args.requests)
    return dataclasses.replace(
        base,
        model=args.model,
        systems=tuple(s for s in base.systems if s not in args.skip),
        repeats=base.repeats if args.repeats is None else args.repeats,
        workload=workload,
        offline="offline" not in args.skip,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    result = run_quantization(config_from_args(args))
    print_result(result, format_quantization(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``actorline bench quantization``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)
