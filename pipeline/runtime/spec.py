"""The vocabulary of a pipeline graph: stages' ports (:class:`Endpoint`), the links between
them, how a stage is built (:class:`StageSpec`) and the two reserved names. Plain data, shared
by the graph (:mod:`pipeline.runtime.graph`) and the hosts that run it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.runtime.stage import Stage

__all__ = ["BOUNDARY", "MAIN_HOST", "Endpoint", "Link", "StageSpec"]

#: the host that is the calling process
MAIN_HOST = "main"
#: the pseudo-stage whose output ports are the entries and input ports the exits
BOUNDARY = "@"


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    """A port of a stage."""

    stage: str
    port: str

    def __str__(self) -> str:
        return f"{self.stage}.{self.port}"


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """A directed link from an output port to an input port. ``transport`` overrides the
    pipeline's default transport when the link crosses hosts."""

    source: Endpoint
    target: Endpoint
    transport: str | None = None

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}"


@dataclasses.dataclass(frozen=True, slots=True)
class StageSpec:
    """How to build a stage: ``factory(config)`` in the process of ``host``."""

    name: str
    factory: type[Stage]
    config: Any = None
    host: str = MAIN_HOST
