"""``actorline serve --data-parallel-size 2`` (gRPC and HTTP from one command) when one engine
replica's host process is SIGKILLed: the service serves on from the other replica (gRPC health
stays SERVING, HTTP ``/health`` stays 200 and names the dead replica, new requests on both
front ends complete), ``/metrics`` reports each replica, the log says what died, the replica
heals on its own (``/health`` names it alive again on a fresh process, its restart counted in
``actorline_replica_restarts_total``, and it computes new requests), and SIGTERM still stops
the command with exit 0 and no process left."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pipeline.server.client import Client
from stages.params import SamplingParams
from tests.pipeline.server.http.conftest import (
    API_KEY,
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
)

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def health(serve: ServeProcess) -> dict[str, Any]:
    with urllib.request.urlopen(serve.base_url + "/health", timeout=60) as response:
        assert response.status == 200
        body: dict[str, Any] = json.loads(response.read())
        return body


def complete(serve: ServeProcess, prompt: str, **extra: Any) -> dict[str, Any]:
    request = urllib.request.Request(
        serve.base_url + "/v1/completions",
        data=json.dumps(
            {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, **extra}
        ).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def test_a_dead_replica_leaves_actorline_serve_serving(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    serve = ServeProcess(
        openai_serve_arguments(
            tiny_model_dir, "--num-blocks", "64", "--data-parallel-size", "2",
            "--api-key", API_KEY, "--restart-backoff", "2",
        ),
        tmp_path / "stderr.txt",
    )  # fmt: skip
    try:
        assert serve.address is not None
        children = child_pids(serve.process.pid)
        hosts = engine_host_pids(serve.process.pid)
        assert len(hosts) == 2, hosts  # one host process per replica
        assert health(serve) == {
            "status": "ok",
            "replicas": [{"replica": "0", "alive": True}, {"replica": "1", "alive": True}],
        }
        before = complete(serve, "Hello there")["choices"][0]["text"]

        victim = min(hosts)
        os.kill(victim, signal.SIGKILL)
        poll_until(
            lambda: not all(replica["alive"] for replica in health(serve)["replicas"]),
            "/health to report the dead replica",
        )
        replicas = health(serve)["replicas"]
        dead = [replica for replica in replicas if not replica["alive"]]
        assert len(dead) == 1 and "killed by signal 9" in dead[0]["error"], replicas
        (alive,) = [replica["replica"] for replica in replicas if replica["alive"]]
        # NOTE: /health says "dead" once the replica failed; the router stops routing to it
        # when it is cut off, a moment later, and then the server logs it
        poll_until(
            lambda: f"engine replica {dead[0]['replica']} died" in serve.stderr,
            "the server to log the lost replica",
        )

        # both front ends serve on, from the replica that lives
        with Client(serve.address, api_key=API_KEY) as client:
            assert client.health() == "SERVING"
            streamed = list(client.generate("Hello there", GREEDY))
            assert sum(len(output.token_ids) for output in streamed) == GREEDY.max_tokens
        assert complete(serve, "Hello there")["choices"][0]["text"] == before
        samples = metrics(serve)
        up = {
            dict(labels)["replica"]: value
            for (name, labels), value in samples.items()
            if name == "actorline_replica_up"
        }
        assert up[alive] == 1.0  # (the dead one may be back already)
        # vLLM's names label each replica's series with engine="<replica>", as vLLM does each
        # engine core's; a request counts under the replica that ran it.
        vllm = [(name, dict(labels), value) for (name, labels), value in samples.items()
                if name.startswith("vllm:")]  # fmt: skip
        assert {labels["model_name"] for _, labels, _ in vllm} == {MODEL}
        assert {labels["engine"] for _, labels, _ in vllm} <= {"0", "1"}
        assert ("vllm:num_requests_running", {"model_name": MODEL, "engine": alive}, 0.0) in vllm
        finished = sum(v for n, _, v in vllm if n == "vllm:e2e_request_latency_seconds_count")
        assert finished >= 3  # the two completions and the stream

        # the dead replica heals on its own: a fresh host process, counted, serving
        poll_until(
            lambda: all(replica["alive"] for replica in health(serve)["replicas"]),
            "/health to report the replica alive again",
            timeout=90,
        )
        assert len(engine_host_pids(serve.process.pid) - hosts) == 1
        assert "engine replica " + dead[0]["replica"] + " serves again (restart 1" in serve.stderr
        restarts = {
            dict(labels)["replica"]: value
            for (name, labels), value in metrics(serve).items()
            if name == "actorline_replica_restarts_total"
        }
        assert restarts == {alive: 0.0, dead[0]["replica"]: 1.0}, restarts

        greedy = complete(serve, "Hello there", temperature=0)["choices"][0]["text"]

        def restored_steps() -> bool:
            for _ in range(2):
                text = complete(serve, "Hello there", temperature=0)["choices"][0]["text"]
                assert text == greedy
            steps = {
                dict(labels)["replica"]: value
                for (name, labels), value in metrics(serve).items()
                if name == "actorline_replica_engine_steps_total"
            }
            return steps.get(dead[0]["replica"], 0.0) > 0

        poll_until(restored_steps, "the restored replica to compute requests", timeout=60)
        children |= engine_host_pids(serve.process.pid)

        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(EXIT_TIMEOUT) == 0, serve.stderr[-3000:]
        assert not any(process_alive(pid) for pid in children)
    finally:
        serve.kill()
