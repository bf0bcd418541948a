"""What the runtime needs of a host, declared once (docs/architecture.md §4.1).

A pipeline's stages run on hosts of three kinds:

- :class:`~pipeline.runtime.host.LocalHost` runs the stages placed on it in this process's
  event loop: the main host of every pipeline, and the one inside each host process or actor;
- :class:`~pipeline.runtime.processes.ProcessHost` is the controller's handle on a host in a
  spawned process (§4.2), talking to the ``LocalHost`` there over its control socket;
- :class:`~pipeline.runtime.ray_hosts.RayActorHost` is the handle on a host in a Ray actor
  (§9), talking to it through actor calls.

Every kind is a :class:`Host`: it binds its inbound links, connects its outbound ones, starts
its stages, cuts the links of a lost replica and shuts down in two phases. A host in another
process is also a :class:`RemoteHost`: the controller spawns it, asks it for statistics (which
doubles as a liveness probe), learns whether it has exited, and kills it.
:class:`~pipeline.runtime.running.RunningPipeline` holds its spawned hosts as ``RemoteHost``
and knows no kind by name but where it creates one. mypy checks that each kind implements its
protocol (the assignments at the end of this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pipeline.runtime.control import HostPlan, HostStatistics
from pipeline.runtime.replicas import ReplicaLost

__all__ = ["Host", "RemoteHost"]


class Host(Protocol):
    """A host of any kind, as the start-up and the shutdown of a pipeline use it."""

    #: the host's name (``main``, or the placement name of a spawned one)
    name: str
    #: its share of the pipeline: stages, local links, inbound and outbound links
    plan: HostPlan

    async def bind_links(self) -> dict[str, str]:
        """Listen for every inbound cross-host link; returns link id -> address.

        Raises:
            HostDiedError, StageFailedError: the host died, or a stage's constructor raised.
        """
        ...

    async def connect_links(self, addresses: dict[str, str]) -> None:
        """Connect a sender for every outbound link to the address ``addresses`` names."""
        ...

    async def start_stages(self) -> None:
        """Run every stage's ``start``, then start handling messages.

        Raises:
            StageFailedError: a stage's start raised.
        """
        ...

    async def cut_replica(self, lost: ReplicaLost, timeout: float = ...) -> None:
        """Close the host's links to and from the replica ``lost`` names and tell the
        stages linked to it (§8). Idempotent."""
        ...

    async def quiesce(self, timeout: float = ..., *, abort: bool = False) -> None:
        """Shutdown, first phase: stop every stage, close every sender (END unless
        ``abort``); receivers stay open (§4.5). Idempotent."""
        ...

    async def stop(self, timeout: float = ..., *, abort: bool = False) -> None:
        """Both shutdown phases (for a spawned host: and its process or actor ends).
        Idempotent."""
        ...


class RemoteHost(Host, Protocol):
    """A host in another process or a Ray actor, through the controller's handle on it."""

    @property
    def pid(self) -> int | None:
        """The host's process id (on its own node for a Ray actor); None before spawn."""
        ...

    async def spawn(self) -> None:
        """Start the host (its process or actor) and hand it its plan."""
        ...

    async def statistics(self) -> HostStatistics:
        """A snapshot of the host's stages and links; the liveness probe too (§4.3).

        Raises:
            HostDiedError: the host is gone. PipelineClosedError: it was stopped.
        """
        ...

    def links_to(self, replica: str) -> bool:
        """Whether the host has a contained link to or from ``replica`` (``set/replica``)."""
        ...

    async def exited(self, grace: float) -> bool:
        """Whether the host has exited, or exits within ``grace`` seconds."""
        ...

    def kill_now(self) -> None:
        """Forced end, the part that does not wait (SIGKILL, or kill the actor).
        Idempotent; never raises."""
        ...

    async def kill(self) -> None:
        """Forced end: :meth:`kill_now`, then wait (bounded) until the host is gone and
        release what the controller holds for it. Idempotent; never raises."""
        ...


if TYPE_CHECKING:  # the static check that each kind implements its protocol
    from pipeline.runtime.host import LocalHost
    from pipeline.runtime.processes import ProcessHost
    from pipeline.runtime.ray_hosts import RayActorHost

    _LOCAL_HOST: type[Host] = LocalHost
    _PROCESS_HOST: type[RemoteHost] = ProcessHost
    _RAY_ACTOR_HOST: type[RemoteHost] = RayActorHost
