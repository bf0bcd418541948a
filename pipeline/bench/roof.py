"""The GEMM roof: how fast the offline workload could run if its linear layers ran at this
machine's best fp32 GEMM rate at the model's own shapes and nothing else took any time.

It measures, in this process with torch's threads (all cores by default):

- the **FMA peak**: independent vector FMAs on registers only (``kernels/fma_peak.c``, the
  widest vector the compiler targets here), the ceiling of any kernel;
- the **GEMM rate** of every distinct linear shape of the model (the decoder layers' and the
  LM head's, enumerated from the model built on the meta device) at several row counts ``M``,
  for MKL (``F.linear``, what torch runs) and for actorline's packed-weight GEMM
  (:mod:`stages.execute.native`), interleaved round by round, best of the rounds each;

- the **read bandwidth** of memory (the faster of torch's sum and the probe's streaming read,
  ``kernels/fma_peak.c``, over a tensor far larger than the caches);

and counts the workload's linear FLOPs (:class:`~pipeline.bench.workload.WorkloadWork`: the
decoder layers over every prompt token less the block-level prefix-cache hits and over every
generated token fed back, the LM head over every generated token). The **roof** is the time
those FLOPs take at the best rate per shape over every ``M`` and both kernels (the MKL-only roof
is printed beside it); "x% of the roof" for a system is ``roof seconds / its seconds``.

Beside it, the **memory floor**: the bytes any engine must read at the measured bandwidth, at
least one forward pass per token of the longest request, each reading every weight, plus the
keys and values every fed-back token attends to. Decode steps of a small model on a CPU are
bound by it rather than by the FMAs, so a run can be slower than the roof however good its
kernels; both are lower bounds on the time, neither is reachable in full.

The **step bound** joins the two step by step: the prompts' tokens at the roof's rates, then
each decode step (every request in one batch from the start, the fewest passes) at the longer
of its FLOPs at the roof's rates and its bytes (every weight once, plus the keys and values its
rows attend) at the measured bandwidth. It is the tightest of the three lower bounds, still not
reachable in full (it assumes each step overlaps its compute and its memory traffic perfectly).

    actorline bench roof [--quick] [--json] [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main
from pipeline.bench.workload import (
    WorkloadSpec,
    WorkloadWork,
    make_workload,
    prompt_ids,
    workload_work,
)

__all__ = [
    "FMA_SOURCE",
    "GemmRate",
    "LinearShape",
    "ModelLinears",
    "Roof",
    "RoofConfig",
    "RoofResult",
    "add_arguments",
    "format_roof",
    "format_share",
    "kv_bytes_per_token",
    "main",
    "measure_bandwidth",
    "measure_fma_peak",
    "measure_roof",
    "model_linears",
    "roof_seconds",
    "run_from_args",
    "run_roof",
    "step_weight_bytes",
]

FMA_SOURCE = Path(__file__).with_name("kernels") / "fma_peak.c"
MKL = "mkl"
PACKED = "packed"
_TARGET_ROUND_SECONDS = 0.02  # each timing repeats a GEMM for about this long


@dataclasses.dataclass(frozen=True, slots=True)
class RoofConfig:
    """What to measure: the model, the row counts of the decoder layers' GEMMs and of the LM
    head's, how many interleaved rounds (best kept), the threads (``None``: torch's default),
    and the workload whose FLOPs the roof is for.

    Raises:
        ValueError: no row counts, a count below 1, or no rounds.
    """

    model: str = "smollm2-135m"
    layer_rows: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    head_rows: tuple[int, ...] = (16, 64, 256)
    rounds: int = 5
    threads: int | None = None
    workload: WorkloadSpec = dataclasses.field(default_factory=WorkloadSpec)
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("layer_rows", "head_rows"):
            rows = getattr(self, name)
            if not rows or min(rows) < 1:
                raise ValueError(f"{name} must be positive row counts, got {rows}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    @classmethod
    def quick(cls, **overrides: Any) -> RoofConfig:
        """A small configuration for smoke tests (numbers not meaningful)."""
        values: dict[str, Any] = {
            "layer_rows": (64, 256),
            "head_rows": (16,),
            "rounds": 1,
            "workload": WorkloadSpec(
                num_requests=8, min_filler=5, max_filler=20, max_tokens_choices=(8, 16)
            ),
        }
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class LinearShape:
    """One distinct linear shape ``y[M, n] = x[M, k] W[n, k]^T``, ``count`` times per token
    (per layer summed over the layers; 1 for the LM head); ``names``: the modules' kinds."""

    n: int
    k: int
    count: int
    names: tuple[str, ...]

    @property
    def flops_per_row(self) -> int:
        return 2 * self.n * self.k * self.count


@dataclasses.dataclass(frozen=True, slots=True)
class ModelLinears:
    """A model's linears: the decoder layers' shapes and the LM head's (``None`` if none)."""

    layers: tuple[LinearShape, ...]
    head: LinearShape | None

    @property
    def layer_flops_per_token(self) -> int:
        return sum(shape.flops_per_row for shape in self.layers)

    @property
    def head_flops_per_row(self) -> int:
        return self.head.flops_per_row if self.head is not None else 0

    def weight_bytes(self, element_size: int = 4) -> int:
        """Bytes of every linear's weight (the LM head once, tied or not)."""
        shapes = [*self.layers, *([self.head] if self.head is not None else [])]
        return sum(shape.n * shape.k * shape.count for shape in shapes) * element_size


@dataclasses.dataclass(frozen=True, slots=True)
class GemmRate:
    """The best rate (GFLOP/s) of one shape at ``rows`` rows with ``kernel`` ("mkl" or
    "packed")."""

    n: int
    k: int
    rows: int
    kernel: str
    gflops: float


@dataclasses.dataclass(frozen=True, slots=True)
class Roof:
    """The roof for one workload: its linear FLOPs and their seconds at the best rate per
    shape (``seconds``) and at MKL's best (``mkl_seconds``); the memory floor's bytes and
    seconds at ``bandwidth_gbs`` (0 and None when no bandwidth was measured)."""

    work: WorkloadWork
    flops: float
    seconds: float
    mkl_seconds: float
    weight_bytes: int = 0
    floor_bytes: float = 0.0
    bandwidth_gbs: float | None = None
    step_seconds: float | None = None

    @property
    def floor_seconds(self) -> float | None:
        """The memory floor, or None without a measured bandwidth."""
        if not self.bandwidth_gbs:
            return None
        return self.floor_bytes / (self.bandwidth_gbs * 1e9)

    @property
    def gflops(self) -> float:
        """The workload's effective rate at the roof."""
        return self.flops / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class RoofResult:
    """The measured rates, the FMA peak and the roof of the configured workload."""

    model: str
    threads: int
    fma_peak_gflops: float | None
    fma_lanes: int | None
    linears: ModelLinears
    rates: tuple[GemmRate, ...]
    roof: Roof
    load_average: tuple[float, float, float]
    cpu_count: int


def model_linears(model_dir: Path) -> ModelLinears:
    """The distinct ``nn.Linear`` shapes of the causal LM in ``model_dir``, from the model
    built on the meta device (no weights read): any architecture transformers builds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            kind = name.rsplit(".", 1)[-1]
            shapes.setdefault((module.out_features, module.in_features), []).append(kind)
    layers = tuple(
        LinearShape(n, k, len(kinds), tuple(sorted(set(kinds))))
        for (n, k), kinds in sorted(shapes.items())
    )
    head_shape = None
    if isinstance(head, torch.nn.Linear):
        head_shape = LinearShape(head.out_features, head.in_features, 1, ("lm_head",))
    return ModelLinears(layers, head_shape)


def step_weight_bytes(model_dir: Path, fmt: str, gguf: Path | None = None) -> int:
    """Bytes of weights one decode step reads with the model in ``model_dir`` in ``fmt`` (a
    :data:`pipeline.bench.llamacpp_peer.FORMATS` name): every linear once (the LM head once,
    tied or not) at its dtype's 4 or 2 bytes a weight, or, for the GGUF format, every tensor of
    the file ``gguf`` as the file stores it (its tied ``token_embd`` is the LM head).

    Raises:
        ValueError: an unknown format, or the GGUF format without a GGUF file.
    """
    from pipeline.bench.llamacpp_peer import FORMATS

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: one of {list(FORMATS)}")
    if FORMATS[fmt].quantization is None:
        return model_linears(model_dir).weight_bytes(4 if FORMATS[fmt].dtype == "float32" else 2)
    if gguf is None:
        raise ValueError(f"no GGUF file for {model_dir}: {fmt} reads the file's own weights")
    import mmap

    from stages.execute.quant.gguf_table import read_tensor_table

    with gguf.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _, tensors = read_tensor_table(data)
    return sum(tensor.nbytes or 0 for tensor in tensors)


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes of keys and values one token takes in the KV cache of the model in
    ``model_dir`` (every layer) at ``dtype`` ("float32", "bfloat16" or "float16")."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    element = 4 if dtype == "float32" else 2
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * element


def roof_seconds(
    linears: ModelLinears,
    rates: Sequence[GemmRate],
    work: WorkloadWork,
    *,
    bandwidth_gbs: float | None = None,
    kv_bytes_per_token: int = 0,
) -> Roof:
    """The roof of ``work`` (see the module docstring) from measured ``rates``, and its memory
    floor at ``bandwidth_gbs`` with ``kv_bytes_per_token`` bytes of keys and values per token.

    Raises:
        ValueError: a shape has no measured rate.
    """

    def best(shape: LinearShape, kernels: tuple[str, ...]) -> float:
        found = [
            rate.gflops
            for rate in rates
            if (rate.n, rate.k) == (shape.n, shape.k) and rate.kernel in kernels
        ]
        if not found or max(found) <= 0:
            raise ValueError(f"no measured rate for a {shape.n} x {shape.k} linear")
        return max(found) * 1e9

    def seconds(kernels: tuple[str, ...]) -> float:
        total = sum(work.layer_tokens * s.flops_per_row / best(s, kernels) for s in linears.layers)
        if linears.head is not None:
            total += work.head_rows * linears.head.flops_per_row / best(linears.head, kernels)
        return total

    flops = float(
        work.layer_tokens * linears.layer_flops_per_token
        + work.head_rows * linears.head_flops_per_row
    )
    weights = linears.weight_bytes()
    floor = float(work.forward_passes * weights + work.decode_context_tokens * kv_bytes_per_token)
    step_seconds = None
    if bandwidth_gbs:
        # Seconds per row at the roof's rates: one token through the layers, one head row.
        both = (MKL, PACKED)
        layer_row = sum(shape.flops_per_row / best(shape, both) for shape in linears.layers)
        head_row = linears.head.flops_per_row / best(linears.head, both) if linears.head else 0.0
        decoded = sum(work.decode_rows)
        prompts = work.layer_tokens - decoded  # prompt tokens less the prefix-cache hits
        step_seconds = prompts * layer_row + (work.head_rows - decoded) * head_row
        for rows, context in zip(work.decode_rows, work.decode_step_contexts):
            compute = rows * (layer_row + head_row)
            memory = (weights + context * kv_bytes_per_token) / (bandwidth_gbs * 1e9)
            step_seconds += max(compute, memory)
    return Roof(
        work,
        flops,
        seconds((MKL, PACKED)),
        seconds((MKL,)),
        weight_bytes=weights,
        floor_bytes=floor,
        bandwidth_gbs=bandwidth_gbs,
        step_seconds=step_seconds,
    )


def measure_bandwidth(rounds: int = 3, megabytes: int = 256) -> float:
    """The best memory read rate (GB/s) over ``rounds`` passes over a ``megabytes`` tensor, far
    beyond any cache, of torch's threads: the faster of torch's ``sum`` and, where the C
    compiler works, the probe's streaming read (``kernels/fma_peak.c``, independent vector
    accumulators; torch's sum read 18-19 GB/s where the probe and the packed GEMM at one row
    read 21-23 on 2 Zen 3 cores, so a bound taken at torch's rate was not one)."""
    import torch

    from stages.execute.native import NativeKernelError

    data = torch.ones(megabytes * 2**20 // 4)
    try:
        library = _fma_library()
    except (NativeKernelError, OSError):
        library = None
    threads = torch.get_num_threads()
    best = 0.0
    for _ in range(rounds + 1):  # the first pass also faults the pages in
        began = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - began) / 1e9)
        if library is not None:
            began = time.perf_counter()
            library.actorline_read_run(data.data_ptr(), data.numel(), threads)
            best = max(best, data.numel() * 4 / (time.perf_counter() - began) / 1e9)
    return best


@functools.cache
def _fma_library() -> Any:
    from stages.execute.native import build_library

    library = ctypes.CDLL(str(build_library(FMA_SOURCE)))
    library.actorline_fma_run.restype = ctypes.c_double
    library.actorline_fma_run.argtypes = [
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_float),
    ]
    library.actorline_fma_lanes.restype = ctypes.c_int
    library.actorline_read_run.restype = ctypes.c_double
    library.actorline_read_run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return library


def measure_fma_peak(threads: int, rounds: int = 3) -> tuple[float, int] | None:
    """The best FMA rate (GFLOP/s) of ``threads`` threads over ``rounds`` runs of about 0.1 s,
    and the vector lanes; ``None`` where no C compiler builds the probe."""
    from stages.execute.native import NativeKernelError

    try:
        library = _fma_library()
    except (NativeKernelError, OSError):
        return None
    sink = ctypes.c_float()
    iterations = 1_000_000
    best = 0.0
    for _ in range(rounds):
        began = time.perf_counter()
        flops = library.actorline_fma_run(iterations, threads, ctypes.byref(sink))
        elapsed = time.perf_counter() - began
        best = max(best, flops / elapsed / 1e9)
        if elapsed < 0.1:  # NOTE: size the next run to about 0.1 s
            iterations = int(iterations * 0.1 / max(elapsed, 1e-4))
    return best, int(library.actorline_fma_lanes())


def _time_call(function: Callable[[], object]) -> float:
    """Seconds per call: the best of a few calls repeated for about a round's length."""
    began = time.perf_counter()
    function()
    first = time.perf_counter() - began
    repeats = max(1, min(50, int(_TARGET_ROUND_SECONDS / max(first, 1e-6))))
    best = first
    for _ in range(repeats):
        began = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - began)
    return best


def _measure_rates(linears: ModelLinears, config: RoofConfig) -> tuple[GemmRate, ...]:
    import torch
    import torch.nn.functional as F

    from stages.execute.native import GEMM_PANEL, packed_gemm_kernel

    kernel = packed_gemm_kernel()
    generator = torch.Generator().manual_seed(0)
    cases: list[tuple[LinearShape, int]] = [
        (shape, rows) for shape in linears.layers for rows in config.layer_rows
    ]
    if linears.head is not None:
        cases += [(linears.head, rows) for rows in config.head_rows]
    best: dict[tuple[int, int, int, str], float] = {}
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for shape, _ in cases:
        if (shape.n, shape.k) not in weights:
            weight = torch.randn(shape.n, shape.k, generator=generator) * shape.k**-0.5
            packed = (
                kernel.pack(weight) if kernel is not None and shape.n % GEMM_PANEL == 0 else None
            )
            weights[(shape.n, shape.k)] = (weight, packed)
    with torch.inference_mode():
        for _ in range(config.rounds):
            for shape, rows in cases:
                weight, packed = weights[(shape.n, shape.k)]
                x = torch.randn(rows, shape.k, generator=generator)
                flops = 2.0 * rows * shape.n * shape.k
                runs: list[tuple[str, Callable[[], object]]] = [
                    (MKL, functools.partial(F.linear, x, weight))
                ]
                if kernel is not None and packed is not None:
                    runs.append((PACKED, functools.partial(kernel, x, packed, None)))
                for name, run in runs:
                    rate = flops / _time_call(run) / 1e9
                    key = (shape.n, shape.k, rows, name)
                    best[key] = max(best.get(key, 0.0), rate)
    return tuple(GemmRate(n, k, rows, name, rate) for (n, k, rows, name), rate in best.items())


def measure_roof(config: RoofConfig) -> RoofResult:
    """Measure the FMA peak and the GEMM rates, and compute the workload's roof (see the
    module docstring), in this process."""
    import torch

    from stages.models import resolve_model
    from stages.tokenize import load_tokenizer

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    threads = torch.get_num_threads()
    load_average = os.getloadavg()
    resolved = resolve_model(config.model)
    linears = model_linears(resolved.path)
    tokenizer = load_tokenizer(config.model)
    requests = make_workload(config.workload)
    work = workload_work(
        [prompt_ids(tokenizer, request.prompt) for request in requests],
        [request.max_tokens for request in requests],
        config.block_size,
    )
    peak = measure_fma_peak(threads)
    rates = _measure_rates(linears, config)
    bandwidth = measure_bandwidth()
    roof = roof_seconds(
        linears,
        rates,
        work,
        bandwidth_gbs=bandwidth,
        kv_bytes_per_token=kv_bytes_per_token(resolved.path, "float32"),
    )
    return RoofResult(
        model=config.model,
        threads=threads,
        fma_peak_gflops=peak[0] if peak is not None else None,
        fma_lanes=peak[1] if peak is not None else None,
        linears=linears,
        rates=rates,
        roof=roof,
        load_average=load_average,
        cpu_count=os.cpu_count() or 0,
    )


def run_roof(config: RoofConfig) -> RoofResult:
    """:func:`measure_roof` in a freshly spawned process, so the caller's threads and
    allocator state stay its own (the result comes back pickled between our processes)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure_roof, config).result()


def format_share(roof: Roof | None, seconds: float) -> str:
    """``seconds`` as a share of the roof (``"61%"``), or ``"-"`` without one."""
    if roof is None or seconds <= 0:
        return "-"
    return f"{100.0 * roof.seconds / seconds:.0f}%"


def format_roof(result: RoofResult) -> str:
    """The readable report: the rates per shape and kernel, then the roof."""
    linears = result.linears
    shapes = [*linears.layers, *([linears.head] if linears.head is not None else [])]
    kernels = sorted({rate.kernel for rate in result.rates})
    rows: list[list[object]] = []
    for shape in shapes:
        for count in sorted({rate.rows for rate in result.rates if rate.n == shape.n}):
            row: list[object] = [f"{shape.n} x {shape.k} ({'/'.join(shape.names)})", count]
            for kernel in kernels:
                match = [
                    rate.gflops
                    for rate in result.rates
                    if (rate.n, rate.k, rate.rows, rate.kernel) == (shape.n, shape.k, count, kernel)
                ]
                row.append(match[0] if match else None)
            rows.append(row)
    roof = result.roof
    work = roof.work
    peak = (
        f"{result.fma_peak_gflops:,.0f} GFLOP/s ({result.fma_lanes}-float vectors)"
        if result.fma_peak_gflops is not None
        else "unavailable (no C compiler)"
    )
    lines = [
        format_table(
            ["linear (N x K)", "M", *[f"{kernel} GFLOP/s" for kernel in kernels]],
            rows,
            title=f"GEMM rates: {result.model}, fp32, {result.threads} threads; "
            f"{result.cpu_count} CPUs, load average {result.load_average[0]:.2f} at start",
        ),
        f"FMA peak, {result.threads} threads: {peak}",
        f"workload: {work.prompt_tokens:,} prompt tokens ({work.cached_prompt_tokens:,} "
        f"prefix-cacheable), {work.generated_tokens:,} generated; decoder layers over "
        f"{work.layer_tokens:,} tokens, LM head over {work.head_rows:,} rows: "
        f"{roof.flops / 1e12:.3f} TFLOP of linears",
        f"roof: {roof.seconds:.2f} s at the best rate per shape ({roof.gflops:,.0f} GFLOP/s "
        f"effective, {work.generated_tokens / roof.seconds:,.0f} generated tokens/s); MKL "
        f"alone: {roof.mkl_seconds:.2f} s",
    ]
    if roof.floor_seconds is not None:
        kv_bytes = roof.floor_bytes - work.forward_passes * roof.weight_bytes
        lines.append(
            f"memory floor: {roof.floor_seconds:.2f} s at {roof.bandwidth_gbs:.1f} GB/s (read "
            f"bandwidth): at least {work.forward_passes} forward passes each reading "
            f"{roof.weight_bytes / 1e6:,.0f} MB of weights, plus {kv_bytes / 1e9:.1f} GB of "
            f"keys and values read by decode rows"
        )
    if roof.step_seconds is not None:
        lines.append(
            f"step bound: {roof.step_seconds:.2f} s (the prompts at the roof's rates, then each "
            f"decode step at the longer of its FLOPs and its bytes); the roof is "
            f"{100.0 * roof.seconds / roof.step_seconds:.0f}% of it"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The roof benchmark's command-line options."""
    add_common_arguments(parser, profile=False)
    parser.add_argument("--threads", type=int, default=None, help="threads (torch's default)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (5)")
    parser.add_argument("--requests", type=int, default=None, help="workload requests (64)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")


def config_from_args(args: argparse.Namespace) -> RoofConfig:
    """The configuration the options ask for (``--quick`` shrinks the defaults)."""
    base = RoofConfig.quick() if args.quick else RoofConfig()
    workload = dataclasses.replace(base.workload, seed=args.seed)
    if args.requests is not None:
        workload = dataclasses.replace(workload, num_requests=args.requests)
    return dataclasses.replace(
        base,
        model=args.model,
        threads=args.threads,
        rounds=base.rounds if args.rounds is None else args.rounds,
        workload=workload,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    result = run_roof(config_from_args(args))
    print_result(result, format_roof(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``actorline bench roof``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)
