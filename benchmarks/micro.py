"""Kernel microbenchmarks: the CPU kernels of the execute stage on their own, at the model's
shapes, cold (every layer's weights or caches distinct, streamed from memory as a decode step
streams them) against warm (one layer's reused, so they stay in the caches).

- **Packed GEMM, one step's linears**: for each row count ``M``, every decoder layer's linears
  (the fused gate/up projection as one GEMM, as the runner packs it) over ``x [M, K]``, then the
  LM head. *Cold*: each layer has weights of its own, as in the model; *warm*: layer 0's
  weights serve every layer. The weight bytes of a cold step over its seconds is the rate the
  step streams its weights at (docs/performance.md §4: decode's GEMMs are bound by it).
- **Paged decode attention, one layer**: ``B`` rows attending random contexts of ``L / 2 .. L``
  tokens in random blocks, timed over as many layers as the model has, each with a KV cache of
  its own (cold) against layer 0's cache for every layer (warm); the keys and values read over
  the seconds is the rate the kernel reads them at. ``--kv-dtype bfloat16``: over a bf16 cache
  (``kv_cache_dtype``), half the bytes.

Random weights and caches of the model's shapes (no checkpoint is read beyond its config); the
threads are torch's; each figure is the best of ``--rounds`` rounds, cold and warm taking
turns. Needs a C compiler (the kernels are actorline's own).

    python -m benchmarks.micro [--rows 1 12 64 ...] [--attention 16x250 64x500 ...]
        [--kv-dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main

__all__ = [
    "AttentionTiming",
    "GemmTiming",
    "MicroConfig",
    "MicroResult",
    "add_arguments",
    "format_micro",
    "main",
    "measure_micro",
    "run_from_args",
]

_FUSED = frozenset({"gate_proj", "up_proj"})  # the runner packs these two as one GEMM


@dataclasses.dataclass(frozen=True, slots=True)
class MicroConfig:
    """What to time: the model whose shapes are used, the GEMM row counts, the attention cases
    (``(rows, context)``: each row attends ``context / 2 .. context`` tokens), the KV block
    size, the KV cache's dtype (``float32`` or ``bfloat16``), the rounds (best kept), the
    threads (``None``: torch's default) and whether the attention cases are timed by the
    process's CPU time (``cpu_clock``: with one thread on a machine shared with other work, the
    time the kernel ran rather than the time it waited) instead of wall time.

    Raises:
        ValueError: no case at all, a count below 1, or no rounds.
    """

    model: str = "smollm2-135m"
    rows: tuple[int, ...] = (1, 4, 12, 26, 32, 64, 256)
    attention: tuple[tuple[int, int], ...] = ((1, 500), (4, 300), (16, 250), (64, 250), (64, 500))
    block_size: int = 16
    rounds: int = 5
    threads: int | None = None
    kv_dtype: str = "float32"
    cpu_clock: bool = False

    def __post_init__(self) -> None:
        if not self.rows and not self.attention:
            raise ValueError("nothing to time: give GEMM rows or attention cases")
        if any(count < 1 for count in self.rows):
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if any(rows < 1 or context < 2 for rows, context in self.attention):
            raise ValueError(f"attention cases need rows >= 1 and context >= 2: {self.attention}")
        if self.rounds < 1 or self.block_size < 1:
            raise ValueError("rounds and block_size must be >= 1")
        if self.kv_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"kv_dtype must be float32 or bfloat16, got {self.kv_dtype!r}")

    @classmethod
    def quick(cls, **overrides: Any) -> MicroConfig:
        """A small configuration for smoke tests (numbers not meaningful)."""
        values: dict[str, Any] = {"rows": (1, 12), "attention": ((4, 64),), "rounds": 1}
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class GemmTiming:
    """One step's linears at ``rows`` rows: milliseconds cold and warm, and the weight bytes a
    step reads (every layer's and the head's)."""

    rows: int
    cold_ms: float
    warm_ms: float
    weight_bytes: int

    @property
    def cold_gbs(self) -> float:
        """The rate a cold step streams its weights at, GB/s."""
        return self.weight_bytes / (self.cold_ms * 1e6) if self.cold_ms > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionTiming:
    """One layer's paged decode attention for ``rows`` rows of up to ``context`` tokens:
    milliseconds per layer cold and warm, and the key and value bytes a layer reads."""

    rows: int
    context: int
    cold_ms: float
    warm_ms: float
    kv_bytes: int

    @property
    def cold_gbs(self) -> float:
        """The rate a cold layer reads its keys and values at, GB/s."""
        return self.kv_bytes / (self.cold_ms * 1e6) if self.cold_ms > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class MicroResult:
    """The timings, with what they were measured on."""

    model: str
    layers: int
    threads: int
    gemm: tuple[GemmTiming, ...]
    attention: tuple[AttentionTiming, ...]
    load_average: tuple[float, float, float]
    cpu_count: int
    kv_dtype: str = "float32"
    cpu_clock: bool = False


def _best_of(
    rounds: int,
    runs: Sequence[Callable[[], object]],
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Each of ``runs``' best seconds over ``rounds`` rounds in which they take turns, by
    ``clock`` (wall time, or the process's CPU time)."""
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for index, run in enumerate(runs):
            began = clock()
            run()
            best[index] = min(best[index], clock() - began)
    return best


def _gemm_step(
    kernel: Any,
    inputs: dict[int, Any],
    shapes: list[tuple[int, int]],
    weights: list[list[Any]],
    head: Any,
) -> None:
    """One step's linears: every layer's GEMMs over ``inputs`` (keyed by K), then the head."""
    for layer in weights:
        for (_, k), weight in zip(shapes, layer, strict=True):
            kernel(inputs[k], weight, None)
    if head is not None:
        kernel(inputs[head.shape[1]], head, None)  # packed [N / 16, K, 16]


def _attend(kernel: Any, caches: list[tuple[Any, Any]], *arguments: Any) -> None:
    """One decode attention per layer, each over its own (keys, values) cache; ``arguments``:
    the kernel's others (query, then block tables, context lengths, out, block size, scale)."""
    query, *rest = arguments
    for keys, values in caches:
        kernel(query, keys, values, *rest)


def _time_gemm(config: MicroConfig, model_dir: Any, layers: int) -> tuple[GemmTiming, ...]:
    import torch

    from pipeline.bench.roof import model_linears
    from stages.execute.native import NativeKernelError, packed_gemm_kernel

    kernel = packed_gemm_kernel()
    if kernel is None:
        raise NativeKernelError("the packed GEMM kernel is unavailable (no C compiler?)")
    linears = model_linears(model_dir)
    # One layer's GEMMs as the runner runs them: (N, K) each, gate and up fused into one.
    shapes: list[tuple[int, int]] = []
    for shape in linears.layers:
        per_layer = shape.count // layers
        if set(shape.names) <= _FUSED and per_layer == 2:
            shapes.append((2 * shape.n, shape.k))
        else:
            shapes += [(shape.n, shape.k)] * per_layer
    generator = torch.Generator().manual_seed(0)

    def packed(n: int, k: int) -> torch.Tensor:
        return kernel.pack(torch.randn(n, k, generator=generator) * k**-0.5)

    cold = [[packed(n, k) for n, k in shapes] for _ in range(layers)]
    warm = [cold[0]] * layers
    head = packed(linears.head.n, linears.head.k) if linears.head is not None else None
    weight_bytes = sum(w.numel() * 4 for layer in cold for w in layer)
    weight_bytes += head.numel() * 4 if head is not None else 0
    timings = []
    with torch.inference_mode():
        for rows in config.rows:
            inputs = {k: torch.randn(rows, k, generator=generator) for _, k in shapes}
            if linears.head is not None:
                inputs.setdefault(
                    linears.head.k, torch.randn(rows, linears.head.k, generator=generator)
                )

            runs = [
                functools.partial(_gemm_step, kernel, inputs, shapes, weights, head)
                for weights in (cold, warm)
            ]
            cold_s, warm_s = _best_of(config.rounds, runs)
            timings.append(GemmTiming(rows, cold_s * 1e3, warm_s * 1e3, weight_bytes))
    return tuple(timings)


def _time_attention(
    config: MicroConfig, model_dir: Any, layers: int
) -> tuple[AttentionTiming, ...]:
    import torch
    from transformers import AutoConfig

    from stages.execute.native import NativeKernelError, paged_decode_kernel

    kernel = paged_decode_kernel()
    if kernel is None:
        raise NativeKernelError("the paged decode kernel is unavailable (no C compiler?)")
    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    block = config.block_size
    kv_dtype = getattr(torch, config.kv_dtype)
    element = torch.empty((), dtype=kv_dtype).element_size()
    generator = torch.Generator().manual_seed(1)
    timings = []
    for rows, context in config.attention:
        lengths = torch.randint(context // 2, context + 1, (rows,), generator=generator)
        per_row = -(-context // block)
        num_blocks = rows * per_row
        # Each row's blocks at random places of the cache, as a long-running engine has them.
        tables = torch.randperm(num_blocks, generator=generator).view(rows, per_row)
        shape = (num_blocks * block, kv_heads, head_dim)
        caches = [
            (
                torch.randn(shape, generator=generator).to(kv_dtype),
                torch.randn(shape, generator=generator).to(kv_dtype),
            )
            for _ in range(layers)
        ]
        query = torch.randn(heads, rows, head_dim, generator=generator)
        out = torch.empty(rows, heads, head_dim)

        runs = [
            functools.partial(
                _attend, kernel, layer_caches, query, tables, lengths, out, block, head_dim**-0.5
            )
            for layer_caches in (caches, [caches[0]] * layers)
        ]
        clock = time.process_time if config.cpu_clock else time.perf_counter
        cold_s, warm_s = _best_of(config.rounds, runs, clock)
        kv_bytes = int(lengths.sum()) * kv_heads * head_dim * element * 2
        timings.append(
            AttentionTiming(rows, context, cold_s / layers * 1e3, warm_s / layers * 1e3, kv_bytes)
        )
        del caches, runs
    return tuple(timings)


def measure_micro(config: MicroConfig) -> MicroResult:
    """Time the kernels (see the module docstring) in this process.

    Raises:
        NativeKernelError: a kernel is unavailable (no C compiler).
    """
    import torch
    from transformers import AutoConfig

    from stages.models import resolve_model

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    load_average = os.getloadavg()
    model_dir = resolve_model(config.model).path
    layers = int(AutoConfig.from_pretrained(model_dir).get_text_config().num_hidden_layers)
    gemm = _time_gemm(config, model_dir, layers) if config.rows else ()
    attention = _time_attention(config, model_dir, layers) if config.attention else ()
    return MicroResult(
        model=config.model,
        layers=layers,
        threads=torch.get_num_threads(),
        gemm=gemm,
        attention=attention,
        load_average=load_average,
        cpu_count=os.cpu_count() or 0,
        kv_dtype=config.kv_dtype,
        cpu_clock=config.cpu_clock,
    )


def format_micro(result: MicroResult) -> str:
    """The readable report."""
    header = (
        f"{result.model}, fp32, {result.threads} threads, {result.layers} layers; "
        f"{result.cpu_count} CPUs, load average {result.load_average[0]:.2f} at start"
    )
    parts = []
    if result.gemm:
        megabytes = result.gemm[0].weight_bytes / 1e6
        parts.append(
            format_table(
                ["rows (M)", "cold ms", "warm ms", "cold / warm", "cold GB/s of weights"],
                [
                    [t.rows, t.cold_ms, t.warm_ms, t.cold_ms / t.warm_ms, t.cold_gbs]
                    for t in result.gemm
                ],
                title=f"packed GEMM, one step's linears ({megabytes:,.0f} MB of weights): "
                + header,
            )
        )
    if result.attention:
        parts.append(
            format_table(
                ["rows x context", "cold µs / layer", "warm µs / layer", "cold GB/s of K/V"],
                [
                    [f"{t.rows} x {t.context}", t.cold_ms * 1e3, t.warm_ms * 1e3, t.cold_gbs]
                    for t in result.attention
                ],
                title="paged decode attention, one layer (contexts of L/2..L tokens; "
                f"{result.kv_dtype} cache{'; CPU time' if result.cpu_clock else ''}): " + header,
            )
        )
    return "\n\n".join(parts)


def _case(text: str) -> tuple[int, int]:
    rows, _, context = text.partition("x")
    try:
        return int(rows), int(context)
    except ValueError:
        message = f"expected ROWSxCONTEXT (e.g. 64x500), got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The microbenchmarks' command-line options."""
    add_common_arguments(parser, profile=False)
    parser.add_argument("--rows", type=int, nargs="*", default=None, help="GEMM row counts")
    parser.add_argument(
        "--attention",
        type=_case,
        nargs="*",
        default=None,
        metavar="ROWSxCONTEXT",
        help="paged decode cases, e.g. 16x250 64x500",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds, best kept (5)")
    parser.add_argument("--threads", type=int, default=None, help="threads (torch's default)")
    parser.add_argument(
        "--kv-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the attention cases' KV cache dtype",
    )
    parser.add_argument(
        "--cpu-clock",
        action="store_true",
        help="time the attention cases by the process's CPU time (with --threads 1 on a "
        "shared machine)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    base = MicroConfig.quick() if args.quick else MicroConfig()
    config = dataclasses.replace(
        base,
        model=args.model,
        rows=base.rows if args.rows is None else tuple(args.rows),
        attention=base.attention if args.attention is None else tuple(args.attention),
        rounds=base.rounds if args.rounds is None else args.rounds,
        threads=args.threads,
        kv_dtype=args.kv_dtype,
        cpu_clock=args.cpu_clock,
    )
    result = measure_micro(config)
    print_result(result, format_micro(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.micro``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
