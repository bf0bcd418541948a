"""The engine on a Ray cluster as users start one (docs/parallelism.md, "Token
authentication"): ``ray start --head`` in a subprocess (tests/ray_started.py: its own home,
temporary directory and free ports; nothing of it left once stopped), not ``ray.init()`` in the
test process. With token authentication on (Ray's default where the user has a token),
``actorline serve --ray ADDRESS`` joins with the token where Ray's CLI finds it and serves the
local engine's greedy tokens; a wrong or missing token, or no cluster at the address, is one
line and exit status 2 for the CLI (serve, bench) and RayConnectionError for the API, without
Ray's 20 s of InvalidAuthToken retries; the token is never printed. With authentication off,
serving needs no token. The options' plain-data checks need no cluster."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import StartOptions
from pipeline.cli.llm import engine_options_from
from pipeline.cli.main import build_parser
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import start_options
from pipeline.runtime.errors import GraphError, PipelineError
from pipeline.runtime.graph import Pipeline
from pipeline.runtime.ray_connection import RayConnectionError, check_versions
from pipeline.server.client import Client
from tests.pipeline.engine.test_ray_engine import GREEDY, PROMPTS, local_tokens
from tests.pipeline.runtime.test_running import run
from tests.pipeline.server.serving import (
    REPOSITORY,
    ServeProcess,
    actorline_command,
    serve_arguments,
)
from tests.ray_started import StartedRay, free_port, generate_token, user_environment

__all__ = ["local_tokens"]  # the fixture, shared with test_ray_engine

#: seconds a refusal may take, at most, on a loaded machine (an interpreter importing torch
#: and Ray included); Ray itself retried for 20 s before failing
PROMPTLY = 90.0
#: Ray's own lines when it retries a refused connection
RAY_RETRY_LINES = ("InvalidAuthToken", "gcs_client.cc", "Failed to connect")
#: the API's start in a fresh interpreter: the error's type names and message as JSON
API_START = """
import asyncio, json, sys
from pipeline import AsyncEngine

async def main():
    engine = AsyncEngine(sys.argv[1], num_blocks=64, ray_address=sys.argv[2],
                         ray_auth_token_file=sys.argv[3])
    try:
        await engine.start()
    except Exception as exc:
        print(json.dumps({"types": [c.__name__ for c in type(exc).__mro__],
                          "message": str(exc)}))
    else:
        print(json.dumps({"types": [], "message": "started"}))
    finally:
        await engine.close()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartedRay]:
    """``ray start --head`` by a user who has a Ray token (``ray get-auth-token --generate``):
    Ray turns token authentication on by itself."""
    home = tmp_path_factory.mktemp("ray-user")
    generate_token(home)
    cluster = StartedRay(home)
    try:
        assert "Token authentication is enabled" in cluster.output
        yield cluster
    finally:
        cluster.stop()


def host_actors(cluster: StartedRay) -> list[str]:
    """The cluster's processes that run an engine host actor."""
    return [command for command in cluster.processes().values() if "_HostActor" in command]


def wait_no_host_actor(cluster: StartedRay, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while host_actors(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not host_actors(cluster), host_actors(cluster)


def refusal(command: list[str], env: dict[str, str]) -> tuple[int, list[str], str, float]:
    """Run ``actorline COMMAND`` to its end: exit status, stderr lines, stdout, seconds."""
    began = time.monotonic()
    result = subprocess.run(
        [*actorline_command(), *command],
        env={**env, "PYTHONPATH": str(REPOSITORY)},
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result.returncode, result.stderr.splitlines(), result.stdout, time.monotonic() - began


# -- plain data ----------------------------------------------------------------------------------


def test_the_token_file_option_reaches_the_start_options_and_needs_ray() -> None:
    args = build_parser().parse_args(
        ["serve", "--ray", "10.0.0.5:6379", "--ray-auth-token-file", "/run/ray/token"]
    )
    options = EngineOptions.create(**engine_options_from(args))
    assert options.ray_auth_token_file == "/run/ray/token"
    started = start_options(options)
    assert (started.ray_address, started.ray_auth_token_file) == ("10.0.0.5:6379", "/run/ray/token")
    assert build_parser().parse_args(["serve"]).ray_auth_token_file is None
    with pytest.raises(ValueError, match="ray_auth_token_file is the token of a Ray cluster"):
        EngineOptions(ray_auth_token_file="/run/ray/token")
    with pytest.raises(ValueError, match="ray_auth_token_file must be a file name"):
        EngineOptions(ray=True, ray_auth_token_file="")
    # the runtime refuses it for a pipeline with no host on Ray
    with pytest.raises(GraphError, match="ray_auth_token_file is for hosts on Ray"):
        run(lambda: Pipeline("empty").start(StartOptions(ray_auth_token_file="/run/ray/token")))


def test_a_cluster_of_another_ray_or_python_is_refused_in_one_line() -> None:
    import ray
    from ray._private.utils import compute_version_info

    ours = compute_version_info()
    check_versions("10.0.0.5:6379", {"ray_version": ours[0], "python_version": ours[1]})
    check_versions("10.0.0.5:6379", {})  # a cluster that publishes none: Ray checks nothing
    other = {"ray_version": "2.59.0", "python_version": ours[1]}
    with pytest.raises(RayConnectionError) as refused:
        check_versions("10.0.0.5:6379", other)
    message = str(refused.value)
    assert "\n" not in message and isinstance(refused.value, PipelineError)
    assert f"runs Ray 2.59.0 on Python {ours[1]}, this process Ray {ray.__version__}" in message
    assert "install ray==2.59.0" in message


# -- on a cluster started with `ray start --head` ------------------------------------------------


@pytest.mark.slow
def test_serve_joins_a_token_cluster_with_the_users_token(
    tiny_model_dir: Path,
    token_cluster: StartedRay,
    local_tokens: list[tuple[int, ...]],
    tmp_path: Path,
) -> None:
    # as the user who started it: no RAY_* variable, the token in ~/.ray/auth_token only
    arguments = serve_arguments(tiny_model_dir, "--ray", token_cluster.address)
    serve = ServeProcess(
        [*arguments, "--ray-num-cpus", "0.5", "--log-level", "INFO"],
        tmp_path / "stderr.txt",
        env=token_cluster.environment(),
    )
    try:
        assert serve.address is not None
        assert len(host_actors(token_cluster)) == 1  # the engine runs in the cluster
        with Client(serve.address) as client:
            tokens = [t for out in client.generate(PROMPTS[0], GREEDY) for t in out.token_ids]
        assert tuple(tokens) == local_tokens[0]
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(60) == 0, serve.stderr[-3000:]
    finally:
        serve.kill()
    token_file = token_cluster.home / ".ray" / "auth_token"
    assert f"asks for a token: sending the one in {token_file}" in serve.stderr
    assert token_file.read_text().strip() not in serve.stderr
    assert not any(line in serve.stderr for line in RAY_RETRY_LINES), serve.stderr[-3000:]
    wait_no_host_actor(token_cluster)


@pytest.mark.slow
def test_serve_joins_with_the_token_in_the_environment_as_on_kuberay(
    tiny_model_dir: Path,
    token_cluster: StartedRay,
    local_tokens: list[tuple[int, ...]],
    tmp_path: Path,
) -> None:
    # deploy/kuberay/raycluster.yaml's frontend: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from
    # the cluster's Secret, no token file anywhere
    token = (token_cluster.home / ".ray" / "auth_token").read_text().strip()
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    env = {**token_cluster.environment(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
           "HOME": str(elsewhere)}  # fmt: skip
    arguments = serve_arguments(tiny_model_dir, "--ray", token_cluster.address)
    serve = ServeProcess([*arguments, "--ray-num-cpus", "0.5"], tmp_path / "stderr.txt", env=env)
    try:
        assert serve.address is not None
        with Client(serve.address) as client:
            tokens = [t for out in client.generate(PROMPTS[2], GREEDY) for t in out.token_ids]
        assert tuple(tokens) == local_tokens[2]
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(60) == 0, serve.stderr[-3000:]
    finally:
        serve.kill()
    assert token not in serve.stderr
    wait_no_host_actor(token_cluster)


@pytest.mark.slow
def test_a_wrong_or_missing_token_is_one_line_and_exit_status_2(
    tiny_model_dir: Path, token_cluster: StartedRay, tmp_path: Path
) -> None:
    address = token_cluster.address
    wrong = tmp_path / "wrong-token"
    wrong.write_text("0" * 64 + "\n")
    stranger = tmp_path / "stranger"  # a user without the cluster's token
    stranger.mkdir()
    serve = ["serve", "--model", str(tiny_model_dir), "--port", "0", "--ray", address]
    cases = [
        # the token file given is not the cluster's: named by where it came from
        (
            [*serve, "--ray-auth-token-file", str(wrong)],
            token_cluster.environment(),
            f"the Ray cluster at {address} refused this process's token (from "
            f"RAY_AUTH_TOKEN_PATH ({wrong})): it is not the cluster's; give the cluster's token",
        ),
        # a user with no token at all
        (
            serve,
            {**token_cluster.environment(), "HOME": str(stranger)},
            f"the Ray cluster at {address} requires token authentication and this process has "
            "no token: give the cluster's token (`ray get-auth-token` on its head prints it) in "
            "~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or as ray_auth_token_file "
            "(--ray-auth-token-file FILE)",
        ),
    ]
    for command, env, expected in cases:
        assert_one_line(command, env, expected)
    wait_no_host_actor(token_cluster)


@pytest.mark.slow
def test_bench_on_a_cluster_that_refuses_is_one_line(
    tiny_model_dir: Path, token_cluster: StartedRay
) -> None:
    # the benchmark that compares Ray with local processes, a wrong token in RAY_AUTH_TOKEN
    command = ["bench", "ceiling", "--quick", "--model", str(tiny_model_dir), "--requests", "2",
               "--max-tokens", "2", "--repeats", "1", "--ray", token_cluster.address]  # fmt: skip
    assert_one_line(
        command,
        token_cluster.environment(RAY_AUTH_TOKEN="1" * 64),
        f"the Ray cluster at {token_cluster.address} refused this process's token (from "
        "RAY_AUTH_TOKEN)",
    )


def assert_one_line(command: list[str], env: dict[str, str], expected: str) -> None:
    """``actorline COMMAND`` fails promptly with exit status 2 and one line on stderr that
    holds ``expected`` and none of the tokens the tests use."""
    status, stderr, stdout, seconds = refusal(command, env)
    assert status == 2, (command, stderr[-20:])
    assert len(stderr) == 1, (command, stderr[-20:])
    (line,) = stderr
    assert line.startswith("actorline") and ": error: " in line, line
    assert expected in line, line
    assert "0" * 64 not in line and "1" * 64 not in line  # never the token
    assert seconds < PROMPTLY, (command, seconds)
    assert stdout == "", stdout


@pytest.mark.slow
def test_the_api_refuses_with_a_typed_error(
    tiny_model_dir: Path, token_cluster: StartedRay, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("2" * 64)
    result = subprocess.run(
        [sys.executable, "-c", API_START, str(tiny_model_dir), token_cluster.address, str(wrong)],
        env={**token_cluster.environment(), "PYTHONPATH": str(REPOSITORY)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["types"][:3] == ["RayConnectionError", "PipelineError", "ValueError"], reply
    assert reply["message"].startswith(f"the Ray cluster at {token_cluster.address} refused")
    assert "2" * 64 not in result.stdout + result.stderr
    assert not any(line in result.stderr for line in RAY_RETRY_LINES), result.stderr[-3000:]


@pytest.mark.slow
def test_no_cluster_at_the_address_is_one_line(tiny_model_dir: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    command = ["serve", "--model", str(tiny_model_dir), "--port", "0", "--ray", address]
    status, stderr, _, seconds = refusal(command, user_environment())
    assert status == 2 and len(stderr) == 1, stderr[-20:]
    assert stderr[0] == (
        f"actorline: error: no Ray cluster at {address}: Connection refused (give the address "
        "`ray start --head` printed; `ray status` on the head shows it)"
    )
    assert seconds < PROMPTLY


@pytest.mark.slow
def test_serve_joins_a_cluster_without_authentication(
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    local_tokens: list[tuple[int, ...]],
    tmp_path: Path,
) -> None:
    # started by a user with no token: Ray leaves authentication off (and says so)
    home = tmp_path_factory.mktemp("ray-open")
    cluster = StartedRay(home)
    try:
        assert "Token authentication is disabled" in cluster.output
        # a token of the user's own since: it is not sent where none is asked for
        generate_token(home)
        arguments = serve_arguments(tiny_model_dir, "--ray", cluster.address)
        serve = ServeProcess(
            [*arguments, "--ray-num-cpus", "0.5", "--log-level", "INFO"],
            tmp_path / "stderr.txt",
            env=cluster.environment(),
        )
        try:
            assert serve.address is not None
            with Client(serve.address) as client:
                tokens = [t for out in client.generate(PROMPTS[1], GREEDY) for t in out.token_ids]
            assert tuple(tokens) == local_tokens[1]
            serve.process.send_signal(signal.SIGTERM)
            assert serve.process.wait(60) == 0, serve.stderr[-3000:]
        finally:
            serve.kill()
        assert "asks for a token" not in serve.stderr and "Connected to Ray" in serve.stderr
        wait_no_host_actor(cluster)
    finally:
        cluster.stop()
