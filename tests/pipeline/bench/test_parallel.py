"""The parallelism comparisons in their --quick form on the tiny model, via the CLI: they run
both sides in one run and report well-formed, positive figures (never a timing threshold)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline.bench.test_bench import bench_parser
from tests.pipeline.runtime.test_ray_hosts import wait_until_gone
from tests.pipeline.runtime.test_running import run as run_async

pytestmark = pytest.mark.slow


def test_data_parallel_ceiling_quick(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["bench", "ceiling", "--quick", "--json", "--profile", "--model", str(tiny_model_dir)]
    args = bench_parser().parse_args([*command, "--data-parallel-size", "2"])
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["size"] == 2 and result["num_requests"] == 32
    assert [run["size"] for run in result["runs"]] == [1, 2]  # one repeat each, alternating
    assert all(run["tokens"] == 32 * 32 and run["tokens_per_second"] > 0 for run in result["runs"])
    assert result["ratio"] == result["best_parallel"] / result["best_single"]
    assert set(result["routed"]) == {"0", "1"}  # both replicas took work
    assert sum(result["routed"].values()) == 32 + 16  # the measured requests and the warm-up
    stages = {row["stage"] for row in result["profile"]["stages"]}
    assert {"router", "execute", "execute_1", "detokenize"} <= stages
    assert {row["host"] for row in result["profile"]["hosts"]} == {"main", "engine", "engine_1"}


def test_tensor_parallel_offline_quick(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["bench", "offline", "--quick", "--json", "--model", str(tiny_model_dir)]
    args = bench_parser().parse_args([*command, "--tensor-parallel-size", "2"])
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["size"] == 2 and result["num_requests"] == 8
    single, parallel = result["runs"]
    assert (single["size"], parallel["size"]) == (1, 2)
    assert single["tokens"] == parallel["tokens"] > 0
    assert single["communication_seconds"] == 0 < parallel["communication_seconds"]
    assert result["communication_ms_per_step"] > 0 and 0 < result["communication_share"] < 1
    assert result["identical_outputs"] == 8


def test_pipeline_parallel_offline_quick(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny model's 2 layers on 2 shards, one each, one step in flight and two, against
    one engine."""
    from pipeline.bench.pipeline_parallel import PipelineRun

    command = ["bench", "offline", "--quick", "--json", "--model", str(tiny_model_dir)]
    args = bench_parser().parse_args([*command, "--pipeline-parallel-size", "2"])
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["size"] == 2 and result["num_requests"] == 8
    runs = [PipelineRun(**{**run, "shard_busy_seconds": tuple(run["shard_busy_seconds"])})
            for run in result["runs"]]  # fmt: skip
    assert [(run.shards, run.steps_in_flight) for run in runs] == [(1, 1), (2, 1), (2, 2)]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens > 0
    assert runs[0].communication_seconds == 0 and runs[0].shard_busy_seconds == ()
    for run in runs[1:]:
        assert run.communication_seconds > 0 and run.communication_ms_per_step > 0
        assert len(run.shard_busy_seconds) == 2 and all(s > 0 for s in run.shard_busy_seconds)
        assert 0 <= run.bubble < 1
        # the last shard sends back its sampled tokens: a few bytes a token, where a row
        # of the tiny model's float32 logits is 49,152 x 4 bytes
        assert 0 < run.answer_bytes_per_token < 1000
    assert result["ratios"][0] == 1.0 and all(ratio > 0 for ratio in result["ratios"])
    assert result["identical_outputs"] == [8, 8, 8]


def run_on_ray_quick(
    benchmark: str, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> dict[str, Any]:
    """``actorline bench BENCHMARK --quick --ray`` through the CLI: its JSON result, checked to
    have run locally, then on Ray."""
    command = ["bench", benchmark, "--quick", "--json", "--model", str(model_dir), "--ray"]
    args = bench_parser().parse_args(command)
    assert args.run(args) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == benchmark
    assert [run["placement"] for run in result["runs"]] == ["local", "ray"]
    return result


def test_ray_ceiling_quick(
    tiny_model_dir: Path, ray_cluster: object, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_on_ray_quick("ceiling", tiny_model_dir, capsys)
    assert result["num_requests"] == 32
    assert all(run["tokens"] == 32 * 32 and run["tokens_per_second"] > 0 for run in result["runs"])
    assert result["ratio"] == result["best_ray"] / result["best_local"]


def test_ray_offline_quick(
    tiny_model_dir: Path, ray_cluster: object, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_on_ray_quick("offline", tiny_model_dir, capsys)
    assert result["num_requests"] > 0
    tokens = {run["tokens"] for run in result["runs"]}
    assert len(tokens) == 1 and tokens.pop() > 0
    # greedy, same model: the engine on Ray writes what the local one does
    assert result["identical_outputs"] == result["num_requests"]
    assert result["ray_num_cpus"] == 2  # the session cluster's node, not this machine's cores
    run_async(lambda: wait_until_gone(ray_cluster, "llm"))
