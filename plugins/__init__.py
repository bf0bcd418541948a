"""The one registry of named components, discovered through entry-point groups.

Three groups, whose names are the constants below. Each built-in component is registered
through actorline's own ``pyproject.toml`` entry points, exactly like a third-party plugin::

    [project.entry-points."actorline.schedulers"]
    my-policy = "my_package.policy:MyPolicy"

:func:`load` finds a name in a group, imports it and checks it against the group's versioned
protocol (an ``api_version`` class attribute plus the attributes the protocol needs). Every
failure is a :class:`PluginError` naming the group, the plugin and the cause.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
from typing import Any

__all__ = [
    "GROUPS",
    "SCHEDULERS",
    "STAGES",
    "TRANSPORTS",
    "GroupSpec",
    "PluginError",
    "PluginLoadError",
    "PluginNotFoundError",
    "PluginProtocolError",
    "available",
    "describe",
    "load",
]

SCHEDULERS = "actorline.schedulers"
STAGES = "actorline.stages"
TRANSPORTS = "actorline.transports"


@dataclasses.dataclass(frozen=True, slots=True)
class GroupSpec:
    """What a component of a group must provide.

    ``api_version``: the protocol version the component's ``api_version`` attribute must equal.
    ``methods``: callables the class must define. ``attributes``: other class attributes.
    """

    group: str
    description: str
    api_version: int
    methods: tuple[str, ...]
    attributes: tuple[str, ...] = ()


GROUPS: dict[str, GroupSpec] = {
    SCHEDULERS: GroupSpec(
        SCHEDULERS,
        "scheduling policies: which waiting request goes next, which running one is preempted",
        api_version=1,
        methods=("order_waiting", "select_victim", "on_arrival", "on_step", "on_finish"),
        attributes=("name",),
    ),
    STAGES: GroupSpec(
        STAGES,
        "pipeline stages (actors)",
        api_version=1,
        methods=("start", "stop", "handle"),
        attributes=("inputs", "outputs"),
    ),
    TRANSPORTS: GroupSpec(
        TRANSPORTS,
        "links between hosts",
        api_version=1,
        methods=("listen", "connect", "aclose"),
        attributes=("name",),
    ),
}


class PluginError(Exception):
    """Base class of registry errors."""


class PluginNotFoundError(PluginError, LookupError):
    """No plugin of that name in the group; the message lists the available names."""

    def __init__(self, group: str, name: str, available_names: list[str]) -> None:
        names = ", ".join(available_names) or "(none installed)"
        super().__init__(f"no {group} plugin named {name!r}; available: {names}")
        self.group = group
        self.name = name
        self.available = available_names


class PluginLoadError(PluginError, ImportError):
    """The plugin's entry point failed to import."""


class PluginProtocolError(PluginError, TypeError):
    """The plugin does not satisfy its group's protocol."""


def _group_spec(group: str) -> GroupSpec:
    spec = GROUPS.get(group)
    if spec is None:
        raise PluginError(f"unknown plugin group {group!r}; known groups: {', '.join(GROUPS)}")
    return spec


def _entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for entry_point in importlib.metadata.entry_points(group=group):
        found.setdefault(entry_point.name, entry_point)
    return found


def available(group: str) -> list[str]:
    """Names installed in ``group``, sorted."""
    _group_spec(group)
    return sorted(_entry_points(group))


def load(group: str, name: str) -> Any:
    """Import the component ``name`` of ``group`` and check it against the group protocol.

    Raises:
        PluginNotFoundError: no such name (the error lists the available ones).
        PluginLoadError: importing the entry point failed (the cause is chained).
        PluginProtocolError: the component lacks what the group's protocol requires.
    """
    spec = _group_spec(group)
    entry_points = _entry_points(group)
    entry_point = entry_points.get(name)
    if entry_point is None:
        raise PluginNotFoundError(group, name, sorted(entry_points))
    try:
        component = entry_point.load()
    except Exception as exc:
        raise PluginLoadError(
            f"{group} plugin {name!r} ({entry_point.value}) failed to import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    check(group, name, component, spec)
    return component


def check(group: str, name: str, component: Any, spec: GroupSpec | None = None) -> None:
    """Check ``component`` against the protocol of ``group``; raise PluginProtocolError."""
    spec = spec if spec is not None else _group_spec(group)
    problems: list[str] = []
    if not inspect.isclass(component):
        problems.append(f"is a {type(component).__name__}, not a class")
    else:
        version = getattr(component, "api_version", None)
        if version != spec.api_version:
            problems.append(f"has api_version {version!r}, the group needs {spec.api_version}")
        for method in spec.methods:
            if not callable(getattr(component, method, None)):
                problems.append(f"lacks method {method}()")
        for attribute in spec.attributes:
            if not hasattr(component, attribute):
                problems.append(f"lacks attribute {attribute!r}")
    if problems:
        raise PluginProtocolError(
            f"{group} plugin {name!r} does not satisfy the protocol: " + "; ".join(problems)
        )


def describe() -> dict[str, list[tuple[str, str]]]:
    """For every group, the installed ``(name, "module:attr")`` pairs (nothing is imported)."""
    return {
        group: [(name, ep.value) for name, ep in sorted(_entry_points(group).items())]
        for group in GROUPS
    }
