"""``bench online --peer llamacpp`` without building llama.cpp: the command line (which formats,
rounds and threads it asks for, what it refuses), both servers' command lines per format, the
online load replayed from a recorded llama-server stream (``data/llamacpp_11434_stream.txt``,
see ``test_llamacpp_peer.py``) over a real socket to the benchmark's own client, and the best
round, ratio and target per format. Running llama.cpp is not part of the test suite."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest

from pipeline.bench.llamacpp_peer import FORMATS
from pipeline.bench.online import http_config_from_args
from pipeline.bench.online_http import (
    ACTORLINE_HTTP,
    LLAMACPP_HTTP,
    LLAMACPP_KV_TOKENS,
    HttpOnlineConfig,
    HttpOnlineResult,
    RateLatency,
    ServerResult,
    actorline_server_command,
    format_http_online,
    llamacpp_online_command,
    measure_rates,
    merge_rounds,
    peer_ratios,
)
from tests.pipeline.bench.conftest import ReplayServer, SeenRequest
from tests.pipeline.bench.test_bench import bench_parser


def test_the_online_cli_takes_llamacpp_per_format() -> None:
    parser = bench_parser()
    args = parser.parse_args(
        ["bench", "online", "--peer", "llamacpp", "--formats", "bf16", "q4_1", "--rates", "1",
         "--llamacpp-threads", "1", "--json"]
    )  # fmt: skip
    config = http_config_from_args(args)
    assert config.llamacpp_formats == ("bf16", "q4_1") and config.formats == ("bf16", "q4_1")
    assert config.rates == (1.0,) and config.llamacpp_threads == 1 and config.rounds == 2
    assert config.vllm_variants == ()
    every = http_config_from_args(parser.parse_args(["bench", "online", "--peer", "llamacpp"]))
    assert every.llamacpp_formats == ("fp32", "bf16", "q4_1")
    vllm = http_config_from_args(parser.parse_args(["bench", "online", "--peer", "vllm"]))
    assert vllm.formats == ("fp32",) and vllm.rounds == 1 and vllm.llamacpp_formats == ()
    both = ["bench", "online", "--peer", "vllm", "--peer", "llamacpp", "--formats", "q4_1"]
    assert http_config_from_args(parser.parse_args(both)).formats == ("fp32", "q4_1")
    with pytest.raises(ValueError, match=r"unknown llama\.cpp formats"):
        HttpOnlineConfig(llamacpp_formats=("fp16",))
    with pytest.raises(ValueError, match="rounds"):
        HttpOnlineConfig(rounds=0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--formats", "bf16"],  # no llama.cpp to run it against
        ["--peer", "vllm", "--llamacpp-threads", "1"],
        ["--peer", "llamacpp", "--vllm-variant", "default"],
        ["--rounds", "2"],  # in process: one engine, no rounds
        ["--peer", "llamacpp", "--rounds", "0"],
    ],
)
def test_an_option_that_would_be_ignored_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = bench_parser().parse_args(["bench", "online", *argv])
    with pytest.raises(SystemExit) as exited:
        args.run(args)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "rounds" in error or "applies" in error or "apply" in error
    assert "Traceback" not in error


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_both_servers_run_the_format_with_the_same_slots(name: str, tmp_path: Path) -> None:
    fmt = FORMATS[name]
    config = HttpOnlineConfig(llamacpp_formats=(name,), llamacpp_threads=2, max_num_seqs=64)
    ours = actorline_server_command(config, fmt)
    assert ours[-len(fmt.actorline_arguments()) :] == fmt.actorline_arguments()
    assert ours[ours.index("--max-num-seqs") + 1] == "64"
    theirs = llamacpp_online_command(tmp_path / "llama-server", tmp_path / "m.gguf", 8, fmt, config)
    options = dict(itertools.pairwise(theirs))
    assert options["--model"] == str(tmp_path / "m.gguf") and options["--port"] == "8"
    assert options["--parallel"] == "64" and "--kv-unified" in theirs
    assert options["--ctx-size"] == str(LLAMACPP_KV_TOKENS)
    assert options["--threads"] == options["--threads-batch"] == "2"
    assert ("--no-repack" in theirs) == (not fmt.repack)


def test_a_recorded_llama_server_stream_through_the_online_load(
    tiny_model_dir: Path, recorded_llama_server: ReplayServer
) -> None:
    from stages.tokenize import load_tokenizer

    config = HttpOnlineConfig(
        model=str(tiny_model_dir),
        rates=(50.0, 100.0),
        requests_per_rate=3,
        llamacpp_formats=("q4_1",),
    )
    tokenizer = load_tokenizer(config.model)
    seen: list[SeenRequest] = []

    async def run() -> list[RateLatency]:
        server = await recorded_llama_server(seen)
        async with server:
            return await measure_rates(server.sockets[0].getsockname()[1], config, tokenizer)

    rates = asyncio.run(run())
    assert len(seen) == 1 + 3 * 2  # the warm-up, then each rate's requests
    for request in (json.loads(each.body) for each in seen[1:]):
        assert request["stream"] is True and request["ignore_eos"] is True
        assert request["temperature"] == 0.0 and request["max_tokens"] in (16, 32, 64, 128)
        prompt = request["prompt"]
        assert isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    assert [rate.rate for rate in rates] == [50.0, 100.0]
    for rate in rates:
        assert rate.requests == 3 and rate.output_tokens == 3 * 8  # the recorded usage
        assert 0 < rate.ttft_p50_ms <= rate.ttft_p99_ms
        assert 0 <= rate.itl_p50_ms <= rate.itl_p99_ms
    peer = ServerResult(LLAMACPP_HTTP, 1.0, tuple(rates), "q4_1")
    ours = ServerResult(ACTORLINE_HTTP, 2.0, tuple(rates), "q4_1")
    servers, rounds = merge_rounds([ours, peer])
    ratios, targets = peer_ratios(servers)
    key = f"{LLAMACPP_HTTP} q4_1 @ 50 req/s"
    assert set(ratios) == {key, f"{LLAMACPP_HTTP} q4_1 @ 100 req/s"}
    assert targets[key] == {"itl": 1.0}
    assert rounds[f"{ACTORLINE_HTTP} q4_1 @ 50 req/s"] == [rates[0].itl_p50_ms]


def _latency(rate: float, ttft: float, itl: float) -> RateLatency:
    return RateLatency(rate, 24, 30.0, 1000, 33.3, ttft, 2 * ttft, itl, 3 * itl)


def test_the_best_round_per_rate_and_the_ratio_per_format() -> None:
    runs = [
        ServerResult(ACTORLINE_HTTP, 3.0, (_latency(1, 120, 20), _latency(2, 150, 30)), "bf16"),
        ServerResult(LLAMACPP_HTTP, 1.0, (_latency(1, 100, 25), _latency(2, 110, 26)), "bf16"),
        ServerResult(LLAMACPP_HTTP, 0.8, (_latency(1, 90, 24), _latency(2, 100, 28)), "bf16"),
        ServerResult(ACTORLINE_HTTP, 2.5, (_latency(1, 130, 22), _latency(2, 140, 27)), "bf16"),
        ServerResult(LLAMACPP_HTTP, 1.0, (_latency(1, 100, 10),), "fp32"),  # no actorline fp32
        ServerResult("vLLM-CPU, default", 90.0, (_latency(1, 200, 40),), "bf16"),
    ]
    servers, rounds = merge_rounds(runs)
    assert [(s.name, s.format) for s in servers] == [
        (ACTORLINE_HTTP, "bf16"), (LLAMACPP_HTTP, "bf16"), (LLAMACPP_HTTP, "fp32"),
        ("vLLM-CPU, default", "bf16"),
    ]  # fmt: skip
    ours = servers[0]
    assert [r.itl_p50_ms for r in ours.rates] == [20, 27] and ours.start_seconds == 2.5
    assert [r.itl_p50_ms for r in servers[1].rates] == [24, 26]
    assert rounds[f"{ACTORLINE_HTTP} bf16 @ 2 req/s"] == [30, 27]
    ratios, targets = peer_ratios(servers)
    assert ratios[f"{LLAMACPP_HTTP} bf16 @ 1 req/s"] == {
        "ttft": pytest.approx(120 / 90),
        "itl": pytest.approx(20 / 24),
    }
    assert f"{LLAMACPP_HTTP} fp32 @ 1 req/s" not in ratios
    assert targets["vLLM-CPU, default bf16 @ 1 req/s"] == {"ttft": 0.7, "itl": 0.7}
    result = HttpOnlineResult(
        model="m",
        servers=servers,
        ratios=ratios,
        targets=targets,
        load_average=(1.0, 1.0, 1.0),
        load_average_end=(2.5, 1.0, 1.0),
        rounds=rounds,
        llamacpp_threads=2,
        cpu_count=2,
    )
    text = format_http_online(result)
    assert "llama-server with 2 threads; 2 CPUs, load average 1.00 at start, 2.50" in text
    assert "30.0 27.0" in text  # every round's ITL p50
    assert (
        f"actorline / {LLAMACPP_HTTP} bf16 @ 1 req/s: TTFT p50 1.33x, ITL p50 0.83x "
        "(target ITL <= 1.0x: met)" in text
    )
    assert f"{LLAMACPP_HTTP} bf16 @ 2 req/s: TTFT p50 1.27x, ITL p50 1.04x" in text
    assert "(target ITL <= 1.0x: not met)" in text
    assert "(target TTFT <= 0.7x and ITL <= 0.7x: met)" in text
