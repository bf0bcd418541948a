"""Replica sets: hosts whose failure is contained instead of failing the pipeline.

A pipeline fails as a whole when any of its hosts fails (``docs/architecture.md`` §4). A
*replica set* relaxes that for hosts that are interchangeable copies of one another, such as
the engine replicas of data parallelism (``docs/architecture.md`` §8)::

    pipeline.replica_set("engines", {"0": ("engine",), "1": ("engine_1", "engine_1_tp1")})

Each replica is one or more hosts that fail together. When anything fails on a replica's
hosts (a process dies or stops answering, a stage on it raises, a link to or from it breaks)
the runtime *contains* it: it kills the replica's hosts, cuts every link between them and the
rest of the pipeline (messages still sent to a cut link are dropped), and delivers a
:class:`ReplicaLost` to every stage outside the replica that was linked to it, after whatever
that replica had sent it, through :meth:`Stage.on_replica_lost
<pipeline.runtime.stage.Stage.on_replica_lost>`. Those stages decide what it means for their
work (the LLM router fails the requests it had sent there and routes around it). The pipeline
goes on; only when every replica of a set is lost does it fail, with the last replica's error,
unless the set is *expendable*: hosts the pipeline can work on without (the LLM engine's
draft model placed apart, docs/speculative.md), whose last replica's loss is contained too.
Failures while the pipeline starts are never contained: a start fails whole.
"""

from __future__ import annotations

import dataclasses

from transports.codec import message

__all__ = ["ReplicaLost", "ReplicaRestored", "ReplicaSet", "ReplicaStatus"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaSet:
    """A named set of replicas: ``replicas`` maps each replica's name to its hosts;
    ``expendable``: losing all of them does not fail the pipeline either."""

    name: str
    replicas: tuple[tuple[str, tuple[str, ...]], ...]
    expendable: bool = False

    def hosts(self, replica: str) -> tuple[str, ...]:
        """The hosts of ``replica``.

        Raises:
            KeyError: no such replica.
        """
        for name, hosts in self.replicas:
            if name == replica:
                return hosts
        raise KeyError(f"replica set {self.name!r} has no replica {replica!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.replicas)


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaLost:
    """Replica ``replica`` of set ``replica_set`` (its ``hosts``) failed and was cut off:
    nothing more arrives from it, and what is sent to it is dropped. ``error_type`` and
    ``message`` describe the failure (a ``HostDiedError``, ``StageFailedError``, ...);
    ``exitcode``: the dead host's exit status, when a process died."""

    replica_set: str
    replica: str
    hosts: tuple[str, ...]
    error_type: str
    message: str
    exitcode: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaRestored:
    """Replica ``replica`` of set ``replica_set`` (its ``hosts``), lost earlier, runs again
    on fresh hosts (:meth:`RunningPipeline.restore_replica
    <pipeline.runtime.running.RunningPipeline.restore_replica>`): its links carry messages
    again. Delivered to the stages outside it that are linked to it, through
    :meth:`Stage.on_replica_restored <pipeline.runtime.stage.Stage.on_replica_restored>`,
    once its stages have started. ``restored``: how many times it was restored so far."""

    replica_set: str
    replica: str
    hosts: tuple[str, ...]
    restored: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica as the running pipeline sees it: ``error`` is None while it lives."""

    replica_set: str
    replica: str
    hosts: tuple[str, ...]
    error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self.error is None
