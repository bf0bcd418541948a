"""The actorline CLI: it generates, and fails cleanly on bad input.

The process-level contract (exit status, stdout, stderr of a real ``actorline`` process) is
checked on real subprocesses; the many bad-input and constraint cases call the console
script's entry point (:func:`pipeline.cli.main`, what ``[project.scripts]`` and ``python -m
pipeline.cli`` run) in this process, the same parser and checks without an interpreter start
per case."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline import LLM, SamplingParams
from pipeline.cli.llm import EXIT_BROKEN_PIPE
from tests.conftest import imported_after
from tests.pipeline.cli.conftest import InProcess

CLI = [sys.executable, "-m", "pipeline.cli"]


def actorline(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def one_error_line(stderr: str) -> str:
    """``stderr``'s only line, an ``actorline[ COMMAND]: error: ...`` line (asserted)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"actorline( \w+)?: error: ", lines[0]), stderr
    return lines[0]


def test_plugins_lists_every_group() -> None:
    result = actorline("plugins")
    assert result.returncode == 0, result.stderr
    for expected in ("actorline.schedulers", "fcfs", "sjf", "actorline.transports", "zmq", "grpc"):
        assert expected in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("chat", [True, False], ids=["chat template", "raw text"])
def test_generate_prints_the_engines_greedy_answer(tiny_model_dir: Path, chat: bool) -> None:
    """What the CLI prints is exactly what the engine generates for the same input: the
    prompt wrapped as a user message for a chat model, or raw with --no-chat-template."""
    raw = [] if chat else ["--no-chat-template"]
    args = ["Hello there", "--model", str(tiny_model_dir), "--max-tokens", "6", *raw]
    result = actorline("generate", *args, "--ignore-eos")
    assert result.returncode == 0, result.stderr
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt: Any = [{"role": "user", "content": "Hello there"}] if chat else "Hello there"
    with LLM(str(tiny_model_dir), transport="memory") as llm:
        [expected] = llm.generate([prompt], params, use_tqdm=False)
    assert len(expected.token_ids) == 6
    assert result.stdout == expected.text + "\n"


@pytest.mark.slow
def test_generate_follows_a_json_schema_file_a_regex_and_choices(
    tiny_model_dir: Path, tmp_path: Path, actorline_in_process: InProcess
) -> None:
    """The tiny random model follows the constraint the options give (a random model is the
    hard case: only the mask keeps it in the grammar). ``generate`` in this process, on the
    memory transport (the engine runs here, as it does in the command's own process with
    ``--transport memory``)."""
    import json

    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        )
    )
    base = ["generate", "Hello", "--model", str(tiny_model_dir), "--transport", "memory"]
    # NOTE: a random model takes whitespace as often as anything the grammar allows, so the
    # JSON is asked for without it
    compact = ["--json-schema", str(schema), "--disable-any-whitespace"]
    status, out, err = actorline_in_process(*base, "--max-tokens", "40", *compact)
    assert status == 0, err
    assert json.loads(out)["ok"] in (True, False)
    # the same schema left open (JSON Schema allows other keys), closed by the flag
    open_schema = tmp_path / "open.json"
    open_schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                       "required": ["ok"]}))  # fmt: skip
    closed = ["--json-schema", str(open_schema), "--disable-any-whitespace",
              "--disable-additional-properties"]  # fmt: skip
    status, out, err = actorline_in_process(*base, "--max-tokens", "40", *closed)
    assert status == 0, err
    assert set(json.loads(out)) == {"ok"}, out
    status, out, err = actorline_in_process(
        *base, "--max-tokens", "12", "--regex", "[0-9]{3}-[0-9]{2}"
    )
    assert status == 0, err
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}\n", out), out
    choices = ["--choice", "left", "--choice", "right"]
    status, out, err = actorline_in_process(*base, "--max-tokens", "12", *choices)
    assert status == 0, err
    assert out in ("left\n", "right\n"), out


@pytest.mark.slow
def test_demo_pipeline_runs() -> None:
    result = actorline("demo", "--count", "5")
    assert result.returncode == 0, result.stderr
    assert "collatz(3) reaches 1 in 7 steps" in result.stdout


def gguf_path() -> Path:
    from stages.models import ALIASES, alias_file

    return alias_file(ALIASES["smollm2-135m"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", ""], "the prompt is empty"),
        (["generate", "hi", "--model", "smollm9-1t"], "unknown model 'smollm9-1t'"),
        (["generate", "hi", "--model", "/no/such/model.gguf"], "does not exist"),
        (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
        (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["generate", "hi", "--scheduler", "nope"], "no actorline.schedulers plugin named 'nope'"),
        # engine values the execute stage's config refuses, checked before the model loads
        (["generate", "hi", "--device", "gpu"], "device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"),
        (["generate", "hi", "--max-model-len", "0"], "max_model_len must be a positive integer"),
        (["generate", "hi", "--num-blocks", "0"], "num_blocks must be a positive integer"),
        (["generate", "hi", "--kv-cache-memory", "-5"], "kv_cache_memory must be a positive"),
        (["generate", "hi", "--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
        # what no stage or link could carry (issue 16): one line and status 2, no traceback
        (["generate", "hi", "--max-tokens", str(2**64)], "max_tokens must be in [1, 2**63 - 1]"),
        (["generate", "hi", "--seed", str(2**63)], "seed must be in [0, 2**63 - 1]"),
        (["generate", "hi", f"--top-k={-(2**70)}"], "top_k must be >= -1, got a negative integer"),
        (["generate", "a\udcffb"], "prompt is not valid Unicode text: U+DCFF at index 1"),
        (["generate", "hi", "--stop", "\udcfe"], "stop[0] is not valid Unicode text"),
        (["generate", "hi", "--temperature", "nan"], "temperature must be a finite number"),
        # parallelism: sizes the model cannot be split by, and topologies that cannot hold it
        (
            ["generate", "hi", "--tensor-parallel-size", "2"],
            "2 does not divide smollm2-135m's 9 query heads and 3 KV heads",
        ),
        (["serve", "--data-parallel-size", "0"], "data_parallel_size must be an integer >= 1"),
        (["generate", "hi", "--data-parallel-size", "2", "--transport", "memory"], "'memory'"),
        (
            ["serve", "--data-parallel-size", "2", "--router", "nope"],
            "no actorline.routers plugin named 'nope'",
        ),
        (["generate", "hi", "--quantization", "int4"], "argument --quantization: invalid choice"),
        (["generate", "hi", "--model-impl", "vllm"], "argument --model-impl: invalid choice"),
        # argument errors argparse finds: one line too, not the usage block
        ([], "the following arguments are required: COMMAND"),
        (["generate"], "the following arguments are required: prompt"),
        (["generate", "hi", "--max-tokens", "x"], "argument --max-tokens: invalid int value"),
        (["serve", "--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["serve", "--rate-limit-burst", "0"], "--rate-limit-burst must be > 0 seconds"),
        (["bench", "nope"], "invalid choice: 'nope'"),
        # structured outputs: one constraint, readable, well-formed
        (["generate", "hi", "--regex", "a", "--choice", "b"], "not allowed with argument"),
        (["generate", "hi", "--json-schema", "/no/such.json"], "--json-schema /no/such.json"),
        (["generate", "hi", "--regex", ""], "structured_outputs.regex must not be empty"),
    ],
)
def test_bad_input_fails_with_one_clear_line(
    args: list[str], message: str, actorline_in_process: InProcess
) -> None:
    """The entry point in this process: status 2 and one line naming what was wrong (the
    real process's side: test_bad_input_in_a_real_process_is_one_line_and_status_2)."""
    status, out, err = actorline_in_process(*args)
    assert status == 2, err
    assert message in one_error_line(err)
    assert not out.strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # argparse's error, the top level's
        ([], "the following arguments are required: COMMAND"),
        # a check of the command's own, after argv's bytes were decoded (surrogateescape)
        (["generate", "a\udcffb"], "prompt is not valid Unicode text: U+DCFF at index 1"),
    ],
    ids=["argparse", "command"],
)
def test_bad_input_in_a_real_process_is_one_line_and_status_2(
    args: list[str], message: str
) -> None:
    """The process-level contract of test_bad_input_fails_with_one_clear_line's cases: a real
    ``actorline`` process exits 2 with one line on stderr, no traceback (and no line from the
    engine host it prespawned)."""
    result = actorline(*args)
    assert result.returncode == 2
    assert message in one_error_line(result.stderr)
    assert "Traceback" not in result.stderr and not result.stdout.strip()


def test_both_model_classes_generate_the_same_text(tiny_model_dir: Path) -> None:
    """``--model-impl``: actorline's own Llama class and transformers' give the same greedy
    text through the whole CLI."""
    texts = []
    for impl in ("native", "transformers"):
        result = actorline(
            "generate", "Hello", "--model", str(tiny_model_dir), "--model-impl", impl,
            "--max-tokens", "6", "--temperature", "0", "--ignore-eos",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        texts.append(result.stdout)
    assert texts[0] == texts[1] and texts[0].strip()


def test_gguf_quantization_of_an_hf_checkpoint_fails_with_one_line(
    tiny_model_dir: Path, actorline_in_process: InProcess
) -> None:
    model = str(tiny_model_dir)
    status, _, err = actorline_in_process(
        "generate", "hi", "--model", model, "--quantization", "gguf"
    )
    assert status == 2
    (line,) = err.strip().splitlines()
    assert "quantization 'gguf' runs a GGUF file's own weights" in line
    assert "--quantization int8" in line


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", pytest.param("gguf", marks=pytest.mark.model)])
def test_generate_with_quantization_prints_the_apis_text(
    quantization: str, tiny_model_dir: Path
) -> None:
    """``--quantization``: the CLI's engine process serves the quantized weights (its load
    line, logged at INFO, says so) and prints the greedy text the Python API gives with the
    same option: int8 on the tiny model, the default model's own GGUF blocks (docs/models.md,
    "Quantized weights")."""

    model = str(tiny_model_dir) if quantization == "int8" else "smollm2-135m"
    prompt = "The capital of France is"
    result = subprocess.run(
        [*CLI, "generate", prompt, "--model", model, "--quantization", quantization,
         "--num-blocks", "64", "--no-chat-template",
         "--max-tokens", "8", "--temperature", "0", "--ignore-eos"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "ACTORLINE_LOG_LEVEL": "INFO"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"quantization='{quantization}'" in result.stderr, result.stderr
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(model, transport="memory", num_blocks=64, quantization=quantization) as llm:
        [expected] = llm.generate([prompt], params, use_tqdm=False)
    assert len(expected.token_ids) == 8
    assert result.stdout == expected.text + "\n"


def test_corrupt_and_truncated_gguf_fail_cleanly(
    tmp_path: Path, actorline_in_process: InProcess
) -> None:
    truncated = tmp_path / "truncated.gguf"
    with gguf_path().open("rb") as whole:  # its first 2 MiB (not the whole file read)
        truncated.write_bytes(whole.read(2 << 20))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 4096)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    for path, message in (
        (truncated, "not a readable GGUF model"),
        (corrupt, "not a readable GGUF model"),
        (not_gguf, "is not a GGUF file"),
    ):
        status, _, err = actorline_in_process(
            "generate", "hi", "--model", str(path), "--max-tokens", "2"
        )
        assert status == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("words", "extra", "length"),
    [(1100, [], 1024), (100, ["--max-model-len", "64", "--transport", "memory"], 64)],
    ids=["model-length", "max-model-len"],
)
def test_prompt_longer_than_the_model_fails_with_one_line(
    tiny_model_dir: Path,
    words: int,
    extra: list[str],
    length: int,
    actorline_in_process: InProcess,
) -> None:
    prompt = "hello " * words
    status, out, err = actorline_in_process(
        "generate", prompt, "--model", str(tiny_model_dir), "--max-tokens", "4", *extra
    )
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("actorline: error:"), err
    assert f"the model's length is {length}" in lines[0] and "the prompt has" in lines[0]
    assert not out.strip()


@pytest.mark.slow
def test_generate_into_a_closed_pipe_exits_quietly_with_sigpipe_status(
    tiny_model_dir: Path,
) -> None:
    """``actorline generate ... | head -c 5``: once the reader has gone, the command stops
    (aborting its request) without a traceback and exits 128 + SIGPIPE, like a process
    killed by SIGPIPE."""
    process = subprocess.Popen(
        [*CLI, "generate", "Write a long story", "--model", str(tiny_model_dir),
         "--max-tokens", "900", "--ignore-eos", "--transport", "memory"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    try:
        assert len(process.stdout.read(5)) == 5
        process.stdout.close()  # what head does once it has its bytes
        status = process.wait(timeout=180)  # a hang guard, not a timing assertion
        stderr = process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
    assert status == EXIT_BROKEN_PIPE == 128 + signal.SIGPIPE, stderr
    assert stderr == ""


@pytest.mark.slow
def test_grpc_transport_shuts_down_without_grpc_log_lines(tiny_model_dir: Path) -> None:
    result = actorline(
        "generate", "hi", "--model", str(tiny_model_dir), "--max-tokens", "4",
        "--transport", "grpc", "--compression", "zstd",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "chttp2" not in result.stderr and "goaway" not in result.stderr.lower()
    assert result.stderr == ""


def test_a_command_other_than_bench_imports_no_benchmark() -> None:
    """``actorline serve`` (any command but ``bench``) parses its arguments without importing
    the benchmark modules, and the top level's help still lists ``bench`` as the full parser
    does; ``bench`` builds every benchmark's parser."""
    from pipeline.cli.main import build_parser

    script = (
        "import contextlib, io\n"
        "from pipeline.cli.main import main\n"
        "try:\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"
        "        main(['serve', '--port', 'abc'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 2, exit.code\n"
        "else:\n"
        "    raise AssertionError('a bad port was accepted')\n"
    )
    assert imported_after(script, ["pipeline.bench", "pipeline.bench.offline"]) == []
    full = build_parser()
    assert build_parser("serve").format_help() == full.format_help()
    assert "bench" in full.format_help()
    offline = build_parser("bench").parse_args(["bench", "offline", "--model", "tiny"])
    assert offline.benchmark == "offline" and callable(offline.run)
