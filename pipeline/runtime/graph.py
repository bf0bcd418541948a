"""The pipeline graph: named stages, named ports, links (cycles allowed), and placement.

A :class:`Pipeline` is plain data until :meth:`Pipeline.start`: build it, edit it (insert,
replace, remove, re-place stages), copy it, then run it in one process or many by changing
placement only::

    pipeline = Pipeline("demo")
    pipeline.add("source", Counter).add("square", Square).add("sink", Collect)
    pipeline.connect("source", "square").connect("square", "sink")
    pipeline.connect("sink.again", "source")          # a feedback edge
    pipeline.entry("numbers", "source").exit("results", "sink.out")
    pipeline.place("square", "worker")                 # run it in a spawned process

Entries and exits are the pipeline's boundary with the calling code: messages sent to an entry
go to its targets; messages emitted on ports linked to an exit can be received by the caller.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.runtime.errors import GraphError
from pipeline.runtime.replicas import ReplicaSet
from pipeline.runtime.running import RunningPipeline, StartOptions
from pipeline.runtime.spec import BOUNDARY, MAIN_HOST, Endpoint, Link, StageSpec
from pipeline.runtime.stage import Stage

__all__ = ["Pipeline"]


class Pipeline:
    """A directed graph of named stages placed on hosts. Methods return ``self`` to chain.

    Every editing method checks first and changes the graph only once nothing can fail, so a
    :class:`GraphError` leaves the graph as it was; no two links join the same two ports.
    """

    def __init__(self, name: str = "pipeline") -> None:
        self.name = name
        self._stages: dict[str, StageSpec] = {}
        self._links: list[Link] = []
        self._entries: list[str] = []
        self._exits: list[str] = []
        self._replica_sets: dict[str, ReplicaSet] = {}

    # -- building -------------------------------------------------------------------------------

    def add(
        self, name: str, factory: type[Stage] | str, config: Any = None, *, host: str = MAIN_HOST
    ) -> Pipeline:
        """Add a stage built by ``factory(config)``. ``factory`` is a Stage subclass or the name
        of a stage plugin (group ``actorline.stages``).

        Raises:
            GraphError: the name is taken or invalid, or the factory is not a Stage class.
        """
        _check_name(name, "stage")
        if name in self._stages:
            raise GraphError(f"a stage named {name!r} already exists in {self.name!r}")
        self._stages[name] = StageSpec(name, _resolve_factory(factory), config, _host(host))
        return self

    def connect(self, source: str, target: str, *, transport: str | None = None) -> Pipeline:
        """Link ``"stage.port"`` (an output) to ``"stage.port"`` (an input). The port may be
        left out when the stage has exactly one port on that side.

        Raises:
            GraphError: unknown stage or port, or the link exists already.
        """
        link = Link(self._output(source), self._input(target), transport)
        if self._linked(link.source, link.target):
            raise GraphError(f"link {link} already exists")
        self._links.append(link)
        return self

    def disconnect(self, source: str, target: str) -> Pipeline:
        """Remove the link from ``source`` to ``target``.

        Raises:
            GraphError: unknown stage or port, or there is no such link.
        """
        source_endpoint, target_endpoint = self._output(source), self._input(target)
        if not self._linked(source_endpoint, target_endpoint):
            raise GraphError(f"there is no link {source_endpoint} -> {target_endpoint}")
        self._links = [
            link for link in self._links
            if not (link.source == source_endpoint and link.target == target_endpoint)
        ]  # fmt: skip
        return self

    def entry(self, name: str, *targets: str) -> Pipeline:
        """Declare an entry: messages the caller sends to ``name`` go to every target.

        Raises:
            GraphError: the name is taken or invalid, a target is unknown or named twice.
                Nothing is changed then.
        """
        self._check_boundary_name(name, "entry")
        endpoints = _distinct(f"entry {name!r}", [self._input(target) for target in targets])
        self._entries.append(name)
        self._links.extend(Link(Endpoint(BOUNDARY, name), endpoint) for endpoint in endpoints)
        return self

    def exit(self, name: str, *sources: str) -> Pipeline:
        """Declare an exit: messages emitted on every source port can be received as ``name``.

        Raises:
            GraphError: the name is taken or invalid, a source is unknown or named twice.
                Nothing is changed then.
        """
        self._check_boundary_name(name, "exit")
        endpoints = _distinct(f"exit {name!r}", [self._output(source) for source in sources])
        self._exits.append(name)
        self._links.extend(Link(endpoint, Endpoint(BOUNDARY, name)) for endpoint in endpoints)
        return self

    def place(self, stage: str, host: str) -> Pipeline:
        """Run ``stage`` on ``host``: ``"main"`` is the calling process, any other name a
        spawned process shared by the stages placed there."""
        spec = self._spec(stage)
        self._stages[stage] = dataclasses.replace(spec, host=_host(host))
        return self

    def replica_set(
        self, name: str, replicas: Mapping[str, Sequence[str]], *, expendable: bool = False
    ) -> Pipeline:
        """Declare ``replicas`` (each replica's name → the hosts it consists of) one replica
        set: a failure on a replica's hosts is contained, the pipeline fails only once every
        replica has failed (see :mod:`pipeline.runtime.replicas`), or never where the set is
        ``expendable`` (the pipeline works on without it: a helper such as a draft model).
        Declaring a set again replaces it. The hosts are checked when the pipeline starts
        (:meth:`validate`).

        Raises:
            GraphError: an invalid name, no replica, a replica with no host or an invalid
                host name, or a host named twice.
        """
        _check_name(name, "replica set")
        if not replicas:
            raise GraphError(f"replica set {name!r} has no replica")
        entries: list[tuple[str, tuple[str, ...]]] = []
        seen: set[str] = set()
        for replica, hosts in replicas.items():
            _check_name(replica, "replica")
            if isinstance(hosts, str) or not hosts:
                raise GraphError(
                    f"replica {replica!r} of set {name!r} needs a sequence of host names"
                )
            for host in hosts:
                _host(host)
                if host in seen:
                    raise GraphError(f"host {host!r} is named twice in replica set {name!r}")
                seen.add(host)
            entries.append((replica, tuple(hosts)))
        self._replica_sets[name] = ReplicaSet(name, tuple(entries), expendable)
        return self

    # -- editing --------------------------------------------------------------------------------

    def insert(
        self,
        name: str,
        factory: type[Stage] | str,
        config: Any = None,
        *,
        after: str | None = None,
        before: str | None = None,
        host: str | None = None,
    ) -> Pipeline:
        """Insert a one-input, one-output stage on the links leaving ``after`` (``"stage"`` or
        ``"stage.port"``) or entering ``before``. It runs on the neighbour's host by default.

        Raises:
            GraphError: neither or both of after/before, unknown neighbour, the name is taken
                or invalid, an invalid host, or the new stage does not have exactly one input
                and one output port. Nothing is changed then.
        """
        # add() refuses a bad name or host before it changes anything; nothing after it fails
        if (after is None) == (before is None):
            raise GraphError("insert() needs exactly one of after= or before=")
        factory_class = _resolve_factory(factory)
        if len(factory_class.inputs) != 1 or len(factory_class.outputs) != 1:
            raise GraphError(
                f"insert() needs a stage with one input and one output port; "
                f"{factory_class.__qualname__} has {factory_class.inputs} / {factory_class.outputs}"
            )
        (new_in,), (new_out,) = factory_class.inputs, factory_class.outputs
        if after is not None:
            anchor = self._output(after)
            placement = host if host is not None else self._spec(anchor.stage).host
            self.add(name, factory_class, config, host=placement)
            self._links = [
                dataclasses.replace(link, source=Endpoint(name, new_out))
                if link.source == anchor else link
                for link in self._links
            ]  # fmt: skip
            self._links.append(Link(anchor, Endpoint(name, new_in)))
        else:
            assert before is not None
            anchor = self._input(before)
            placement = host if host is not None else self._spec(anchor.stage).host
            self.add(name, factory_class, config, host=placement)
            self._links = [
                dataclasses.replace(link, target=Endpoint(name, new_in))
                if link.target == anchor else link
                for link in self._links
            ]  # fmt: skip
            self._links.append(Link(Endpoint(name, new_out), anchor))
        return self

    def replace(self, name: str, factory: type[Stage] | str, config: Any = None) -> Pipeline:
        """Swap the stage ``name`` for another, keeping its links and placement.

        Raises:
            GraphError: unknown stage, or the new stage lacks a port that a link uses.
        """
        spec = self._spec(name)
        factory_class = _resolve_factory(factory)
        for link in self._links:
            if link.source.stage == name and link.source.port not in factory_class.outputs:
                raise GraphError(
                    f"{factory_class.__qualname__} has no output port {link.source.port!r} "
                    f"used by link {link}"
                )
            if link.target.stage == name and link.target.port not in factory_class.inputs:
                raise GraphError(
                    f"{factory_class.__qualname__} has no input port {link.target.port!r} "
                    f"used by link {link}"
                )
        self._stages[name] = StageSpec(name, factory_class, config, spec.host)
        return self

    def remove(self, name: str) -> Pipeline:
        """Remove a stage. A stage with one input and one output port is bypassed: whatever fed
        it now feeds what it fed (a bypass link that exists already is not added twice; a new
        one keeps the transport of the outgoing link it replaces). Otherwise its links are
        dropped.

        Raises:
            GraphError: unknown stage.
        """
        spec = self._spec(name)
        kept = [link for link in self._links if name not in (link.source.stage, link.target.stage)]
        if len(spec.factory.inputs) == 1 and len(spec.factory.outputs) == 1:
            feeders = [
                link.source for link in self._links
                if link.target.stage == name and link.source.stage != name
            ]  # fmt: skip
            outgoing = [
                link for link in self._links
                if link.source.stage == name and link.target.stage != name
            ]  # fmt: skip
            present = {(link.source, link.target) for link in kept}
            for source in feeders:
                for out in outgoing:
                    if (source, out.target) not in present:
                        present.add((source, out.target))
                        kept.append(Link(source, out.target, out.transport))
        self._links = kept
        del self._stages[name]
        return self

    def copy(self) -> Pipeline:
        """An independent copy (configs are shared, they are immutable by convention)."""
        twin = copy.copy(self)
        twin._stages = dict(self._stages)
        twin._links = list(self._links)
        twin._entries = list(self._entries)
        twin._exits = list(self._exits)
        twin._replica_sets = dict(self._replica_sets)
        return twin

    # -- inspection -----------------------------------------------------------------------------

    @property
    def stages(self) -> dict[str, StageSpec]:
        return dict(self._stages)

    @property
    def links(self) -> list[Link]:
        return list(self._links)

    @property
    def entries(self) -> list[str]:
        return list(self._entries)

    @property
    def exits(self) -> list[str]:
        return list(self._exits)

    @property
    def replica_sets(self) -> dict[str, ReplicaSet]:
        return dict(self._replica_sets)

    @property
    def hosts(self) -> list[str]:
        """Hosts in use, the main host first."""
        names = {spec.host for spec in self._stages.values()}
        return [MAIN_HOST, *sorted(names - {MAIN_HOST})]

    def __getitem__(self, name: str) -> StageSpec:
        return self._spec(name)

    def __contains__(self, name: object) -> bool:
        return name in self._stages

    def describe(self) -> str:
        """A readable listing of stages (with hosts) and links."""
        lines = [f"pipeline {self.name!r}"]
        for spec in self._stages.values():
            lines.append(f"  stage {spec.name} [{spec.factory.__qualname__}] on {spec.host}")
        for link in self._links:
            via = f" via {link.transport}" if link.transport else ""
            lines.append(f"  {_show(link.source)} -> {_show(link.target)}{via}")
        for replica_set in self._replica_sets.values():
            replicas = ", ".join(
                f"{name}: {'+'.join(hosts)}" for name, hosts in replica_set.replicas
            )
            expendable = ", expendable" if replica_set.expendable else ""
            lines.append(f"  replica set {replica_set.name} ({replicas}){expendable}")
        return "\n".join(lines)

    def validate(self) -> None:
        """Check the graph can run.

        Raises:
            GraphError: a link names a missing stage or port, an entry is linked to nothing,
                nothing is linked to an exit (its receivers would wait forever), or a stage's
                output is linked to nothing (its messages would be lost) and the stage does
                not declare it in ``optional_outputs``, or a replica set names the main host,
                a host no stage is placed on, or a host another set names too.
        """
        for link in self._links:
            for endpoint, side in ((link.source, "outputs"), (link.target, "inputs")):
                if endpoint.stage == BOUNDARY:
                    continue
                spec = self._stages.get(endpoint.stage)
                if spec is None:
                    raise GraphError(f"link {link} names the missing stage {endpoint.stage!r}")
                if endpoint.port not in getattr(spec.factory, side):
                    raise GraphError(f"link {link}: {spec.factory.__qualname__} has no port "
                                     f"{endpoint.port!r} in its {side}")  # fmt: skip
        for name in self._entries:
            if not any(link.source == Endpoint(BOUNDARY, name) for link in self._links):
                raise GraphError(f"entry {name!r} is linked to no stage")
        for name in self._exits:
            if not any(link.target == Endpoint(BOUNDARY, name) for link in self._links):
                raise GraphError(f"exit {name!r} is fed by no stage")
        linked = {link.source for link in self._links}
        for spec in self._stages.values():
            for port in spec.factory.outputs:
                if port not in spec.factory.optional_outputs and (
                    Endpoint(spec.name, port) not in linked
                ):
                    raise GraphError(
                        f"output {spec.name}.{port} is linked to nothing: its messages would be "
                        f"lost (link it, list it in {spec.factory.__qualname__}.optional_outputs, "
                        "or declare outputs = () for a stage that never emits)"
                    )
        placed = {spec.host for spec in self._stages.values()}
        claimed: dict[str, str] = {}
        for replica_set in self._replica_sets.values():
            for _, hosts in replica_set.replicas:
                for host in hosts:
                    if host == MAIN_HOST:
                        raise GraphError(
                            f"replica set {replica_set.name!r} names the main host: the calling "
                            "process cannot be a replica"
                        )
                    if host not in placed:
                        raise GraphError(
                            f"replica set {replica_set.name!r} names host {host!r}, on which no "
                            "stage is placed"
                        )
                    if host in claimed:
                        raise GraphError(
                            f"host {host!r} is in replica sets {claimed[host]!r} and "
                            f"{replica_set.name!r}"
                        )
                    claimed[host] = replica_set.name

    # -- running --------------------------------------------------------------------------------

    async def start(self, options: StartOptions | None = None, **kwargs: Any) -> RunningPipeline:
        """Start every host and stage; returns once all stages have started.

        Keyword arguments are :class:`~pipeline.runtime.running.StartOptions` fields (``transport``,
        ``compression``, ...). Raises StageFailedError if a stage fails to start.
        """
        chosen = options if options is not None else StartOptions(**kwargs)
        if options is not None and kwargs:
            chosen = dataclasses.replace(options, **kwargs)
        return await RunningPipeline.start(self.copy(), chosen)

    # -- internals ------------------------------------------------------------------------------

    def _spec(self, name: str) -> StageSpec:
        spec = self._stages.get(name)
        if spec is None:
            known = ", ".join(self._stages) or "(none)"
            raise GraphError(f"no stage named {name!r} in {self.name!r}; stages: {known}")
        return spec

    def _linked(self, source: Endpoint, target: Endpoint) -> bool:
        return any(link.source == source and link.target == target for link in self._links)

    def _check_boundary_name(self, name: str, what: str) -> None:
        _check_name(name, what)
        if name in self._entries or name in self._exits:
            raise GraphError(f"an entry or exit named {name!r} already exists")

    def _output(self, text: str) -> Endpoint:
        return self._endpoint(text, "outputs")

    def _input(self, text: str) -> Endpoint:
        return self._endpoint(text, "inputs")

    def _endpoint(self, text: str, side: str) -> Endpoint:
        stage, _, port = text.partition(".")
        spec = self._spec(stage)
        ports: tuple[str, ...] = getattr(spec.factory, side)
        if not port:
            if len(ports) != 1:
                raise GraphError(
                    f"stage {stage!r} has {len(ports)} {side[:-1]} ports {ports}; name one as "
                    f"'{stage}.<port>'"
                )
            port = ports[0]
        elif port not in ports:
            raise GraphError(f"stage {stage!r} has no {side[:-1]} port {port!r}; it has {ports}")
        return Endpoint(stage, port)


def _show(endpoint: Endpoint) -> str:
    return f"[{endpoint.port}]" if endpoint.stage == BOUNDARY else str(endpoint)


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name or "." in name or name == BOUNDARY:
        raise GraphError(f"invalid {what} name {name!r}: a non-empty string without '.'")


def _distinct(owner: str, endpoints: list[Endpoint]) -> list[Endpoint]:
    """``endpoints`` unchanged; a GraphError if one is named twice (it would link twice)."""
    seen: set[Endpoint] = set()
    for endpoint in endpoints:
        if endpoint in seen:
            raise GraphError(f"{owner} names {endpoint} twice")
        seen.add(endpoint)
    return endpoints


def _host(host: str) -> str:
    if not isinstance(host, str) or not host:
        raise GraphError(f"invalid host name {host!r}")
    return host


def _resolve_factory(factory: type[Stage] | str) -> type[Stage]:
    if isinstance(factory, str):
        import plugins

        try:
            factory = plugins.load(plugins.STAGES, factory)
        except plugins.PluginError as exc:
            raise GraphError(str(exc)) from exc
    if not inspect.isclass(factory) or not issubclass(factory, Stage):
        raise GraphError(f"{factory!r} is not a Stage subclass")
    return factory
