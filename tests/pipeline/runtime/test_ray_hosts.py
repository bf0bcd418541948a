"""Hosts as Ray actors on a local Ray cluster: the same graph runs on Ray by changing start
options only, links stay zmq on tcp at the node's IP, an actor that dies (``ray.kill``) is a
host that dies (HostDiedError to every pending call within 5 s), and a stopped pipeline
leaves no actor and no placement group in the cluster (``ray.util.state``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline import Caller, GraphError, HostDiedError, Pipeline, StartOptions
from pipeline.runtime.demo import Job, collatz_pipeline
from pipeline.runtime.ray_hosts import RayHost, RayPlacementGroup
from tests.pipeline.runtime.test_running import run

pytestmark = pytest.mark.slow

PROMPTLY = 60.0


def pipeline_state(ray: object, pipeline: str) -> tuple[list[str], list[str]]:
    """The pipeline's live actors and placement groups, as Ray's state API lists them."""
    from ray.util import state

    actors = [
        actor.name
        for actor in state.list_actors(filters=[("state", "=", "ALIVE")])
        if actor.name.startswith(f"actorline:{pipeline}:")
    ]
    groups = [
        group.name
        for group in state.list_placement_groups()
        if group.name.startswith(f"actorline:{pipeline}:") and group.state != "REMOVED"
    ]
    return actors, groups


def test_a_stage_on_ray_serves_dies_typed_and_leaves_nothing(ray_cluster: object) -> None:
    pipeline = collatz_pipeline().place("step", "worker")
    options = StartOptions(
        hosts={"worker": RayHost(num_cpus=0.5, placement_group="workers", bundle_index=0)},
        placement_groups={"workers": RayPlacementGroup(({"CPU": 0.5},))},
    )

    async def body() -> None:
        running = await pipeline.start(options)
        try:
            caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
            result = await asyncio.wait_for(caller.call(Job("a", (6, 7))), PROMPTLY)
            assert result.steps.tolist() == [8, 16]
            actors, groups = pipeline_state(ray_cluster, "collatz")
            assert len(actors) == 1 and actors[0].startswith("actorline:collatz:worker:")
            assert groups == ["actorline:collatz:workers"]
            # the link into the actor is zmq on tcp, at the node's address
            (worker,) = [s for s in await running.statistics() if s.host == "worker"]
            addresses = [link.address for link in worker.links_in.values()]
            assert len(addresses) == 2 and all(a.startswith("tcp://") for a in addresses)
            pending = asyncio.create_task(caller.call(Job("slow", (27,) * 2000)))
            await asyncio.sleep(0.2)
            ray_cluster.kill(running.ray_actor("worker"))  # type: ignore[attr-defined]
            killed = time.monotonic()
            with pytest.raises(HostDiedError) as died:
                await asyncio.wait_for(pending, PROMPTLY)
            assert time.monotonic() - killed < 5.0
            assert died.value.host == "worker" and "Ray actor died" in str(died.value)
            await caller.aclose()
        finally:
            await running.stop()
        deadline = time.monotonic() + PROMPTLY
        while pipeline_state(ray_cluster, "collatz") != ([], []):
            assert time.monotonic() < deadline, pipeline_state(ray_cluster, "collatz")
            await asyncio.sleep(0.5)

    run(body)


def test_ray_placements_are_checked_before_anything_starts(ray_cluster: object) -> None:
    pipeline = collatz_pipeline().place("step", "worker")

    async def start(options: StartOptions) -> None:
        running = await pipeline.start(options)
        await running.stop()

    with pytest.raises(GraphError, match="not a spawned host"):
        run(lambda: start(StartOptions(hosts={"main": RayHost()})))
    with pytest.raises(GraphError, match="placement_groups does not define"):
        run(lambda: start(StartOptions(hosts={"worker": RayHost(placement_group="nope")})))
    with pytest.raises(ValueError, match="needs a placement_group"):
        RayHost(bundle_index=0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        RayPlacementGroup(({"CPU": 1},), strategy="TIGHT")
    assert isinstance(pipeline, Pipeline)
