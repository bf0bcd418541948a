"""How a pipeline is to run, and how its graph splits into one plan per host.

:class:`StartOptions` are the options of :meth:`Pipeline.start
<pipeline.runtime.graph.Pipeline.start>`; :func:`plan_hosts` turns the graph and those options
into one :class:`~pipeline.runtime.control.HostPlan` per host: links inside a host deliver
straight into the target's mailbox, links across hosts get an id (``L1``, ``L2``, ...) and a
transport, and a link with one end outside a replica names that replica (so that its loss is
contained, :mod:`pipeline.runtime.replicas`). :class:`~pipeline.runtime.running.RunningPipeline`
starts the hosts from these plans.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pipeline.runtime import settings
from pipeline.runtime.control import HostPlan, RemoteLink
from pipeline.runtime.omp_policy import POLICY_ENV
from pipeline.runtime.ray_hosts import RayHost, RayPlacementGroup
from pipeline.runtime.spec import BOUNDARY, MAIN_HOST, Endpoint
from transports.base import LinkOptions
from transports.compression import Compression

if TYPE_CHECKING:
    from pipeline.runtime.graph import Pipeline

__all__ = ["StartOptions", "plan_hosts"]


@dataclasses.dataclass(frozen=True, slots=True)
class StartOptions:
    """How to run a pipeline.

    ``transport``: the default transport of links that cross hosts (a name in the
    ``actorline.transports`` group). ``compression``: ``"zstd"`` (or a Compression) for byte
    transports. ``capacity``: per-link buffer. ``exit_capacity``: buffer of each exit.
    ``transport_settings``: keyword arguments per transport name (e.g. bind addresses).
    ``tune_gc``: once the stages have started, raise the garbage collector's young-generation
    threshold while the pipeline runs (in this process too) and freeze the start-up heap of
    each spawned host process (see :mod:`pipeline.runtime.gc_policy`). ``omp_wait_policy``:
    how a spawned host's OpenMP threads wait (:mod:`pipeline.runtime.omp_policy`; None:
    ``auto``, or what this process's environment says).
    ``hosts``: hosts to run as Ray actors (host name → :class:`RayHost`), the others are
    spawned processes; ``placement_groups``: Ray placement groups to create for them (name →
    :class:`RayPlacementGroup`); ``ray_address``: the cluster to connect to ("auto": the one
    running here; None: ``RAY_ADDRESS``, else a new local one) unless this process is
    connected already (see :mod:`pipeline.runtime.ray_hosts`); ``ray_auth_token_file``: a
    file holding the cluster's token (None: where Ray finds one; see
    :mod:`pipeline.runtime.ray_connection`).
    """

    transport: str = "zmq"
    compression: Compression | str | None = None
    capacity: int = 1024
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    exit_capacity: int = 65536
    start_timeout: float | None = 600.0
    stop_timeout: float = 10.0
    log_level: str | None = None
    transport_settings: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    tune_gc: bool = True
    omp_wait_policy: str | None = None
    hosts: Mapping[str, RayHost] = dataclasses.field(default_factory=dict)
    placement_groups: Mapping[str, RayPlacementGroup] = dataclasses.field(default_factory=dict)
    ray_address: str | None = None
    ray_auth_token_file: str | None = None

    def link_options(self) -> LinkOptions:
        return LinkOptions(
            compression=Compression.parse(self.compression),
            capacity=self.capacity,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout,
        )


def plan_hosts(pipeline: Pipeline, options: StartOptions) -> dict[str, HostPlan]:
    """Split the graph into one plan per host; links across hosts get ids and transports."""
    pipeline.validate()
    host_of = {name: spec.host for name, spec in pipeline.stages.items()}
    host_of[BOUNDARY] = MAIN_HOST
    replica_of = {
        host: f"{replica_set.name}/{replica}"
        for replica_set in pipeline.replica_sets.values()
        for replica, hosts in replica_set.replicas
        for host in hosts
    }
    link_options = options.link_options()
    local: dict[str, list[tuple[Endpoint, Endpoint]]] = {h: [] for h in pipeline.hosts}
    inbound: dict[str, list[RemoteLink]] = {h: [] for h in pipeline.hosts}
    outbound: dict[str, list[RemoteLink]] = {h: [] for h in pipeline.hosts}
    ids = itertools.count(1)
    for link in pipeline.links:
        source_host, target_host = host_of[link.source.stage], host_of[link.target.stage]
        if source_host == target_host:
            local[source_host].append((link.source, link.target))
            continue
        link_id = f"L{next(ids)}"
        transport = link.transport or options.transport
        source_replica = replica_of.get(source_host, "")
        target_replica = replica_of.get(target_host, "")
        contained = source_replica != target_replica  # one end is outside the other's replica
        outbound[source_host].append(
            RemoteLink(
                link_id, link.source, transport, link.target, target_replica if contained else ""
            )
        )
        inbound[target_host].append(
            RemoteLink(
                link_id, link.target, transport, link.source, source_replica if contained else ""
            )
        )
    settings_items = tuple(
        (name, dict(value)) for name, value in options.transport_settings.items()
    )
    return {
        host: HostPlan(
            name=host,
            stages=tuple(spec for spec in pipeline.stages.values() if spec.host == host),
            local_links=tuple(local[host]),
            inbound=tuple(inbound[host]),
            outbound=tuple(outbound[host]),
            link_options=link_options,
            log_level=options.log_level or settings.log_level(),
            transport_settings=settings_items,
            tune_gc=options.tune_gc,
            environment=(
                ((POLICY_ENV, options.omp_wait_policy),) if options.omp_wait_policy else ()
            ),
        )
        for host in pipeline.hosts
    }
