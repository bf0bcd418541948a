"""Options declared once: a dataclass field made by :func:`option` carries its one-line help,
its check, its CLI flag and the stage configs it is copied into, and everything else is
derived from it — the checks in ``__post_init__`` (:func:`check_options`), the CLI flags of
``generate``, ``serve`` and ``bench`` (:func:`add_option_arguments`, :func:`flag_values`), the
copies into stage configs (:func:`fed`) and the docs' option table (:func:`options_table`).
As vLLM's ``EngineArgs`` → ``add_cli_args`` (vllm/engine/arg_utils.py), with the flag read
from the field instead of written beside it, so the two cannot drift (docs/options.md).

Pure: no asyncio, no torch; argparse only to add flags to a parser it is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

__all__ = [
    "KINDS",
    "Kind",
    "OptionSpec",
    "add_option_argument",
    "add_option_arguments",
    "check_options",
    "fed",
    "flag_of",
    "flag_problems",
    "flag_values",
    "option",
    "option_specs",
    "options_table",
    "refuse_clashes",
]


#: ``cli_default`` when the flag's default is the field's
_SAME: Any = object()


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    """A check of one value: what it must be (the error's words) and the test."""

    phrase: str
    accepts: Callable[[Any], bool]


#: the checks an option may name (``option(kind=...)``); each refuses with
#: ``"<name> must be <phrase>, got <value!r>"``
KINDS: Mapping[str, Kind] = {
    "int>=1": Kind("an integer >= 1", lambda v: type(v) is int and v >= 1),
    "bool": Kind("a boolean", lambda v: type(v) is bool),
    "seconds>0": Kind("a number of seconds > 0", lambda v: _number(v) and 0 < v < math.inf),
    "seconds>=0": Kind("a number of seconds >= 0", lambda v: _number(v) and 0 <= v < math.inf),
    "finite seconds>0": Kind(
        "a finite number of seconds > 0", lambda v: _number(v) and 0 < v < math.inf
    ),
    "number>=0": Kind("a number >= 0", lambda v: _number(v) and 0 <= v < math.inf),
    "name": Kind("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip())),
}

#: the CLI type of a field's annotation (``X | None`` reads as ``X``)
_CLI_TYPES: Mapping[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    # its JSON text; the field's __post_init__ reads it (pipeline/engine/options.py)
    "SpeculativeConfig": str,
    # "P:D"; the field's __post_init__ reads it (pipeline/engine/prefill_decode.py)
    "PrefillDecode": str,
}


@dataclasses.dataclass(frozen=True, slots=True)
class OptionSpec:
    """What :func:`option` records of a field (see there)."""

    help: str
    kind: str | None = None
    phrase: str | None = None
    choices: tuple[str, ...] | None = None
    feeds: tuple[str, ...] = ()
    flag: str | None = None
    commands: tuple[str, ...] = ("generate", "serve")
    group: str = "engine"
    cli_default: Any = _SAME
    metavar: str | None = None
    upper: bool = False
    nargs: str | None = None
    const: Any = None
    from_flag: Callable[[Any], dict[str, Any]] | None = None


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    kind: str | None = None,
    phrase: str | None = None,
    choices: tuple[str, ...] | None = None,
    feeds: tuple[str, ...] = (),
    flag: str | None = None,
    commands: tuple[str, ...] = ("generate", "serve"),
    group: str = "engine",
    cli_default: Any = _SAME,
    metavar: str | None = None,
    upper: bool = False,
    nargs: str | None = None,
    const: Any = None,
    from_flag: Callable[[Any], dict[str, Any]] | None = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field declared once.

    ``help``: one line (the flag's help and the docs' table). ``kind``: a check of
    :data:`KINDS` (``phrase`` words it otherwise); ``choices``: the values allowed (None is
    allowed besides where the default is None). ``feeds``: the stage configs the value is
    copied into as it is, ``"execute"`` (same field name) or ``"schedule.policy"`` (another
    name); see :func:`fed`. ``flag``: the CLI flag (default ``--`` and the name in dashes; a
    boolean's ``--no-x`` flag turns it off) on ``commands`` (``()``: no flag), in the help
    group ``group``; ``cli_default``: the flag's default where it differs from the field's;
    ``metavar``, ``nargs``, ``const``, ``upper`` (the value is upper-cased): as argparse's;
    ``from_flag``: the field values of the flag's value where one flag sets several fields.
    """
    spec = OptionSpec(
        help=help, kind=kind, phrase=phrase, choices=choices, feeds=feeds, flag=flag,
        commands=commands, group=group, cli_default=cli_default, metavar=metavar, upper=upper,
        nargs=nargs, const=const, from_flag=from_flag,
    )  # fmt: skip
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown option kind {kind!r}; known: {', '.join(KINDS)}")
    metadata = {"option": spec}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def option_specs(cls: Any) -> Iterator[tuple[dataclasses.Field[Any], OptionSpec]]:
    """Each field of the dataclass ``cls`` declared with :func:`option`, with its spec."""
    return iter(_declared(cls))


@functools.cache
def _declared(cls: Any) -> tuple[tuple[dataclasses.Field[Any], OptionSpec], ...]:
    return tuple(
        (field, field.metadata["option"])
        for field in dataclasses.fields(cls)
        if isinstance(field.metadata.get("option"), OptionSpec)
    )


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def check_options(instance: Any) -> None:
    """Check each declared field of ``instance`` against its kind and choices (None passes
    where the field's default is None).

    Raises:
        ValueError: ``"<name> must be ..., got <value!r>"`` for the first field that fails.
    """
    for field, spec in option_specs(type(instance)):
        value = getattr(instance, field.name)
        if value is None and _default(field) is None:
            continue
        if spec.kind is not None:
            kind = KINDS[spec.kind]
            if not kind.accepts(value):
                raise ValueError(
                    f"{field.name} must be {spec.phrase or kind.phrase}, got {value!r}"
                )
        if spec.choices is not None:
            shown = value.upper() if spec.upper and isinstance(value, str) else value
            if shown not in spec.choices:
                either = " or None" if _default(field) is None else ""
                raise ValueError(
                    f"{field.name} must be one of {spec.choices}{either}, got {value!r}"
                )


def fed(instance: Any, config: str) -> dict[str, Any]:
    """The fields of ``instance`` copied as they are into the stage config ``config``
    (``feeds=("execute",)`` or ``feeds=("schedule.policy",)``), by that config's field
    names: ``ExecuteConfig(**fed(options, "execute"))``."""
    values = {}
    for field, spec in option_specs(type(instance)):
        for target in spec.feeds:
            name, _, renamed = target.partition(".")
            if name == config:
                values[renamed or field.name] = getattr(instance, field.name)
    return values


def flag_of(name: str, spec: OptionSpec) -> str:
    """The CLI flag of the field ``name``."""
    return spec.flag or "--" + name.replace("_", "-")


def _cli_type(field: dataclasses.Field[Any]) -> type:
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    base = annotation.replace(" | None", "").replace("None | ", "").strip()
    if base not in _CLI_TYPES:
        raise TypeError(f"option {field.name}: no CLI type for {annotation!r}; give commands=()")
    return _CLI_TYPES[base]


def _with_default(text: str, default: Any) -> str:
    """The help of a flag: its text and default (None: the text says what no value means)."""
    return text if default is None else f"{text} (default {_shown(default)})"


def _shown(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}" if abs(value) < 1e15 else repr(value)
    return "off" if value is None or value is False else "on" if value is True else str(value)


def add_option_arguments(parser: argparse.ArgumentParser, cls: Any, command: str) -> None:
    """Add the flag of each declared field of ``cls`` that ``command`` takes to ``parser``,
    grouped by each field's group; a flag's value lands on the field's name."""
    groups: dict[str, Any] = {}
    for field, spec in option_specs(cls):
        if command in spec.commands:
            group = groups.get(spec.group)
            if group is None:
                group = groups[spec.group] = parser.add_argument_group(spec.group)
            _add_flag(group, field, spec)


def add_option_argument(parser: Any, cls: Any, name: str) -> None:
    """Add the flag of the declared field ``name`` of ``cls`` to ``parser`` (or a group of
    it), whichever commands the field names: a benchmark that takes one engine option.

    Raises:
        KeyError: ``cls`` declares no such option.
    """
    for field, spec in option_specs(cls):
        if field.name == name:
            _add_flag(parser, field, spec)
            return
    raise KeyError(f"{cls.__name__} declares no option {name!r}")


def _add_flag(group: Any, field: dataclasses.Field[Any], spec: OptionSpec) -> None:
    default = _default(field) if spec.cli_default is _SAME else spec.cli_default
    kind = _cli_type(field)
    flag = flag_of(field.name, spec)
    arguments: dict[str, Any] = {"dest": field.name, "default": default}
    if kind is bool and spec.nargs is None:
        if flag.startswith("--no-"):
            arguments["action"] = "store_false" if default else "store_true"
            help_text = spec.help
        else:
            arguments["action"] = argparse.BooleanOptionalAction
            help_text = _with_default(spec.help, default)
    else:
        if spec.nargs is not None:
            arguments.update(nargs=spec.nargs, const=spec.const)
        else:
            arguments["type"] = str.upper if spec.upper else kind
        if spec.choices is not None:
            arguments["choices"] = spec.choices
        help_text = _with_default(spec.help, default)
    if spec.metavar is not None:
        arguments["metavar"] = spec.metavar
    group.add_argument(flag, help=help_text.replace("%", "%%"), **arguments)


def flag_values(args: argparse.Namespace, cls: Any, command: str) -> dict[str, Any]:
    """The field values the flags of ``command`` parsed into ``args`` give (the keyword
    arguments of ``cls``)."""
    values: dict[str, Any] = {}
    for field, spec in option_specs(cls):
        if command not in spec.commands or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if spec.from_flag is not None:
            values.update(spec.from_flag(value))
        else:
            values[field.name] = value
    return values


def flag_problems(parser: argparse.ArgumentParser, cls: Any, command: str) -> list[str]:
    """Where ``parser``'s flags and the declared fields of ``cls`` that ``command`` takes
    disagree: a field without its flag, a flag whose default, choices or type is not the
    field's, a flag of the field's name that sets another field, a flag in one of the fields'
    help groups that sets no field. Empty: they agree."""
    actions = {action.dest: action for action in parser._actions}
    problems = []
    declared = {field.name for field in dataclasses.fields(cls)}
    for field, spec in option_specs(cls):
        if command not in spec.commands:
            if field.name in actions and flag_of(field.name, spec) in (
                actions[field.name].option_strings
            ):
                problems.append(f"{field.name}: {command} has its flag, the field says not")
            continue
        action = actions.get(field.name)
        flag = flag_of(field.name, spec)
        if action is None or flag not in action.option_strings:
            problems.append(f"{field.name}: {command} has no flag {flag}")
            continue
        default = _default(field)
        if spec.from_flag is not None:
            if spec.from_flag(action.default).get(field.name) != default:
                problems.append(f"{field.name}: the flag's default gives another value")
        elif spec.cli_default is not _SAME:
            if action.default != spec.cli_default:
                problems.append(f"{field.name}: flag default {action.default!r}")
        elif action.default != default:
            problems.append(
                f"{field.name}: flag default {action.default!r}, field default {default!r}"
            )
        choices = tuple(action.choices) if action.choices is not None else None
        if choices != spec.choices:
            problems.append(f"{field.name}: flag choices {choices}, field choices {spec.choices}")
        kind = _cli_type(field)
        if kind is not bool and spec.nargs is None and action.type not in (kind, str.upper):
            problems.append(f"{field.name}: flag type {action.type}, field type {kind}")
    titles = {spec.group for _, spec in option_specs(cls)}
    for group in parser._action_groups:
        if group.title not in titles:
            continue
        for action in group._group_actions:
            if action.dest not in declared:
                problems.append(f"{action.option_strings[0]}: sets {action.dest!r}, which no field "
                                f"declares")  # fmt: skip
    for dest, action in actions.items():
        flags = [text for text in action.option_strings if text.startswith("--")]
        looks_declared = any(
            text.removeprefix("--").removeprefix("no-").replace("-", "_") in declared
            for text in flags
        )
        if looks_declared and dest not in declared:
            problems.append(f"{flags[0]}: sets {dest!r}, which no field declares")
    return problems


def options_table(cls: Any) -> str:
    """The markdown table of the declared fields of ``cls``: option, flag (and the commands
    that take it), default, meaning, the stage configs it is copied into."""
    lines = [
        "| option | flag | default | meaning | copied into |",
        "|---|---|---|---|---|",
    ]
    for field, spec in option_specs(cls):
        default = _default(field)
        shown = repr(default) if not isinstance(default, dict) else "{}"
        if spec.cli_default is not _SAME and spec.from_flag is None:
            shown += f" (flag: {spec.cli_default!r})"
        if spec.commands:
            flag = f"`{flag_of(field.name, spec)}`"
            if spec.commands != ("generate", "serve"):
                flag += f" ({', '.join(spec.commands)})"
        else:
            flag = "—"
        meaning = spec.help
        if spec.choices is not None:
            meaning += f"; one of {', '.join(spec.choices)}"
        feeds = ", ".join(f"`{target}`" for target in spec.feeds) or "—"
        cells = (f"`{field.name}`", flag, f"`{shown}`", meaning, feeds)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def refuse_clashes(subject: str, clashes: Iterable[tuple[str, bool]], section: str) -> None:
    """Refuse the first option ``subject`` does not combine with yet: ``clashes`` pairs what
    it clashes with (as the message names it) with whether it is set; ``section`` is the
    docs/parallelism.md section that says why.

    Raises:
        ValueError: "``subject`` does not combine with ``what``: not built yet (...)".
    """
    for what, clash in clashes:
        if clash:
            raise ValueError(
                f"{subject} does not combine with {what}: not built yet "
                f"(docs/parallelism.md, {section})"
            )
