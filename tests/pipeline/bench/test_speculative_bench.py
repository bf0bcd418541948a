"""The speculative-decoding benchmarks (docs/speculative.md): ``bench offline
--speculative-config`` end to end on the tiny model (without and with, the ratio, the
acceptance rate, identical outputs), and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pipeline.bench.test_bench import bench_parser

#: drafts at any batch size, so the quick workload's 8 requests draft
SPEC = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": 64,
    }
)


def test_offline_speculative_config_from_the_cli() -> None:
    from pipeline.bench.offline import ACTORLINE_SPECULATIVE, ACTORLINE_ZMQ, config_from_args

    args = bench_parser().parse_args(
        ["bench", "offline", "--speculative-config", SPEC, "--repeats", "3"]
    )
    config = config_from_args(args)
    assert config.systems == (ACTORLINE_ZMQ, ACTORLINE_SPECULATIVE)
    assert config.speculative_config == SPEC and config.repeats == 3
    assert config.workload.num_requests == 64  # the offline workload, as without it
    assert not config.roof and not config.measure_default_budget and not config.llamacpp


@pytest.mark.slow
def test_offline_with_and_without_speculation(tiny_model_dir: Path) -> None:
    from pipeline.bench.offline import (
        ACTORLINE_SPECULATIVE,
        ACTORLINE_ZMQ,
        OfflineConfig,
        format_offline,
        run_offline,
    )

    config = OfflineConfig.quick(
        model=str(tiny_model_dir),
        systems=(ACTORLINE_ZMQ, ACTORLINE_SPECULATIVE),
        speculative_config=SPEC,
        roof=False,
        measure_default_budget=False,
        check_requests=0,
    )
    result = run_offline(config)
    assert [s.name for s in result.systems] == [ACTORLINE_ZMQ, ACTORLINE_SPECULATIVE]
    for system in result.systems:
        assert system.generated_tokens == result.requested_tokens > 0
    spec = result.speculative
    assert spec is not None and spec.identical
    assert 0 < spec.accepted_tokens <= spec.draft_tokens
    assert spec.acceptance_rate == spec.accepted_tokens / spec.draft_tokens
    assert set(result.ratios) == {"speculative / without (zmq)"}
    text = format_offline(result)
    assert "ratio speculative / without (zmq): " in text and "(target >= 0.95x)" in text
    line = next(line for line in text.splitlines() if line.startswith("speculative {"))
    assert f"acceptance rate {spec.acceptance_rate:.2f}" in line
    assert "outputs identical to without" in line


@pytest.mark.parametrize(
    "extra",
    [["--peer", "vllm"], ["--structured"], ["--tensor-parallel-size", "2"]],
    ids=["peer", "structured", "tp"],
)
def test_offline_speculative_refuses_what_it_would_ignore(extra: list[str]) -> None:
    from pipeline.bench.offline import config_from_args

    args = bench_parser().parse_args(["bench", "offline", "--speculative-config", SPEC, *extra])
    with pytest.raises(ValueError, match="with and without speculation"):
        config_from_args(args)


def test_offline_refuses_a_bad_speculative_config_naming_the_key() -> None:
    from pipeline.bench.offline import config_from_args

    args = bench_parser().parse_args(
        ["bench", "offline", "--speculative-config", '{"num_speculative_tokens": 0}']
    )
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        config_from_args(args)
