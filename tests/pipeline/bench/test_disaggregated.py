"""``actorline bench online --prefill-decode 1:1 --quick`` on the tiny Llama
(pipeline/bench/disaggregated.py): both variants run on fresh engines, every request's
greedy tokens agree, and the P/D run counts a transfer per request with its bytes, none of
which passed through the frontend's process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pipeline.bench.disaggregated import DisaggregatedConfig, workload
from pipeline.bench.online import run_from_args
from pipeline.cli import bench as cli_bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actorline")
    cli_bench.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.slow
def test_online_prefill_decode_quick(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(
        ["bench", "online", "--prefill-decode", "1:1", "--quick", "--json",
         "--model", str(tiny_model_dir)]
    )  # fmt: skip
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] == result["requests"] == 6
    dp, pd = result["runs"]
    assert (dp["variant"], pd["variant"]) == ("DP=2", "P/D=1:1")
    assert dp["transfers"] == 0
    # every prompt is over one block: each prefilled, its full blocks but the last moved
    assert pd["transfers"] == 6 and pd["fallbacks"] == 0
    # the tiny Llama's block: K and V of 2 layers, 16 tokens, 2 KV heads of 16, float32
    assert pd["bytes_per_transfer"] == pd["blocks_per_transfer"] * 2 * 2 * 16 * 2 * 16 * 4
    # one hop: the frontend's process received less than the K/V moved, so none of it
    # (the blocks go straight from the prefill engine to the decode engine)
    assert 0 < pd["frontend_bytes_in"] < pd["transfers"] * pd["bytes_per_transfer"]
    for run in (dp, pd):
        assert run["output_tokens"] == 4 * 16 + 2 * 4
        assert 0 < run["short_itl_p50_ms"] <= run["short_itl_p99_ms"]


def test_the_workload_mixes_long_and_short_prompts() -> None:
    config = DisaggregatedConfig(num_requests=7)
    requests = workload(config)
    assert [r.long for r in requests] == [False, True, False] * 2 + [False]
    assert {len(r.prompt) for r in requests if r.long} == {1024}
    assert {r.max_tokens for r in requests if not r.long} == {64}
    assert len({r.prompt[:16] for r in requests}) == 7  # no shared prefix
    assert workload(config) == requests  # from the seed
    with pytest.raises(ValueError, match="long_every must be an integer >= 1"):
        DisaggregatedConfig(long_every=0)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--ray", "auto"], "apply with --prefill-decode"),
        (["--ray-num-cpus", "2"], "apply with --prefill-decode"),
        (["--prefill-decode", "1:1", "--ray-prefill-decode-resources", "a,b"], "give --ray too"),
    ],
)
def test_the_ray_flags_are_refused_where_they_would_do_nothing(
    flags: list[str], words: str
) -> None:
    args = build_parser().parse_args(["bench", "online", *flags])
    with pytest.raises(ValueError, match=words):
        run_from_args(args)
