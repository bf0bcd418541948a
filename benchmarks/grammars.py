"""Grammar engines for structured outputs: llguidance against xgrammar, on the model's tokenizer.

The measurement that chose the built-in backend (``docs/performance.md``, "Grammar engines").
For one realistic JSON schema (an order: nested object, array of objects, enums, required
fields, ``uuid`` / ``email`` / ``date-time`` formats, a pattern, integer bounds; flexible
whitespace, as vLLM's default) and each engine installed:

- compile time, cold: a fresh compiler with no cache, median of ``--repeats`` compiles (the
  engines alternate, so both see the same machine load); and cached: the second compile of
  the same schema through actorline's :class:`~stages.structured.manager.GrammarManager` for
  llguidance (its cache, plus the template's deep copy) and through xgrammar's own
  ``GrammarCompiler`` cache;
- per-token mask time at batch 32: 32 matchers walk 32 different valid documents token by
  token; each step fills all 32 rows of the bitmask (each engine's batched fill: llguidance's
  ``LLExecutor`` through the engine's own :class:`~stages.structured.manager.GrammarManager`,
  xgrammar's ``BatchGrammarMatcher``, both on up to 4 threads) and advances every matcher by
  its document's token; the engines alternate step by step. Mean, median and 99th percentile
  of the fill per step.

xgrammar is not a dependency of actorline (it needs triton, about 1 GB, on x86-64 Linux):
``pip install xgrammar`` to include it; without it only llguidance is measured.

    python -m benchmarks.grammars [--quick] [--json] [--repeats N] [--batch 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main
from pipeline.bench.workload import ORDER_SCHEMA

__all__ = [
    "ORDER_SCHEMA",
    "EngineResult",
    "GrammarBenchConfig",
    "GrammarBenchResult",
    "add_arguments",
    "format_grammars",
    "main",
    "order_document",
    "run_from_args",
    "run_grammars",
]

LLGUIDANCE = "llguidance"
XGRAMMAR = "xgrammar"


def order_document(index: int) -> dict[str, Any]:
    """A valid instance of :data:`ORDER_SCHEMA`, different for each ``index``."""
    draw = random.Random(index)
    return {
        "id": f"3f2b6c1e-8a4d-4b7e-9c2f-{draw.randrange(10**12):012d}",
        "customer": {
            "name": f"{draw.choice(['Ada Lovelace', 'Alan Turing', 'Grace Hopper'])} {index}",
            "email": f"user{index}@example.com",
            "tier": draw.choice(["free", "pro", "enterprise"]),
        },
        "items": [
            {
                "sku": f"ABC-{draw.randrange(10000):04d}",
                "quantity": draw.randint(1, 100),
                "price": round(draw.random() * 100, 2),
            }
            for _ in range(draw.randint(1, 4))
        ],
        "placed": f"2024-05-{draw.randint(1, 28):02d}T10:{draw.randint(0, 59):02d}:00Z",
        "status": draw.choice(["pending", "paid", "shipped", "cancelled"]),
        "notes": draw.choice([None, "leave at the door, please"]),
    }


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarBenchConfig:
    """``repeats``: cold compiles per engine; ``batch``: matchers filled per step.

    Raises:
        ValueError: a count below 1.
    """

    model: str = "smollm2-135m"
    repeats: int = 5
    batch: int = 32

    def __post_init__(self) -> None:
        for name in ("repeats", "batch"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineResult:
    """One engine: its version, tokenizer setup, cold compiles (each, ms), a cached compile
    (ms), and the per-step fill of ``batch`` rows over ``steps`` steps (ms)."""

    engine: str
    version: str
    tokenizer_setup_ms: float
    compile_cold_ms: tuple[float, ...]
    compile_cold_median_ms: float
    compile_cached_ms: float
    steps: int
    mask_mean_ms: float
    mask_p50_ms: float
    mask_p99_ms: float


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarBenchResult:
    """Every engine measured, xgrammar / llguidance ratios (above 1: llguidance is faster),
    and the engines that could not be measured (not installed)."""

    model: str
    vocab_size: int
    batch: int
    engines: tuple[EngineResult, ...]
    ratios: dict[str, float]
    missing: tuple[str, ...]
    load_average: tuple[float, float, float]
    cpu_count: int


class _Llguidance:
    name = LLGUIDANCE

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import llguidance

        from stages.structured.manager import GrammarConfig, GrammarManager

        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"
        self._tokenizer = tokenizer
        self._vocab, self._eos = vocab, eos
        began = time.perf_counter()
        self._manager = GrammarManager(
            GrammarConfig("unused"), tokenizer_loader=lambda model: tokenizer
        )
        self._manager.set_engine_info(vocab, [eos])
        self._manager.compile(_params('{"type": "string"}'))  # loads the backend
        self.setup_ms = (time.perf_counter() - began) * 1e3

    def compile_cold(self, schema: str) -> float:
        from stages.structured.llguidance import LLGuidanceBackend

        backend = self._manager.backend()
        assert isinstance(backend, LLGuidanceBackend)
        began = time.perf_counter()
        backend.compile(_params(schema))
        return (time.perf_counter() - began) * 1e3

    def compile_cached(self, schema: str) -> float:
        self._manager.compile(_params(schema))
        began = time.perf_counter()
        compiled = self._manager.compile(_params(schema))
        compiled.matcher()
        return (time.perf_counter() - began) * 1e3

    def start(self, schema: str, documents: Sequence[Sequence[int]]) -> None:
        compiled = self._manager.compile(_params(schema))
        self._documents = documents
        self._ids = [f"r{i}" for i in range(len(documents))]
        for request_id in self._ids:
            self._manager.start(request_id, compiled)

    def step(self, index: int) -> float:
        """Fill every row's mask (timed, ms), then advance each matcher by its token."""
        began = time.perf_counter()
        self._manager.bitmask(self._ids)
        elapsed = (time.perf_counter() - began) * 1e3
        for request_id, document in zip(self._ids, self._documents, strict=True):
            if not self._manager.accept(request_id, [document[index]]):
                raise RuntimeError(f"llguidance refused token {index} of a valid document")
        return elapsed


class _Xgrammar:
    name = XGRAMMAR

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import importlib.metadata

        import xgrammar

        self._xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        began = time.perf_counter()
        self._info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[eos]
        )
        self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=_threads())
        self.setup_ms = (time.perf_counter() - began) * 1e3
        self._vocab = vocab

    def compile_cold(self, schema: str) -> float:
        compiler = self._xgr.GrammarCompiler(
            self._info, max_threads=_threads(), cache_enabled=False
        )
        began = time.perf_counter()
        compiler.compile_json_schema(schema, any_whitespace=True)
        return (time.perf_counter() - began) * 1e3

    def compile_cached(self, schema: str) -> float:
        self._compiler.compile_json_schema(schema, any_whitespace=True)
        began = time.perf_counter()
        compiled = self._compiler.compile_json_schema(schema, any_whitespace=True)
        self._xgr.GrammarMatcher(compiled)
        return (time.perf_counter() - began) * 1e3

    def start(self, schema: str, documents: Sequence[Sequence[int]]) -> None:
        xgr = self._xgr
        compiled = self._compiler.compile_json_schema(schema, any_whitespace=True)
        self._documents = documents
        self._matchers = [xgr.GrammarMatcher(compiled) for _ in documents]
        self._batch = xgr.BatchGrammarMatcher(max_threads=_threads())
        self._bitmask = np.empty((len(documents), (self._vocab + 31) // 32), dtype=np.int32)

    def step(self, index: int) -> float:
        """Fill every row's mask (timed, ms), then advance each matcher by its token."""
        began = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask(self._matchers, self._bitmask)
        elapsed = (time.perf_counter() - began) * 1e3
        for matcher, document in zip(self._matchers, self._documents, strict=True):
            if not matcher.accept_token(document[index]):
                raise RuntimeError(f"xgrammar refused token {index} of a valid document")
        return elapsed


def _params(schema: str) -> Any:
    from stages.structured.params import StructuredOutputsParams

    return StructuredOutputsParams(json=schema)


def _threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _available() -> tuple[list[type[_Llguidance] | type[_Xgrammar]], list[str]]:
    """The engines that are installed, and the names of those that are not."""
    import importlib.util

    found: list[type[_Llguidance] | type[_Xgrammar]] = []
    missing: list[str] = []
    for engine in (_Llguidance, _Xgrammar):
        if importlib.util.find_spec(engine.name) is not None:
            found.append(engine)
        else:
            missing.append(engine.name)
    return found, missing


def run_grammars(config: GrammarBenchConfig) -> GrammarBenchResult:
    """Measure every installed engine (see the module docstring)."""
    from stages.models import resolve_model
    from stages.tokenize import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    vocab = _model_vocab(resolve_model(config.model).path, len(tokenizer))
    eos = int(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
    schema = json.dumps(ORDER_SCHEMA)
    documents = [
        tokenizer.encode(json.dumps(order_document(i)), add_special_tokens=False)
        for i in range(config.batch)
    ]
    load_average = os.getloadavg()
    classes, missing = _available()
    engines = [cls(tokenizer, vocab, eos) for cls in classes]
    cold: dict[str, list[float]] = {engine.name: [] for engine in engines}
    for _ in range(config.repeats):  # interleaved: both engines see the same load
        for engine in engines:
            cold[engine.name].append(engine.compile_cold(schema))
    masks: dict[str, list[float]] = {engine.name: [] for engine in engines}
    for engine in engines:
        engine.start(schema, documents)
    for index in range(min(len(d) for d in documents)):  # interleaved, step by step
        for engine in engines:
            masks[engine.name].append(engine.step(index))
    results: list[EngineResult] = []
    for engine in engines:
        cached = engine.compile_cached(schema)
        times = sorted(masks[engine.name])
        results.append(
            EngineResult(
                engine=engine.name,
                version=engine.version,
                tokenizer_setup_ms=engine.setup_ms,
                compile_cold_ms=tuple(cold[engine.name]),
                compile_cold_median_ms=statistics.median(cold[engine.name]),
                compile_cached_ms=cached,
                steps=len(times),
                mask_mean_ms=statistics.fmean(times),
                mask_p50_ms=times[len(times) // 2],
                mask_p99_ms=times[min(len(times) - 1, int(len(times) * 0.99))],
            )
        )
    by_name = {result.engine: result for result in results}
    ratios: dict[str, float] = {}
    if LLGUIDANCE in by_name and XGRAMMAR in by_name:
        ll, xg = by_name[LLGUIDANCE], by_name[XGRAMMAR]
        ratios["compile cold: xgrammar / llguidance"] = (
            xg.compile_cold_median_ms / ll.compile_cold_median_ms
        )
        ratios["mask per step: xgrammar / llguidance"] = xg.mask_mean_ms / ll.mask_mean_ms
    return GrammarBenchResult(
        model=config.model,
        vocab_size=vocab,
        batch=config.batch,
        engines=tuple(results),
        ratios=ratios,
        missing=tuple(missing),
        load_average=load_average,
        cpu_count=os.cpu_count() or 0,
    )


def _model_vocab(model_dir: Any, fallback: int) -> int:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return fallback
    text = config.get("text_config") or config
    return int(text.get("vocab_size") or fallback)


def format_grammars(result: GrammarBenchResult) -> str:
    """The readable report."""
    rows = [
        [
            f"{e.engine} {e.version}",
            e.tokenizer_setup_ms,
            e.compile_cold_median_ms,
            e.compile_cached_ms,
            e.mask_mean_ms,
            e.mask_p50_ms,
            e.mask_p99_ms,
        ]
        for e in result.engines
    ]
    lines = [
        format_table(
            [
                "engine",
                "tokenizer ms",
                "compile cold ms",
                "cached ms",
                f"mask/step ms (batch {result.batch})",
                "p50",
                "p99",
            ],
            rows,
            title=f"grammar engines: order schema, {result.model} tokenizer (vocabulary "
            f"{result.vocab_size:,}); {result.cpu_count} CPUs, load average "
            f"{result.load_average[0]:.2f} at start",
        )
    ]
    for name, ratio in result.ratios.items():
        lines.append(f"ratio {name}: {ratio:.2f}x")
    for name in result.missing:
        lines.append(f"{name}: not installed (pip install {name}), not measured")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The grammar benchmark's command-line options."""
    add_common_arguments(parser, profile=False)
    parser.add_argument("--repeats", type=int, default=None, help="cold compiles per engine (5)")
    parser.add_argument("--batch", type=int, default=None, help="matchers per step (32)")


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    base = GrammarBenchConfig(repeats=2, batch=4) if args.quick else GrammarBenchConfig()
    config = dataclasses.replace(
        base,
        model=args.model,
        repeats=base.repeats if args.repeats is None else args.repeats,
        batch=base.batch if args.batch is None else args.batch,
    )
    result = run_grammars(config)
    print_result(result, format_grammars(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.grammars``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
