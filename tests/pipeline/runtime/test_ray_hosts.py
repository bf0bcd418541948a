"""Hosts as Ray actors on a local Ray cluster: the same graph runs on Ray by changing start
options only, links stay zmq on tcp at the node's IP (which the actor publishes to its
stages), an actor that dies (``ray.kill``) is a host that dies (HostDiedError to every pending
call within 5 s), and a stopped pipeline leaves no actor and no placement group in the cluster
(``ray.util.state``). Without Ray, a Ray host is refused before anything starts, naming the
extra to install."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from pipeline import Caller, GraphError, HostDiedError, Pipeline, StartOptions
from pipeline.demo import Job, collatz_pipeline
from pipeline.runtime.ray_hosts import RayHost, RayPlacementGroup, RayUnavailableError, require_ray
from tests.pipeline.runtime.test_running import run

pytestmark = pytest.mark.slow

PROMPTLY = 60.0


def pipeline_state(ray: object, pipeline: str) -> tuple[list[str], list[str]]:
    """The pipeline's live actors and placement groups, as Ray's state API lists them (on
    the cluster ``ray`` is connected to: another one may run on this machine)."""
    from ray.util import state

    address = ray.get_runtime_context().gcs_address  # type: ignore[attr-defined]
    actors = [
        actor.name
        for actor in state.list_actors(address=address, filters=[("state", "=", "ALIVE")])
        if actor.name.startswith(f"actorline:{pipeline}:")
    ]
    groups = [
        group.name
        for group in state.list_placement_groups(address=address)
        if group.name.startswith(f"actorline:{pipeline}:") and group.state != "REMOVED"
    ]
    return actors, groups


async def wait_until_gone(ray: object, pipeline: str) -> None:
    """Wait (at most PROMPTLY seconds) until the cluster lists no actor and no placement
    group of ``pipeline``."""
    deadline = time.monotonic() + PROMPTLY
    while pipeline_state(ray, pipeline) != ([], []):
        assert time.monotonic() < deadline, pipeline_state(ray, pipeline)
        await asyncio.sleep(0.5)


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
            # the links into the actor are zmq on tcp, at the node's IP as Ray reports it,
            # which the actor also publishes to its stages (and holds no GPU)
            node_ip = ray_cluster.util.get_node_ip_address()  # type: ignore[attr-defined]
            (worker,) = [s for s in await running.statistics() if s.host == "worker"]
            addresses = [link.address for link in worker.links_in.values()]
            assert len(addresses) == 2, addresses
            assert all(a.startswith(f"tcp://{node_ip}:") for a in addresses), addresses
            _, ip, gpus = await running.ray_actor("worker").where.remote()
            assert (ip, gpus) == (node_ip, ())
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
        await wait_until_gone(ray_cluster, "collatz")

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


def test_without_ray_a_ray_host_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray cannot be imported
    pipeline = collatz_pipeline().place("step", "worker")
    message = r"Ray is not installed: pip install 'actorline\[ray\]'"
    with pytest.raises(RayUnavailableError, match=message):
        require_ray()

    async def start() -> None:
        running = await pipeline.start(StartOptions(hosts={"worker": RayHost()}))
        await running.stop()

    with pytest.raises(RayUnavailableError, match=message):  # before any host is spawned
        run(start)
