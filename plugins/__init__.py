"""The one registry of named components, discovered through entry-point groups.

Seven groups, whose names are the constants below. Each built-in component is registered
through actorline's own ``pyproject.toml`` entry points, exactly like a third-party plugin::

    [project.entry-points."actorline.schedulers"]
    my-policy = "my_package.policy:MyPolicy"

:func:`load` finds a name in a group, imports it and checks it against the group's versioned
protocol (an ``api_version`` class attribute plus the attributes the protocol needs). Every
failure is a :class:`PluginError` naming the group, the plugin and the cause.

Names are resolved the same way whatever the order of ``sys.path``: actorline's own built-in
wins over a plugin of another distribution that registers the same name (which is logged as
shadowed when that name is loaded); two other distributions registering one name are
ambiguous, and loading it raises :class:`PluginConflictError` naming both. :func:`conflicts`
lists both kinds (``actorline plugins`` shows them).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import logging
from typing import Any

__all__ = [
    "GRAMMARS",
    "GROUPS",
    "PROPOSERS",
    "REASONING_PARSERS",
    "ROUTERS",
    "SCHEDULERS",
    "STAGES",
    "TOOL_PARSERS",
    "TRANSPORTS",
    "GroupSpec",
    "PluginConflict",
    "PluginConflictError",
    "PluginError",
    "PluginLoadError",
    "PluginNotFoundError",
    "PluginProtocolError",
    "available",
    "conflicts",
    "describe",
    "load",
    "load_instance",
]

logger = logging.getLogger("actorline.plugins")

GRAMMARS = "actorline.grammars"
PROPOSERS = "actorline.proposers"
ROUTERS = "actorline.routers"
SCHEDULERS = "actorline.schedulers"
STAGES = "actorline.stages"
TRANSPORTS = "actorline.transports"
TOOL_PARSERS = "actorline.tool_parsers"
REASONING_PARSERS = "actorline.reasoning_parsers"
#: the distribution whose entry points are the built-ins
_BUILTIN_DISTRIBUTION = "actorline"


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
    GRAMMARS: GroupSpec(
        GRAMMARS,
        "grammar engines for structured outputs: compile a constraint, mask the tokens it forbids",
        api_version=1,
        methods=("compile", "fill_bitmask"),
        attributes=("name",),
    ),
    PROPOSERS: GroupSpec(
        PROPOSERS,
        "speculative decoding proposers: draft a request's next tokens for the target to verify",
        api_version=1,
        methods=("propose",),
        attributes=("name",),
    ),
    ROUTERS: GroupSpec(
        ROUTERS,
        "routing policies: which engine replica serves a request (data parallelism)",
        api_version=1,
        methods=("choose", "forget_replica"),
        attributes=("name",),
    ),
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
    TOOL_PARSERS: GroupSpec(
        TOOL_PARSERS,
        "tool-call parsers: the function calls in a model's output, read as it streams",
        api_version=1,
        methods=("feed", "finish"),
        attributes=("name",),
    ),
    REASONING_PARSERS: GroupSpec(
        REASONING_PARSERS,
        "reasoning parsers: the reasoning part of a model's output (<think>...</think>)",
        api_version=1,
        methods=("feed", "finish"),
        attributes=("name",),
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

    def __reduce__(self) -> tuple[object, ...]:  # its __init__ is not (message,)
        return (type(self), (self.group, self.name, self.available))


class PluginLoadError(PluginError, ImportError):
    """The plugin's entry point failed to import."""


class PluginProtocolError(PluginError, TypeError):
    """The plugin does not satisfy its group's protocol."""


class PluginConflictError(PluginError, LookupError):
    """Two distributions other than actorline register the same name in a group; the
    message names both (uninstall one, or rename its entry point)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PluginConflict:
    """A name registered by more than one distribution in ``group``.

    ``chosen``: the entry point that wins (``"module:attr (distribution version)"``,
    actorline's built-in) or None when the name is ambiguous. ``others``: the entry points
    that lose (shadowed), or all of them when ambiguous.
    """

    group: str
    name: str
    chosen: str | None
    others: tuple[str, ...]

    @property
    def ambiguous(self) -> bool:
        return self.chosen is None


@dataclasses.dataclass(frozen=True, slots=True)
class _Resolved:
    """How one name of a group resolves: the winning entry point (None if ambiguous) and
    those it shadows (all candidates when ambiguous)."""

    entry_point: importlib.metadata.EntryPoint | None
    others: tuple[importlib.metadata.EntryPoint, ...] = ()


def _group_spec(group: str) -> GroupSpec:
    spec = GROUPS.get(group)
    if spec is None:
        raise PluginError(f"unknown plugin group {group!r}; known groups: {', '.join(GROUPS)}")
    return spec


def _distribution(entry_point: importlib.metadata.EntryPoint) -> str:
    """The name of the distribution that declares ``entry_point`` ("" if unknown)."""
    dist = getattr(entry_point, "dist", None)
    return str(dist.metadata["Name"] or "") if dist is not None else ""


def _origin(entry_point: importlib.metadata.EntryPoint) -> str:
    """``"module:attr (distribution version)"`` for messages."""
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return f"{entry_point.value} (unknown distribution)"
    return f"{entry_point.value} ({dist.metadata['Name']} {dist.version})"


def _is_builtin(entry_point: importlib.metadata.EntryPoint) -> bool:
    return _distribution(entry_point).lower() == _BUILTIN_DISTRIBUTION


def _resolve(group: str) -> dict[str, _Resolved]:
    """Every name of ``group`` and how it resolves, independent of ``sys.path`` order."""
    candidates: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry_point in importlib.metadata.entry_points(group=group):
        found = candidates.setdefault(entry_point.name, [])
        # NOTE: one distribution seen twice (an egg-info in the source tree and an
        # installed dist-info) is the same plugin, not a conflict.
        if not any(
            _distribution(other).lower() == _distribution(entry_point).lower()
            and other.value == entry_point.value
            for other in found
        ):
            found.append(entry_point)
    resolved: dict[str, _Resolved] = {}
    for name, found in candidates.items():
        builtin = [entry_point for entry_point in found if _is_builtin(entry_point)]
        distributions = {_distribution(entry_point).lower() for entry_point in found}
        if builtin:
            chosen = builtin[0]
            others = tuple(entry_point for entry_point in found if not _is_builtin(entry_point))
            resolved[name] = _Resolved(chosen, others)
        elif len(distributions) > 1:
            resolved[name] = _Resolved(None, tuple(found))
        else:  # one distribution (maybe seen twice, in two versions): the first, as import does
            resolved[name] = _Resolved(found[0])
    return resolved


def _entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The entry point each unambiguous name of ``group`` resolves to."""
    return {
        name: resolved.entry_point
        for name, resolved in _resolve(group).items()
        if resolved.entry_point is not None
    }


def available(group: str) -> list[str]:
    """Names installed in ``group`` (ambiguous ones included), sorted."""
    _group_spec(group)
    return sorted(_resolve(group))


def conflicts(group: str | None = None) -> list[PluginConflict]:
    """Names registered by more than one distribution, in ``group`` or in every group:
    shadowed by actorline's built-in, or ambiguous (see the module notes). Nothing is
    imported."""
    groups = [group] if group is not None else list(GROUPS)
    found: list[PluginConflict] = []
    for name_of_group in groups:
        _group_spec(name_of_group)
        for name, resolved in sorted(_resolve(name_of_group).items()):
            if not resolved.others:
                continue
            chosen = _origin(resolved.entry_point) if resolved.entry_point is not None else None
            others = tuple(_origin(entry_point) for entry_point in resolved.others)
            found.append(PluginConflict(name_of_group, name, chosen, others))
    return found


def load(group: str, name: str) -> Any:
    """Import the component ``name`` of ``group`` and check it against the group protocol.

    Raises:
        PluginNotFoundError: no such name (the error lists the available ones).
        PluginConflictError: two distributions other than actorline register the name.
        PluginLoadError: importing the entry point failed (the cause is chained).
        PluginProtocolError: the component lacks what the group's protocol requires.
    """
    spec = _group_spec(group)
    everything = _resolve(group)
    resolved = everything.get(name)
    if resolved is None:
        raise PluginNotFoundError(group, name, sorted(everything))
    entry_point = resolved.entry_point
    if entry_point is None:
        origins = " and ".join(_origin(other) for other in resolved.others)
        raise PluginConflictError(
            f"{group} plugin {name!r} is ambiguous: {origins} both register it; "
            "uninstall one of them or rename its entry point"
        )
    for other in resolved.others:
        logger.warning(
            "%s plugin %r of %s is shadowed by actorline's built-in %s",
            group,
            name,
            _origin(other),
            entry_point.value,
        )
    try:
        component = entry_point.load()
    except Exception as exc:
        raise PluginLoadError(
            f"{group} plugin {name!r} ({entry_point.value}) failed to import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    check(group, name, component, spec)
    return component


def load_instance(group: str, name: str, error: type[Exception]) -> Any:
    """:func:`load` the component ``name`` of ``group`` and construct it with no arguments: a
    policy instance (schedulers, routers), whose ``name`` must be a string.

    Raises:
        what :func:`load` raises, and ``error`` (a ``PluginError`` of the caller's kind) when
        the constructor raised or the instance's ``name`` is not a string.
    """
    component = load(group, name)
    where = f"{component.__module__}.{component.__qualname__}"
    try:
        instance = component()
    except Exception as exc:
        raise error(
            f"{group} plugin {name!r} ({where}) failed to construct: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(getattr(instance, "name", None), str):
        raise error(
            f"{group} plugin {name!r} ({where}) has a non-string name "
            f"{getattr(instance, 'name', None)!r}"
        )
    return instance


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
    """For every group, the installed ``(name, "module:attr")`` pairs that :func:`load`
    resolves to, ambiguous names left out (see :func:`conflicts`); nothing is imported."""
    return {
        group: [(name, ep.value) for name, ep in sorted(_entry_points(group).items())]
        for group in GROUPS
    }
