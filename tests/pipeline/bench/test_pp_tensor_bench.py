"""``actorline bench offline --pipeline-parallel-size M --tensor-parallel-size N`` in its
--quick form on the tiny model, via the CLI: M shards of N ranks each against one engine in
one run, well-formed positive figures and identical greedy outputs (never a timing
threshold)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.bench.parallel import TensorParallelConfig
from tests.pipeline.bench.test_bench import bench_parser


def test_the_config_gives_each_run_its_parallelism_and_refuses_ranks_without_shards() -> None:
    config = TensorParallelConfig(size=2, pipeline=True, tensor=3)
    assert config.engine_options(1) == {"pipeline_parallel_size": 1}
    assert config.engine_options(2) == {"pipeline_parallel_size": 2, "tensor_parallel_size": 3}
    assert TensorParallelConfig(size=3).engine_options(3) == {"tensor_parallel_size": 3}
    with pytest.raises(ValueError, match="only with pipeline"):
        TensorParallelConfig(size=2, tensor=2)


@pytest.mark.slow
def test_pp2_by_tp2_offline_quick(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model's 2 layers on 2 shards of 2 ranks (4 processes) against one engine."""
    command = ["bench", "offline", "--quick", "--json", "--model", str(tiny_model_dir)]
    args = bench_parser().parse_args(
        [*command, "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"]
    )
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pipeline"] is True and result["tensor"] == 2
    assert result["size"] == 2 and result["num_requests"] == 8
    single, parallel = result["runs"]
    assert (single["size"], parallel["size"]) == (1, 2)
    assert single["tokens"] == parallel["tokens"] > 0
    assert single["communication_seconds"] == 0 < parallel["communication_seconds"]
    assert result["identical_outputs"] == 8
