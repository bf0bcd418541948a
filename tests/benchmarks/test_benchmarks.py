"""The experiments and records of ``benchmarks/`` (benchmarks/README.md) in their quick form
on the tiny model: they run end to end and report well-formed, positive figures (never a
timing threshold); each runs from the repository root as ``python -m benchmarks.NAME``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks import ablation, grammars, http_body, micro, serve_cpu, soak, split, stepcost
from benchmarks.ablation import ALL_ON, AblationConfig, format_ablation, run_ablation
from benchmarks.http_body import HttpBodyConfig, format_http_body, run_http_body
from benchmarks.serve_cpu import ServeCpuConfig, format_serve_cpu, run_serve_cpu
from benchmarks.soak import SoakConfig, format_soak, run_soak
from benchmarks.split import SplitConfig, format_split, run_split
from benchmarks.stepcost import StepCostConfig, format_stepcost, run_stepcost
from pipeline.bench.workload import make_workload
from tests.pipeline.bench.test_bench import bench_parser

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = {
    "ablation": ablation,
    "grammars": grammars,
    "http_body": http_body,
    "micro": micro,
    "serve_cpu": serve_cpu,
    "soak": soak,
    "split": split,
    "stepcost": stepcost,
}


def parse(module: ModuleType, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed as ``python -m benchmarks.NAME`` parses it."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_each_takes_the_common_options_and_is_no_cli_subcommand(name: str) -> None:
    args = parse(EXPERIMENTS[name], ["--quick", "--json"])
    assert args.quick and args.json
    # moved out of the installed CLI: ``actorline bench NAME`` is refused
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["bench", name.replace("_", "-")])


def test_runs_from_the_repository_root_as_a_module() -> None:
    """``python -m benchmarks.NAME`` from a checkout: the package is found, its parser runs."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--concurrency" in result.stdout and "soak of the frontend" in result.stdout


def test_grammars_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """The grammar engines' measurement runs (``python -m benchmarks.grammars --quick --json``);
    xgrammar is measured only where installed."""
    import importlib.util

    assert grammars.main(["--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    engines = {engine["engine"]: engine for engine in result["engines"]}
    assert "llguidance" in engines and result["vocab_size"] == 49152 and result["batch"] == 4
    ll = engines["llguidance"]
    assert len(ll["compile_cold_ms"]) == 2 and ll["compile_cached_ms"] > 0
    assert ll["steps"] > 100 and 0 < ll["mask_p50_ms"] <= ll["mask_p99_ms"]
    if importlib.util.find_spec("xgrammar") is None:
        assert result["missing"] == ["xgrammar"] and result["ratios"] == {}
    else:
        assert set(engines) == {"llguidance", "xgrammar"} and len(result["ratios"]) == 2


@pytest.mark.slow
def test_split_quick(tiny_model_dir: Path) -> None:
    result = run_split(SplitConfig.quick(model=str(tiny_model_dir)))
    assert len(result.rows) == 2
    for row in result.rows:
        assert row.memory_tokens_per_second > 0 and row.zmq_tokens_per_second > 0
        assert row.zmq_over_memory == pytest.approx(
            row.zmq_tokens_per_second / row.memory_tokens_per_second
        )
    assert "split / single" in format_split(result)


@pytest.mark.slow
def test_stepcost_quick(tiny_model_dir: Path) -> None:
    """One stream of the tiny model with a sleeping forward pass: every decode step is timed,
    and the stream's figures are positive."""
    config = StepCostConfig.quick(model=str(tiny_model_dir), sleep_forward_ms=2.0)
    result = run_stepcost(config)
    assert result.tokens_per_second > 0 and result.ms_per_token > 0
    assert result.forward_ms > 0 and 0 < result.min_gap_ms <= result.gap_ms
    assert "gap between forward passes" in format_stepcost(result)
    with pytest.raises(ValueError, match="memory"):
        run_stepcost(StepCostConfig.quick(transport="zmq", sleep_forward_ms=2.0))


def test_http_body_quick(tiny_model_dir: Path) -> None:
    config = HttpBodyConfig(model=str(tiny_model_dir), bodies=2, body_mb=1.2, bystander_tokens=32)
    result = run_http_body(config)
    peer, capped = result.runs
    assert peer.max_request_bytes > 1_200_000 and 413 not in peer.statuses
    assert capped.statuses == (413, 413)
    assert capped.engine_alive and capped.bystander_finished
    for run in (peer, capped):
        assert run.peak_growth_mib >= 0 and run.answer_seconds > 0
    assert "peer / capped" in format_http_body(result)


def test_serve_cpu_quick(tiny_model_dir: Path) -> None:
    """``actorline serve`` streams 1 and then 2 streams; its own CPU time over each is read and
    spread over the tokens streamed."""
    result = run_serve_cpu(ServeCpuConfig(model=str(tiny_model_dir), streams=(1, 2), tokens=8))
    assert [(run.streams, run.tokens) for run in result.runs] == [(1, 8), (2, 16)]
    for run in result.runs:
        assert run.seconds > 0 and run.cpu_seconds >= 0 and run.cpu_ms_per_token >= 0
        assert run.host_loop_cpu_seconds >= 0 and run.host_loop_ms_per_token >= 0
    assert "serve CPU ms/token" in format_serve_cpu(result)
    assert "engine loop CPU ms/token" in format_serve_cpu(result)
    with pytest.raises(ValueError, match="format"):
        ServeCpuConfig(format="fp16")
    with pytest.raises(ValueError, match="positive"):
        ServeCpuConfig(streams=(0,))


def test_soak_quick() -> None:
    """Requests leave nothing for the cycle collector (the frontend's threshold is raised)."""
    result = run_soak(SoakConfig(requests=300, concurrency=32, warmup=20))
    assert result.gc_found == 0 and result.seconds > 0
    assert result.rss_after_mib >= 0 and "gc.collect()" in format_soak(result)


@pytest.mark.slow
def test_ablation_quick(tiny_model_dir: Path) -> None:
    config = AblationConfig.quick(model=str(tiny_model_dir))
    result = run_ablation(config)
    assert [variant.name for variant in result.variants] == list(config.variants)
    requested = sum(request.max_tokens for request in make_workload(config.workload))
    for variant in result.variants:
        # ignore_eos: every request generates exactly its max_tokens, in every variant
        assert variant.generated_tokens == requested
        assert variant.tokens_per_second > 0
        assert variant.prefill_seconds > 0 and variant.decode_seconds > 0
    table = format_ablation(result)
    assert f"vs {ALL_ON}" in table and "cpu_linears=False" in table
