"""LoRA adapters against the base model alone (``actorline bench offline --lora N``,
docs/lora.md):

- **throughput**: the offline workload of :mod:`pipeline.bench.offline` (64 requests, greedy)
  on the engine without LoRA, then with ``enable_lora`` and request ``i`` under adapter
  ``i mod N`` (``max_loras`` N, so every adapter shares each step), each run in a fresh
  process, alternating, ``--repeats`` times, the best of each kept; generated tokens/s and
  their ratio (the target is at least 0.8x with 4 adapters of rank 8 on the default model).
  The adapters are rank 8 on q/k/v/o/gate/up/down, made with ``peft`` from random weights
  (``init_lora_weights=False``) into a temporary directory. The first request of each
  adapter loads it, inside the timing, as a server's first request of it would.
- **loading while streams run**: a few base streams generate; a request of an adapter already
  loaded joins, then one of an adapter never loaded (its weights read on its first step);
  the running streams' inter-token gaps before either joins (median), and the longest gap
  while each joins: the difference between the two joins is what the load costs the streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.bench.report import format_rate, format_table
from pipeline.bench.workload import blocks_to_hold

__all__ = [
    "LORA_TARGETS",
    "LORA_TARGET_RATIO",
    "LoRABenchConfig",
    "LoRABenchResult",
    "LoRALoadCost",
    "LoRARun",
    "format_lora",
    "load_cost_of",
    "make_random_adapters",
    "run_lora_bench",
]

#: the projections the benchmark's adapters target
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the issue's target: throughput with 4 adapters at least this share of the base model's
LORA_TARGET_RATIO = 0.8
_STREAMS = 4
_STREAM_TOKENS = 160
_JOIN_AFTER = 24  # tokens every stream has before the first adapter request joins
_WARMUP_TOKENS = 4


@dataclasses.dataclass(frozen=True, slots=True)
class LoRABenchConfig:
    """``adapters`` adapters of rank ``rank`` on ``model``; ``repeats`` alternations.

    Raises:
        ValueError: a count below 1, or a rank below 1.
    """

    model: str = "smollm2-135m"
    adapters: int = 4
    rank: int = 8
    repeats: int = 1
    dtype: str = "float32"
    quantization: str | None = None
    max_num_batched_tokens: int = 2048
    load_cost: bool = True

    def __post_init__(self) -> None:
        for name in ("adapters", "rank", "repeats"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class LoRARun:
    """One timed run: ``lora`` (with the adapters) or the base model alone."""

    lora: bool
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class LoRALoadCost:
    """The running streams' inter-token gaps (ms): median before any adapter request, the
    longest while a request of a loaded adapter joins, the longest while one of an adapter
    never loaded joins (its weights read); and how many gaps each window held."""

    streams: int
    median_gap_ms: float
    warm_join_max_gap_ms: float
    cold_join_max_gap_ms: float
    warm_join_gaps: int
    cold_join_gaps: int


@dataclasses.dataclass(frozen=True, slots=True)
class LoRABenchResult:
    model: str
    adapters: int
    rank: int
    num_requests: int
    runs: tuple[LoRARun, ...]
    best_base: float
    best_lora: float
    ratio: float
    load_cost: LoRALoadCost | None
    load_average: tuple[float, float, float]
    cpu_count: int


def make_random_adapters(model: str, count: int, rank: int, directory: Path) -> list[Path]:
    """``count`` PEFT adapters of ``model`` (rank ``rank`` on :data:`LORA_TARGETS`, random
    A and B) saved under ``directory``.

    Raises:
        RuntimeError: ``peft`` is not installed (it is a test dependency).
    """
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RuntimeError(
            f"--lora makes its adapters with peft, which is missing: {exc}"
        ) from None

    from stages.models import resolve_model

    base_dir = resolve_model(model).path
    paths = []
    for index in range(count):
        torch.manual_seed(1000 + index)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS), init_lora_weights=False
        )
        path = directory / f"adapter{index + 1}"
        get_peft_model(base, config).save_pretrained(str(path))
        paths.append(path)
    return paths


def run_lora_bench(
    config: LoRABenchConfig, prompts: list[list[int]], max_tokens: list[int]
) -> LoRABenchResult:
    """The comparison on ``prompts`` (token ids), each generating exactly its
    ``max_tokens`` (see the module docstring).

    Raises:
        RuntimeError: ``peft`` is missing.
    """
    load_average = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="actorline-lora-bench-") as directory:
        paths = make_random_adapters(
            config.model, config.adapters + 2, config.rank, Path(directory)
        )
        adapters, spare = [str(p) for p in paths[: config.adapters]], [str(p) for p in paths[-2:]]
        runs: list[LoRARun] = []
        for _ in range(config.repeats):
            for lora in (False, True):
                runs.append(
                    _fresh(_run_workload, config, adapters if lora else [], prompts, max_tokens)
                )
        load_cost = _fresh(_measure_load_cost, config, spare, prompts) if config.load_cost else None
    best_base = max(run.tokens_per_second for run in runs if not run.lora)
    best_lora = max(run.tokens_per_second for run in runs if run.lora)
    return LoRABenchResult(
        model=config.model,
        adapters=config.adapters,
        rank=config.rank,
        num_requests=len(prompts),
        runs=tuple(runs),
        best_base=best_base,
        best_lora=best_lora,
        ratio=best_lora / best_base if best_base > 0 else 0.0,
        load_cost=load_cost,
        load_average=load_average,
        cpu_count=os.cpu_count() or 1,
    )


def _fresh(function: Any, *args: Any) -> Any:
    """``function(*args)`` in a freshly spawned process."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def _engine_options(config: LoRABenchConfig, lora_slots: int, blocks: int) -> dict[str, Any]:
    options: dict[str, Any] = {
        "dtype": config.dtype,
        "quantization": config.quantization,
        "num_blocks": blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }
    if lora_slots:
        options.update(enable_lora=True, max_loras=lora_slots, max_lora_rank=max(config.rank, 16))
    return options


def _run_workload(
    config: LoRABenchConfig, adapters: list[str], prompts: list[list[int]], max_tokens: list[int]
) -> LoRARun:
    from pipeline.engine.llm import LLM
    from stages.lora import LoRARequest
    from stages.params import SamplingParams

    loras = [LoRARequest(f"adapter{i + 1}", i + 1, path) for i, path in enumerate(adapters)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    options = _engine_options(config, len(loras), blocks_to_hold(prompts, max_tokens, 16) + 1)
    with LLM(config.model, max_num_seqs=max(len(prompts), 1), **options) as llm:
        warmup = SamplingParams(max_tokens=_WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0]], warmup, use_tqdm=False)
        if loras:
            # NOTE: each adapter's first request loads it; here before the clock starts, as
            # the base model's warm-up runs before it: this figure is the steady mixed batch
            # (the 0.8x target's), and loading an adapter while streams run is measured on its
            # own (_measure_load_cost)
            llm.generate([prompts[0]] * len(loras), warmup, use_tqdm=False, lora_request=loras)
        per_request = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
        began = time.perf_counter()
        results = llm.generate(list(prompts), params, use_tqdm=False, lora_request=per_request)
        seconds = time.perf_counter() - began
    tokens = sum(len(result.token_ids) for result in results)
    return LoRARun(bool(loras), tokens, seconds)


def _measure_load_cost(
    config: LoRABenchConfig, adapters: list[str], prompts: list[list[int]]
) -> LoRALoadCost:
    from pipeline.engine.async_engine import AsyncEngine
    from stages.lora import LoRARequest
    from stages.params import SamplingParams
    from transports.tasks import TaskSet

    warm, cold = (LoRARequest(f"load{i + 1}", 100 + i, path) for i, path in enumerate(adapters))
    stream_params = SamplingParams(max_tokens=_STREAM_TOKENS, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    options = _engine_options(config, 2, 512)

    async def measure() -> LoRALoadCost:
        async with (
            AsyncEngine(config.model, max_num_seqs=_STREAMS + 2, **options) as engine,
            TaskSet("bench:lora") as tasks,
        ):

            async def run(
                prompt: list[int], params: Any, lora: Any = None, ready: Any = None
            ) -> list[float]:
                stamps: list[float] = []
                async for _ in engine.generate(
                    {"prompt_token_ids": prompt}, params, lora_request=lora
                ):
                    stamps.append(time.perf_counter())
                    if ready is not None and len(stamps) == _JOIN_AFTER:
                        ready.set()
                return stamps

            await run(prompts[0], short, warm)  # the warm adapter loaded before the streams
            ready = [asyncio.Event() for _ in range(_STREAMS)]
            streams = [
                tasks.spawn(run(prompts[i % len(prompts)], stream_params, None, event))
                for i, event in enumerate(ready)
            ]
            # the streams run a while before anything joins
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in ready)), 300)
            submitted = time.perf_counter()
            warm_window = (submitted, (await run(prompts[1], short, warm))[0])
            submitted = time.perf_counter()
            cold_window = (submitted, (await run(prompts[1], short, cold))[0])
            stamps = await asyncio.gather(*streams)
        return load_cost_of(stamps, warm_window, cold_window)

    return asyncio.run(measure())


def load_cost_of(
    stamps: list[list[float]], warm: tuple[float, float], cold: tuple[float, float]
) -> LoRALoadCost:
    """The gaps of each stream (consecutive output times) sorted into the windows: before
    the warm join, overlapping ``warm`` ``(submitted, first token)``, overlapping ``cold``."""
    before: list[float] = []
    warm_gaps: list[float] = []
    cold_gaps: list[float] = []
    for times in stamps:
        for start, end in itertools.pairwise(times):
            gap = (end - start) * 1e3
            if end <= warm[0]:
                before.append(gap)
            if start < warm[1] and end > warm[0]:
                warm_gaps.append(gap)
            if start < cold[1] and end > cold[0]:
                cold_gaps.append(gap)
    return LoRALoadCost(
        streams=len(stamps),
        median_gap_ms=statistics.median(before) if before else float("nan"),
        warm_join_max_gap_ms=max(warm_gaps, default=float("nan")),
        cold_join_max_gap_ms=max(cold_gaps, default=float("nan")),
        warm_join_gaps=len(warm_gaps),
        cold_join_gaps=len(cold_gaps),
    )


def format_lora(result: LoRABenchResult) -> str:
    """The readable report."""
    rows = [
        [f"{result.adapters} adapters" if run.lora else "base model", run.tokens, run.seconds,
         run.tokens_per_second]
        for run in result.runs
    ]  # fmt: skip
    lines = [
        format_table(
            ["run", "tokens", "seconds", "tokens/s"],
            rows,
            title=f"LoRA: {result.model}, {result.num_requests} requests (the offline workload, "
            f"greedy), {result.adapters} adapters of rank {result.rank} on "
            f"q/k/v/o/gate/up/down; {result.cpu_count} CPUs, load average "
            f"{result.load_average[0]:.2f} at start",
        ),
        f"best base {format_rate(result.best_base)}, best with adapters "
        f"{format_rate(result.best_lora)}: lora/base {result.ratio:.2f}x "
        f"(target >= {LORA_TARGET_RATIO}x)",
    ]
    cost = result.load_cost
    if cost is not None:
        lines.append(
            f"adapter load while {cost.streams} streams run: inter-token gap median "
            f"{cost.median_gap_ms:.1f} ms before; longest {cost.warm_join_max_gap_ms:.1f} ms "
            f"while a loaded adapter's request joins, {cost.cold_join_max_gap_ms:.1f} ms while "
            "a new adapter loads and joins"
        )
    return "\n".join(lines)
