"""Hosts on a Ray cluster: a host of a pipeline can be a Ray actor instead of a spawned process.

Which hosts run on Ray is a start option, so the same graph runs on local processes or on a
cluster by changing start options only (``docs/architecture.md`` §9)::

    pipeline.place("square", "worker")
    await pipeline.start(hosts={"worker": RayHost(num_cpus=1)}, ray_address="auto")

- **Placement.** :class:`RayHost` gives the actor's resources (``num_cpus``, ``num_gpus``,
  custom ``resources``), and optionally a node (``node_id``) or a bundle of a placement group
  the pipeline creates (:class:`RayPlacementGroup`, named in ``StartOptions.placement_groups``;
  ``STRICT_PACK`` keeps an engine's tensor-parallel ranks on one node, as vLLM's Ray executor
  does).
- **Links** stay the project's transports: with any host on Ray, every host's zmq links listen
  on tcp (gRPC links on its server address) on the node's IP as Ray reports it, so any node can
  reach them; nothing is configured by hand.
- **What a stage learns of its Ray host.** A Ray host's process publishes, for its stages,
  the node's IP (:func:`host_node_ip`: where a port the stage opens itself is reachable, e.g.
  the tensor-parallel rendezvous) and the GPUs Ray assigned the actor (:func:`host_gpu_ids`:
  Ray makes only those visible, so each computes on its own ``cuda:0``; docs/parallelism.md).
- **Control** is Ray itself: the controller calls the actor's methods (bind, connect, start,
  statistics, stop, cut a replica) and keeps one call pending that returns the host's events
  (a stage failed, a contained link was lost). No other port is opened.
- **Supervision.** When the actor dies (``ray.kill``, its process killed, OOM, its node lost)
  that pending call fails with Ray's ``RayActorError`` at once, and the host is reported dead
  with :class:`~pipeline.runtime.errors.HostDiedError`, as a dead process is (§4).
- **Nothing is left behind.** Stopping the pipeline kills its actors (they are not detached
  either: they die with the driver) and removes its placement groups; a Ray the pipeline
  started itself is shut down with it.

Ray is an optional extra (``pip install actorline[ray]``); without it a Ray host is refused
with :class:`RayUnavailableError` before anything starts. Connecting (the cluster's token
included) is :mod:`pipeline.runtime.ray_connection`'s: a cluster that refuses this process is
:class:`RayConnectionError`, one line saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import sys
from collections.abc import Mapping
from typing import Any

from pipeline.runtime.control import HostFailure, HostPlan, HostStatistics, LinkLost
from pipeline.runtime.errors import HostDiedError, PipelineClosedError
from pipeline.runtime.gc_policy import freeze_startup_heap
from pipeline.runtime.host import FailureCallback, LinkLostCallback, LocalHost
from pipeline.runtime.processes import error_from_failure, failure_message
from pipeline.runtime.ray_connection import (
    RayConnectionError,
    RayUnavailableError,
    connect_ray,
    import_ray,
    require_ray,
)
from pipeline.runtime.replicas import ReplicaLost
from transports.tasks import TaskSet

__all__ = [
    "GPU_IDS_ENV",
    "NODE_IP_ENV",
    "PLACEMENT_STRATEGIES",
    "RayActorHost",
    "RayConnectionError",
    "RayHost",
    "RayPlacementGroup",
    "RayUnavailableError",
    "connect_ray",
    "create_placement_group",
    "host_gpu_ids",
    "host_node_ip",
    "largest_node_cpus",
    "node_ip",
    "placement_shortfall",
    "reachable_plan",
    "remove_placement_groups",
    "require_ray",
    "shutdown_ray",
]

logger = logging.getLogger("actorline.ray")

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
#: seconds a call to a live actor may take (statistics, a shutdown phase) on top of its bound
_CALL_MARGIN = 10.0
#: seconds to see a killed actor reported dead
_DEATH_WAIT = 10.0
#: set in a Ray host's process: the IP address other nodes reach it on (see host_node_ip)
NODE_IP_ENV = "ACTORLINE_RAY_NODE_IP"
#: set in a Ray host's process: the ids of the GPUs Ray assigned it, comma-separated
GPU_IDS_ENV = "ACTORLINE_RAY_GPU_IDS"


@dataclasses.dataclass(frozen=True, slots=True)
class RayHost:
    """Run a host as a Ray actor with these resources. ``node_id``: pin it to that node;
    ``placement_group``: the name of a :class:`RayPlacementGroup` of the start options, and
    ``bundle_index`` its bundle (-1: any); ``runtime_env``: Ray's runtime environment of the
    actor.

    Raises:
        ValueError: a negative resource, or a bundle index without a placement group.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    node_id: str | None = None
    placement_group: str | None = None
    bundle_index: int = -1
    runtime_env: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        amounts = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **self.resources}
        for name, amount in amounts.items():
            if type(amount) not in (int, float) or amount < 0:
                raise ValueError(f"RayHost.{name} must be a number >= 0, got {amount!r}")
        if self.placement_group is None and self.bundle_index != -1:
            raise ValueError("RayHost.bundle_index needs a placement_group")
        if self.placement_group is not None and self.node_id is not None:
            raise ValueError("RayHost takes a node_id or a placement_group, not both")


@dataclasses.dataclass(frozen=True, slots=True)
class RayPlacementGroup:
    """A Ray placement group the pipeline creates at start and removes at stop: ``bundles``
    of resources, placed by ``strategy`` (``STRICT_PACK``: all on one node).

    Raises:
        ValueError: no bundle, a negative resource, or an unknown strategy.
    """

    bundles: tuple[Mapping[str, float], ...]
    strategy: str = "STRICT_PACK"

    def __post_init__(self) -> None:
        if not self.bundles:
            raise ValueError("a RayPlacementGroup needs at least one bundle")
        for bundle in self.bundles:
            if any(type(v) not in (int, float) or v < 0 for v in bundle.values()):
                raise ValueError(f"bundle resources must be numbers >= 0, got {dict(bundle)}")
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"strategy must be one of {PLACEMENT_STRATEGIES}, got {self.strategy!r}"
            )


def largest_node_cpus() -> float:
    """The most CPUs any live node of the connected Ray cluster has (0 when none says)."""
    nodes = import_ray().nodes()
    return max((node["Resources"].get("CPU", 0.0) for node in nodes if node["Alive"]), default=0.0)


def node_ip() -> str:
    """The IP address other Ray nodes reach this node on."""
    return str(import_ray().util.get_node_ip_address())


def host_node_ip() -> str | None:
    """In a host that runs as a Ray actor: the IP address other nodes reach its node on (a
    stage that opens a port of its own listens there, as the host's links do); None in any
    other process. Needs no Ray import."""
    return os.environ.get(NODE_IP_ENV) or None


def host_gpu_ids() -> tuple[str, ...]:
    """In a host that runs as a Ray actor holding GPUs (``RayHost.num_gpus`` > 0): the ids
    of the GPUs Ray assigned it. Ray sets ``CUDA_VISIBLE_DEVICES`` to exactly these, so the
    process sees them as ``cuda:0``, ``cuda:1``, ... in this order. Empty in any other
    process (a local one, or an actor with no GPU: Ray then leaves the visible devices as the
    node has them). Needs no Ray import."""
    return tuple(gpu for gpu in os.environ.get(GPU_IDS_ENV, "").split(",") if gpu)


def reachable_plan(plan: HostPlan, ip: str) -> HostPlan:
    """``plan`` with its links listening where other nodes can reach them: zmq on tcp at
    ``ip``, gRPC servers on ``ip`` (settings the plan names already are kept)."""
    settings = {name: dict(value or {}) for name, value in plan.transport_settings}
    settings["zmq"] = {"tcp_interface": ip, **settings.get("zmq", {})}
    settings["zmq"].pop("ipc_dir", None)
    settings["grpc"] = {"host": ip, **settings.get("grpc", {})}
    return dataclasses.replace(plan, transport_settings=tuple(settings.items()))


class _HostActor:
    """The Ray actor that runs one host (made a Ray actor class by :func:`_actor_class`).
    Every method runs on the actor's event loop."""

    def __init__(self, plan: HostPlan, paths: list[str]) -> None:
        # NOTE: a local cluster's workers run this machine's code: let the stage classes
        # resolve as in the driver (a cluster node needs them installed, e.g. in its image).
        sys.path.extend(path for path in paths if path not in sys.path and os.path.isdir(path))
        logging.basicConfig(
            level=plan.log_level,
            format=f"%(asctime)s %(levelname)s [{plan.name}:%(process)d] %(name)s: %(message)s",
        )
        ip = self._ip = node_ip()
        # what the host's stages learn of where they run (host_node_ip, host_gpu_ids)
        os.environ[NODE_IP_ENV] = ip
        os.environ[GPU_IDS_ENV] = ",".join(str(gpu) for gpu in import_ray().get_gpu_ids())
        self._plan = reachable_plan(plan, ip)
        self._events: asyncio.Queue[HostFailure | LinkLost] | None = None
        self._built: asyncio.Event | None = None
        self._host: LocalHost | None = None
        self._tune_gc = plan.tune_gc

    def _report(self, error: BaseException) -> None:
        assert self._events is not None
        self._events.put_nowait(failure_message(0, self._plan.name, error))

    def _report_link_lost(self, link_id: str, detail: str) -> None:
        assert self._events is not None
        self._events.put_nowait(LinkLost(0, self._plan.name, link_id, detail))

    async def bind_links(self) -> dict[str, str] | HostFailure:
        self._events = asyncio.Queue()
        self._ready().set()
        host = self._host = LocalHost(self._plan, self._report, on_link_lost=self._report_link_lost)
        try:
            host.build()
            return await host.bind_links()
        except Exception as exc:
            return failure_message(0, self._plan.name, host._stage_error("(constructor)", exc))

    async def connect_links(self, addresses: dict[str, str]) -> HostFailure | None:
        assert self._host is not None
        try:
            await self._host.connect_links(addresses)
        except Exception as exc:
            return failure_message(0, self._plan.name, exc)
        return None

    async def start_stages(self) -> HostFailure | None:
        assert self._host is not None
        try:
            await self._host.start_stages()
        except Exception as exc:
            return failure_message(0, self._plan.name, exc)
        if self._tune_gc:
            freeze_startup_heap()
        return None

    async def statistics(self) -> HostStatistics:
        assert self._host is not None
        return self._host.statistics()

    async def stop(self, phase: int, abort: bool, timeout: float) -> None:
        if self._host is None:
            return
        if phase == 1:
            await self._host.quiesce(timeout, abort=abort)
        else:
            await self._host.release(timeout, abort=abort)

    async def cut_replica(self, lost: ReplicaLost) -> None:
        if self._host is not None:
            await self._host.cut_replica(lost)

    def _ready(self) -> asyncio.Event:
        if self._built is None:
            self._built = asyncio.Event()
        return self._built

    async def next_event(self) -> HostFailure | LinkLost:
        await self._ready().wait()  # (called before bind_links)
        assert self._events is not None
        return await self._events.get()

    async def where(self) -> tuple[int, str, tuple[str, ...]]:
        """This actor's process id, its node's IP and the GPUs Ray assigned it (what its
        stages see through :func:`host_node_ip` and :func:`host_gpu_ids`)."""
        return os.getpid(), self._ip, host_gpu_ids()

    async def node_id(self) -> str:
        """The id of the Ray node this actor runs on (as ``ray.nodes()`` names it: nodes of
        one machine share an IP, not an id)."""
        return str(import_ray().get_runtime_context().get_node_id())


_ACTOR_CLASSES: dict[str, Any] = {}


def _actor_class() -> Any:
    if "host" not in _ACTOR_CLASSES:
        _ACTOR_CLASSES["host"] = import_ray().remote(_HostActor)
    return _ACTOR_CLASSES["host"]


class RayActorHost:
    """The controller's handle on a host running as a Ray actor (the counterpart of
    :class:`~pipeline.runtime.processes.ProcessHost`; same methods)."""

    _tokens = itertools.count()

    def __init__(
        self,
        plan: HostPlan,
        placement: RayHost,
        on_failure: FailureCallback,
        on_link_lost: LinkLostCallback | None = None,
        *,
        pipeline: str = "pipeline",
        placement_group: Any = None,
    ) -> None:
        self.plan = plan
        self.name = plan.name
        self.placement = placement
        self._on_failure = on_failure
        self._on_link_lost = on_link_lost
        self._placement_group = placement_group
        self.actor_name = f"actorline:{pipeline}:{plan.name}:{secrets.token_hex(4)}"
        self.actor: Any = None
        self._watch: asyncio.Task[None] | None = None
        self._tasks = TaskSet(f"ray host {plan.name}")  # the event watch
        self._stopping = False
        self._gone = asyncio.Event()
        self._pid: int | None = None
        #: once spawned: the IP of the actor's node and the GPUs Ray assigned it
        self.node_ip: str | None = None
        self.gpu_ids: tuple[str, ...] = ()
        #: once spawned: the id of the Ray node it runs on
        self.node_id: str | None = None

    @property
    def pid(self) -> int | None:
        """The actor's process id on its node (not necessarily this machine)."""
        return self._pid

    async def spawn(self) -> None:
        """Create the actor (placed as :class:`RayHost` says) and start watching it."""
        ray = import_ray()
        placement = self.placement
        options: dict[str, Any] = {
            "num_cpus": placement.num_cpus,
            "num_gpus": placement.num_gpus,
            "resources": dict(placement.resources),
            "name": self.actor_name,
            "max_restarts": 0,
            "max_concurrency": 64,
        }
        if placement.runtime_env is not None:
            options["runtime_env"] = dict(placement.runtime_env)
        if self._placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._placement_group, placement_group_bundle_index=placement.bundle_index
            )
        elif placement.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                placement.node_id, soft=False
            )
        self.actor = _actor_class().options(**options).remote(self.plan, list(sys.path))
        del ray
        self._pid, self.node_ip, self.gpu_ids = await self._call(self.actor.where)
        self.node_id = await self._call(self.actor.node_id)
        logger.info(
            "host %r runs as Ray actor %s on node %s (%s; GPUs: %s)",
            self.name,
            self.actor_name,
            self.node_ip,
            self.node_id,
            ", ".join(self.gpu_ids) or "none",
        )
        self._watch = self._tasks.spawn(self._watch_events(), name=f"ray-watch:{self.name}")

    async def _watch_events(self) -> None:
        ray = import_ray()
        while True:
            try:
                event = await self.actor.next_event.remote()
            except ray.exceptions.RayActorError as exc:
                self._died(exc)
                return
            if self._stopping:
                continue
            if isinstance(event, HostFailure):
                self._on_failure(error_from_failure(event))
            elif isinstance(event, LinkLost) and self._on_link_lost is not None:
                self._on_link_lost(event.link_id, event.detail)

    def _died(self, cause: BaseException | None) -> None:
        if self._gone.is_set():
            return
        self._gone.set()
        if not self._stopping:
            detail = f"its Ray actor died ({type(cause).__name__})" if cause else ""
            self._on_failure(HostDiedError(self.name, None, detail))

    async def _call(self, method: Any, *args: Any, timeout: float | None = None) -> Any:
        ray = import_ray()
        if self._gone.is_set():
            if self._stopping:
                raise PipelineClosedError(f"host {self.name!r} is stopped")
            raise HostDiedError(self.name, None, "its Ray actor died")
        try:
            reply = await asyncio.wait_for(method.remote(*args), timeout)
        except ray.exceptions.RayActorError as exc:
            self._died(exc)
            raise HostDiedError(self.name, None, "its Ray actor died") from exc
        if isinstance(reply, HostFailure):
            raise error_from_failure(reply)
        return reply

    async def bind_links(self) -> dict[str, str]:
        reply = await self._call(self.actor.bind_links)
        assert isinstance(reply, dict)
        return reply

    async def connect_links(self, addresses: dict[str, str]) -> None:
        await self._call(self.actor.connect_links, addresses)

    async def start_stages(self) -> None:
        await self._call(self.actor.start_stages)

    async def statistics(self) -> HostStatistics:
        reply = await self._call(self.actor.statistics, timeout=_CALL_MARGIN)
        assert isinstance(reply, HostStatistics)
        return reply

    def links_to(self, replica: str) -> bool:
        """Whether this host has a contained link to or from replica ``replica``."""
        return any(link.contained == replica for link in (*self.plan.inbound, *self.plan.outbound))

    async def cut_replica(self, lost: ReplicaLost, timeout: float = 5.0) -> None:
        with contextlib.suppress(Exception):
            await self._call(self.actor.cut_replica, lost, timeout=timeout)

    async def exited(self, grace: float) -> bool:
        """Whether the actor is dead, or dies within ``grace`` seconds (reported as its
        watch reports it)."""
        if self.actor is None:
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._gone.wait(), grace)
        return self._gone.is_set()

    async def quiesce(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Shutdown phase 1 (see :meth:`LocalHost.quiesce`). Never raises."""
        self._stopping = True
        if self.actor is not None and not self._gone.is_set():
            bound = timeout * (2 + len(self.plan.stages) + len(self.plan.outbound)) + _CALL_MARGIN
            with contextlib.suppress(Exception):
                await self._call(self.actor.stop, 1, abort, timeout, timeout=bound)

    async def stop(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Shutdown phase 2, then the actor is killed (an actor lives until it is).
        Idempotent; never raises."""
        self._stopping = True
        if self.actor is not None and not self._gone.is_set():
            links = len(self.plan.inbound) + len(self.plan.outbound)
            bound = timeout * (2 + links) + _CALL_MARGIN
            with contextlib.suppress(Exception):
                await self._call(self.actor.stop, 2, abort, timeout, timeout=bound)
        await self.kill()

    def kill_now(self) -> None:
        """Forced end, the part that does not wait: kill the actor. Idempotent."""
        self._stopping = True
        if self.actor is not None:
            with contextlib.suppress(Exception):
                import_ray().kill(self.actor, no_restart=True)

    async def kill(self) -> None:
        """Kill the actor and wait (bounded) until Ray reports it dead. Idempotent."""
        self.kill_now()
        if self.actor is None:
            return
        if self._watch is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._gone.wait(), _DEATH_WAIT)
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
        self._gone.set()


def placement_shortfall(group: RayPlacementGroup, nodes: list[Mapping[str, Any]]) -> str | None:
    """Why the live ``nodes`` (as ``ray.nodes()`` lists them) cannot hold ``group`` as they
    are (None: nothing obvious): a resource that no live node has, a bundle larger than any
    node, or ``STRICT_SPREAD`` over more bundles than there are nodes. Total free capacity is
    not judged (Ray's own reservation decides that)."""
    alive = [dict(node.get("Resources", {})) for node in nodes if node.get("Alive")]
    for bundle in group.bundles:
        for resource in bundle:
            if bundle[resource] > 0 and not any(resource in node for node in alive):
                return f"no live node has resource {resource!r}"
        if not any(all(node.get(r, 0.0) >= a for r, a in bundle.items()) for node in alive):
            return f"no live node is large enough for bundle {dict(bundle)}"
    if group.strategy == "STRICT_SPREAD" and len(group.bundles) > len(alive):
        return f"STRICT_SPREAD needs {len(group.bundles)} nodes, the cluster has {len(alive)} live"
    return None


async def create_placement_group(name: str, group: RayPlacementGroup, timeout: float | None) -> Any:
    """Create ``group`` in the cluster and wait until its bundles are reserved (a group the
    live nodes cannot hold as they are is warned about at once: nodes may still join).

    Raises:
        TimeoutError: the cluster could not reserve the bundles within ``timeout``.
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    shortfall = placement_shortfall(group, await asyncio.to_thread(ray.nodes))
    if shortfall is not None:
        logger.warning(
            "Ray cannot reserve placement group %r (%s, %d bundles: %s) on the cluster's live "
            "nodes now: %s; waiting for nodes to join (start_timeout)",
            name,
            group.strategy,
            len(group.bundles),
            [dict(b) for b in group.bundles],
            shortfall,
        )

    created = placement_group(
        [dict(bundle) for bundle in group.bundles], strategy=group.strategy, name=name
    )
    try:
        await asyncio.wait_for(created.ready(), timeout)
    except asyncio.TimeoutError:
        remove_placement_group(created)
        raise TimeoutError(
            f"Ray could not reserve placement group {name!r} ({group.strategy}, "
            f"{len(group.bundles)} bundles: {[dict(b) for b in group.bundles]}) within "
            f"{timeout:g} s: the cluster lacks the resources"
            + (f" ({shortfall})" if shortfall else "")
        ) from None
    except BaseException:
        # NOTE: cancelled (the pipeline's own start_timeout ran out first, or its start was
        # abandoned): the group is nobody's yet, so it would stay pending in the cluster
        remove_placement_group(created)
        raise
    del ray
    return created


def remove_placement_groups(groups: list[Any]) -> None:
    """Remove the pipeline's placement groups (never raises)."""
    if not groups:
        return
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)


def shutdown_ray() -> None:
    """Disconnect this process from Ray (stopping a local cluster it started)."""
    with contextlib.suppress(Exception):
        import_ray().shutdown()
