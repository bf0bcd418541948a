"""``actorline serve`` heals (docs/architecture.md §4.7): its engine process SIGKILLed, then
SIGSTOPped (frozen, found by the heartbeat), while a gRPC stream runs; each time the stream ends
with UNAVAILABLE, ``/health`` turns 503 and gRPC health NOT_SERVING, a fresh engine starts, both
turn back to 200 / SERVING, and the same prompt gets the same answer over HTTP and gRPC from
the same serve process; ``/metrics`` counts the restarts. Killed twice within the window with
``--restart-limit 2``, the command exits 1 with one line saying why. SIGTERM while the fresh
engine starts still exits 0. No traceback in any log."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pipeline.engine.errors import EngineDeadError
from pipeline.server.client import Client
from stages.params import SamplingParams
from tests.pipeline.server.http.conftest import (
    EXIT_TIMEOUT,
    MODEL,
    metrics,
    openai_serve_arguments,
    poll_until,
)
from tests.pipeline.server.serving import (
    ServeProcess,
    child_pids,
    engine_host_pids,
    process_alive,
    serve_arguments,
    stream_in_background,
)

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
#: a heartbeat timeout a test can wait on (docs/serving.md, Health)
HEARTBEAT_TIMEOUT = 3.0
#: seconds from the kill to the stream's error (frozen: plus the heartbeat timeout)
FAILS_WITHIN = 10.0
#: seconds for a fresh tiny engine to serve on a loaded 2-core machine
HEALS_WITHIN = 90.0
#: seconds the first answer after the restart may take
ANSWER_WITHIN = 30.0
#: (no back-off: the restart follows at once, so a SIGTERM lands while the fresh engine starts)
SUPERVISION = ("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--restart-backoff", "0")


def http_health(serve: ServeProcess, reason: str = "") -> int:
    """``/health``'s status; a 503 must give ``reason`` in its message."""
    try:
        with urllib.request.urlopen(serve.base_url + "/health", timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        message = json.loads(error.read())["error"]["message"]
        assert reason in message, message
        return int(error.code)


def grpc_health(serve: ServeProcess) -> str:
    assert serve.address is not None
    with Client(serve.address) as client:
        return client.health()


def http_answer(serve: ServeProcess, prompt: str) -> str:
    request = urllib.request.Request(
        serve.base_url + "/v1/completions",
        data=json.dumps(
            {"model": MODEL, "prompt": prompt, "max_tokens": GREEDY.max_tokens,
             "temperature": 0.0, "ignore_eos": True}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=ANSWER_WITHIN) as response:
        answer: dict[str, Any] = json.loads(response.read())
    text: str = answer["choices"][0]["text"]
    return text


def grpc_answer(serve: ServeProcess, prompt: str) -> tuple[int, ...]:
    assert serve.address is not None
    with Client(serve.address) as client:
        return tuple(t for output in client.generate(prompt, GREEDY) for t in output.token_ids)


def break_engine(serve: ServeProcess, signum: int) -> float:
    """Send ``signum`` to the engine process while a gRPC stream runs; check the stream fails
    and both healths go down, then come back; the seconds from the signal to both healthy."""
    assert serve.address is not None
    stream = stream_in_background(serve.address, "Go on forever", LONG, timeout=120)
    assert stream.started.wait(60) and not stream.errors, stream.errors
    (engine,) = engine_host_pids(serve.process.pid)
    os.kill(engine, signum)
    killed = time.monotonic()
    try:
        stream.thread.join(FAILS_WITHIN + HEARTBEAT_TIMEOUT)
        assert not stream.thread.is_alive()
        assert len(stream.errors) == 1 and isinstance(stream.errors[0], EngineDeadError)
        poll_until(
            lambda: (
                http_health(serve, "the engine is restarting") == 503
                and grpc_health(serve) == "NOT_SERVING"
            ),
            "/health 503 and NOT_SERVING while the engine restarts",
            timeout=5.0,
        )
    finally:
        if signum == signal.SIGSTOP:
            try:
                os.kill(engine, signal.SIGCONT)
            except ProcessLookupError:
                pass
    poll_until(
        lambda: http_health(serve) == 200 and grpc_health(serve) == "SERVING",
        "/health 200 and SERVING once a fresh engine serves",
        timeout=HEALS_WITHIN,
    )
    healed = time.monotonic() - killed
    assert not process_alive(engine)
    (fresh,) = engine_host_pids(serve.process.pid)
    assert fresh != engine
    return healed


def test_actorline_serve_heals_a_killed_then_a_frozen_engine_then_stops_while_restarting(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Killed, then frozen: each time the serve process heals (see :func:`break_engine`) and
    answers as before. Then killed a third time, and SIGTERM while the fresh engine starts:
    the restart is cancelled, the command exits 0 without a traceback, and no engine process
    is left (neither the dead one nor the fresh). (Formerly
    test_a_stop_signal_while_the_engine_restarts, a serve process of its own.)"""
    serve = ServeProcess(
        openai_serve_arguments(tiny_model_dir, "--num-blocks", "64", *SUPERVISION),
        tmp_path / "stderr.txt",
    )
    try:
        text, tokens = http_answer(serve, "Hello there"), grpc_answer(serve, "Hello there")
        assert len(tokens) == GREEDY.max_tokens
        for restarts, signum in enumerate((signal.SIGKILL, signal.SIGSTOP), start=1):
            healed = break_engine(serve, signum)
            print(f"{signal.Signals(signum).name}: healthy again {healed:.1f} s after the signal")
            started = time.monotonic()
            assert grpc_answer(serve, "Hello there") == tokens
            assert http_answer(serve, "Hello there") == text
            assert time.monotonic() - started < ANSWER_WITHIN
            assert metrics(serve)["actorline_engine_restarts_total", frozenset()] == restarts
        # killed again, and SIGTERM while the fresh engine starts
        (engine,) = engine_host_pids(serve.process.pid)
        os.kill(engine, signal.SIGKILL)
        poll_until(lambda: http_health(serve) == 503, "/health 503", timeout=5.0)
        children = child_pids(serve.process.pid)  # a fresh engine's process among them
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(EXIT_TIMEOUT) == 0, serve.stderr[-3000:]
        assert not any(process_alive(pid) for pid in children | {engine})
        stderr = serve.stderr
        assert "Traceback" not in stderr, stderr[-5000:]
        assert "killed by signal 9" in stderr and "has been unresponsive for 3 s" in stderr
        assert "the engine serves again (restart 2," in stderr, stderr[-5000:]
        assert "the engine serves again (restart 3," not in stderr, stderr[-5000:]
    finally:
        serve.kill()


def test_actorline_serve_exits_on_a_crash_loop(tiny_model_dir: Path, tmp_path: Path) -> None:
    serve = ServeProcess(
        serve_arguments(tiny_model_dir, "--restart-limit", "2", "--restart-backoff", "0"),
        tmp_path / "stderr.txt",
    )
    try:
        children = child_pids(serve.process.pid)
        (engine,) = engine_host_pids(serve.process.pid)
        os.kill(engine, signal.SIGKILL)
        poll_until(
            lambda: (
                engine_host_pids(serve.process.pid) not in (set(), {engine})
                and grpc_health(serve) == "SERVING"
            ),
            "a fresh engine",
            timeout=HEALS_WITHIN,
        )
        (engine,) = engine_host_pids(serve.process.pid)
        os.kill(engine, signal.SIGKILL)
        assert serve.process.wait(EXIT_TIMEOUT) == 1, serve.stderr[-3000:]
        assert not any(process_alive(pid) for pid in children)
        stderr = serve.stderr
        assert "Traceback" not in stderr, stderr[-5000:]
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("actorline: error: the engine died 2 times within 120 s"), last
        assert "killed by signal 9" in last
    finally:
        serve.kill()
