"""A benchmark's server in its own process: started, awaited until its ``/health`` answers,
stopped when the block ends (``actorline serve``, ``vllm serve``, llama.cpp's
``llama-server`` alike), and a free port to give one."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

__all__ = ["free_port", "serve_process", "started_server"]

_READY = "serving OpenAI-compatible API on "
_START_TIMEOUT_S = 1800.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the server binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def serve_process(
    command: list[str], env: dict[str, str] | None, port: int | None
) -> Iterator[int]:
    """Run a server until the block ends; yields its HTTP port once ``/health`` answers (ours
    prints its URL; vLLM's and llama-server's is the ``port`` given).

    Raises:
        RuntimeError: the server exited or did not answer within the start timeout (the
            message has the end of its output).
    """
    with started_server(command, env, port) as (bound, _process):
        yield bound


@contextlib.contextmanager
def started_server(
    command: list[str], env: dict[str, str] | None, port: int | None
) -> Iterator[tuple[int, subprocess.Popen[Any]]]:
    """:func:`serve_process`, yielding the server's process beside its port (a benchmark that
    reads the process's own CPU time).

    Raises:
        RuntimeError: as :func:`serve_process`.
    """
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE if port is None else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
            text=port is None,
        )
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            if port is None:
                assert process.stdout is not None
                for line in process.stdout:
                    if line.startswith(_READY):
                        port = int(line[len(_READY) :].strip().rsplit(":", 1)[1].split("/")[0])
                        break
            while port is None or not _healthy(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"{command[0]} did not start serving:\n{tail}")
                time.sleep(0.5)
            yield port, process
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
