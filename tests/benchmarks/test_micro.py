"""The kernel microbenchmarks: ``python -m benchmarks.micro --quick`` on the tiny model through
its command line (well-formed, positive figures; never a timing threshold), and its options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import micro
from benchmarks.micro import MicroConfig
from tests.benchmarks.test_benchmarks import parse
from tests.conftest import TINY_LLAMA


def test_micro_quick_via_the_cli(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command = ["--quick", "--json", "--model", str(tiny_model_dir)]
    assert micro.main([*command, "--attention", "4x64", "2x40"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layers"] == TINY_LLAMA["num_hidden_layers"]
    hidden, inter = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"]
    q = TINY_LLAMA["num_attention_heads"] * TINY_LLAMA["head_dim"]
    kv = TINY_LLAMA["num_key_value_heads"] * TINY_LLAMA["head_dim"]
    per_layer = q * hidden + 2 * kv * hidden + hidden * q + 3 * inter * hidden
    weights = 4 * (TINY_LLAMA["num_hidden_layers"] * per_layer + TINY_LLAMA["vocab_size"] * hidden)
    assert [t["rows"] for t in result["gemm"]] == [1, 12]
    for timing in result["gemm"]:
        assert timing["weight_bytes"] == weights  # every layer's linears and the head, once
        assert timing["cold_ms"] > 0 and timing["warm_ms"] > 0
    cases = [(t["rows"], t["context"]) for t in result["attention"]]
    assert cases == [(4, 64), (2, 40)]
    for timing in result["attention"]:
        assert timing["cold_ms"] > 0 and timing["warm_ms"] > 0
        # each row reads between half its context and all of it, keys and values, every KV head
        per_token = 2 * TINY_LLAMA["num_key_value_heads"] * TINY_LLAMA["head_dim"] * 4
        low, high = timing["context"] // 2, timing["context"]
        assert low * timing["rows"] * per_token <= timing["kv_bytes"]
        assert timing["kv_bytes"] <= high * timing["rows"] * per_token


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="nothing to time"):
        MicroConfig(rows=(), attention=())
    with pytest.raises(ValueError, match="rows must be"):
        MicroConfig(rows=(0,))
    with pytest.raises(SystemExit):
        parse(micro, ["--attention", "64-500"])
