"""Internal: host plans, statistics and the control messages between the controller (the
calling process) and spawned hosts. Control messages travel as codec frames over the
process's control pipe (bytes, never pickle); their tags are in
:data:`transports.tags.WIRE_TAGS` (20-49)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.runtime.replicas import ReplicaLost
from pipeline.runtime.spec import Endpoint, StageSpec
from transports.base import LinkOptions, LinkStatistics
from transports.codec import DEFAULT_REGISTRY, message
from transports.tags import tag_of

__all__ = [
    "Ack",
    "BindLinks",
    "ConnectLinks",
    "CutReplica",
    "HostFailure",
    "HostPlan",
    "HostStatistics",
    "LinkLost",
    "LinksBound",
    "QueryStatistics",
    "RemoteLink",
    "StageStatistics",
    "StartStages",
    "StopHost",
    "TellRestored",
]

DEFAULT_REGISTRY.register(LinkStatistics, tag_of(LinkStatistics))


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteLink:
    """A link crossing hosts: ``endpoint`` is the local end (a target for inbound links, a
    source for outbound ones), ``peer`` the other end. ``contained``: the key
    (``"set/replica"``) of the replica the peer host belongs to when this host is outside it:
    the link's loss is then contained (see :mod:`pipeline.runtime.replicas`); "" otherwise."""

    link_id: str
    endpoint: Endpoint
    transport: str
    peer: Endpoint | None = None
    contained: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class HostPlan:
    """Everything a host needs to run its part of a pipeline (picklable: it is handed to a
    spawned process by multiprocessing, parent to child, never over a network)."""

    name: str
    stages: tuple[StageSpec, ...]
    local_links: tuple[tuple[Endpoint, Endpoint], ...]
    inbound: tuple[RemoteLink, ...]
    outbound: tuple[RemoteLink, ...]
    link_options: LinkOptions
    log_level: str = "WARNING"
    transport_settings: tuple[tuple[str, Any], ...] = ()
    tune_gc: bool = True
    #: variables a spawned host process starts with, set by its parent (the OpenMP wait
    #: policy, pipeline.runtime.omp_policy: read before torch loads, so not from the plan)
    environment: tuple[tuple[str, str], ...] = ()
    #: the file the host maps for its crash notes ("" for none; see pipeline.runtime.crash_note)
    crash_note: str = ""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class StageStatistics:
    """One stage: its mailbox, messages handled, time spent handling, whether it is busy
    (handling now) and idle (no hidden work). ``handle_buckets``: how many messages took at
    most each of :data:`HANDLE_SECONDS_BUCKETS` (and, last, more), not cumulative.
    ``recovered``: messages whose handler failed and the stage recovered from (its
    ``recover`` answered them)."""

    name: str
    mailbox: LinkStatistics
    handled: int
    handle_seconds: float
    busy: bool
    idle: bool
    dropped: int = 0
    handle_buckets: tuple[int, ...] = ()
    recovered: int = 0


#: upper bounds (seconds) of the buckets of a stage's handling times, from 10 µs to 3 s
HANDLE_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class HostStatistics:
    """One host: its stages and the ends of its cross-host links (keyed by link id)."""

    host: str
    pid: int
    stages: tuple[StageStatistics, ...]
    links_in: dict[str, LinkStatistics]
    links_out: dict[str, LinkStatistics]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class BindLinks:
    """Listen for every inbound cross-host link (``replica`` empty: the host's start), or
    afresh for those from lost replica ``replica`` (``"set/replica"``), which is restored
    (:meth:`LocalHost.rebind_replica <pipeline.runtime.host.LocalHost.rebind_replica>`)."""

    call_id: int
    replica: str = ""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class LinksBound:
    call_id: int
    addresses: dict[str, str]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class ConnectLinks:
    """Connect every outbound cross-host link (``replica`` empty), or those to restored
    replica ``replica``, taking its links back into use
    (:meth:`LocalHost.reconnect_replica <pipeline.runtime.host.LocalHost.reconnect_replica>`)."""

    call_id: int
    addresses: dict[str, str]
    replica: str = ""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class StartStages:
    call_id: int


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class QueryStatistics:
    call_id: int


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class StopHost:
    """Shutdown phase 1 (quiesce: stages stop, senders close) or 2 (release links, exit);
    ``abort`` drops queued messages instead of delivering them; ``timeout``: seconds each
    step may take (each stage's ``stop``, each link's close), the pipeline's stop timeout."""

    call_id: int
    phase: int
    abort: bool = False
    timeout: float = 5.0


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class Ack:
    call_id: int
    statistics: HostStatistics | None = None


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class HostFailure:
    """A stage (or the host) failed; ``call_id`` is the command it answers, 0 for an event.
    A deadlock names its ``cycle`` of stages and their mailbox ``capacities``; a lost link
    that fell silent, how long (``silent_for``)."""

    call_id: int
    host: str
    stage: str
    error_type: str
    message: str
    traceback: str = ""
    cycle: tuple[str, ...] = ()
    capacities: tuple[int, ...] = ()
    silent_for: float | None = None


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class CutReplica:
    """Cut this host's links to the lost replica ``lost`` describes and tell the stages
    linked to it (see :mod:`pipeline.runtime.replicas`)."""

    call_id: int
    lost: ReplicaLost
    #: False: cut only (a restore that failed; the stages heard of the loss already)
    tell: bool = True


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class TellRestored:
    """Replica ``replica`` of ``replica_set`` (its ``hosts``) runs again (restored
    ``restored`` times): deliver a :class:`~pipeline.runtime.replicas.ReplicaRestored` to
    this host's stages linked to it."""

    call_id: int
    replica_set: str
    replica: str
    hosts: tuple[str, ...]
    restored: int


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class LinkLost:
    """An event (``call_id`` 0): this host's contained link ``link_id`` broke or fell
    silent (``detail`` says how); the controller decides which replica to contain."""

    call_id: int
    host: str
    link_id: str
    detail: str
