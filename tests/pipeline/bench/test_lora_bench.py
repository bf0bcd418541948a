"""``actorline bench offline --lora N`` (pipeline/bench/lora.py) on the tiny model: the
command line, its JSON and its readable report; the load-cost windows (pure)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeline.bench.lora import LoRABenchConfig, load_cost_of
from tests.pipeline.bench.test_bench import bench_parser


def test_load_cost_sorts_each_gap_into_its_windows() -> None:
    # one stream: gaps of 10 ms, then 50 ms across the warm join, 200 ms across the cold one
    stamps = [[0.0, 0.01, 0.02, 0.07, 0.08, 0.28, 0.29]]
    cost = load_cost_of(stamps, warm=(0.03, 0.06), cold=(0.1, 0.27))
    assert math.isclose(cost.median_gap_ms, 10.0)
    assert math.isclose(cost.warm_join_max_gap_ms, 50.0) and cost.warm_join_gaps == 1
    assert math.isclose(cost.cold_join_max_gap_ms, 200.0) and cost.cold_join_gaps == 1
    with pytest.raises(ValueError, match="adapters must be an integer >= 1"):
        LoRABenchConfig(adapters=0)


@pytest.mark.slow
def test_offline_lora_quick_via_the_cli(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two adapters against the base model, one run each, then the load cost."""
    argv = ["bench", "offline", "--quick", "--json", "--lora", "2", "--model", str(tiny_model_dir)]
    args = bench_parser().parse_args(argv)
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["adapters"] == 2 and result["rank"] == 8 and result["num_requests"] == 8
    assert [run["lora"] for run in result["runs"]] == [False, True]
    tokens = {run["tokens"] for run in result["runs"]}
    assert len(tokens) == 1 and tokens.pop() > 0  # both generate every requested token
    assert result["best_base"] > 0 and result["best_lora"] > 0
    assert math.isclose(result["ratio"], result["best_lora"] / result["best_base"])
    cost = result["load_cost"]
    assert cost["streams"] == 4 and cost["median_gap_ms"] > 0
    assert cost["warm_join_gaps"] > 0 and cost["cold_join_gaps"] > 0
    assert cost["cold_join_max_gap_ms"] > 0 and cost["warm_join_max_gap_ms"] > 0
    # the readable form
    from pipeline.bench.lora import LoRABenchResult, LoRALoadCost, LoRARun, format_lora

    fields = {**result, "runs": tuple(LoRARun(**run) for run in result["runs"])}
    fields["load_cost"] = LoRALoadCost(**cost)
    fields["load_average"] = tuple(result["load_average"])
    text = format_lora(LoRABenchResult(**fields))
    assert "2 adapters of rank 8" in text and f"lora/base {result['ratio']:.2f}x" in text
    assert "while a new adapter loads and joins" in text


@pytest.mark.parametrize(
    "extra",
    [["--peer", "vllm"], ["--structured"],
     ["--speculative-config", '{"num_speculative_tokens": 2}'],
     ["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]],
)  # fmt: skip
def test_lora_is_refused_beside_another_comparison(extra: list[str]) -> None:
    from pipeline.bench.offline import config_from_args

    args = bench_parser().parse_args(["bench", "offline", "--lora", "2", *extra])
    with pytest.raises(ValueError, match="--lora compares one actorline engine"):
        config_from_args(args)
