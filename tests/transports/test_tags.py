"""Tests of transports/tags.py: the one table of wire tags (docs/architecture.md §5.4)."""

from __future__ import annotations

import ast
import importlib
from collections import Counter
from pathlib import Path

import pytest

from transports.codec import DEFAULT_REGISTRY, MessageRegistry, message
from transports.tags import WIRE_TAGS, tag_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("plugins", "transports", "pipeline", "stages")


def test_no_two_classes_share_a_tag() -> None:
    shared = {tag: n for tag, n in Counter(WIRE_TAGS.values()).items() if n > 1}
    assert not shared, f"tags given to more than one class in WIRE_TAGS: {shared}"
    assert all(0 < tag < 2**31 for tag in WIRE_TAGS.values())


def test_every_class_of_the_table_registers_under_its_tag() -> None:
    for name in WIRE_TAGS:
        importlib.import_module(name.rpartition(".")[0])
    registered = DEFAULT_REGISTRY.tags()
    for name, tag in WIRE_TAGS.items():
        assert registered.get(tag) == name, f"{name} is not registered under its tag {tag}"


def test_every_registered_message_of_ours_is_in_the_table() -> None:
    for name in WIRE_TAGS:
        importlib.import_module(name.rpartition(".")[0])
    ours = {
        tag: name for tag, name in DEFAULT_REGISTRY.tags().items() if name.split(".")[0] in PACKAGES
    }
    missing = {tag: name for tag, name in ours.items() if WIRE_TAGS.get(name) != tag}
    assert not missing, f"registered outside transports/tags.py: {missing}"


def _numbered_registrations(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        literal = [arg for arg in [*node.args, *(k.value for k in node.keywords)]
                   if isinstance(arg, ast.Constant) and isinstance(arg.value, int)]  # fmt: skip
        if name in ("message", "register") and literal:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_module_numbers_its_own_tags() -> None:
    numbered = [
        where
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for where in _numbered_registrations(path)
    ]
    assert not numbered, f"tags numbered by hand (take them from WIRE_TAGS): {numbered}"


def test_a_class_outside_the_table_is_refused_by_name() -> None:
    from dataclasses import dataclass

    with pytest.raises(LookupError, match=r"Unlisted has no wire tag: add it to WIRE_TAGS"):

        @message(registry=MessageRegistry())
        @dataclass
        class Unlisted:
            x: int

    with pytest.raises(LookupError, match=r"transports/tags\.py"):
        tag_of(int)
