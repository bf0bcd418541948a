"""deploy/: the KubeRay RayCluster manifest and the container image recipe, parsed (no cluster
here): the manifest is a well-formed RayCluster whose head runs `actorline serve --ray`, its Ray
version is the one the image installs, and the image builds from what the repository holds."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from pipeline.cli import llm

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actorline")
    llm.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


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


def test_the_manifest_is_a_raycluster_serving_actorline_on_ray() -> None:
    cluster, service = documents()
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # engines go to the workers
    ray_head, frontend = head["template"]["spec"]["containers"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in " ".join(ray_head["args"])
    command = " ".join(frontend["args"])
    serve = shlex.split(command[command.index("actorline serve") :])
    assert serve[:4] == ["actorline", "serve", "--ray", "127.0.0.1:6379"]
    # the serve command line is one the CLI accepts
    args = build_parser().parse_args(serve[1:])
    assert args.ray == "127.0.0.1:6379" and args.data_parallel_size == 2
    assert {"containerPort": 50051, "name": "grpc"} in frontend["ports"]
    (workers,) = spec["workerGroupSpecs"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    worker = workers["template"]["spec"]["containers"][0]
    cpus = float(worker["resources"]["limits"]["cpu"])
    assert args.ray_num_cpus <= cpus  # an engine host fits a worker pod
    images = {ray_head["image"], frontend["image"], worker["image"]}
    assert len(images) == 1  # one image, so one Ray version, everywhere
    assert service["kind"] == "Service"
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "head"
    assert service["spec"]["ports"][0]["targetPort"] == "grpc"


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
    assert ("EXPOSE", "50051") in steps
    assert ("ENTRYPOINT", '["actorline"]') in steps
