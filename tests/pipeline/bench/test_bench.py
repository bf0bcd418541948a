"""The benchmarks in their --quick form on the tiny model: they run end to end and report
well-formed, positive figures (never a timing threshold). Plus their pure helpers."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.bench.workload import (
    FILLER_WORDS,
    TOPICS,
    WorkloadSpec,
    make_workload,
    percentile,
    poisson_arrivals,
)


def bench_parser() -> argparse.ArgumentParser:
    from pipeline.cli import bench as _cli_bench

    parser = argparse.ArgumentParser(prog="actorline")
    _cli_bench.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


# -- pure helpers ------------------------------------------------------------------------------


def test_workload_is_fixed_by_its_seed() -> None:
    spec = WorkloadSpec()
    requests = make_workload(spec)
    assert requests == make_workload(spec)
    assert requests != make_workload(WorkloadSpec(seed=1))
    assert len(requests) == 64
    assert {r.max_tokens for r in requests} == {16, 32, 64, 128}
    for item in requests:
        head, _, filler = item.prompt.partition(". ")
        assert head.removeprefix("Write about ") in TOPICS
        words = filler.split()
        assert 5 <= len(words) <= 120 and set(words) <= set(FILLER_WORDS)
    with pytest.raises(ValueError, match="max_filler"):
        WorkloadSpec(min_filler=10, max_filler=5)


def test_poisson_arrivals_and_percentiles() -> None:
    arrivals = poisson_arrivals(4.0, 2000, seed=3)
    assert arrivals == poisson_arrivals(4.0, 2000, seed=3)
    assert all(b > a for a, b in itertools.pairwise(arrivals))
    assert arrivals[-1] / len(arrivals) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 3, seed=0)
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_cli_lists_every_benchmark() -> None:
    parser = bench_parser()
    names = (
        "offline", "online", "latency", "ceiling", "roof", "quantization", "coldstart",
        "transports",
    )  # fmt: skip
    for name in names:
        args = parser.parse_args(["bench", name, "--quick", "--json"])
        assert args.benchmark == name and args.quick and args.json and callable(args.run)
    args = parser.parse_args(["bench", "offline", "--peer", "vllm", "--repeats", "2"])
    assert args.peer == ["vllm"] and args.repeats == 2
    from pipeline.bench.offline import config_from_args

    config = config_from_args(args)
    assert config.vllm_variants == ("default", "all-cores") and config.repeats == 2
    args = parser.parse_args(["bench", "offline", "--peer", "vllm", "--vllm-variant", "default"])
    assert config_from_args(args).vllm_variants == ("default",)
    assert config_from_args(parser.parse_args(["bench", "offline"])).vllm_variants == ()
    args = parser.parse_args(["bench", "ceiling", "--profile", "--requests", "8"])
    assert args.profile and args.requests == 8 and args.tune_gc
    assert not parser.parse_args(["bench", "ceiling", "--no-tune-gc"]).tune_gc


@pytest.mark.parametrize("benchmark", ["ceiling", "offline"])
def test_ray_options_are_one_pair_per_benchmark(benchmark: str) -> None:
    from pipeline.bench.report import asks_for_ray

    parser = bench_parser()
    assert not asks_for_ray(parser.parse_args(["bench", benchmark]))
    anywhere = parser.parse_args(["bench", benchmark, "--ray"])
    assert asks_for_ray(anywhere) and anywhere.ray == ""  # RAY_ADDRESS or a local cluster
    named = parser.parse_args(["bench", benchmark, "--ray", "10.0.0.1:6379"])
    assert asks_for_ray(named) and named.ray == "10.0.0.1:6379"
    alone = parser.parse_args(["bench", benchmark, "--ray-auth-token-file", "/token"])
    with pytest.raises(ValueError, match="give --ray too"):
        asks_for_ray(alone)


# -- the benchmarks, --quick, on the tiny model ------------------------------------------------


@pytest.mark.slow
def test_ceiling_quick_via_the_cli(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = bench_parser().parse_args(
        ["bench", "ceiling", "--quick", "--json", "--profile", "--model", str(tiny_model_dir)]
    )
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_requests"] == 32 and result["max_tokens"] == 32
    (run,) = result["runs"]
    assert run["tokens"] == 32 * 32  # every token reached the callers
    assert run["seconds"] > 0 and run["tokens_per_second"] > 0 and run["engine_steps"] > 0
    assert result["best_tokens_per_second"] == run["tokens_per_second"]
    assert result["target_tokens_per_second"] == 50_000
    profile = result["profile"]
    stages = {row["stage"]: row for row in profile["stages"] if row["stage"] != "transport"}
    assert set(stages) == {
        "tokenize", "admit", "schedule", "execute", "detokenize", "stop_check", "parse"
    }  # fmt: skip
    # each host's cross-host links: encoding and decoding, measured in the links
    transport = {row["host"]: row for row in profile["stages"] if row["stage"] == "transport"}
    assert set(transport) == {"main", "engine"}
    assert all(row["handled"] > 0 and row["seconds"] > 0 for row in transport.values())
    assert [row["stage"] for row in profile["stages"]][-2:] == ["transport", "transport"]
    assert stages["tokenize"]["handled"] == 32
    # NOTE: the API learns the step count from outputs, the profile from the stages' statistics,
    # so a free-only step (one that frees finished requests and emits nothing) can fall on
    # either side: the warm-up's last one can be in the profile's "before" snapshot but reach
    # the API only with the run's first output (one more in engine_steps), and the run's last
    # one can be in the "after" snapshot but in no output (one or two more in the profile).
    steps = stages["execute"]["handled"]
    assert run["engine_steps"] - 1 <= steps <= run["engine_steps"] + 2
    assert all(row["seconds"] > 0 for row in stages.values())
    assert {row["host"] for row in profile["hosts"]} == {"main", "engine"}
    links = {row["link"]: row for row in profile["links"]}
    assert steps - 1 <= links["schedule.out → detokenize.in"]["messages"] <= steps


@pytest.mark.slow
def test_offline_quick(tiny_model_dir: Path) -> None:
    from pipeline.bench.offline import OfflineConfig, format_offline, run_offline

    result = run_offline(OfflineConfig.quick(model=str(tiny_model_dir), profile=True))
    names = [system.name for system in result.systems]
    assert names == [
        "actorline (zmq)",
        "actorline (memory)",
        "HF generate (static batches)",
        "HF continuous batching",
    ]
    assert result.roof is not None and result.roof.seconds > 0
    for system in result.systems:
        # ignore_eos everywhere: every system generates exactly the requested tokens
        assert system.generated_tokens == result.requested_tokens > 0
        assert system.seconds > 0 and system.tokens_per_second > 0
        assert system.roof_share == pytest.approx(result.roof.seconds / system.seconds)
        assert system.runs == (system.tokens_per_second,)
    assert set(result.ratios) == {
        f"{ours} / {theirs}" for ours in names[:2] for theirs in names[2:]
    }
    assert all(ratio > 0 for ratio in result.ratios.values())
    assert [check.requests_checked for check in result.greedy_checks] == [2, 2]
    assert result.engine_peak_rss_bytes is not None and result.engine_peak_rss_bytes > 0
    # the engine run with its default KV budget (an engine start of its own, checked here too)
    budget = result.default_budget
    assert budget is not None and budget.num_blocks > 0 and budget.tokens_per_second > 0
    assert set(result.profiles) == {"actorline (zmq)", "actorline (memory)"}
    text = format_offline(result)
    assert "HF continuous batching" in text and "peak RSS" in text and "greedy check" in text
    assert "% roof" in text and "roof:" in text


@pytest.mark.slow
def test_offline_structured_quick_via_the_cli(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unconstrained against half the requests JSON-constrained, same workload, one run."""
    args = bench_parser().parse_args(
        ["bench", "offline", "--quick", "--json", "--structured", "--model", str(tiny_model_dir)]
    )
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    names = [system["name"] for system in result["systems"]]
    assert names == ["actorline (zmq)", "actorline (zmq), half the requests JSON-constrained"]
    for system in result["systems"]:
        assert system["generated_tokens"] == result["requested_tokens"] > 0
    assert set(result["ratios"]) == {"structured / unconstrained (zmq)"}
    assert result["ratios"]["structured / unconstrained (zmq)"] > 0
    compile_times = result["grammar_compile"]
    assert compile_times["cold_ms"] > 0 and compile_times["cached_ms"] > 0
    assert result["greedy_checks"] == [] and result["default_budget"] is None


@pytest.mark.slow  # five fresh processes (decode and offline per system, accuracy): 48 s in CI
def test_quantization_quick(tiny_model_dir: Path) -> None:
    from pipeline.bench.quantization import (
        QuantizationBenchConfig,
        format_quantization,
        run_quantization,
    )

    # The tiny model is an HF checkpoint: fp32 and int8 (gguf needs a GGUF model).
    result = run_quantization(QuantizationBenchConfig.quick(model=str(tiny_model_dir)))
    assert [summary.system for summary in result.systems] == ["fp32", "int8"]
    fp32, int8 = result.systems
    assert int8.weight_bytes < fp32.weight_bytes / 2
    for summary in result.systems:
        (decode,) = summary.decode_tokens_per_second
        (offline,) = summary.offline_tokens_per_second
        assert decode > 0 and offline > 0
        assert summary.decode_peak_rss_bytes and summary.engine_peak_rss_bytes
    assert set(result.ratios["int8"]) == {"weight memory", "batch-1 decode", "offline throughput"}
    (accuracy,) = result.accuracy
    assert accuracy.prompts == 2
    if accuracy.int8_activations:
        # int8 activations (a CPU with VNNI) round each linear's inputs too: close, not equal
        assert accuracy.mean_logit_diff_deq < 0.05 and accuracy.agreement_deq > 0
    else:
        # the same dequantized weights: the runner's greedy tokens are HF's
        assert accuracy.identical_deq == accuracy.prompts
        assert accuracy.mean_logit_diff_deq < 1e-3
    text = format_quantization(result)
    assert "int8 / fp32" in text and "accuracy int8" in text


@pytest.mark.slow
def test_online_quick(tiny_model_dir: Path) -> None:
    from pipeline.bench.online import OnlineConfig, format_online, run_online

    result = run_online(OnlineConfig.quick(model=str(tiny_model_dir)))
    assert [rate.rate for rate in result.rates] == [4.0, 8.0]
    for rate in result.rates:
        assert rate.requests == 4 and rate.output_tokens >= 4 * 8
        for value in (rate.ttft_p50_ms, rate.ttft_p99_ms, rate.itl_p50_ms, rate.itl_p99_ms,
                      rate.tokens_per_second, rate.mean_latency_ms):  # fmt: skip
            assert value > 0
        assert rate.ttft_p99_ms >= rate.ttft_p50_ms and rate.itl_p99_ms >= rate.itl_p50_ms
    assert "TTFT p50" in format_online(result)


def test_transports_quick() -> None:
    """``actorline bench transports`` runs every link and its raw peers on the same bytes and
    prints the ratios as JSON, and nothing else: no gRPC log line amid the figures."""
    command = ["bench", "transports", "--quick", "--json", "--sizes", "10000"]
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    rows = {(row["transport"], row["zstd"]): row for row in json.loads(result.stdout)}
    assert set(rows) == {
        (name, zstd) for name in ("memory", "zmq", "grpc") for zstd in (False, True)
    } - {("memory", True)}
    for (name, _), row in rows.items():
        assert row["size"] == 10_000 and row["link_msgs_per_s"] > 0
        assert row["link_p50_us"] > 0 and row["link_p99_us"] >= row["link_p50_us"]
        if name != "memory":  # measured against the raw library in the same run
            assert row["raw_msgs_per_s"] > 0
            assert row["ratio"] == pytest.approx(row["link_msgs_per_s"] / row["raw_msgs_per_s"])
    grpc = rows["grpc", False]
    assert grpc["raw_batched_msgs_per_s"] > 0
    assert grpc["batched_ratio"] == pytest.approx(
        grpc["link_msgs_per_s"] / grpc["raw_batched_msgs_per_s"]
    )
