"""What each execute-stage optimization is worth: the offline workload (see
:mod:`pipeline.bench.offline`) driven straight through the real scheduler and model runner, no
transports or frontend, once with everything on and once with each optimization turned off
through its :class:`~stages.execute.config.ExecuteConfig` switch. Each variant runs in a fresh
process (the allocator setting is process-wide); the variants run round-robin ``--repeats``
times and each keeps its best run, so a noisy neighbour skews no single variant. It prints
generated tokens/s, the ratio to "all on", prefill and decode seconds, and how many requests'
greedy outputs equal "all on"'s.

    python -m benchmarks.ablation [--repeats N] [--quick] [--json] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor

from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main
from pipeline.bench.workload import WorkloadSpec, blocks_to_hold, make_workload

__all__ = [
    "VARIANTS",
    "AblationConfig",
    "AblationResult",
    "VariantResult",
    "add_arguments",
    "format_ablation",
    "main",
    "run_ablation",
    "run_from_args",
]

ALL_ON = "all on"
VARIANTS: Mapping[str, Mapping[str, object]] = {
    ALL_ON: {},
    "native_linears=False (MKL row-count dispatch)": {"native_linears": False},
    "cpu_linears=False (MKL F.linear everywhere)": {"cpu_linears": False},
    "fused_ops=False (torch's RMSNorm and SiLU * mul)": {"fused_ops": False},
    "tune_allocator=False (glibc defaults)": {"tune_allocator": False},
    "decode_attention=grouped (gather + SDPA)": {"decode_attention": "grouped"},
    "decode_attention=per_sequence": {"decode_attention": "per_sequence"},
    "decode_attention=padded": {"decode_attention": "padded"},
    "use_cuda_graphs=False (no CPU step graph: decode steps module by module)": {
        "use_cuda_graphs": False
    },
    "enable_prefix_caching=False": {"enable_prefix_caching": False},
    "model_impl=transformers (transformers' LlamaForCausalLM)": {"model_impl": "transformers"},
    "no C compiler (every fallback)": {
        "native_linears": False,
        "fused_ops": False,
        "decode_attention": "grouped",
    },
}
"""Variant name -> the ExecuteConfig fields it changes from the defaults."""


@dataclasses.dataclass(frozen=True, slots=True)
class AblationConfig:
    """The model, the workload, the scheduler's limits, which variants to run and how many
    times each (the best run is kept)."""

    model: str = "smollm2-135m"
    workload: WorkloadSpec = dataclasses.field(default_factory=WorkloadSpec)
    max_num_batched_tokens: int = 2048
    variants: tuple[str, ...] = tuple(VARIANTS)
    repeats: int = 2

    def __post_init__(self) -> None:
        unknown = [name for name in self.variants if name not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"variants must be a non-empty subset of {list(VARIANTS)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")

    @classmethod
    def quick(cls, **overrides: object) -> AblationConfig:
        """A small configuration for smoke tests."""
        values: dict[str, object] = {
            "workload": WorkloadSpec(
                num_requests=4, min_filler=2, max_filler=8, max_tokens_choices=(4, 8)
            ),
            "variants": (ALL_ON, "cpu_linears=False (MKL F.linear everywhere)"),
            "repeats": 1,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class VariantResult:
    """One variant's run: wall seconds of all steps, generated tokens, seconds spent in
    steps with prefill chunks and in pure decode steps, and the outputs per request."""

    name: str
    seconds: float
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    prefix_cache_hits: int
    outputs: tuple[tuple[int, ...], ...]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class AblationResult:
    """Every variant's best run, in the configured order."""

    model: str
    num_requests: int
    repeats: int
    variants: tuple[VariantResult, ...]


def run_ablation(config: AblationConfig) -> AblationResult:
    """Run each variant in its own fresh process (spawned), round-robin ``repeats`` times;
    keep each variant's fastest run."""
    context = multiprocessing.get_context("spawn")
    best: dict[str, VariantResult] = {}
    for _ in range(config.repeats):
        for name in config.variants:
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                result = pool.submit(_drive_variant, config, name).result()
            if name not in best or result.tokens_per_second > best[name].tokens_per_second:
                best[name] = result
    return AblationResult(
        config.model,
        config.workload.num_requests,
        config.repeats,
        tuple(best[name] for name in config.variants),
    )


def _drive_variant(config: AblationConfig, name: str) -> VariantResult:
    """In the variant's process: load the runner, warm up, run the workload to completion."""
    from pipeline.bench.workload import prompt_ids
    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner
    from stages.messages import EngineRequest
    from stages.params import SamplingParams
    from stages.policies import load_policy
    from stages.scheduler import Scheduler, SchedulerConfig
    from stages.tokenize import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    workload = make_workload(config.workload)
    prompts = [prompt_ids(tokenizer, request.prompt) for request in workload]
    # Blocks for every request at once (as the offline benchmark sizes them): no preemption.
    max_tokens = [request.max_tokens for request in workload]
    num_blocks = blocks_to_hold(prompts, max_tokens, 16) + 1
    overrides = dict(VARIANTS[name])
    runner = ModelRunner(ExecuteConfig(model=config.model, num_blocks=num_blocks, **overrides))  # type: ignore[arg-type]
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=len(prompts), max_num_batched_tokens=config.max_num_batched_tokens
        ),
        load_policy("fcfs"),
    )
    scheduler.set_engine_info(runner.load())

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run(requests: Sequence[EngineRequest]) -> tuple[float, float, dict[str, list[int]]]:
        for request in requests:
            scheduler.add_request(request)
        outputs: dict[str, list[int]] = {request.request_id: [] for request in requests}
        prefill = decode = 0.0
        while (step := scheduler.schedule()) is not None:
            began = time.perf_counter()
            result = runner.execute(step)
            elapsed = time.perf_counter() - began
            if any(chunk.num_tokens > 1 for chunk in step.chunks):
                prefill += elapsed
            else:
                decode += elapsed
            update = scheduler.update(result)
            for request_id, tokens in zip(update.request_ids, update.new_token_ids, strict=True):
                outputs[request_id].extend(tokens)
        return prefill, decode, outputs

    run([EngineRequest("warmup", tuple(prompts[0]), params(4))])
    hits_before = scheduler.stats().prefix_cache_hits
    requests = [
        EngineRequest(f"r{index}", tuple(prompt), params(request.max_tokens))
        for index, (prompt, request) in enumerate(zip(prompts, workload))
    ]
    began = time.perf_counter()
    prefill, decode, outputs = run(requests)
    seconds = time.perf_counter() - began
    return VariantResult(
        name=name,
        seconds=seconds,
        generated_tokens=sum(len(tokens) for tokens in outputs.values()),
        prefill_seconds=prefill,
        decode_seconds=decode,
        prefix_cache_hits=scheduler.stats().prefix_cache_hits - hits_before,
        outputs=tuple(tuple(outputs[request.request_id]) for request in requests),
    )


def format_ablation(result: AblationResult) -> str:
    """The variants as a table, each against "all on" (or the first variant run)."""
    base = next((v for v in result.variants if v.name == ALL_ON), result.variants[0])
    rows = []
    for variant in result.variants:
        same = sum(a == b for a, b in zip(variant.outputs, base.outputs, strict=True))
        rows.append(
            (
                variant.name,
                variant.tokens_per_second,
                f"{variant.tokens_per_second / base.tokens_per_second:.2f}x",
                variant.prefill_seconds,
                variant.decode_seconds,
                variant.prefix_cache_hits,
                f"{same}/{len(base.outputs)}",
            )
        )
    return format_table(
        ("variant", "tokens/s", f"vs {base.name}", "prefill s", "decode s", "hit tokens", "same"),
        rows,
        title=(
            f"execute-stage ablation: {result.model}, {result.num_requests} requests, "
            f"scheduler + runner only; best of {result.repeats} runs each"
        ),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ablation's command-line options."""
    add_common_arguments(parser, profile=False)
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs of each variant, best kept (2)"
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        choices=list(VARIANTS),
        metavar="NAME",
        help=f"run only these variants (repeatable): {', '.join(VARIANTS)}",
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run and print the ablation as the parsed arguments say."""
    base = AblationConfig.quick() if args.quick else AblationConfig()
    variants = tuple(args.only) if args.only else base.variants
    repeats = base.repeats if args.repeats is None else args.repeats
    result = run_ablation(
        dataclasses.replace(base, model=args.model, variants=variants, repeats=repeats)
    )
    print_result(result, format_ablation(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.ablation``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
