"""The actorline CLI as a real subprocess: it generates, and fails cleanly on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "pipeline.cli"]


def actorline(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_plugins_lists_every_group() -> None:
    result = actorline("plugins")
    assert result.returncode == 0, result.stderr
    for expected in ("actorline.schedulers", "fcfs", "sjf", "actorline.transports", "zmq", "grpc"):
        assert expected in result.stdout


@pytest.mark.slow
def test_generate_streams_text(tiny_model_dir: Path) -> None:
    result = actorline(
        "generate", "Hello there", "--model", str(tiny_model_dir), "--max-tokens", "6"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


@pytest.mark.slow
def test_demo_pipeline_runs() -> None:
    result = actorline("demo", "--count", "5")
    assert result.returncode == 0, result.stderr
    assert "collatz(3) reaches 1 in 7 steps" in result.stdout


def gguf_path() -> Path:
    from stages.models import ALIASES, _alias_file

    return _alias_file(ALIASES["smollm2-135m"])


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
    ],
)
def test_bad_input_fails_with_one_clear_line(args: list[str], message: str) -> None:
    result = actorline(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("actorline: error:"), result.stderr
    assert message in lines[0]


def test_corrupt_and_truncated_gguf_fail_cleanly(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path().read_bytes()[: 2 << 20])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 4096)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    for path, message in (
        (truncated, "not a readable GGUF model"),
        (corrupt, "not a readable GGUF model"),
        (not_gguf, "is not a GGUF file"),
    ):
        result = actorline("generate", "hi", "--model", str(path), "--max-tokens", "2")
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("words", "extra", "length"),
    [(1100, [], 1024), (100, ["--max-model-len", "64", "--transport", "memory"], 64)],
    ids=["model-length", "max-model-len"],
)
def test_prompt_longer_than_the_model_fails_with_one_line(
    tiny_model_dir: Path, words: int, extra: list[str], length: int
) -> None:
    prompt = "hello " * words
    result = actorline(
        "generate", prompt, "--model", str(tiny_model_dir), "--max-tokens", "4", *extra
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("actorline: error:"), result.stderr
    assert f"the model's length is {length}" in lines[0] and "the prompt has" in lines[0]
    assert not result.stdout.strip()
