"""The speculative-decoding benchmarks (docs/speculative.md): ``bench offline
--speculative-config`` end to end on the tiny model (without and with, the ratio, the
acceptance rate, identical outputs) and its refusals; ``bench latency``'s llama.cpp peer with
its own speculative decoding (its options from our config, a recorded speculative stream's
draft counts, the report's ratios)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from stages.speculative import SpeculativeConfig
from tests.pipeline.bench.conftest import ReplayServer, SeenRequest
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


# -- bench latency: llama.cpp's own speculative decoding beside ours ---------------------------


def test_llamacpps_speculative_options_follow_our_ngram_config() -> None:
    from pipeline.bench.llamacpp_peer import LlamaPeerError, speculative_arguments

    command = speculative_arguments(SPEC)
    options = dict(zip(command[::2], command[1::2], strict=True))
    assert options == {
        "--spec-type": "ngram-simple",
        "--spec-ngram-simple-size-n": "1",  # prompt_lookup_min
        "--spec-ngram-simple-size-m": "3",  # num_speculative_tokens
    }
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_arguments('{"num_speculative_tokens": 0}')
    with pytest.raises(LlamaPeerError, match=r"no llama\.cpp counterpart"):
        speculative_arguments(SpeculativeConfig(method="other", num_speculative_tokens=2))


def test_llamacpps_draft_model_options_take_the_drafts_gguf_file() -> None:
    from pipeline.bench.llamacpp_peer import LlamaPeerError, speculative_arguments
    from stages.models import resolve_model

    draft = '{"model": "smollm2-135m", "quantization": "gguf", "num_speculative_tokens": 4}'
    command = speculative_arguments(draft)
    options = dict(zip(command[::2], command[1::2], strict=True))
    gguf = resolve_model("smollm2-135m").gguf
    assert gguf is not None and gguf.is_file()
    assert options == {
        "--spec-type": "draft-simple",
        "--spec-draft-model": str(gguf),  # the wheel's own Q4_1 file, as ours drafts with
        "--spec-draft-n-max": "4",
        "--spec-draft-n-min": "0",
    }
    # a draft llama.cpp cannot load (no GGUF) is refused by name
    with pytest.raises(LlamaPeerError, match="has no GGUF file"):
        speculative_arguments('{"model": "smollm2-135m", "num_speculative_tokens": 4}')


def test_copy_prompts_rewrite_a_text_long_enough_for_the_tokens_measured() -> None:
    from pipeline.bench.latency import COPY_TEXTS, copy_prompts
    from pipeline.bench.workload import WorkloadSpec, make_workload, prompt_ids
    from stages.tokenize import load_tokenizer

    texts = [request.prompt for request in make_workload(WorkloadSpec(num_requests=6, seed=0))]
    prompts = copy_prompts(texts)
    assert len(prompts) == len(texts)
    for index, prompt in enumerate(prompts):
        paragraph = " ".join(texts[(index + j) % len(texts)] for j in range(COPY_TEXTS))
        assert prompt.count(paragraph) == 2  # given in full, twice, as copy_prompt does
    # the one stream's prompt holds more text to copy than its 256 tokens, and fits a
    # slot's context (1024) with them
    tokenizer = load_tokenizer("smollm2-135m")
    lengths = [len(prompt_ids(tokenizer, prompt)) for prompt in prompts]
    assert all(length // 2 > 256 for length in lengths[1:2]) and max(lengths) + 256 <= 1024


def test_the_latency_cli_takes_a_speculative_config() -> None:
    from pipeline.bench.latency import config_from_args

    args = bench_parser().parse_args(
        ["bench", "latency", "--speculative-config", SPEC, "--prompts", "copy", "--quick"]
    )
    config = config_from_args(args)
    assert config.speculative_config == SPEC and config.prompts == "copy"
    assert config.peers == ("llamacpp",)
    alone = config_from_args(
        bench_parser().parse_args(
            ["bench", "latency", "--speculative-config", SPEC, "--peer", "none"]
        )
    )
    assert alone.peers == ()  # actorline with and without speculation, no llama-server
    with pytest.raises(ValueError, match="actorline alone"):
        config_from_args(
            bench_parser().parse_args(["bench", "latency", "--peer", "none", "--peer", "llamacpp"])
        )
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        config_from_args(
            bench_parser().parse_args(
                ["bench", "latency", "--speculative-config", '{"method": "ngram"}']
            )
        )


def test_a_recorded_speculative_llama_server_stream_counts_its_drafts(
    recorded_llama_spec_server: ReplayServer,
) -> None:
    from pipeline.bench.http_load import stream_completion
    from pipeline.bench.latency import LLAMACPP_SPEC, summarize
    from pipeline.bench.llamacpp_peer import LlamaPeerError, parse_timings

    async def replay() -> Any:
        seen: list[SeenRequest] = []
        async with await recorded_llama_spec_server(seen) as server:
            port = server.sockets[0].getsockname()[1]
            return await stream_completion("127.0.0.1", port, {"prompt": [1, 2], "max_tokens": 24})

    trace = asyncio.run(replay())
    timings = parse_timings({"timings": trace.timings})
    assert timings is not None and timings.predicted_tokens == 24
    assert (timings.draft_tokens, timings.accepted_tokens) == (12, 10)
    run = summarize(LLAMACPP_SPEC, "fp32", [trace])
    assert run.tokens == 24 and (run.draft_tokens, run.accepted_tokens) == (12, 10)
    # a server that drafted nothing leaves the two keys out; a malformed count is refused
    bare = {k: v for k, v in trace.timings.items() if not k.startswith("draft_n")}
    plain = parse_timings({"timings": bare})
    assert plain is not None and (plain.draft_tokens, plain.accepted_tokens) == (0, 0)
    with pytest.raises(LlamaPeerError, match="malformed"):
        parse_timings({"timings": {**trace.timings, "draft_n": "many"}})


def test_a_recorded_draft_model_llama_server_stream_counts_its_drafts(
    recorded_llama_draft_server: ReplayServer,
) -> None:
    # draft-simple reports its drafts in the same timings keys as ngram-simple
    from pipeline.bench.http_load import stream_completion
    from pipeline.bench.latency import LLAMACPP_SPEC, summarize

    async def replay() -> Any:
        seen: list[SeenRequest] = []
        async with await recorded_llama_draft_server(seen) as server:
            port = server.sockets[0].getsockname()[1]
            return await stream_completion("127.0.0.1", port, {"prompt": [1, 2], "max_tokens": 24})

    run = summarize(LLAMACPP_SPEC, "fp32", [asyncio.run(replay())])
    assert run.tokens == 24 and (run.draft_tokens, run.accepted_tokens) == (18, 18)
    assert run.server_tokens_per_second == pytest.approx(8.386, abs=0.001)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q4_1"])
def test_llamacpp_runs_a_draft_model_without_repacking_in_every_format(fmt: str) -> None:
    # the draft inherits the target's repacking, and its Q4_1 AMX kernel died of SIGILL on
    # an AMX Xeon before serving (exit 132): with a draft llama-server runs --no-repack
    # (once, also for q4_1, which runs without it already); the n-gram peer keeps the format's
    from pipeline.bench.llamacpp_peer import FORMATS, server_command, speculative_repack

    draft = '{"model": "smollm2-135m", "quantization": "gguf", "num_speculative_tokens": 4}'
    assert not speculative_repack(draft) and speculative_repack(SPEC)

    def command(speculative: str | None = None) -> list[str]:
        return server_command(
            Path("llama-server"), Path("m.gguf"), 1, threads=2, slots=1, context_per_slot=64,
            repack=FORMATS[fmt].repack, speculative=speculative,
        )  # fmt: skip

    with_draft = command(draft)
    assert with_draft.count("--no-repack") == 1
    assert with_draft[with_draft.index("--spec-type") + 1] == "draft-simple"
    with_ngram, plain = command(SPEC), command()
    assert ("--no-repack" in with_ngram) == ("--no-repack" in plain) == (not FORMATS[fmt].repack)
    assert with_ngram[: len(plain)] == plain and "ngram-simple" in with_ngram
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        command('{"num_speculative_tokens": 0}')


def test_the_latency_report_names_the_draft_peers_options() -> None:
    from pipeline.bench.latency import LatencyConfig, peer_speculative_options
    from stages.models import resolve_model

    draft = '{"model": "smollm2-135m", "quantization": "gguf", "num_speculative_tokens": 4}'
    options = peer_speculative_options(LatencyConfig(formats=("fp32",), speculative_config=draft))
    assert options[0] == "--no-repack" and str(resolve_model("smollm2-135m").gguf) in options
    # q4_1 alone runs without repacking anyway; the n-gram peer adds only its own options;
    # actorline alone has no peer options
    q4 = peer_speculative_options(LatencyConfig(formats=("q4_1",), speculative_config=draft))
    assert q4 == options[1:]
    assert "--no-repack" not in peer_speculative_options(LatencyConfig(speculative_config=SPEC))
    alone = LatencyConfig(peers=(), speculative_config=draft)
    assert peer_speculative_options(alone) == ()


def _run(system: str, streams: int, rate: float, drafted: int = 0, accepted: int = 0) -> Any:
    from pipeline.bench.latency import WorkloadRun

    return WorkloadRun(system, "fp32", streams, 100, 1.0, rate, rate, 50.0, None, drafted, accepted)


def test_the_latency_report_sets_both_speculative_runs_beside_each_other() -> None:
    from pipeline.bench.latency import (
        ACTORLINE,
        ACTORLINE_SPEC,
        LLAMACPP,
        LLAMACPP_SPEC,
        LatencyResult,
        format_latency,
        speculative_ratios,
    )

    best = (
        _run(ACTORLINE, 1, 40.0),
        _run(ACTORLINE_SPEC, 1, 60.0),
        _run(LLAMACPP, 1, 50.0),
        _run(LLAMACPP_SPEC, 1, 75.0, drafted=40, accepted=30),
    )
    result = LatencyResult(
        model="m", best=best, rounds={}, ratios={}, llamacpp_version="v", llamacpp_threads=2,
        load_average=(1.0, 1.0, 1.0), load_average_end=(1.0, 1.0, 1.0), cpu_count=2,
        speculative_ratios=speculative_ratios(best), acceptance_rate=0.5,
        peer_speculative_ratios=speculative_ratios(best, LLAMACPP_SPEC, LLAMACPP),
        spec_vs_peer_ratios=speculative_ratios(best, ACTORLINE_SPEC, LLAMACPP_SPEC),
        peer_acceptance_rate=0.75,
    )  # fmt: skip
    text = format_latency(result)
    assert "ratio actorline+spec / actorline, fp32 @ 1 streams: 1.50x" in text
    assert "ratio llama.cpp+spec / llama.cpp, fp32 @ 1 streams: 1.50x" in text
    assert "ratio actorline+spec / llama.cpp+spec, fp32 @ 1 streams: 0.80x" in text
    assert "speculative acceptance rate: 0.50" in text
    assert "llama.cpp speculative acceptance rate: 0.75" in text
    assert "llama.cpp+spec runs llama-server with" not in text
    drafted = dataclasses.replace(
        result, peer_speculative_options=("--no-repack", "--spec-type", "draft-simple")
    )
    line = format_latency(drafted).splitlines()[-1]
    assert line.startswith("llama.cpp+spec runs llama-server with --no-repack --spec-type ")
    assert "SIGILL" in line
