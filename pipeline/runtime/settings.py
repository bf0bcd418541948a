"""Environment variables, read here and nowhere else.

- ``ACTORLINE_CACHE_DIR``: where converted models are cached (default
  ``$XDG_CACHE_HOME/actorline`` or ``~/.cache/actorline``).
- ``ACTORLINE_LOG_LEVEL``: log level of the ``actorline`` loggers (default ``WARNING``).
- ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: vLLM's switch of its runtime LoRA endpoints, honoured
  by ``actorline serve`` as ``--enable-lora-runtime-updates`` (``1`` or ``true``, any case).

:func:`child_environment` is the environment a program this process starts gets (the
benchmarks' peers): this process's, with some variables set or removed.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "child_environment", "log_level", "runtime_lora_updating"]


def cache_dir() -> Path:
    """The actorline cache directory (not created here)."""
    explicit = os.environ.get("ACTORLINE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "actorline"


def log_level() -> str:
    return os.environ.get("ACTORLINE_LOG_LEVEL", "WARNING").upper()


def runtime_lora_updating() -> bool:
    """Whether vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is on (read as vLLM's ``envs.py``
    reads it: ``1`` or ``true``, any case)."""
    value = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    return value.strip().lower() in ("1", "true")


def child_environment(overrides: dict[str, str | None]) -> dict[str, str]:
    """A copy of this process's environment with ``overrides`` applied: a string sets the
    variable, ``None`` removes it."""
    environment = dict(os.environ)
    for name, value in overrides.items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    return environment
