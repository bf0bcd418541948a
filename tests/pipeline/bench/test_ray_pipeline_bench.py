"""``actorline bench offline --pipeline-parallel-size N --ray`` (pipeline.bench.ray_pipeline):
N shards (here of two tensor-parallel ranks each) on Ray against PP=1 on Ray, alternated, via
the CLI in its --quick form on the tiny model and the session's Ray cluster: well-formed,
positive figures and the greedy tokens of the unsplit engine (never a timing threshold). Its
placement flags are refused where they would be ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pipeline.bench.test_bench import bench_parser
from tests.pipeline.runtime.test_ray_hosts import wait_until_gone
from tests.pipeline.runtime.test_running import run as run_async

QUICK = ["bench", "offline", "--quick", "--json"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--ray-placement-strategy", "SPREAD"],  # no --ray
        ["--ray", "--ray-shard-resources", "a"],  # no pipeline shards
        ["--pipeline-parallel-size", "2", "--ray-num-cpus", "0.5"],  # not on Ray
    ],
)
def test_placement_flags_are_refused_without_shards_on_ray(
    tiny_model_dir: Path, extra: list[str]
) -> None:
    from pipeline.bench.offline import run_from_args

    args = bench_parser().parse_args([*QUICK, "--model", str(tiny_model_dir), *extra])
    with pytest.raises(ValueError, match="place pipeline shards on Ray: give"):
        run_from_args(args)  # (refused before any engine starts)


@pytest.mark.slow
def test_pipeline_parallel_on_ray_offline_quick(
    tiny_model_dir: Path, ray_cluster: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny model's 2 layers on 2 shards of 2 tensor-parallel ranks each (a host of half
    a CPU each on the session's 2-CPU cluster) against one engine on the cluster."""
    command = [*QUICK, "--model", str(tiny_model_dir), "--pipeline-parallel-size", "2", "--ray",
               "--tensor-parallel-size", "2", "--ray-num-cpus", "0.5",
               "--ray-placement-strategy", "SPREAD"]  # fmt: skip
    args = bench_parser().parse_args(command)
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["size"] == result["tensor"] == 2 and result["num_requests"] == 8
    assert [run["shards"] for run in result["runs"]] == [1, 2]  # one repeat each, alternating
    single, split = result["runs"]
    assert single["tokens"] == split["tokens"] > 0
    assert single["communication_seconds"] == 0 < split["communication_seconds"]
    assert result["communication_ms_per_step"] > 0
    assert result["ratio"] == result["best_pipeline"] / result["best_single"]
    assert result["identical_outputs"] == 8
    # SPREAD on the one-node session cluster: Ray puts the bundles on the node there is
    assert sorted(result["nodes"]) == [
        "pp1 engine", "pp2 engine", "pp2 engine_pp1", "pp2 engine_pp1_tp1", "pp2 engine_tp1"
    ]  # fmt: skip
    assert len(set(result["nodes"].values())) == 1
    assert (result["placement_strategy"], result["ray_num_cpus"]) == ("SPREAD", 0.5)
    run_async(lambda: wait_until_gone(ray_cluster, "llm"))
