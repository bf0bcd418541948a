"""Every name a package exports (``__all__``, lazily resolved ones included) exists."""

from __future__ import annotations

import importlib

import pytest

MODULES = [
    "pipeline",
    "pipeline.server.client",
    "pipeline.engine",
    "pipeline.engine.async_engine",
    "pipeline.engine.errors",
    "pipeline.runtime.errors",
    "pipeline.runtime",
    "pipeline.runtime.running",
    "pipeline.cli",
    "plugins",
    "stages",
    "stages.errors",
    "stages.messages",
    "transports",
    "transports.errors",
    "transports.testing",
    "transports.tasks",
    "pipeline.runtime.hosts",
]


@pytest.mark.parametrize("name", MODULES)
def test_every_exported_name_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", ())
    missing = [item for item in exported if not hasattr(module, item)]
    assert not missing, f"{name} exports names it does not have: {missing}"
