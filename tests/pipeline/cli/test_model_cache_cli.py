"""The model cache through the CLI (stages/models.py; the Python API's side is
tests/stages/test_model_cache.py): a full disk and a damaged cache file are one line on stderr
and exit status 2, and the command the line names rebuilds the cache. The CLI's entry point
runs in this process (:func:`pipeline.cli.main`, the same parser, checks and error line
without an interpreter start per call) but where the process is the subject: ``serve``'s full
disk (a real ``actorline`` process's exit status and stderr) and a conversion killed midway."""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import LLM
from pipeline.runtime.prespawn import discard_prespawned
from stages import tokenize
from stages.models import ModelCacheCorruptError, resolve_model
from tests.conftest import share_kernels, small_tmpfs
from tests.pipeline.cli.conftest import InProcess
from tests.stages.test_model_cache import random_bytes, zero_bytes

CLI = [sys.executable, "-m", "pipeline.cli"]


def actorline(cache: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """The CLI, a real process, with ``cache`` as its cache directory (never the shared real
    one; the run's compiled kernels linked in)."""
    env = {**os.environ, "ACTORLINE_CACHE_DIR": str(share_kernels(cache))}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


#: the CLI in this process with ``cache`` as its cache directory, as :func:`actorline` runs it
Actorline = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def in_process(actorline_in_process: InProcess, monkeypatch: pytest.MonkeyPatch) -> Actorline:
    """:func:`actorline`'s call in this process: ``main(argv)``'s exit status, stdout and
    stderr. Each call's side work is over when it returns (its tokenizer prefetch finished,
    a prespawned engine host it left discarded): none outlives the cache directory (a tmpfs
    unmounted after the call) or carries it into the next call."""

    def run(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
        monkeypatch.setenv("ACTORLINE_CACHE_DIR", str(share_kernels(cache)))
        before = dict(tokenize._PREFETCHED)
        try:
            status, out, err = actorline_in_process(*args)
        finally:
            for model, future in tokenize._PREFETCHED.items():
                if before.get(model) is not future:
                    concurrent.futures.wait([future], timeout=180)
            discard_prespawned()
        return subprocess.CompletedProcess([*CLI, *args], status, out, err)

    return run


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The failure's only stderr line (exit status 2, no traceback)."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("actorline: error: "), result.stderr
    return lines[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("command", ["models prepare", "generate", "serve"])
def test_a_full_disk_on_the_first_start_is_one_line_and_leaves_nothing(
    tiny_gguf: Path, tmp_path: Path, command: str, in_process: Actorline
) -> None:
    """``models prepare`` and the first start of ``generate`` / ``serve`` convert the model:
    on a 1 MiB disk (the conversion writes about 5.8 MB) each says where and how much.
    ``serve`` as a real process (its exit status and stderr), the others in this process."""
    args = {
        "models prepare": ["models", "prepare", str(tiny_gguf)],
        "generate": ["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2"],
        "serve": ["serve", "--model", str(tiny_gguf), "--port", str(free_port())],
    }[command]
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        run = actorline if command == "serve" else in_process
        line = one_line(run(disk, *args))
        assert f"not enough disk space to cache the converted model in {disk / 'models'}" in line
        assert " bytes are free" in line
        needed = int(line.split(": it needs ", 1)[1].split(" bytes", 1)[0])
        assert needed > 5 << 20
        assert [p.name for p in (disk / "models").iterdir()] == [".lock"]


@pytest.mark.slow
def test_a_damaged_cache_fails_generate_with_one_line_and_its_rebuild_fixes_it(
    tiny_gguf: Path, tmp_path: Path, in_process: Actorline
) -> None:
    cache = tmp_path / "cache"
    prepared = in_process(cache, "models", "prepare", str(tiny_gguf))
    assert prepared.returncode == 0, prepared.stderr
    weights = Path(prepared.stdout.split(": ", 1)[1].strip()) / "model.safetensors"
    zero_bytes(weights)
    generate = ["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2", "--ignore-eos"]
    line = one_line(in_process(cache, *generate))
    assert f"the cached model file {weights} does not match the sha256" in line
    rebuild = line.split("rebuild the cache with: ", 1)[1]
    assert rebuild == f"actorline models prepare {tiny_gguf.resolve()} --force"
    rebuilt = in_process(cache, *shlex.split(rebuild)[1:])
    assert rebuilt.returncode == 0, rebuilt.stderr
    answered = in_process(cache, *generate)
    assert answered.returncode == 0, answered.stderr


@pytest.mark.slow
@pytest.mark.model
def test_the_default_models_damaged_cache_is_refused_not_run(
    default_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    in_process: Actorline,
) -> None:
    """The issue's vector on the real 538 MB cache (a copy): zeroed bytes used to run and
    answer garbage, random bytes to be reported as a model needing an attention feature."""
    cache = tmp_path / "cache"
    entry = cache / "models" / default_model_dir.name
    shutil.copytree(default_model_dir, entry)
    weights = entry / "model.safetensors"
    monkeypatch.setenv("ACTORLINE_CACHE_DIR", str(cache))
    assert resolve_model("smollm2-135m").path == entry  # the copy hashed once (new inodes)
    zero_bytes(weights)
    line = one_line(in_process(cache, "generate", "hi", "--max-tokens", "2"))
    assert f"{weights} does not match the sha256" in line
    assert line.endswith("rebuild the cache with: actorline models prepare smollm2-135m --force")
    random_bytes(weights)
    with pytest.raises(ModelCacheCorruptError) as caught:
        LLM("smollm2-135m", transport="memory", num_blocks=16)
    assert caught.value.path == str(weights)


@pytest.mark.slow
def test_what_a_killed_conversion_left_is_removed_by_the_next_start(
    tiny_gguf: Path, tmp_path: Path, in_process: Actorline
) -> None:
    """The conversion killed midway is a real process; the next start, in this process."""
    cache = tmp_path / "cache"
    env = {**os.environ, "ACTORLINE_CACHE_DIR": str(cache)}
    process = subprocess.Popen(
        [*CLI, "models", "prepare", str(tiny_gguf)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    models = cache / "models"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if models.is_dir() and any(p.name.startswith(".tiny-") for p in models.iterdir()):
                break
            time.sleep(0.005)
    finally:
        process.kill()
        process.wait()
    left = [p.name for p in models.iterdir() if p.name != ".lock"]
    assert left and all(name.startswith(".tiny-") for name in left), left  # killed midway
    prepared = in_process(cache, "models", "prepare", str(tiny_gguf))
    assert prepared.returncode == 0, prepared.stderr
    entry = Path(prepared.stdout.split(": ", 1)[1].strip())
    assert sorted(p.name for p in models.iterdir()) == [".lock", entry.name]
