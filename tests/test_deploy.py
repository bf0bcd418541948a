"""deploy/: the KubeRay RayCluster manifest and the container image recipe, parsed (no cluster
here): the manifest is a well-formed RayCluster whose head pod runs `actorline serve --ray` as a
Ray driver beside Ray's head (sharing its session directory and process namespace, joining with
the token KubeRay makes for the cluster), every flag of its command line is one the real CLI
parser defines, the ports it serves are the ones the pod and the Service expose, its Ray version
is the one the image installs, and the image builds from what the repository holds
(docs/parallelism.md, "KubeRay")."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from pipeline.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
#: where a Ray node keeps its session (the raylet's sockets, logs): a driver on the node reads it
RAY_SESSION_DIR = "/tmp/ray"


def documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()))


def containerfile() -> list[tuple[str, str]]:
    """The recipe's instructions (continuation lines joined), as (INSTRUCTION, rest)."""
    text = (DEPLOY / "Containerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


def subcommand(name: str) -> argparse.ArgumentParser:
    """The real CLI's parser of ``actorline NAME``."""
    (commands,) = [
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    parser = commands.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def parse_actorline(command: list[str]) -> argparse.Namespace:
    """``command`` (``actorline SUBCOMMAND ...``) parsed by the real CLI parser, after checking
    that each of its flags is one the subcommand defines, spelled out (argparse would also take
    an abbreviation)."""
    assert command[0] == "actorline", command
    flags = subcommand(command[1])._option_string_actions
    for word in command[2:]:
        if word.startswith("-"):
            assert word.split("=", 1)[0] in flags, f"actorline {command[1]} has no flag {word}"
    return build_parser().parse_args(command[1:])


def head_pod() -> dict[str, Any]:
    cluster, _ = documents()
    spec: dict[str, Any] = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    return spec


def serve_command() -> list[str]:
    """The head's actorline container's ``actorline serve ...`` command line."""
    _, frontend = head_pod()["containers"]
    command = " ".join(frontend["args"])
    return shlex.split(command[command.index("actorline serve") :])


def test_the_manifest_is_a_raycluster_serving_actorline_on_ray() -> None:
    cluster, service = documents()
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # engines go to the workers
    ray_head, frontend = head["template"]["spec"]["containers"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in " ".join(ray_head["args"])
    serve = serve_command()
    assert serve[:4] == ["actorline", "serve", "--ray", "127.0.0.1:6379"]
    # the serve command line is one the real CLI accepts, flag by flag
    args = parse_actorline(serve)
    assert args.ray == "127.0.0.1:6379" and args.data_parallel_size == 2
    assert args.host == "0.0.0.0"
    (workers,) = spec["workerGroupSpecs"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    worker = workers["template"]["spec"]["containers"][0]
    cpus = float(worker["resources"]["limits"]["cpu"])
    assert args.ray_num_cpus <= cpus  # an engine host fits a worker pod
    images = {ray_head["image"], frontend["image"], worker["image"]}
    assert len(images) == 1  # one image, so one Ray version, everywhere
    assert service["kind"] == "Service"
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "head"


def test_the_frontend_is_a_driver_of_the_heads_ray() -> None:
    pod = head_pod()
    # a Ray driver on a node needs its raylet's session directory and to see the raylet
    assert pod["shareProcessNamespace"] is True
    (volume,) = [v for v in pod["volumes"] if "emptyDir" in v]
    for container in pod["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        assert mounts.get(RAY_SESSION_DIR) == volume["name"], container["name"]


def test_the_frontend_joins_with_the_token_kuberay_makes() -> None:
    cluster, _ = documents()
    # KubeRay (1.5.1+) makes the Secret, named after the cluster (ray-operator's CheckName keeps
    # a name of 50 characters or fewer that starts with a letter), with the token under
    # `auth_token`, and sets these variables on Ray's own container of each pod only
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    name = cluster["metadata"]["name"]
    assert len(name) <= 50 and name[0].isalpha()
    ray_head, frontend = head_pod()["containers"]
    env = {variable["name"]: variable for variable in frontend["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": name, "key": "auth_token"}
    assert "RAY_AUTH_TOKEN" not in {v["name"] for v in ray_head.get("env", [])}  # KubeRay's
    # the serve command takes the token from the environment, as Ray's CLI does: no file flag
    assert parse_actorline(serve_command()).ray_auth_token_file is None


def test_the_ports_served_are_the_ones_exposed() -> None:
    _, service = documents()
    _, frontend = head_pod()["containers"]
    args = parse_actorline(serve_command())
    # gRPC and the OpenAI-compatible HTTP API, each on a named container port
    ports = {port["name"]: port["containerPort"] for port in frontend["ports"]}
    assert ports == {"grpc": args.grpc_port, "http": args.http_port}
    assert (args.grpc_port, args.http_port) == (50051, 8000)
    assert frontend["readinessProbe"]["grpc"]["port"] == args.grpc_port
    exposed = {port["targetPort"]: port["port"] for port in service["spec"]["ports"]}
    assert exposed == {"grpc": 50051, "http": 8000}


def test_the_image_installs_the_clusters_ray_and_builds_from_the_repository() -> None:
    steps = containerfile()
    assert steps[0][0] == "FROM"
    arguments = dict(step[1].split("=", 1) for step in steps if step[0] == "ARG" and "=" in step[1])
    (cluster, _) = documents()
    assert arguments["RAY_VERSION"] == cluster["spec"]["rayVersion"]
    copied = [step[1].split()[0] for step in steps if step[0] == "COPY"]
    for source in copied:
        assert (ROOT / source).exists(), source
    assert {"pipeline", "transports", "stages", "plugins", "pyproject.toml"} <= set(copied)
    installs = " ".join(step[1] for step in steps if step[0] == "RUN")
    assert '".[ray]"' in installs and "ray[default]==${RAY_VERSION}" in installs
    assert "actorline models prepare smollm2-135m" in installs
    extra = re.search(r'ray = \["(ray\[default\][^"]*)"\]', (ROOT / "pyproject.toml").read_text())
    assert extra is not None  # the extra the image installs exists
    # torch: the project's version, the CPU build by default (the CUDA one documented), and
    # installed before actorline, whose own torch requirement it then satisfies
    assert arguments["TORCH_SPEC"] == "torch==2.13.0"
    assert arguments["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [step[1] for step in steps if step[0] == "RUN"]
    torch_step = next(i for i, run in enumerate(runs) if '"${TORCH_SPEC}"' in run)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_step]
    assert torch_step < next(i for i, run in enumerate(runs) if '".[ray]"' in run)
    comments = (DEPLOY / "Containerfile").read_text()
    assert "--build-arg TORCH_INDEX_URL=https://pypi.org/simple" in comments  # the CUDA variant
    assert ("EXPOSE", "50051 8000") in steps
    assert ("ENTRYPOINT", '["actorline"]') in steps
    # the default command is one the real CLI accepts, serving both front ends
    (cmd,) = [step[1] for step in steps if step[0] == "CMD"]
    args = parse_actorline(["actorline", *yaml.safe_load(cmd)])
    assert (args.command, args.grpc_port, args.http_port) == ("serve", 50051, 8000)
